"""Tier checks: no_flapping (the model tier changes at most N times in any M seconds).

The ground truth is the agent's own record of its tier: every `tier` event is one change, at the time
it happened (the agent's `mono`); a target without events is read from the scraped
`agent_model_tier{tier="light"}` gauge, each differing sample one change (flips faster than the scrape
interval are invisible there, so the evidence names the source). A run with neither has nothing to
judge and does not pass.
"""

from __future__ import annotations

from harness.checks.base import CHECKS, Param, Verdict, phase_window, verdict
from harness.scenario import CheckSpec
from harness.timeline import Timeline

_EPS = 1e-6   # event times travel as JSON floats: a change exactly per_s later is outside the window


def tier_changes(tl: Timeline) -> tuple[str, list[tuple[float, str, str]]] | None:
    """(source, [(t, from, to)]) of every tier change in the run, or None when the run has no tier data."""
    events = tl.events_of("tier")
    if events:
        return "events", [(e.t, str(e.data.get("from")), str(e.data.get("to"))) for e in events]
    name = tl.metric_names.get("model_tier", "agent_model_tier") + '{tier="light"}'
    samples = tl.metric(name)
    if not samples:
        return None
    out: list[tuple[float, str, str]] = []
    last = "light" if samples[0][1] >= 1 else "full"
    for t, value in samples[1:]:
        tier = "light" if value >= 1 else "full"
        if tier != last:
            out.append((t, last, tier))
            last = tier
    return "metrics", out


def busiest_window(times: list[float], per_s: float) -> tuple[int, float]:
    """The most changes in any window [t, t + per_s) that starts at a change, and where it starts."""
    best, best_at, j = 0, times[0] if times else 0.0, 0
    for i, start in enumerate(times):
        j = max(j, i)
        while j < len(times) and times[j] - start < per_s - _EPS:
            j += 1
        if j - i > best:
            best, best_at = j - i, start
    return best, best_at


class NoFlapping:
    name = "no_flapping"
    params = {"phase": Param("phase", help="default: the whole run"),
              "max_changes": Param("int", required=True, help="N: tier changes allowed in any window"),
              "per_s": Param("duration", required=True, help="M: the window length")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        start, end = phase_window(tl, spec)
        limit = int(spec.params["max_changes"])
        per_s = float(spec.params["per_s"])
        found = tier_changes(tl)
        if found is None:
            return verdict(spec, False, "no tier data: the target reported no tier events and no "
                           "agent_model_tier samples, so flapping cannot be judged", changes=[])
        if per_s <= 0:
            return verdict(spec, False, f"per_s must be positive, got {per_s:g}s", changes=[])
        source, all_changes = found
        # Sorted: a period tick's change carries its grid time, which may precede a queue change logged first.
        changes = sorted((t, a, b) for t, a, b in all_changes if start <= t <= end)
        times = [t for t, _, _ in changes]
        most, at = busiest_window(times, per_s)
        evidence = {"source": source, "change_times_s": [round(t, 3) for t in times],
                    "changes": [{"t": round(t, 3), "from": a, "to": b} for t, a, b in changes],
                    "max_changes": limit, "per_s": per_s, "busiest": most,
                    "busiest_window_s": [round(at, 3), round(at + per_s, 3)] if times else None,
                    "window_s": [round(start, 3), round(end, 3)]}
        if most > limit:
            burst = [f"{t:.2f}" for t in times if at <= t and t - at < per_s - _EPS]
            shown = ", ".join(burst[:8]) + (", ..." if len(burst) > 8 else "s")
            return verdict(spec, False, f"the tier changed {most} times within {per_s:g}s "
                           f"({at:.1f}-{at + per_s:.1f}s, at {shown}); at most {limit} allowed: it flaps",
                           **evidence)
        if not times:
            return verdict(spec, True, f"the tier never changed in {start:.1f}-{end:.1f}s ({source})",
                           **evidence)
        return verdict(spec, True, f"{len(times)} tier change(s) in {start:.1f}-{end:.1f}s, at most {most} "
                       f"within any {per_s:g}s (limit {limit})", **evidence)


for _check in (NoFlapping(),):
    CHECKS.add(_check.name, _check)
