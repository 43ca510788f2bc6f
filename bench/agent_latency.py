"""Benchmark: the agent's Decide throughput and latency on CPU, against a trivial echo peer.

For each of: an echo grpc.aio server of the same proto (the peer: gRPC + client cost alone), the agent
with the full tier and the agent with the light tier (both on its default lean h2 server, each tier pinned:
no queue-depth or P99 degradation), the agent as served (full, degrading batches to light while calls
queue), the full tier with the fixed batching window of before (`--batch-window fixed`, the peer of the
adaptive window), and the full tier on grpc.aio (`--server grpcio`, the peer of the lean server; leave it out with
--no-grpcio), it measures
  - batch 1: sequential calls from one client (latency of an idle server, batch size 1)
  - open loop: at each rate in --rates (Poisson, unary only; the lean client of bench/leanload.py, or
    grpc.aio's `run_traffic` with --open-loop-client grpcio), p50/p99 from intended time
    and the server's own CPU time per call (psutil), which says what one core could sustain even when
    a shared host makes wall-clock latency noisy
  - throughput: --callers calls in flight back to back for --throughput-s seconds from the replayer's lean
    HTTP/2 client (bench/leanload.py, ~20 us of client CPU per call, so the server is the bottleneck):
    completed calls/s, and the server's main thread saturation meanwhile (schedstat: ~1.0 = server-bound).
    This is the tier's throughput; CPU per call at the open-loop rates also counts each wake-up's fixed
    cost, which at low rates is a large share of both tiers' calls.
A model-only section times the forward pass of each tier at batch 1 and 32 (inferences/s). It prints the agent/echo and light/full ratios. Servers run in their own processes.

The cache section (--no-cache leaves it out, --cache-only runs nothing else) compares, in the same run and
at --cache-rate calls/s (open loop, Poisson, latency from the intended send time, split by Decision.cache):
  - off:   the agent without a cache, on a fixed set of snapshots replayed, and on snapshots never seen
  - local: --cache local; the fixed set (warmed once) answered from the local tier, and the unseen ones (misses)
  - redis: --cache redis on a redis-server started here; a writer agent computes unseen snapshots (misses:
           a Redis lookup, the model, a Redis write), a second agent replays them (first touch: Redis hits)
with each run's server CPU per call, so a miss with the cache on can be compared with one with it off.
Those runs are minutes apart on a shared machine, so the miss is also measured in --cache-rounds
interleaved rounds: off, local and redis agents side by side, each round fresh unseen snapshots to each in
turn (the order alternating), medians per mode (issue 27: a miss may cost at most 5 % more with a cache).

    .venv/bin/python bench/agent_latency.py                      # default rates 500 1000 1500 2000
    .venv/bin/python bench/agent_latency.py --rates 1500 --duration 10 --json out.json
    .venv/bin/python bench/agent_latency.py --cache-only --cache-rate 1000 --cache-duration 4
    .venv/bin/python bench/agent_latency.py --window-rounds 6   # throughput, adaptive vs fixed window, interleaved

--window-rounds runs the closed loop alone, the adaptive and the fixed window's agents side by side in
interleaved rounds: single runs of each, minutes apart, drifted more than the few per cent compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cpus import pin  # noqa: E402
from leanload import open_loop as lean_open_loop  # noqa: E402
from leanload import saturate  # noqa: E402

from agent_under_test.launch import AgentProcess  # noqa: E402
from agent_under_test.market import MarketSim  # noqa: E402
from agent_under_test.saturation import read_schedstat  # noqa: E402
from agent_under_test.traffic import run_traffic  # noqa: E402
from wire.stats import percentiles  # noqa: E402


async def _echo_main(port_file: str) -> None:
    from grpc import aio

    from agent_under_test.proto import agent_pb2, agent_pb2_grpc

    class Echo(agent_pb2_grpc.TradingAgentServicer):
        async def Decide(self, request, context):  # noqa: N802
            return agent_pb2.Decision(sequence_id=request.sequence_id, symbol=request.symbol, tier="echo")

    server = aio.server()
    agent_pb2_grpc.add_TradingAgentServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))
    await server.wait_for_termination()


class EchoProcess:
    """The peer: a grpc.aio server of the same proto that answers without any work."""

    def __enter__(self) -> EchoProcess:
        self._port_file = f"/tmp/shadowtest-echo-{os.getpid()}.port"
        self.proc = subprocess.Popen([sys.executable, __file__, "--echo-server", self._port_file])
        deadline = time.monotonic() + 30
        while not os.path.exists(self._port_file) or not Path(self._port_file).read_text():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("echo server did not start")
            time.sleep(0.05)
        self.grpc_address = f"127.0.0.1:{Path(self._port_file).read_text()}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        os.unlink(self._port_file)


def batch_one(address: str, n: int) -> dict[str, float]:
    """Sequential calls: each waits for the previous answer, so every forward pass has batch 1."""
    import grpc

    from agent_under_test.proto import agent_pb2_grpc

    sim = MarketSim(random.Random(3))
    msgs = [sim.next(i) for i in range(n)]
    with grpc.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.TradingAgentStub(channel)
        for m in msgs[:50]:
            stub.Decide(m)
        lat = []
        start = time.perf_counter()
        for m in msgs:
            t = time.perf_counter()
            stub.Decide(m)
            lat.append((time.perf_counter() - t) * 1e3)
        elapsed = time.perf_counter() - start
    q = percentiles(lat, (0.5, 0.99))
    return {"calls_s": round(n / elapsed, 1), "p50_ms": round(q[0.5], 3), "p99_ms": round(q[0.99], 3)}


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


OPEN_LOOP_CLIENTS = ("lean", "grpcio")
OPEN_LOOP_CLIENT = "lean"   # --open-loop-client


def open_loop(address: str, pid: int, rate: float, duration: float) -> dict[str, object]:
    """One open-loop run at `rate` (Poisson, unary). The lean client by default: grpc.aio's own CPU
    (~0.5 ms a call) on the same 2 cores lagged its sends 2-4 ms at 1,000-2,000 calls/s and pushed the
    P99 it measured over 20 ms before the agent's did, so "sustained" measured the client as well."""
    cpu0 = _cpu_s(pid)
    if OPEN_LOOP_CLIENT == "lean":
        row = lean_open_loop(address, rate, duration, seed=11)
        row["server_cpu_us_per_call"] = round((_cpu_s(pid) - cpu0) / max(int(row["sent"]), 1) * 1e6)
        return row
    r = run_traffic(address, rate, duration, "poisson", seed=11, stream_share=0.0, call_timeout_s=10.0)
    cpu_us = (_cpu_s(pid) - cpu0) / max(r.sent, 1) * 1e6
    return {"rate": rate, "achieved": r.achieved_rate, "ok": r.ok, "sent": r.sent, "p50_ms": r.p50_ms,
            "p99_ms": r.p99_ms, "errors": r.errors, "send_lag_p99_ms": r.send_lag_p99_ms,
            "server_cpu_us_per_call": round(cpu_us)}


def _busy_ns(pid: int) -> int | None:
    """On-CPU + runnable ns of process `pid`'s main thread (its event loop), or None where unreadable."""
    stat = read_schedstat(pid, pid)
    return None if stat is None else stat[0] + stat[1]


def throughput(address: str, pid: int, seconds: float, callers: int) -> dict[str, float | None]:
    """Closed-loop throughput and the server's main-thread saturation while it ran."""
    saturate(address, 1.0, callers, 3)            # warm: connection, batch sizes, allocator
    busy0, t0 = _busy_ns(pid), time.monotonic_ns()
    calls_s = saturate(address, seconds, callers, 4)
    busy1, t1 = _busy_ns(pid), time.monotonic_ns()
    busy = None if busy0 is None or busy1 is None else round((busy1 - busy0) / (t1 - t0), 3)
    return {"calls_s": round(calls_s), "server_saturation": busy}


def model_only(rounds: int = 300) -> dict[str, dict[str, float]]:
    """Forward-pass throughput per tier (traced, one thread), no gRPC: inferences/s at batch 1 and 32."""
    import numpy as np

    from agent_under_test.engine import load_engine
    from agent_under_test.features import build_features
    from agent_under_test.snapshot import parse_snapshot

    sim = MarketSim(random.Random(5))
    feats = [build_features(parse_snapshot(sim.next(i))) for i in range(32)]
    engine = load_engine("cpu", None, seed=0, torch_threads=1)
    engine.warm_up(32)
    out: dict[str, dict[str, float]] = {}
    for tier in ("full", "light"):
        for b in (1, 32):
            times = []
            for _ in range(rounds):
                t = time.perf_counter()
                engine.run(feats[:b], tier)
                times.append(time.perf_counter() - t)
            out.setdefault(tier, {})[f"batch{b}_per_s"] = round(b / float(np.median(times)))
    return out


def measure(name: str, address: str, pid: int, rates: list[float], duration: float, n_seq: int,
            tput: tuple[float, int]) -> dict[str, object]:
    out: dict[str, object] = {"batch1": batch_one(address, n_seq), "open_loop": []}
    print(f"{name:6s} batch1 {out['batch1']}", flush=True)
    out["throughput"] = throughput(address, pid, *tput)
    print(f"{name:6s} throughput {out['throughput']}", flush=True)
    for rate in rates:
        row = open_loop(address, pid, rate, duration)
        out["open_loop"].append(row)  # type: ignore[union-attr]
        print(f"{name:6s} open-loop {row}", flush=True)
    return out


# -- the cache section ----------------------------------------------------------------------------------

MAX_IN_FLIGHT = 512   # open-loop calls outstanding at once; beyond that a call is counted as dropped


async def _replay(address: str, msgs: list, rate: float, seed: int) -> dict[str, object]:
    """Send `msgs` open loop (Poisson at `rate`), each once; latency (ms, from the intended send time) by
    the answer's cache field ('' = computed now), and errors."""
    import grpc
    from grpc import aio

    from agent_under_test.proto import agent_pb2_grpc

    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    by_source: dict[str, list[float]] = {}
    server: dict[str, list[float]] = {}   # the agent's own view: Decision.server_latency_ns
    cache_us: dict[str, list[float]] = {}
    counts = {"errors": 0, "dropped": 0}
    inflight: set[asyncio.Task[None]] = set()
    async with aio.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.TradingAgentStub(channel)
        await stub.Decide(msgs[0], timeout=10)   # connect before the clock starts

        async def one(msg: object, at: float) -> None:
            try:
                out = await stub.Decide(msg, timeout=5)
            except grpc.RpcError:
                counts["errors"] += 1
                return
            by_source.setdefault(out.cache, []).append((loop.time() - at) * 1e3)
            server.setdefault(out.cache, []).append(out.server_latency_ns / 1e6)
            for stage in out.stages:   # the cache's own time in the call (probe and lookup), as the agent timed it
                if stage.stage == "cache":
                    cache_us.setdefault(out.cache, []).append(stage.ns / 1e3)

        at = loop.time() + 0.05
        for msg in msgs:
            at += rng.expovariate(rate)
            if (delay := at - loop.time()) > 0:
                await asyncio.sleep(delay)
            if len(inflight) >= MAX_IN_FLIGHT:
                counts["dropped"] += 1
                continue
            task = loop.create_task(one(msg, at))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        await asyncio.gather(*inflight)
    return {"by_source": by_source, "server": server, "cache_us": cache_us, **counts}


def _summary(rows: list[float]) -> dict[str, float]:
    q = percentiles(rows, (0.5, 0.99))
    return {"n": len(rows), "p50_ms": round(q[0.5], 3), "p99_ms": round(q[0.99], 3)}


def cache_run(agent: AgentProcess, msgs: list, rate: float, seed: int) -> dict[str, object]:
    """One open-loop replay of `msgs` against `agent`: p50/p99 per answer source, server CPU per call."""
    cpu0 = _cpu_s(agent.pid)
    raw = asyncio.run(_replay(agent.grpc_address, msgs, rate, seed))
    calls = sum(len(v) for v in raw["by_source"].values())  # type: ignore[union-attr]
    out: dict[str, object] = {
        "calls": calls, "errors": raw["errors"], "dropped": raw["dropped"],
        "server_cpu_us_per_call": round((_cpu_s(agent.pid) - cpu0) / max(calls, 1) * 1e6)}
    for source, rows in raw["by_source"].items():  # type: ignore[union-attr]
        out[source or "computed"] = {**_summary(rows), "server_p50_ms":
                                     _summary(raw["server"][source])["p50_ms"]}  # type: ignore[index]
        if stage := raw["cache_us"].get(source):  # type: ignore[union-attr]
            out[source or "computed"]["cache_stage_p50_us"] = round(statistics.median(stage), 1)  # type: ignore[index]
    if agent.metrics_url:
        out["agent_metrics"] = _cache_counters(agent.metrics_url)
    return out


def _metrics(url: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """The agent's /metrics samples whose line starts with one of `prefixes`: {name{labels}: value}."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines() if line.startswith(prefixes)}


def _cache_counters(url: str) -> dict[str, float]:
    """The agent's cache and Redis counters so far (agent_cache_total, errors, circuit state), zeros left out."""
    keep = ("agent_cache_total{", "agent_dependency_errors_total{", "agent_dependency_circuit_state{")
    return {k: v for k, v in _metrics(url, keep).items() if v != 0.0}


def _redis_server() -> tuple[subprocess.Popen[bytes], str, str] | None:
    """A throwaway loopback redis-server (None when it is not installed): the process, its URL, its dir."""
    import shutil
    import socket
    import tempfile

    binary = shutil.which("redis-server")
    if binary is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="shadowtest-bench-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"redis://127.0.0.1:{port}/0", workdir
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def cache_section(rate: float, duration: float, rounds: int = 3, sets: int = 1,
                  pinned: bool = False) -> dict[str, object]:
    """Cache off / local / redis on the same request mixes (see the module docstring)."""
    import shutil

    from agent_under_test.market import symbol_names

    n = max(64, int(rate * duration))
    sim = MarketSim(random.Random(21))
    fixed = [sim.next(i) for i in range(64)]                                    # the repeating mix
    replayed = [fixed[i % len(fixed)] for i in range(n)]
    # Unseen snapshots: many symbols, so each Redis bucket keeps every one of them for the second agent.
    sim = MarketSim(random.Random(22), symbols=symbol_names(500))
    unseen = [sim.next(i) for i in range(n)]
    base = {"device": "cpu", "tier": "light", "metrics_port": 0}
    out: dict[str, object] = {"rate": rate, "calls_per_run": n}
    with AgentProcess(**base) as agent:
        out["off"] = {"replayed": cache_run(agent, replayed, rate, 1), "unseen": cache_run(agent, unseen, rate, 2)}
    print(f"cache  off    {out['off']}", flush=True)
    with AgentProcess(cache="local", **base) as agent:
        cache_run(agent, fixed, 200.0, 3)                                        # warm: every one computed once
        out["local"] = {"replayed": cache_run(agent, replayed, rate, 1), "unseen": cache_run(agent, unseen, rate, 2)}
    print(f"cache  local  {out['local']}", flush=True)
    redis = _redis_server()
    if redis is None:
        out["redis"] = "skipped: no redis-server on PATH"
    else:
        proc, url, workdir = redis
        try:
            with AgentProcess(cache="redis", redis_url=url, **base) as writer, \
                    AgentProcess(cache="redis", redis_url=url, **base) as reader:
                out["redis"] = {"unseen": cache_run(writer, unseen, rate, 2),
                                "second_agent": cache_run(reader, unseen, rate, 2)}
        finally:
            proc.kill()
            proc.wait(10)
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"cache  redis  {out['redis']}", flush=True)
    if rounds > 0:
        out["miss_rounds"] = miss_rounds(rate, duration, rounds, sets, pinned)
    return out


def miss_rounds(rate: float, duration: float, rounds: int, sets: int = 1, pinned: bool = False) -> dict[str, object]:
    """Server CPU per call on a miss, the cache off vs local vs redis, in interleaved rounds (see the
    module docstring); each agent is warmed first, and every snapshot of a round is new to all of them.
    `sets` > 1: that many sets of fresh agents, `rounds` rounds each. Two processes of one build differ by
    up to ~10 % of CPU per call (memory layout: bench/RESULTS.md), more than the 5 % judged, so the verdict
    is the median over sets of each set's ratio, not one pair of processes measured many times.
    `pinned`: the agents on a core of their own, this process and Redis on the other (cpus.pin)."""
    import contextlib
    import shutil

    from agent_under_test.market import symbol_names

    n = max(64, int(rate * duration))
    base = {"device": "cpu", "tier": "light", "metrics_port": 0}
    cpu: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    hits, counters = 0, {}
    stage_us: dict[str, list[float]] = {}   # a miss's cache stage (probe + lookup) as the agent timed it
    warm = [MarketSim(random.Random(30)).next(i) for i in range(200)]
    with contextlib.ExitStack() as outer:
        redis = _redis_server()
        if redis is not None:
            proc, url, workdir = redis
            outer.callback(shutil.rmtree, workdir, ignore_errors=True)
            outer.callback(proc.wait, 10)
            outer.callback(proc.kill)
        for k in range(sets):
            with contextlib.ExitStack() as stack:
                agents = {"off": stack.enter_context(AgentProcess(**base)),
                          "local": stack.enter_context(AgentProcess(cache="local", **base))}
                if redis is not None:
                    agents["redis"] = stack.enter_context(AgentProcess(cache="redis", redis_url=url, **base))
                if pinned:
                    for agent in agents.values():
                        done = pin(agent.pid, *([proc.pid] if redis is not None else []))
                    if k == 0:
                        print(f"cache  {done}", flush=True)
                for agent in agents.values():
                    cache_run(agent, warm, rate, 4)
                mine: dict[str, list[float]] = {mode: [] for mode in agents}
                for r in range(rounds):
                    sim = MarketSim(random.Random(1000 + 100 * k + r), symbols=symbol_names(500))
                    unseen = [sim.next(i) for i in range(n)]
                    for mode in (list(agents) if (k + r) % 2 == 0 else list(agents)[::-1]):
                        run = cache_run(agents[mode], unseen, rate, 5 + r)
                        mine[mode].append(run["server_cpu_us_per_call"])  # type: ignore[arg-type]
                        if "cache_stage_p50_us" in run.get("computed", {}):  # type: ignore[operator]
                            stage_us.setdefault(mode, []).append(run["computed"]["cache_stage_p50_us"])  # type: ignore[index]
                        hits += sum(v["n"] for key, v in run.items() if key in ("local", "redis", "stale"))  # type: ignore[index]
                # A Redis that timed out (a stalled machine) opens the circuit, and a miss that skips Redis costs
                # less: such a round understates redis, so its counters go with the result.
                if "redis" in agents:
                    for key, v in _cache_counters(agents["redis"].metrics_url).items():
                        counters[key] = counters.get(key, 0.0) + v
            for mode, v in mine.items():
                cpu.setdefault(mode, []).extend(v)
                ratios.setdefault(mode, []).append(round(statistics.median(v) / statistics.median(mine["off"]) - 1, 4))
            if sets > 1:
                print(f"cache  miss set {k + 1}/{sets}: {mine}", flush=True)
    median = {mode: statistics.median(v) for mode, v in cpu.items()}
    out: dict[str, object] = {"rounds": rounds, "sets": sets, "calls_per_run": n, "cpu_us_per_call": cpu,
                              "median": median, "ratio_per_set": ratios,
                              "vs_off": {m: statistics.median(v) for m, v in ratios.items()},
                              "miss_cache_stage_p50_us": {m: statistics.median(v) for m, v in stage_us.items()},
                              "hits": hits, "redis_counters": counters}
    print(f"cache  miss rounds  {out}", flush=True)
    return out


def _batches(url: str) -> tuple[float, float]:
    """The agent's agent_batch_size histogram so far: (requests, forward passes)."""
    vals = _metrics(url, ("agent_batch_size_sum ", "agent_batch_size_count "))
    return vals["agent_batch_size_sum"], vals["agent_batch_size_count"]


def window_rounds(rounds: int, seconds: float, callers: int) -> dict[str, object]:
    """Closed-loop throughput of the adaptive batch window against the fixed one, interleaved: both agents
    (full tier, pinned) up at once, one closed loop at a time, the order swapped each round (A B, B A, ...),
    so drift on a shared host (a neighbour, the CPU's clock) falls on both alike. Each run's mean batch
    says which way its callers settled: 64 callers can settle into passes of 32 or into smaller groups
    (21-27 a pass), with either window, and a run that does is slower for it."""
    pinned = {"queue_light_depth": 0, "alerts": False}
    runs: dict[str, list[int]] = {"adaptive": [], "fixed": []}
    batch: dict[str, list[float]] = {"adaptive": [], "fixed": []}
    with AgentProcess(tier="full", device="cpu", server="h2", **pinned) as adaptive, \
            AgentProcess(tier="full", device="cpu", server="h2", batch_window="fixed", **pinned) as fixed:
        agents = {"adaptive": adaptive, "fixed": fixed}
        for agent in agents.values():
            saturate(agent.grpc_address, 1.0, callers, 3)      # warm: connection, batch sizes, allocator
        for i in range(rounds):
            for name in (("adaptive", "fixed") if i % 2 == 0 else ("fixed", "adaptive")):
                url = str(agents[name].metrics_url)
                n0, p0 = _batches(url)
                runs[name].append(round(saturate(agents[name].grpc_address, seconds, callers, 4 + i)))
                n1, p1 = _batches(url)
                batch[name].append(round((n1 - n0) / max(p1 - p0, 1), 2))
            print(f"window round {i + 1}: adaptive {runs['adaptive'][-1]} calls/s (mean batch {batch['adaptive'][-1]}), "
                  f"fixed {runs['fixed'][-1]} (mean batch {batch['fixed'][-1]})", flush=True)
    ratios = [a / f for a, f in zip(runs["adaptive"], runs["fixed"], strict=True)]
    return {"rounds": rounds, "seconds": seconds, "callers": callers, "calls_s": runs, "mean_batch": batch,
            "median_calls_s": {k: statistics.median(v) for k, v in runs.items()},
            "ratio_per_round": [round(r, 3) for r in ratios], "ratio_median": round(statistics.median(ratios), 3)}


def _print_cache(res: dict) -> None:
    def cell(run: dict, source: str) -> str:
        s = run.get(source)
        return (f"p50 {s['p50_ms']:.3f} p99 {s['p99_ms']:.3f} ms (server p50 {s['server_p50_ms']:.3f}, n {s['n']})"
                if s else "-")

    print(f"\n== cache (light tier, {res['rate']:g} calls/s open loop, {res['calls_per_run']} calls a run)")
    off, local = res["off"], res["local"]
    print(f"off    replayed: computed {cell(off['replayed'], 'computed')}   CPU {off['replayed']['server_cpu_us_per_call']} us/call")
    print(f"off    unseen:   computed {cell(off['unseen'], 'computed')}   CPU {off['unseen']['server_cpu_us_per_call']} us/call")
    print(f"local  replayed: hit {cell(local['replayed'], 'local')}   CPU {local['replayed']['server_cpu_us_per_call']} us/call")
    print(f"local  unseen:   miss {cell(local['unseen'], 'computed')}   CPU {local['unseen']['server_cpu_us_per_call']} us/call")
    if isinstance(res["redis"], dict):
        r = res["redis"]
        print(f"redis  unseen:   miss {cell(r['unseen'], 'computed')}   CPU {r['unseen']['server_cpu_us_per_call']} us/call")
        print(f"redis  2nd agent: hit {cell(r['second_agent'], 'redis')}   miss {cell(r['second_agent'], 'computed')}"
              f"   CPU {r['second_agent']['server_cpu_us_per_call']} us/call")
        for name in ("unseen", "second_agent"):
            print(f"redis  {name} agent counters: {r[name].get('agent_metrics')}")
    else:
        print(f"redis  {res['redis']}")
    if "miss_rounds" in res:
        m = res["miss_rounds"]
        sets = m.get("sets", 1)
        print(f"miss CPU, {sets} set(s) of fresh agents, {m['rounds']} interleaved rounds of {m['calls_per_run']} "
              f"unseen calls each (median, runs; {m['hits']} hits; vs off: the median of the sets' ratios):")
        for mode, runs in m["cpu_us_per_call"].items():
            per_set = f"   per set {m['ratio_per_set'][mode]}" if sets > 1 else ""
            print(f"  {mode:6s} {m['median'][mode]:6.0f} us/call  {m['vs_off'][mode]:+7.1%} vs off   runs {runs}{per_set}")
        stage = m.get("miss_cache_stage_p50_us", {})
        print("  a miss's cache stage (probe + lookup, as the agent timed it), median of the runs' p50: "
              + ", ".join(f"{mode} {us:.1f} us" for mode, us in stage.items()))
        errors = {k: v for k, v in m.get("redis_counters", {}).items() if "errors" in k or "circuit" in k}
        print(f"  redis agent's errors and circuit in the rounds: {errors or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[500, 1000, 1500, 2000])
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--open-loop-client", choices=OPEN_LOOP_CLIENTS, default="lean",
                    help="the open-loop runs' client: lean (the replayer's HTTP/2 connection) or grpcio (grpc.aio)")
    ap.add_argument("--seq-calls", type=int, default=500)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-grpcio", action="store_true", help="skip the full tier on grpc.aio")
    ap.add_argument("--throughput-s", type=float, default=4.0, help="closed-loop throughput run, seconds")
    ap.add_argument("--callers", type=int, default=64, help="calls in flight in the throughput run")
    ap.add_argument("--cache-rate", type=float, default=1000.0, help="calls/s of the cache section")
    ap.add_argument("--cache-duration", type=float, default=4.0, help="seconds of each cache-section run")
    ap.add_argument("--cache-rounds", type=int, default=3,
                    help="interleaved miss rounds (off, local, redis side by side) of the cache section; 0: none")
    ap.add_argument("--cache-sets", type=int, default=1,
                    help="the miss rounds on N sets of fresh agents (process-to-process spread; see miss_rounds)")
    ap.add_argument("--cache-pin", action="store_true",
                    help="the miss rounds' agents on a core of their own, the client and Redis on the others")
    ap.add_argument("--cache-only", action="store_true", help="run the cache section alone")
    ap.add_argument("--no-cache", action="store_true", help="skip the cache section")
    ap.add_argument("--window-rounds", type=int, default=0,
                    help="closed-loop throughput, adaptive vs fixed batch window, N interleaved rounds, then exit")
    ap.add_argument("--echo-server", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global OPEN_LOOP_CLIENT
    OPEN_LOOP_CLIENT = args.open_loop_client
    if args.echo_server:
        asyncio.run(_echo_main(args.echo_server))
        return
    results: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rates": args.rates}
    if args.window_rounds:
        res = window_rounds(args.window_rounds, args.throughput_s, args.callers)
        med = res["median_calls_s"]
        print(f"\n== batch window, closed loop ({args.callers} callers, {args.throughput_s:g} s a run): medians adaptive "
              f"{med['adaptive']:.0f}, fixed {med['fixed']:.0f} calls/s = {med['adaptive'] / med['fixed']:.3f}; "
              f"per round {res['ratio_per_round']} (median {res['ratio_median']:.3f}; goal: no lower)")
        if args.json:
            Path(args.json).write_text(json.dumps({**results, "window": res}, indent=2))
        return
    if not args.no_cache:
        results["cache"] = cache_section(args.cache_rate, args.cache_duration, args.cache_rounds, args.cache_sets,
                                         args.cache_pin)
    if args.cache_only:
        _print_cache(results["cache"])  # type: ignore[arg-type]
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return
    tput = (args.throughput_s, args.callers)
    results["model"] = model_only()
    print(f"model  {results['model']}", flush=True)
    with EchoProcess() as echo:
        results["echo"] = measure("echo", echo.grpc_address, echo.proc.pid, args.rates, args.duration, args.seq_calls,
                                  tput)
    # full/light/grpcio pin their tier (no queue-depth or P99 degradation): a tier's own throughput.
    # "served" is the agent as shipped, which turns batches light while calls queue for the model.
    pinned = {"queue_light_depth": 0, "alerts": False}
    runs = [("full", "full", "h2", pinned), ("light", "light", "h2", pinned), ("served", "full", "h2", {}),
            ("fixed", "full", "h2", {**pinned, "batch_window": "fixed"})]   # before the adaptive window
    runs += [] if args.no_grpcio else [("grpcio", "full", "grpcio", pinned)]
    for name, tier, server, extra in runs:
        with AgentProcess(tier=tier, device="cpu", metrics_port=None, server=server, **extra) as agent:
            results[name] = measure(name, agent.grpc_address, agent.pid, args.rates, args.duration, args.seq_calls,
                                    tput)
    _print_ratios(results, args.rates)
    if "cache" in results:
        _print_cache(results["cache"])  # type: ignore[arg-type]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def _best_rate(res: dict, p99_limit_ms: float = 20.0) -> float:
    """Highest achieved rate whose p99 stayed within the limit with no errors."""
    ok = [r["achieved"] for r in res["open_loop"] if r["p99_ms"] is not None and r["p99_ms"] <= p99_limit_ms
          and not r["errors"]]
    return max(ok, default=0.0)


def _cpu_per_call(res: dict) -> float:
    """Median server CPU us per call over the open-loop runs."""
    vals = sorted(r["server_cpu_us_per_call"] for r in res["open_loop"])
    return float(vals[len(vals) // 2])


def _print_ratios(results: dict, rates: list[float]) -> None:
    model = results["model"]
    print("\n== summary (sustained = highest offered rate with p99 <= 20 ms and no errors;"
          " one core = 1e6 / server CPU us per call; throughput = closed loop, server saturation in brackets)")
    for name in [n for n in ("echo", "full", "light", "served", "fixed", "grpcio") if n in results]:
        res, cpu = results[name], _cpu_per_call(results[name])
        print(f"{name:6s} batch1 {res['batch1']['calls_s']:8.1f} calls/s (p50 {res['batch1']['p50_ms']} ms)   "
              f"sustained {_best_rate(res):8.1f} calls/s   server CPU {cpu:6.0f} us/call = one core {1e6 / cpu:6.0f} calls/s"
              f"   throughput {res['throughput']['calls_s']:6.0f} calls/s ({res['throughput']['server_saturation']})")
    full_cpu, light_cpu, echo_cpu = (_cpu_per_call(results[n]) for n in ("full", "light", "echo"))
    tp = {n: results[n]["throughput"]["calls_s"] for n in ("full", "light")}
    print(f"ratio light/full  throughput {tp['light'] / max(tp['full'], 1):.2f} (target >= 2)")
    if "fixed" in results:
        echo_p50 = results["echo"]["batch1"]["p50_ms"]
        for name in ("full", "light", "fixed"):
            print(f"batch 1 p50 {name:5s} {results[name]['batch1']['p50_ms']:.3f} ms = echo + "
                  f"{results[name]['batch1']['p50_ms'] - echo_p50:.3f} ms (adaptive window goal: <= 1 ms, <= echo + 0.6)")
        print(f"ratio adaptive/fixed window  throughput {tp['full'] / max(results['fixed']['throughput']['calls_s'], 1):.2f}"
              f"   sustained {_best_rate(results['full']) / max(_best_rate(results['fixed']), 1):.2f}")
    print(f"ratio full/echo   one-core capacity {echo_cpu / full_cpu:.2f}   sustained "
          f"{_best_rate(results['full']) / max(_best_rate(results['echo']), 1):.2f}")
    print(f"ratio light/full  one-core capacity {full_cpu / light_cpu:.2f}   sustained "
          f"{_best_rate(results['light']) / max(_best_rate(results['full']), 1):.2f}")
    if "grpcio" in results:
        grpcio_cpu = _cpu_per_call(results["grpcio"])
        print(f"ratio full h2/grpcio server  one-core capacity {grpcio_cpu / full_cpu:.2f}   sustained "
              f"{_best_rate(results['full']) / max(_best_rate(results['grpcio']), 1):.2f}")
    for b in (1, 32):
        key = f"batch{b}_per_s"
        print(f"model forward batch {b:2d}: full {model['full'][key]}/s  light {model['light'][key]}/s  "
              f"ratio light/full {model['light'][key] / model['full'][key]:.2f}")


if __name__ == "__main__":
    main()
