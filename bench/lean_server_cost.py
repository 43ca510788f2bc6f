"""Benchmark: the lean HTTP/2 gRPC server's own CPU per call, against grpc.aio serving the same handler.

Each server runs in its own process with a trivial unary handler (fixed bytes back), driven closed loop
by the replayer's lean client (bench/leanload.py, 64 calls in flight) for --seconds; the server's CPU
per call comes from its process CPU time (start-up included, the same for every run). With --before
DIR (a work tree of another commit, e.g. `git worktree add /tmp/before 7564dda`) the lean server of
that tree runs too, alternating, so a change to the server's per-call path is measured against its
previous self as well as against the peer.

    .venv/bin/python bench/lean_server_cost.py --rounds 5
    .venv/bin/python bench/lean_server_cost.py --rounds 5 --before /tmp/before
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from leanload import DECIDE, saturate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVER = """
import asyncio, sys, time
sys.path.insert(0, sys.argv[1])
import grpc, uvloop
from grpc import aio
from agent_under_test.h2server import LeanServer
SERVICE, METHOD = sys.argv[3].strip("/").split("/")

async def decide(request, ctx):
    return b"\\x08\\x01"

async def main():
    handlers = {METHOD: grpc.unary_unary_rpc_method_handler(decide)}
    if sys.argv[2] == "lean":
        srv = LeanServer()
        srv.add_registered_method_handlers(SERVICE, handlers)
    else:
        srv = aio.server()
        srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    print(time.process_time(), flush=True)

(uvloop.run if sys.argv[2] == "lean" else asyncio.run)(main())
"""


def measure(tree: Path, kind: str, seconds: float, seed: int) -> tuple[float, float]:
    """(calls/s, server CPU us per call) of one server process."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(tree), kind, DECIDE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        port = int(proc.stdout.readline())
        time.sleep(0.5)
        rate = saturate(f"127.0.0.1:{port}", seconds, 64, seed)
        proc.stdin.close()
        cpu = float(proc.stdout.readline())
    finally:
        proc.wait(10)
    return rate, cpu / (rate * seconds) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--before", type=Path, default=None, help="a work tree of another commit")
    args = ap.parse_args()
    runs: list[tuple[str, Path, str]] = [("lean", ROOT, "lean"), ("grpc.aio", ROOT, "aio")]
    if args.before is not None:
        runs.insert(0, ("lean-before", args.before, "lean"))
    results: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in runs}
    for rnd in range(args.rounds):
        for name, tree, kind in runs:
            rate, us = measure(tree, kind, args.seconds, rnd)
            results[name].append((rate, us))
            print(f"round {rnd + 1} {name:12s} {rate:8.0f} calls/s  server CPU {us:6.1f} us/call", flush=True)
    med = {name: (statistics.median(r for r, _ in v), statistics.median(u for _, u in v))
           for name, v in results.items()}
    for name, (rate, us) in med.items():
        print(f"median {name:12s} {rate:8.0f} calls/s  server CPU {us:6.1f} us/call")
    print(f"ratio lean/grpc.aio server CPU per call {med['lean'][1] / med['grpc.aio'][1]:.2f}")
    if "lean-before" in med:
        print(f"ratio lean/lean-before server CPU per call {med['lean'][1] / med['lean-before'][1]:.3f}")


if __name__ == "__main__":
    main()
