"""Ground truth measured outside the target, for the checks that judge what the service can observe.

    proxy upstream leg   the fault proxy's tap (faults/proxy/h2tap.py) times every call on the server's
                         side of the proxy: from the request's last frame leaving the proxy to the
                         response's last frame reaching it. Toxics on the client's side (`downstream`,
                         the default) happen after that, so network jitter never reaches this number.
                         It is what the service saw plus loopback TCP and the time the request waited
                         in the target's kernel before the service read it (which grows while its CPU
                         is throttled): the tolerance every check using it states.
    target scheduler     the target's threads' CPU time and run-queue wait (/proc/PID/task/*/schedstat):
                         CPU contention moves the wait, a CPU quota caps the CPU time.

`Timeline.outside` holds them: "proxy_legs" [(sent_s, done_s, served)], "sched" [(t, cpu_s, wait_s)]
(cumulative seconds since the process started), both on the run's clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from harness.timeline import Timeline
from wire.stats import percentile

LEG_TOLERANCE = ("proxy upstream leg: request END_STREAM leaving the proxy -> response END_STREAM reaching "
                 "it, on loopback; it also holds loopback TCP (~0.1 ms) and the time a call waits in the "
                 "target's kernel before the service reads it (the service cannot see that part); periods "
                 "on the run's grid, the service's own grid is offset by up to one period")


@dataclass(frozen=True)
class LegPeriod:
    """One period of upstream-leg latency (calls the service served, by when they finished)."""

    index: int
    start_s: float
    end_s: float
    count: int
    p50_ms: float | None
    p99_ms: float | None


def read_leg_log(path: str | Path, t0: float, limit: int = 10_000_000) -> list[tuple[float, float, bool]]:
    """The tap's `SENT DONE DATA` lines as (sent_s, done_s, served) in run seconds (bounded; a torn
    last line is skipped)."""
    out: list[tuple[float, float, bool]] = []
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for i, line in enumerate(f):
                if i >= limit:
                    break
                parts = line.split()
                try:
                    sent, done, data = float(parts[0]), float(parts[1]), parts[2] == "1"
                except (IndexError, ValueError):
                    continue
                if math.isfinite(sent) and math.isfinite(done) and done >= sent:
                    out.append((round(sent - t0, 6), round(done - t0, 6), data))
    except OSError:
        return []
    return out


def proxy_legs(tl: Timeline) -> list[tuple[float, float, bool]] | None:
    """The run's upstream-leg calls, or None when the proxy did not time them (no proxy, or Toxiproxy)."""
    legs = tl.outside.get("proxy_legs")
    return list(legs) if legs else None


def leg_periods(tl: Timeline, served_only: bool = True) -> list[LegPeriod] | None:
    """Upstream-leg P50/P99 per period of the run's grid, by completion time (as the service counts a
    call in the period it finished in); None without leg data. A period with fewer than the timeline's
    min_samples calls has no percentiles."""
    legs = proxy_legs(tl)
    if legs is None:
        return None
    count = max(1, math.ceil(tl.duration_s / tl.period_s - 1e-9))
    lat: list[list[float]] = [[] for _ in range(count)]
    for sent, done, served in legs:
        if served_only and not served:
            continue
        i = int(done // tl.period_s)
        if 0 <= i < count:
            lat[i].append((done - sent) * 1000.0)
    out = []
    for i, values in enumerate(lat):
        values.sort()
        enough = len(values) >= tl.min_samples
        out.append(LegPeriod(i, i * tl.period_s, (i + 1) * tl.period_s, len(values),
                             round(percentile(values, 0.5), 3) if enough else None,
                             round(percentile(values, 0.99), 3) if enough else None))
    return out


def leg_values(tl: Timeline, start: float, end: float) -> list[float] | None:
    """Upstream-leg latencies (ms, sorted) of the served calls finishing in [start, end); None without
    leg data."""
    legs = proxy_legs(tl)
    if legs is None:
        return None
    return sorted((d - s) * 1000.0 for s, d, served in legs if served and start <= d < end)


def sched_rates(tl: Timeline, start: float, end: float) -> tuple[float, float] | None:
    """The target's (CPU %, run-queue wait ms per s) over [start, end) from its scheduler stats; None
    when fewer than two samples fall in the window."""
    samples = [s for s in tl.outside.get("sched", []) if start <= s[0] <= end]
    return sched_rate_between(samples[0], samples[-1]) if len(samples) >= 2 else None


def sched_rate_between(first: tuple[float, float, float],
                       last: tuple[float, float, float]) -> tuple[float, float] | None:
    """(CPU %, run-queue wait ms per s) between two cumulative (t, CPU s, wait s) samples; None when
    they are not in time order."""
    (t0, cpu0, wait0), (t1, cpu1, wait1) = first, last
    span = t1 - t0
    if span <= 0:
        return None
    return round((cpu1 - cpu0) / span * 100.0, 2), round((wait1 - wait0) / span * 1000.0, 3)


def read_schedstat(pid: int) -> tuple[float, float] | None:
    """(CPU s, run-queue wait s) summed over the threads of `pid` (/proc/PID/task/*/schedstat); None
    when the process is gone or the kernel has no schedstat. Threads that ended are not counted."""
    cpu = wait = 0.0
    found = False
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks[:4096]:
        try:
            fields = (task / "schedstat").read_text().split()
            cpu += int(fields[0]) / 1e9
            wait += int(fields[1]) / 1e9
            found = True
        except (OSError, IndexError, ValueError):
            continue
    return (cpu, wait) if found else None
