"""Micro-benchmark: the agent's per-call CPU outside the gRPC server and outside the model's forward pass.

One call here is what the server does around the model for a Decide:

    MarketSnapshot.FromString(bytes) -> Pipeline.decide(msg) -> Decision.SerializeToString()

with a batcher stub whose submit() answers at once with a precomputed BatchResult (no queue, no forward
pass), and either the real guard (`protection.build_guard(GuardConfig())`, metrics_port=None, never
started) or NullGuard, so the guard's share (the per-stage histogram observes) shows. The coroutine is
driven by hand (no event loop: the loop's cost is the server's, not the pipeline's). Snapshots come from
`MarketSim` (10 levels, 16 ticks, the traffic the load tests send). Prints the median us/call over
--repeats rounds of --n calls each, and a median split of the stages for the real guard.

    .venv/bin/python bench/pipeline_cost.py
    .venv/bin/python bench/pipeline_cost.py --baseline 9431d38   # also time that commit's agent_under_test

--baseline REV extracts REV's agent_under_test/ (git archive) into a temporary directory and runs this
same script against it in a subprocess, alternating rounds is not possible across processes, so run it
on a quiet machine (wrap it: flock /tmp/bench.lock timeout 300 ...).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _measure(n: int, repeats: int, seed: int) -> dict[str, float]:
    from agent_under_test import protection
    from agent_under_test.batcher import BatchResult
    from agent_under_test.hooks import GuardConfig, NullGuard
    from agent_under_test.market import MarketSim
    from agent_under_test.pipeline import Pipeline
    from agent_under_test.proto import agent_pb2

    rng = random.Random(seed)
    sim = MarketSim(random.Random(seed))
    blobs = [sim.next(i).SerializeToString() for i in range(n)]
    # Model rows spread over BUY / SELL / HOLD, in-band and out-of-band prices, as a trained-ish model would.
    results = [BatchResult([rng.gauss(0, 1.5) for _ in range(3)] + [rng.gauss(0, 0.3), rng.gauss(0, 1)],
                           8, "full", 0.0004, 0.0012) for _ in range(64)]

    class StubBatcher:
        def __init__(self) -> None:
            self.i = 0

        async def submit(self, features: object) -> BatchResult:
            self.i += 1
            return results[self.i & 63]

    from_string = agent_pb2.MarketSnapshot.FromString

    def run_round(pipe: Pipeline) -> float:
        decide = pipe.decide
        gc.disable()
        try:
            t0 = time.perf_counter()
            for blob in blobs:
                coro = decide(from_string(blob), 0)
                try:
                    coro.send(None)
                except StopIteration as stop:
                    stop.value.SerializeToString()
                else:  # pragma: no cover - the stub never suspends
                    raise RuntimeError("the pipeline suspended with a stub batcher")
            return (time.perf_counter() - t0) / len(blobs) * 1e6
        finally:
            gc.enable()

    guard = protection.build_guard(GuardConfig(metrics_port=None))
    pipes = {"guard": Pipeline(StubBatcher(), guard), "null": Pipeline(StubBatcher(), NullGuard())}  # type: ignore[arg-type]
    for pipe in pipes.values():   # warm-up
        run_round(pipe)
    times: dict[str, list[float]] = {k: [] for k in pipes}
    for _ in range(repeats):      # interleaved, so a noisy moment hits both alike
        for name, pipe in pipes.items():
            times[name].append(run_round(pipe))
    out = {f"{k}_us": round(statistics.median(v), 2) for k, v in times.items()}
    out.update({f"{k}_min_us": round(min(v), 2) for k, v in times.items()})

    # Where it goes (real guard): parse-only and parse+features costs, from the same snapshots.
    from agent_under_test.features import build_features
    from agent_under_test.snapshot import parse_snapshot
    msgs = [from_string(b) for b in blobs]
    for label, fn in (("fromstring", lambda: [from_string(b) for b in blobs]),
                      ("parse", lambda: [parse_snapshot(m) for m in msgs]),
                      ("parse+features", lambda: [build_features(parse_snapshot(m)) for m in msgs])):
        ts = []
        for _ in range(max(3, repeats // 2)):
            gc.disable()
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) / n * 1e6)
            gc.enable()
        out[f"{label}_us"] = round(statistics.median(ts), 2)
    return out


def _baseline(rev: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="pipeline-cost-") as tmp:
        archive = subprocess.run(["git", "archive", rev, "agent_under_test"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        env = dict(os.environ, PYTHONPATH=tmp)
        proc = subprocess.run([sys.executable, __file__, "--json-only", "--n", str(args.n), "--repeats",
                               str(args.repeats), "--seed", str(args.seed)], env=env, check=True,
                              capture_output=True, text=True)
        return json.loads(proc.stdout)  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5000, help="snapshots per round")
    ap.add_argument("--repeats", type=int, default=9, help="rounds per configuration")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--baseline", default=None, metavar="REV", help="also time REV's agent_under_test")
    ap.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json_only:   # the baseline run: agent_under_test comes from PYTHONPATH (the extracted REV)
        import agent_under_test
        print(f"baseline code from {Path(agent_under_test.__file__).parent}", file=sys.stderr)
        print(json.dumps(_measure(args.n, args.repeats, args.seed)))
        return
    sys.path.insert(0, str(ROOT))
    rows = {}
    if args.baseline:
        rows[f"baseline {args.baseline}"] = _baseline(args.baseline, args)
    rows["working tree"] = _measure(args.n, args.repeats, args.seed)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}  load {os.getloadavg()[0]:.2f}  "
          f"n={args.n} repeats={args.repeats}   us/call (median of rounds; min in brackets)")
    print(f"{'code':22s} {'guard':>16s} {'NullGuard':>16s} {'guard share':>12s} {'FromString':>11s} "
          f"{'parse':>8s} {'parse+feat':>11s}")
    for name, r in rows.items():
        print(f"{name:22s} {r['guard_us']:8.2f} ({r['guard_min_us']:6.2f}) {r['null_us']:8.2f} "
              f"({r['null_min_us']:6.2f}) {r['guard_us'] - r['null_us']:12.2f} {r['fromstring_us']:11.2f} "
              f"{r['parse_us']:8.2f} {r['parse+features_us']:11.2f}")
    if len(rows) == 2:
        base, now = rows.values()
        for key, label in (("guard_us", "guard"), ("null_us", "NullGuard")):
            print(f"{label}: {now[key]:.2f} vs {base[key]:.2f} us/call: {100 * (1 - now[key] / base[key]):.1f}% less")


if __name__ == "__main__":
    main()
