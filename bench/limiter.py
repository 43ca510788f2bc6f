#!/usr/bin/env python3
"""Limiter benchmark: `seed` vs `gradient` against the real agent, through an overload step.

    calibrate: find the agent's capacity C (highest offered rate with client P99 <= threshold, limiter
               off); if 2C would not exceed its throughput capacity X (64 callers back to back), C = 0.6 X
    per policy, fresh agent each:  C for --baseline-s  ->  2C for --overload-s  ->  C for --after-s
    (--overload-x N: N x C instead of 2C; at 2.4 C refusing costs the agent most of what serving does)
    (baseline 20 s: both policies start at 2,000/s and seed needs ~10 periods of x1.1 to reach C, so
    with a shorter one the step hits seed before it is at its steady state)

Reports, per policy: time from the step until the P99 of admitted calls (client side, measured from the
actual send, grouped by scheduled send time, pooled over a 3 s window sliding by 1 s) is back under the
threshold ("recover": the first such window; "held": the first of 3 such windows in a row, i.e. back
under and staying there; "server": the agent's own per-period P99 of admitted calls, 3 periods in a
row); the client's own send lag is printed apart; OK calls/s and goodput (OK calls within the
threshold/s) during the overload as shares of C; the limiter rate's steady-state oscillation over the
last half of the overload, +-(max-min)/2 / mean, from the agent's own events; and the agent's CPU
during the overload (when refusals alone saturate it, no limiter can bring P99 back).
Targets (issue 3): gradient recovers in at most half seed's time, goodput at least seed's, oscillation
within +-10 %. The same protocol also runs on a deterministic queue model (instant, no machine noise).
The machine is noisy: judge on the medians of several runs (--json each, then --summarize).

    .venv/bin/python bench/limiter.py                    # about 3 minutes
    .venv/bin/python bench/limiter.py --capacity 600     # skip calibration
    .venv/bin/python bench/limiter.py --json out.json    # per-period traces included
    .venv/bin/python bench/limiter.py --summarize a.json b.json c.json   # medians, runs nothing
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from leanload import LeanClient, payloads, saturate  # noqa: E402

from agent_under_test.launch import AgentProcess  # noqa: E402
from replay.senders.base import OK, REJECTED, SendOutcome  # noqa: E402
from wire.stats import percentiles  # noqa: E402


async def _drive(address: str, schedule: list[tuple[float, float]], seed: int) -> np.ndarray:
    """Poisson open loop following `schedule` [(rate, seconds)]; rows (send_s, latency_s, ok, rejected)."""
    rng = random.Random(seed)
    pool = LeanClient.framed(payloads(rng))
    rows: list[tuple[float, float, int, int]] = []
    lags: list[float] = []
    client = await LeanClient.connect(address)
    outstanding = 0
    drained = asyncio.get_running_loop().create_future()

    def one(sent: float, body: bytes) -> None:
        # Latency from when the call actually left, not from its schedule: on a starved machine the
        # client itself falls behind, and that lag is not the agent's (it is reported apart).
        nonlocal outstanding
        start = time.monotonic()
        lags.append(start - t0 - sent)
        outstanding += 1

        def ended(out: SendOutcome) -> None:
            nonlocal outstanding
            rows.append((sent, time.monotonic() - start, int(out.outcome == OK), int(out.outcome == REJECTED)))
            outstanding -= 1
            if outstanding == 0 and finished and not drained.done():
                drained.set_result(None)
        client.call(body, ended)

    finished = False
    t0 = time.monotonic()
    at, phase_start = 0.0, 0.0
    try:
        for rate, seconds in schedule:
            while True:
                at += rng.expovariate(rate)
                if at >= phase_start + seconds:
                    at = phase_start + seconds
                    break
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                one(at, pool[len(lags) % len(pool)])
            phase_start += seconds
        finished = True
        if outstanding:
            await asyncio.wait_for(drained, 15.0)
    finally:
        client.close()
    if lags:
        q = percentiles(lags, (0.5, 0.99))
        print(f"    client send lag p50 {q[0.5] * 1000:.1f} ms, p99 "
              f"{q[0.99] * 1000:.1f} ms over {len(lags)} calls", flush=True)
    return np.array(sorted(rows), dtype=float).reshape(-1, 4)


def drive(address: str, schedule: list[tuple[float, float]], seed: int) -> np.ndarray:
    return asyncio.run(_drive(address, schedule, seed))


def calibrate(threshold_ms: float, seed: int, rates: list[float], seconds: float) -> float:
    """Highest offered rate the agent (limiter off) serves at the threshold: the median of its 1 s
    windows' client P99 <= threshold and >= 95 % served. Stops after two failing rates in a row; the
    median, not the pooled P99, because on a shared machine one hiccup must not decide the capacity."""
    best, misses = rates[0], 0
    with AgentProcess(device="cpu", limiter="off", p99_threshold_ms=threshold_ms) as agent:
        drive(agent.grpc_address, [(rates[0], 1.0)], seed)     # warm the connection and the model
        saturation = saturate(agent.grpc_address, 3.0, 64, seed)
        print(f"  calibrate: throughput capacity X = {saturation:.0f}/s (64 callers back to back)", flush=True)
        for rate in rates:
            rows = drive(agent.grpc_address, [(rate, seconds)], seed)
            p99s = [p for _, p in window_p99(rows, 0.0, seconds)]
            median = float(np.nanmedian(p99s)) if p99s else float("inf")
            done = float(np.sum(rows[:, 2])) / seconds
            print(f"  calibrate {rate:7.0f}/s offered: {done:7.0f}/s ok, client p99 by second "
                  f"{' '.join(f'{p:.0f}' for p in p99s)} ms (median {median:.1f})", flush=True)
            if median <= threshold_ms and done >= 0.95 * rate:
                best, misses = rate, 0
            else:
                misses += 1
                if misses == 2:
                    break
    if 2 * best < 1.1 * saturation:
        # Then 2C would not overload the agent (batching buys throughput at the cost of latency), or
        # the machine's noise hid the real C: use 0.6 X, so that 2C = 1.2 X is a true overload.
        print(f"  calibrate: 2 x {best:.0f}/s would not overload (X = {saturation:.0f}/s); using C = 0.6 X",
              flush=True)
        best = round(0.6 * saturation)
    return best


@dataclass
class PolicyResult:
    policy: str
    recover_s: float | None       # None ("-"): not back under the threshold within the overload
    recover_after_end_s: float | None
    goodput_share: float           # OK calls/s during the overload / capacity ("ok/C")
    slo_goodput_share: float       # goodput: OK calls within the threshold /s during the overload / capacity
    rejected_share: float          # of calls offered during the overload
    oscillation_pct: float | None  # +- % of the mean limiter rate, last half of the overload
    mean_rate: float | None
    recover_held_s: float | None = None   # stricter: back under and still under for hold_s + 2 more seconds
    trace: dict[str, list[float | None]] | None = None   # per period/second, for reading a run afterwards
    server_recover_s: float | None = None  # the agent's own P99 of admitted calls, 3 periods in a row <= T


def window_p99(rows: np.ndarray, start: float, end: float, width: float = 1.0) -> list[tuple[float, float]]:
    """P99 (ms) of OK calls by send time in windows [t, t + width), t = start, start + 1, ... < end."""
    out = []
    t = start
    while t < end - 1e-9:
        sel = rows[(rows[:, 0] >= t) & (rows[:, 0] < t + width) & (rows[:, 2] == 1)]
        out.append((t, percentiles(sel[:, 1].tolist(), (0.99,))[0.99] * 1000 if len(sel) else float("nan")))
        t += 1.0
    return out


def recovery(rows: np.ndarray, start: float, end: float, threshold_ms: float, hold_s: float = 3.0) -> float | None:
    """Seconds from `start` until the P99 of OK calls sent in the next `hold_s` seconds is under the threshold.

    A pooled 3 s window, not three 1 s windows: on a shared machine one scheduling hiccup can lift a
    single second's P99 even at a safe rate."""
    for t, p99 in window_p99(rows, start, end - hold_s + 1e-9, hold_s):
        if p99 <= threshold_ms:
            return t - start
    return None


def recovery_held(rows: np.ndarray, start: float, end: float, threshold_ms: float, hold_s: float = 3.0,
                  k: int = 3) -> float | None:
    """Seconds from `start` until `k` consecutive pooled `hold_s` windows (sliding by 1 s) are all under
    the threshold: P99 back under and staying there, not one lucky window (stricter than `recovery`)."""
    ok = [p99 <= threshold_ms for _, p99 in window_p99(rows, start, end - hold_s + 1e-9, hold_s)]
    return next((float(i) for i in range(len(ok) - k + 1) if all(ok[i:i + k])), None)


def _cpu_sampler(agent: AgentProcess, at_s: list[float]) -> list[float]:
    """The agent process's CPU seconds (all threads) sampled at `at_s` from now, filled in by timers:
    shows when the step's refusals alone saturate the agent, whatever the limiter does."""
    proc = psutil.Process(agent.proc.pid) if agent.proc is not None else None
    out: list[float] = []

    def sample() -> None:
        with contextlib.suppress(psutil.Error):
            if proc is not None:
                out.append(sum(proc.cpu_times()[:2]))

    for at in at_s:
        timer = threading.Timer(at, sample)
        timer.daemon = True
        timer.start()
    return out


def run_policy(policy: str, capacity: float, args: argparse.Namespace) -> PolicyResult:
    t_step, t_end = args.baseline_s, args.baseline_s + args.overload_s
    with AgentProcess(device="cpu", limiter=policy, p99_threshold_ms=args.threshold_ms, period_s=1.0) as agent:
        mono0 = time.monotonic()
        cpu = _cpu_sampler(agent, [t_step, t_end])
        rows = drive(agent.grpc_address, [(capacity, args.baseline_s), (args.overload_x * capacity, args.overload_s),
                                          (capacity, args.after_s)], args.seed)
        with urllib.request.urlopen(f"{agent.metrics_url}/events?follow=0", timeout=10) as resp:
            events = [json.loads(x) for x in resp.read().splitlines()]
    over = rows[(rows[:, 0] >= t_step) & (rows[:, 0] < t_end)]
    ok = over[over[:, 2] == 1]
    windows = window_p99(rows, t_step, t_end)
    rec = recovery(rows, t_step, t_end, args.threshold_ms)
    rec_after = recovery(rows, t_end, t_end + args.after_s, args.threshold_ms)
    held = recovery_held(rows, t_step, t_end, args.threshold_ms)
    # Limiter rate per period over the last half of the overload (agent events, monotonic clock).
    lo, hi = mono0 + t_step + args.overload_s / 2, mono0 + t_end
    rates = [e["rate"] for e in events if e["type"] == "period" and lo <= e["mono"] <= hi and e["rate"]]
    periods = [e for e in events if e["type"] == "period" and mono0 <= e["mono"] <= mono0 + t_end + args.after_s + 1]
    osc = mean = None
    if rates:
        mean = float(np.mean(rates))
        osc = 100.0 * (max(rates) - min(rates)) / 2 / mean
    srv = [e for e in periods if mono0 + t_step < e["mono"] <= mono0 + t_end]
    under = [e["p99_ms"] is not None and e["p99_ms"] <= args.threshold_ms for e in srv]
    srv_rec = next((max(0.0, srv[i]["mono"] - 1.0 - mono0 - t_step) for i in range(len(under) - 2)
                    if all(under[i:i + 3])), None)
    agent_cores = (cpu[1] - cpu[0]) / args.overload_s if len(cpu) == 2 else None
    print(f"  {policy}: agent CPU during the overload {fmt(agent_cores, ' cores')} for "
          f"{len(over) / args.overload_s:.0f} calls/s offered, {len(ok) / args.overload_s:.0f}/s served", flush=True)
    print(f"  {policy}: client p99 (ms) by second of the overload: " + " ".join(f"{p:.0f}" for _, p in windows),
          flush=True)
    print(f"  {policy}: limiter rate by period of the overload: " + " ".join(
        f"{e['rate']:.0f}" for e in events if e["type"] == "period" and e["rate"]
        and mono0 + t_step <= e["mono"] <= hi + 1), flush=True)
    trace = {"agent_cpu_cores_overload": [agent_cores], "t": [round(e["mono"] - mono0, 3) for e in periods], "rate": [e["rate"] for e in periods],
             "server_p50_ms": [e["p50_ms"] for e in periods], "server_p99_ms": [e["p99_ms"] for e in periods],
             "count": [e["count"] for e in periods], "saturation": [e.get("saturation") for e in periods], "rejected": [e["rejected"] for e in periods],
             "client_p99_ms_by_second": [None if np.isnan(p) else round(p, 2) for _, p in window_p99(
                 rows, 0.0, t_end + args.after_s)]}
    return PolicyResult(policy, rec, rec_after, len(ok) / args.overload_s / capacity,
                        float(np.sum(ok[:, 1] * 1000 <= args.threshold_ms)) / args.overload_s / capacity,
                        float(np.mean(over[:, 3])) if len(over) else 0.0, osc, mean, held, trace, srv_rec)


def model_run(policy: str, args: argparse.Namespace, capacity: float = 1000.0) -> PolicyResult:
    """The same protocol on a deterministic single-queue model (1 s periods): the server completes at
    most `capacity`/s, P99 is 5 ms plus the wait behind its backlog, and the serving thread's
    saturation is 0.1 + 0.9 x its work / capacity. No machine noise: this shows
    the controllers' own dynamics next to the real, noisy measurement."""
    from agent_under_test.limiter import LimiterSettings, make_limiter
    from agent_under_test.monitor import PeriodSummary

    lim = make_limiter(policy, LimiterSettings(threshold_ms=args.threshold_ms))
    step, end = int(args.baseline_s), int(args.baseline_s + args.overload_s)
    backlog, rows = 0.0, []
    for n in range(end + int(args.after_s)):
        offered = capacity * (2.0 if step <= n < end else 1.0)
        admitted = min(offered, lim.rate)
        done = min(capacity, backlog + admitted)
        # The serving thread is busy in proportion to the work it has, plus a fixed 10 % (its loop).
        saturation = min(1.0, 0.1 + 0.9 * (backlog + admitted) / capacity)
        backlog += admitted - done
        p99 = 5.0 + 1000.0 * backlog / capacity
        state = "breaching" if p99 > args.threshold_ms else "healthy"
        lim.on_period(PeriodSummary(n, n, n + 1.0, int(done), int(done), 0, 0, int(offered - admitted),
                                    p99, p99, p99, state, saturation))
        rows.append((n, p99, done, offered - admitted, offered, lim.rate))
    over = [r for r in rows if step <= r[0] < end]
    rec = next((r[0] - step for r in over if r[1] <= args.threshold_ms), None)
    under = [r[1] <= args.threshold_ms for r in over]
    held = next((float(i) for i in range(len(under) - 4) if all(under[i:i + 5])), None)
    rates = [r[5] for r in over[len(over) // 2:]]
    mean = float(np.mean(rates))
    return PolicyResult(policy, rec, None, sum(r[2] for r in over) / len(over) / capacity,
                        sum(r[2] for r in over if r[1] <= args.threshold_ms) / len(over) / capacity,
                        sum(r[3] for r in over) / sum(r[4] for r in over),
                        100.0 * (max(rates) - min(rates)) / 2 / mean, mean, held, server_recover_s=held)


def report(title: str, results: dict[str, PolicyResult], overload_s: float) -> None:
    print(title)
    print(f"{'policy':9} {'recover':>9} {'held':>7} {'server':>7} {'after end':>9} {'ok/C':>6} {'goodput/C':>9} "
          f"{'rejected':>8} {'osc':>7} {'mean rate':>9}")
    for r in results.values():
        print(f"{r.policy:9} {fmt(r.recover_s):>9} {fmt(r.recover_held_s):>7} {fmt(r.server_recover_s):>7} "
              f"{fmt(r.recover_after_end_s):>9} "
              f"{r.goodput_share:6.2f} {r.slo_goodput_share:9.2f} {r.rejected_share:8.2f} "
              f"{fmt(r.oscillation_pct, '%'):>7} {(r.mean_rate or 0):9.0f}")
    for line in verdicts(results["seed"], results["gradient"], overload_s):
        print("  " + line)


def verdicts(s: PolicyResult, g: PolicyResult, overload_s: float) -> list[str]:
    """The issue's three targets, with 'never' (no recovery within the overload) counted as the whole step
    for seed and as a miss for gradient; recovery judged both ways (first window, and held)."""
    out = []
    for name, sv, gv in (("recover", s.recover_s, g.recover_s), ("recover held", s.recover_held_s, g.recover_held_s),
                         ("server-side recover", s.server_recover_s, g.server_recover_s)):
        seed_v = sv if sv is not None else overload_s
        ok = gv is not None and gv <= seed_v / 2
        out.append(f"{name} seed/gradient: {seed_v:.1f} s / {fmt(gv)} (seed 'never' counted as {overload_s:g} s)"
                   f" -> gradient <= 1/2 of seed: {'met' if ok else 'MISSED'}")
    ratio = f"{g.slo_goodput_share / s.slo_goodput_share:.2f}x" if s.slo_goodput_share >= 0.01 else "seed ~0"
    out.append(f"goodput (ok within the threshold) gradient/seed: {ratio} -> "
               f"{'met' if g.slo_goodput_share >= s.slo_goodput_share else 'MISSED'}; ok calls gradient/seed "
               f"{g.goodput_share / max(s.goodput_share, 1e-9):.2f}x; gradient oscillation "
               f"{fmt(g.oscillation_pct, '%')} -> {'met' if (g.oscillation_pct or 0) <= 10 else 'MISSED'} (<= 10 %)")
    return out


def summarize(paths: list[Path]) -> None:
    """Medians over several runs' JSON files (the machine is noisy: judge the targets on the medians).

    A recovery that never happened counts as the whole overload for the median, shown as '-' only when
    the median itself is 'never'."""
    runs = [json.loads(p.read_text()) for p in paths]
    overload = float(runs[0]["args"]["overload_s"])
    print(f"medians over {len(runs)} runs, C = {' '.join(str(round(r['capacity'])) for r in runs)}")
    for part in ("results", "model"):
        med: dict[str, PolicyResult] = {}
        for policy in ("seed", "gradient"):
            rs = [r[part][policy] for r in runs]

            med[policy] = PolicyResult(policy, _median(rs, "recover_s", overload),
                                       _median(rs, "recover_after_end_s", 1e9),
                                       _median(rs, "goodput_share") or 0.0, _median(rs, "slo_goodput_share") or 0.0,
                                       _median(rs, "rejected_share") or 0.0, _median(rs, "oscillation_pct"),
                                       _median(rs, "mean_rate"), _median(rs, "recover_held_s", overload),
                                       None, _median(rs, "server_recover_s", overload))
            print(f"  {part} {policy}: recover " + " ".join(fmt(x.get("recover_s")) for x in rs) +
                  " | held " + " ".join(fmt(x.get("recover_held_s")) for x in rs) +
                  " | server " + " ".join(fmt(x.get("server_recover_s")) for x in rs) +
                  " | goodput/C " + " ".join(f"{x['slo_goodput_share']:.2f}" for x in rs) +
                  " | osc " + " ".join(fmt(x.get("oscillation_pct"), "%") for x in rs))
        report(f"{part}: medians", med, overload)


def _median(rows: list[dict[str, float | None]], key: str, never: float | None = None) -> float | None:
    """Median of `key` over runs; a None counts as `never` (then a median at `never` is None again). With an
    even number of runs, the upper of the two middle values: averaging a time with `never` means nothing."""
    vals = sorted(float(v) for v in ((x.get(key) if x.get(key) is not None else never) for x in rows) if v is not None)
    if not vals:
        return None
    v = vals[len(vals) // 2]
    return None if never is not None and v >= never else v


def fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.1f}{unit}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=float, default=None, help="calls/s; default: calibrate")
    ap.add_argument("--threshold-ms", type=float, default=20.0)
    ap.add_argument("--baseline-s", type=float, default=20.0)
    ap.add_argument("--overload-s", type=float, default=30.0)
    ap.add_argument("--after-s", type=float, default=8.0)
    ap.add_argument("--overload-x", type=float, default=2.0, help="the overload step, x the capacity")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--summarize", type=Path, nargs="+", default=None, metavar="JSON",
                    help="print the medians of earlier runs' --json files and exit (runs nothing)")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return 0
    print(f"bench/limiter.py seed={args.seed} threshold={args.threshold_ms} ms", flush=True)
    capacity = args.capacity or calibrate(args.threshold_ms, args.seed,
                                          [150, 250, 500, 1000, 1500, 2000, 2500, 3000, 3500, 4000, 5000, 6000], 2.5)
    print(f"capacity C = {capacity:.0f} calls/s; overload {args.overload_x:g}C = {args.overload_x * capacity:.0f} calls/s for {args.overload_s:g} s",
          flush=True)
    results = {p: run_policy(p, capacity, args) for p in ("seed", "gradient")}
    model = {p: model_run(p, args) for p in ("seed", "gradient")}
    report(f"real agent, C = {capacity:.0f}/s (client side):", results, args.overload_s)
    report("deterministic queue model, C = 1000/s (same protocol, no machine noise):", model, args.overload_s)
    if args.json:
        args.json.write_text(json.dumps({"capacity": capacity, "args": vars(args) | {"json": str(args.json)},
                                         "results": {k: asdict(v) for k, v in results.items()},
                                         "model": {k: asdict(v) for k, v in model.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
