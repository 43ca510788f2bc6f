"""How close to its intended time does each replayed send go out? shadowtest vs a relative-sleep peer.

    recording at R calls/s (evenly spaced, 4 connections) --> echo target (own process, grpc.aio)
    shadowtest: absolute schedule t0 + offset/speed, sleep-then-spin, every overdue send per wake-up
    peer:       GoReplay-style, sleep(gap to the previous call) then send -- errors accumulate

Prints send lag p50/p99/max and total drift at the end for R = 1,000, 2,000 and 4,000 calls/s, and
the ratio of the peer's drift to ours. Targets (issue 5): at 2,000 calls/s lag p99 <= 500 us and
drift <= 0.1 % over 60 s (`--duration 60`). Default: 8 s per rate, about a minute in all.

    .venv/bin/python bench/replay_fidelity.py [--duration S] [--rates 1000,2000,4000] [--senders grpc,h2]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay.engine import ReplayRun  # noqa: E402
from replay.options import ReplayOptions  # noqa: E402
from replay.plan import plan_from_recording  # noqa: E402
from replay.schedule import ScheduleOptions  # noqa: E402
from replay.senders.grpc import GrpcSender  # noqa: E402
from replay.stats import RunStats, percentiles_us  # noqa: E402
from replay.testing import write_unary_recording  # noqa: E402


def start_echo() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "replay.testing", "--fast"], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


async def peer_replay(path: Path, target: str) -> dict[str, float]:
    """The relative-sleep peer: sleep the recorded gap since the previous call, then send."""
    rec, plan = plan_from_recording(path, ScheduleOptions())
    sender, stats, tasks = GrpcSender(target), RunStats(), set()
    t0, prev = time.monotonic_ns(), 0

    async def one(p: object) -> None:
        async def reqs():  # type: ignore[no-untyped-def]
            for m in p.messages:  # type: ignore[attr-defined]
                yield m
        await sender.call(p, reqs(), 10.0)  # type: ignore[arg-type]

    for p in plan:
        await asyncio.sleep((p.due_ns - prev) / 1e9)
        prev = p.due_ns
        stats.on_sent(t0 + p.due_ns, time.monotonic_ns())
        task = asyncio.create_task(one(p))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    await sender.close()
    rec.close()
    return _timing(stats)


def _timing(stats: RunStats) -> dict[str, float]:
    intended = stats.last_intended - stats.first_intended
    lag = percentiles_us(stats.lag)
    # total drift: the last send's lateness in percent of the span (report.py defines it the same)
    return {"lag_p50_us": lag["p50"], "lag_p99_us": lag["p99"], "lag_max_us": lag["max"],
            "drift_pct": 100 * (stats.last_sent - stats.last_intended) / intended,
            "end_lag_us": (stats.last_sent - stats.last_intended) / 1000}


def ours(path: Path, target: str, sender: str) -> dict[str, float]:
    run = ReplayRun(path, target, ReplayOptions(sender=sender))
    rep = run.run()
    assert rep.invariant_ok, rep
    return _timing(run.stats) | {"achieved_rate": rep.achieved_rate, "not_ok": rep.scheduled - rep.ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of recording per rate")
    ap.add_argument("--rates", default="1000,2000,4000")
    ap.add_argument("--senders", default="grpc,h2", help="shadowtest senders to run (grpc: grpcio, h2: lean)")
    args = ap.parse_args()
    proc, target = start_echo()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"target {target}, {args.duration:g} s per rate; lag in us, drift in % of the span")
            print(f"{'rate':>6} {'who':<16} {'lag p50':>8} {'lag p99':>8} {'lag max':>9} {'drift %':>9} {'end lag':>9}")
            for rate in (int(r) for r in args.rates.split(",")):
                path = Path(tmp) / f"r{rate}.rec"
                n = int(rate * args.duration)
                write_unary_recording(path, [i * 1_000_000_000 // rate for i in range(n)], flows=4)
                mine = {f"shadowtest-{s}": ours(path, target, s) for s in args.senders.split(",")}
                b = asyncio.run(peer_replay(path, target))
                for who, r in (*mine.items(), ("peer-sleep", b)):
                    print(f"{rate:>6} {who:<16} {r['lag_p50_us']:>8.0f} {r['lag_p99_us']:>8.0f} "
                          f"{r['lag_max_us']:>9.0f} {r['drift_pct']:>9.4f} {r['end_lag_us']:>9.0f}")
                for who, a in mine.items():
                    ratio = abs(b["drift_pct"]) / max(abs(a["drift_pct"]), 1e-4)
                    print(f"{rate:>6} {who}: peer drift / our drift = {ratio:.1f}x; achieved "
                          f"{a['achieved_rate']:.0f}/s of {rate}; not ok (target overloaded): {a['not_ok']}")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
