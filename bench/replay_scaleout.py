"""Scale-out by call: a recording of ONE connection at a rate one replay process cannot hold, replayed
by `--workers 1` and `--workers 2` (replay.workers.WorkerPool, the same code as the CLI), alternating.

    recording: R calls/s, evenly spaced, one gRPC connection, D seconds
    target:    the lean HTTP/2 gRPC server (agent_under_test.h2server), fixed answer, its own process
    replayer:  WorkerPool(workers=1) vs WorkerPool(workers=2), the h2 sender, every call sharded by call

Prints per run: achieved rate (calls sent / span), send lag p99, calls not sent; then medians and the
ratios 2 workers / 1 worker. Before issue 18 the second worker got no call of a one-connection
recording (shards were whole connections), so the ratio was 1.0 by construction.

    .venv/bin/python bench/replay_scaleout.py [--rate 8000] [--seconds 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replay.options import ReplayOptions  # noqa: E402
from replay.testing import DECIDE, write_unary_recording  # noqa: E402
from replay.workers import WorkerPool  # noqa: E402

SERVER = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
import grpc, uvloop
from agent_under_test.h2server import LeanServer
SERVICE, METHOD = sys.argv[2].strip("/").split("/")

async def decide(request, ctx):
    return b"\\x08\\x01"

async def main():
    srv = LeanServer()
    srv.add_registered_method_handlers(SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(decide)})
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

uvloop.run(main())
"""


def one_run(path: Path, target: str, workers: int) -> dict[str, float]:
    rep = WorkerPool(path, target, ReplayOptions(timeout_s=5.0), workers).run()
    assert rep.invariant_ok, rep.failures
    return {"rate": rep.achieved_rate, "lag_p99_us": rep.lag_us["p99"], "sent": rep.sent,
            "not_sent": rep.not_sent, "ok": rep.ok, "shares": [w["sent"] for w in rep.workers]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=int, default=8000, help="recorded calls per second (one connection)")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not (100 <= args.rate <= 50_000 and 1 <= args.seconds <= 30 and 1 <= args.rounds <= 10):
        ap.error("rate 100-50000, seconds 1-30, rounds 1-10")
    n = int(args.rate * args.seconds)
    gap = 1_000_000_000 // args.rate
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "one-connection.rec"
        write_unary_recording(path, (i * gap for i in range(n)), flows=1, method=DECIDE)
        server = subprocess.Popen([sys.executable, "-c", SERVER, str(ROOT), DECIDE], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            target = f"127.0.0.1:{server.stdout.readline().strip()}"
            print(f"{n} calls on one connection at {args.rate}/s ({args.seconds:g} s) -> {target}; "
                  f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
            results: dict[int, list[dict[str, float]]] = {1: [], 2: []}
            for r in range(args.rounds):
                for workers in ((1, 2) if r % 2 == 0 else (2, 1)):
                    res = one_run(path, target, workers)
                    results[workers].append(res)
                    print(f"round {r + 1} workers {workers}: rate {res['rate']:,.0f}/s  lag p99 "
                          f"{res['lag_p99_us']:,.0f} us  sent {res['sent']}  not sent {res['not_sent']}  "
                          f"ok {res['ok']}  per worker {res['shares']}", flush=True)
                    time.sleep(0.5)
        finally:
            if server.stdin is not None:
                server.stdin.close()
            server.wait(10)
    med = {w: {k: statistics.median(x[k] for x in rs) for k in ("rate", "lag_p99_us")} for w, rs in results.items()}
    for w in (1, 2):
        print(f"median workers {w}: rate {med[w]['rate']:,.0f}/s  lag p99 {med[w]['lag_p99_us']:,.0f} us")
    print(f"2 workers / 1 worker: achieved rate x{med[2]['rate'] / med[1]['rate']:.2f}, "
          f"lag p99 x{med[2]['lag_p99_us'] / max(med[1]['lag_p99_us'], 1):.2f} (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
