"""Benchmark: the agent's Decide throughput and latency on CPU, against a trivial echo peer.

For each of: an echo grpc.aio server of the same proto (the peer: gRPC + client cost alone), the agent
with the full tier and the agent with the light tier (both on its default lean h2 server, each tier pinned:
no queue-depth or P99 degradation), the agent as served (full, degrading batches to light while calls
queue), and the full tier on grpc.aio (`--server grpcio`, the peer of the lean server; leave it out with
--no-grpcio), it measures
  - batch 1: sequential calls from one client (latency of an idle server, batch size 1)
  - open loop: `run_traffic` at each rate in --rates (Poisson, unary only), p50/p99 from intended time
    and the server's own CPU time per call (psutil), which says what one core could sustain even when
    a shared host makes wall-clock latency noisy
  - throughput: --callers calls in flight back to back for --throughput-s seconds from the replayer's lean
    HTTP/2 client (bench/leanload.py, ~20 us of client CPU per call, so the server is the bottleneck):
    completed calls/s, and the server's main thread saturation meanwhile (schedstat: ~1.0 = server-bound).
    This is the tier's throughput; CPU per call at the open-loop rates also counts each wake-up's fixed
    cost, which at low rates is a large share of both tiers' calls.
A model-only section times the forward pass of each tier at batch 1 and 32 (inferences/s). It prints the agent/echo and light/full ratios. Servers run in their own processes.

    .venv/bin/python bench/agent_latency.py                      # default rates 500 1000 1500 2000
    .venv/bin/python bench/agent_latency.py --rates 1500 --duration 10 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from leanload import saturate  # noqa: E402

from agent_under_test.launch import AgentProcess  # noqa: E402
from agent_under_test.market import MarketSim  # noqa: E402
from agent_under_test.saturation import read_schedstat  # noqa: E402
from agent_under_test.traffic import run_traffic  # noqa: E402


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
    import numpy as np

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
    return {"calls_s": round(n / elapsed, 1), "p50_ms": round(float(np.percentile(lat, 50)), 3),
            "p99_ms": round(float(np.percentile(lat, 99)), 3)}


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def open_loop(address: str, pid: int, rate: float, duration: float) -> dict[str, object]:
    cpu0 = _cpu_s(pid)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[500, 1000, 1500, 2000])
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--seq-calls", type=int, default=500)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-grpcio", action="store_true", help="skip the full tier on grpc.aio")
    ap.add_argument("--throughput-s", type=float, default=4.0, help="closed-loop throughput run, seconds")
    ap.add_argument("--callers", type=int, default=64, help="calls in flight in the throughput run")
    ap.add_argument("--echo-server", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.echo_server:
        asyncio.run(_echo_main(args.echo_server))
        return
    results: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rates": args.rates}
    tput = (args.throughput_s, args.callers)
    results["model"] = model_only()
    print(f"model  {results['model']}", flush=True)
    with EchoProcess() as echo:
        results["echo"] = measure("echo", echo.grpc_address, echo.proc.pid, args.rates, args.duration, args.seq_calls,
                                  tput)
    # full/light/grpcio pin their tier (no queue-depth or P99 degradation): a tier's own throughput.
    # "served" is the agent as shipped, which turns batches light while calls queue for the model.
    pinned = {"queue_light_depth": 0, "alerts": False}
    runs = [("full", "full", "h2", pinned), ("light", "light", "h2", pinned), ("served", "full", "h2", {})]
    runs += [] if args.no_grpcio else [("grpcio", "full", "grpcio", pinned)]
    for name, tier, server, extra in runs:
        with AgentProcess(tier=tier, device="cpu", metrics_port=None, server=server, **extra) as agent:
            results[name] = measure(name, agent.grpc_address, agent.pid, args.rates, args.duration, args.seq_calls,
                                    tput)
    _print_ratios(results, args.rates)
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
    for name in [n for n in ("echo", "full", "light", "served", "grpcio") if n in results]:
        res, cpu = results[name], _cpu_per_call(results[name])
        print(f"{name:6s} batch1 {res['batch1']['calls_s']:8.1f} calls/s (p50 {res['batch1']['p50_ms']} ms)   "
              f"sustained {_best_rate(res):8.1f} calls/s   server CPU {cpu:6.0f} us/call = one core {1e6 / cpu:6.0f} calls/s"
              f"   throughput {res['throughput']['calls_s']:6.0f} calls/s ({res['throughput']['server_saturation']})")
    full_cpu, light_cpu, echo_cpu = (_cpu_per_call(results[n]) for n in ("full", "light", "echo"))
    tp = {n: results[n]["throughput"]["calls_s"] for n in ("full", "light")}
    print(f"ratio light/full  throughput {tp['light'] / max(tp['full'], 1):.2f} (target >= 2)")
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
