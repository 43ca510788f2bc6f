"""Limiter checks: limiter_reduces (by how much, within how long) and limiter_recovers."""

from __future__ import annotations

from harness.checks.base import Param, Verdict, register, verdict
from harness.scenario import CheckSpec
from harness.timeline import Timeline


def _series_in(tl: Timeline, start: float, end: float) -> list[tuple[float, float]]:
    return [(t, r) for t, r in tl.limiter_series() if start <= t <= end]


class LimiterReduces:
    name = "limiter_reduces"
    params = {"phase": Param("phase", required=True),
              "at_least_pct": Param("number", help="minimum cut from the rate at phase start (default 10)"),
              "within_s": Param("duration", help="counted from the phase start (default the whole phase)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        start, end = tl.phase_bounds(spec.params["phase"]) or (0.0, 0.0)
        want = spec.params.get("at_least_pct", 10.0)
        end = min(end, start + spec.params.get("within_s", end - start))
        before = tl.rate_at(start)
        points = _series_in(tl, start, end)
        if before is None and points:
            before = points[0][1]
        if before is None or not points:
            return verdict(spec, False, "no limiter rate was observed (no limiter events or "
                           "agent_limiter_rate samples): is the limiter on?", series=points)
        low_t, low = min(points, key=lambda p: p[1])
        cut = (1 - low / before) * 100 if before > 0 else 0.0
        evidence = {"rate_at_start": before, "lowest_rate": low, "lowest_at_s": round(low_t, 3),
                    "cut_pct": round(cut, 1), "required_pct": want}
        if cut >= want:
            return verdict(spec, True, f"limiter cut its rate {cut:.0f}% ({before:.0f} -> {low:.0f}/s, "
                           f"lowest at {low_t:.1f}s), needed {want:g}%", **evidence)
        return verdict(spec, False, f"limiter cut its rate only {cut:.0f}% ({before:.0f} -> {low:.0f}/s) "
                       f"by {end:.1f}s; needed {want:g}%", **evidence)


class LimiterRecovers:
    name = "limiter_recovers"
    params = {"phase": Param("phase", required=True),
              "to_pct_of_baseline": Param("number", help="share of the baseline rate to reach (default 90)"),
              "within_s": Param("duration", help="from the phase start (default the whole phase)"),
              "baseline_phase": Param("phase", help="whose final rate is the baseline (default the first)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        start, end = tl.phase_bounds(spec.params["phase"]) or (0.0, 0.0)
        base_name = spec.params.get("baseline_phase", tl.phases[0][0])
        base_end = (tl.phase_bounds(base_name) or (0.0, 0.0))[1]
        baseline = tl.rate_at(base_end)
        want = spec.params.get("to_pct_of_baseline", 90.0)
        deadline = min(end, start + spec.params.get("within_s", end - start))
        if baseline is None:
            return verdict(spec, False, f"no limiter rate observed by the end of {base_name!r}: "
                           "is the limiter on?")
        target = baseline * want / 100
        low = min((r for _, r in _series_in(tl, start, deadline)), default=tl.rate_at(start))
        reached = [(t, r) for t, r in tl.limiter_series() if start <= t <= deadline and r >= target]
        at_start = tl.rate_at(start)
        evidence = {"baseline_rate": baseline, "target_rate": round(target, 2), "deadline_s": round(deadline, 3),
                    "rate_at_start": at_start, "lowest_rate": low}
        if at_start is not None and at_start >= target and not reached:
            reached = [(start, at_start)]
        if reached:
            t, r = reached[0]
            return verdict(spec, True, f"limiter back to {r:.0f}/s (>= {want:g}% of {baseline:.0f}) at "
                           f"{t:.1f}s, {t - start:.1f}s into the phase", reached_s=round(t, 3), **evidence)
        final = tl.rate_at(deadline)
        return verdict(spec, False, f"limiter only at {final or 0:.0f}/s by {deadline:.1f}s; needed "
                       f"{target:.0f}/s ({want:g}% of baseline {baseline:.0f})", final_rate=final, **evidence)


for _check in (LimiterReduces(), LimiterRecovers()):
    register(_check)
