"""The unprivileged backend: a local TCP proxy IN the request path that records what it forwards.

    client --> 127.0.0.1:listen_port [ProxyBackend: chunk + timestamp] --> upstream_host:port
                                    <--                                <--

Unlike eBPF it needs no privilege, but clients must be pointed at the proxy, and it adds a hop
(latency) to every call: use it where eBPF is not allowed. `address` says where it listens.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Hashable

from capture.backends import RecordOptions
from capture.errors import CaptureError
from capture.recording import Direction, Flow
from capture.sink import FlowSink

_READ = 65536


class ProxyBackend:
    def __init__(self, options: RecordOptions) -> None:
        if not options.port:
            raise CaptureError("the proxy backend needs --port (the service's port to forward to)")
        self.options = options
        self.address: tuple[str, int] | None = None
        self.sink: FlowSink | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()

    def describe(self) -> dict[str, object]:
        return {"listen": list(self.address or ()), "upstream": [self.options.upstream_host, self.options.port],
                "in_request_path": True}

    def start(self, sink: FlowSink) -> None:
        self.sink = sink
        ready = threading.Event()
        errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(ready, errors), name="capture-proxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise CaptureError(f"proxy backend cannot listen on 127.0.0.1:{self.options.listen_port}: "
                               f"{errors[0]} (choose another --listen-port)") from errors[0]

    def _run(self, ready: threading.Event, errors: list[BaseException]) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", self.options.listen_port))
            self.address = self._server.sockets[0].getsockname()[:2]
        except OSError as exc:
            errors.append(exc)
            ready.set()
            return
        ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.sink is not None
        task = asyncio.current_task()
        if task:
            self._tasks.add(task)
        key = ("proxy", next(self._ids))
        try:
            up_r, up_w = await asyncio.open_connection(self.options.upstream_host, self.options.port)
        except OSError:
            writer.close()   # the service is down: the client sees a reset, as it would without us
            return
        peer = writer.get_extra_info("peername")[:2]
        self.sink.open_flow(key, Flow(src=peer, dst=(self.options.upstream_host, self.options.port),
                                      opened_ns=time.monotonic_ns(), comm="proxy"))
        try:
            await asyncio.gather(self._pipe(reader, up_w, key, "c2s"), self._pipe(up_r, writer, key, "s2c"))
        finally:
            self.sink.close_flow(key, time.monotonic_ns())
            if task:
                self._tasks.discard(task)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, key: Hashable,
                    direction: Direction) -> None:
        assert self.sink is not None
        try:
            while data := await src.read(_READ):
                self.sink.data(key, direction, time.monotonic_ns(), data)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass   # the peer went away: the other pipe sees it too
        finally:
            try:
                dst.close()
            except RuntimeError:
                pass

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        async def shutdown() -> None:
            if self._server:
                self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.sleep(0)
        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread:
            self._thread.join(5)
        self._loop = None
