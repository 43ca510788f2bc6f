"""Agent lifecycle: load the model, warm it up, open the port, print the ready line, drain on SIGTERM.

    AgentServer(options).start()  -> ready dict {"event": "ready", "grpc": "host:port", ...}
                                     (with --cache: the response cache; Redis down at start opens its
                                     circuit, and the agent starts all the same)
    AgentServer.stop()            -> health NOT_SERVING, stop accepting, finish in-flight calls (grace),
                                     close the batcher and the cache, guard.stop()
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from agent_under_test import protection, similarity
from agent_under_test.batcher import Batcher
from agent_under_test.cache import CacheSettings, ResponseCache, build_cache
from agent_under_test.config import ServeOptions
from agent_under_test.engine import Engine, load_engine
from agent_under_test.errors import ServeError
from agent_under_test.h2server import LeanServer
from agent_under_test.hooks import Guard
from agent_under_test.pipeline import Pipeline
from agent_under_test.proto import agent_pb2, agent_pb2_grpc
from agent_under_test.saturation import ThreadSaturation
from agent_under_test.server import SERVICE, TradingAgentServicer, admission


class AgentServer:
    """One agent server inside the running event loop (the CLI and in-process tests both use it)."""

    def __init__(self, options: ServeOptions, *, guard: Guard | None = None, engine: Engine | None = None) -> None:
        self.options = options
        self.guard = guard
        self.engine = engine
        self.batcher: Batcher | None = None
        self.cache: ResponseCache | None = None
        self.port = 0
        self.ready: dict[str, object] = {}
        self._server: aio.Server | LeanServer | None = None
        self._health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._executor: ThreadPoolExecutor | None = None

    async def start(self) -> dict[str, object]:
        """Load and warm up the model, then open the port. Returns the ready dict.

        Raises:
            ServeError: the port cannot be bound, the device or weights are unusable.
        """
        opts = self.options
        cache_settings = CacheSettings.from_options(opts)
        cache_settings.validate()   # a bad option fails in one line, before the model loads
        if self.engine is None:
            self.engine = await asyncio.to_thread(load_engine, opts.device, opts.weights, opts.seed,
                                                opts.torch_threads, opts.jit)
            await asyncio.to_thread(self.engine.warm_up, opts.max_batch)
        if self.guard is None:
            self.guard = protection.build_guard(opts.guard_config())
        workers = forward_workers(opts.workers, self.engine.device)
        if workers > 0:
            self._executor = ThreadPoolExecutor(workers, thread_name_prefix="agent-forward")
        self.batcher = Batcher(self.engine.run, self.guard, self._executor, window_s=opts.batch_window_ms / 1000,
                               max_batch=opts.max_batch, workers=workers, adaptive=opts.batch_window == "adaptive")
        self.batcher.start()
        self.cache = await build_cache(cache_settings, self.guard)
        self._server = self._build_server()
        try:
            self.port = self._server.add_insecure_port(f"{opts.host}:{opts.port}")
        except RuntimeError as exc:
            raise ServeError(f"cannot listen on {opts.host}:{opts.port} ({exc}); pick a free port or --port 0") from exc
        await self._server.start()
        watch = getattr(self.guard, "set_saturation_source", None)
        if watch is not None:   # start() runs on the event loop thread: the one that serves every call
            watch(ThreadSaturation().sample)
        self.guard.start()
        # Everything loaded so far (torch, the model, protobuf, grpc) lives as long as the process: keep it
        # out of the collector's reach, or each full collection walks it all and stalls the loop for tens of ms.
        gc.collect()
        gc.freeze()
        await self._set_serving(True)
        metrics = getattr(self.guard, "metrics_url", None)
        self.ready = {"event": "ready", "grpc": f"{opts.host}:{self.port}", "metrics": metrics,
                      "pid": os.getpid(), "device": self.engine.device, "tier": opts.tier}
        if self.cache is not None:
            # "numpy": the compiled kernel was not built at install (no C compiler): misses cost ~30 us more
            self.ready.update(cache=opts.cache, cache_kernel=similarity.KERNEL)
            if self.cache.redis is not None:   # false: Redis refused client tracking (or it is off, or down)
                self.ready["redis_tracking"] = self.cache.redis.tracking_active
        return self.ready

    def _build_server(self) -> aio.Server | LeanServer:
        assert self.batcher is not None and self.guard is not None, "start() builds these first"
        opts = self.options
        server: aio.Server | LeanServer
        if opts.server == "grpcio":
            server = aio.server(options=opts.grpc_options())
        else:
            server = LeanServer(max_receive_message_length=opts.max_receive_bytes,
                                header_table_size=4096 if opts.hpack_table_size is None else opts.hpack_table_size,
                                max_connection_age_s=opts.max_connection_age_s, grace_s=opts.grace_s,
                                idle_timeout_s=opts.idle_timeout_s or None, admit=admission(self.guard))
            if (metrics := getattr(self.guard, "metrics", None)) is not None:
                stall = server.stall
                metrics.loop_stalls.set_function(lambda: stall.stalls)
                metrics.loop_stalled.set_function(lambda: stall.stalled_ns / 1e9)
        agent_pb2_grpc.add_TradingAgentServicer_to_server(
            TradingAgentServicer(Pipeline(self.batcher, self.guard, max_message_bytes=self.options.max_message_bytes,
                                          cache=self.cache),
                                 self.guard, admits=not isinstance(server, LeanServer)), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = (agent_pb2.DESCRIPTOR.services_by_name["TradingAgent"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        if isinstance(server, LeanServer):  # enable_server_reflection() would pick the sync servicer for it
            reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(names), server)
        else:
            reflection.enable_server_reflection(names, server)
        return server

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            result = self._health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight calls finish within the grace period, release everything."""
        grace = self.options.grace_s if grace_s is None else grace_s
        if self._server is not None:
            await self._set_serving(False)
            await self._server.stop(grace)
            self._server = None
        if self.cache is not None:
            await self.cache.close()
            self.cache = None
        if self.batcher is not None:
            await self.batcher.close()
            self.batcher = None
        if self.guard is not None:
            self.guard.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def forward_workers(requested: int | None, device: str) -> int:
    """Forward-pass threads: as asked, else one per CUDA device stream on a GPU and none on CPU.

    On CPU the small model's pass (0.1-3 ms) runs inline on the event loop: handing each batch to a
    thread cost more than the pass (GIL hand-offs, wake-ups) and doubled the P99 (measured: full tier at
    1,500 calls/s, p99 9-10 ms inline against 17-21 ms with one thread, 25 % less CPU per call)."""
    if requested is not None:
        return requested
    return 1 if device.startswith("cuda") else 0


def _announce(ready: dict[str, object], ready_file: str | None) -> None:
    line = json.dumps(ready)
    if ready_file:
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as f:
            f.write(line + "\n")
        os.replace(tmp, ready_file)  # readers never see half a line
    print(line, flush=True)


async def serve(options: ServeOptions) -> int:
    """Run the agent until SIGTERM/SIGINT, then drain and return the exit status (0)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = AgentServer(options)
    try:
        _announce(await server.start(), options.ready_file)
        await stop.wait()
        print(json.dumps({"event": "stopping", "grace_s": options.grace_s}), file=sys.stderr, flush=True)
    finally:
        await server.stop()
    return 0


def run(options: ServeOptions) -> int:
    """Blocking entry point for the CLI."""
    if options.server == "h2" and options.event_loop in ("auto", "uvloop"):
        import uvloop  # grpc.aio needs asyncio's own loop; the lean server runs on either

        return uvloop.run(serve(options))
    return asyncio.run(serve(options))
