"""Limiter checks: limiter_reduces, limiter_recovers, limiter_obeys.

    limiter_reduces   the rate fell by at least X % in the phase AND the limiter really limited: the
                      client saw calls refused, or the rate went below the load offered to it. A cut
                      from far above the traffic (600 -> 251/s with 100/s offered) proves nothing.
    limiter_recovers  the rate got back to a share of the baseline; nothing to judge when it was never
                      below that share (nothing was reduced).
    limiter_obeys     what the limiter admitted (the client's calls that were not refused, per period)
                      stays within the rate it reports, in every period where the offered load was
                      above that rate; a limiter that reports cuts but admits everything fails it.
    limiter_stable    in a steady phase the rate settles: its swing ((max - min) / 2 over the mean, in
                      the phase's second half) stays within a bound, and no single adjustment grows the
                      rate by more than its policy declares (seed x1.1, gradient x1.5 towards its
                      ceiling); a limiter that doubles after each healthy period fails it.
"""

from __future__ import annotations

from typing import Any

from harness.checks.base import CHECKS, Param, Verdict, nothing_to_judge, phase_window, verdict
from harness.scenario import CheckSpec
from harness.timeline import Timeline


def _series_in(tl: Timeline, start: float, end: float) -> list[tuple[float, float]]:
    return [(t, r) for t, r in tl.limiter_series() if start <= t <= end]


def _offered(tl: Timeline, start: float, end: float) -> list[tuple[float, float, int, int]]:
    """(start, end, offered, rejected) of the client's periods inside [start, end)."""
    return [(p.start_s, p.end_s, p.offered - p.not_sent, p.rejected) for p in tl.periods
            if start - 1e-9 <= p.start_s and p.end_s <= end + 1e-9]


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
                           "agent_limiter_rate samples) although the scenario expects a cut: the limiter "
                           "stayed flat or is off", series=points)
        low_t, low = min(points, key=lambda p: p[1])
        cut = (1 - low / before) * 100 if before > 0 else 0.0
        periods = _offered(tl, start, end + tl.period_s)
        rejected = sum(r for *_, r in periods)
        offered_peak = max((o / (b - a) for a, b, o, _ in periods), default=0.0)
        evidence = {"rate_at_start": before, "lowest_rate": low, "lowest_at_s": round(low_t, 3),
                    "cut_pct": round(cut, 1), "required_pct": want, "client_rejected": rejected,
                    "offered_peak_per_s": round(offered_peak, 1)}
        if cut < want:
            return verdict(spec, False, f"limiter cut its rate only {cut:.0f}% ({before:.0f} -> {low:.0f}/s) "
                           f"by {end:.1f}s; needed {want:g}%", **evidence)
        if rejected == 0 and low >= offered_peak:
            return verdict(spec, False, f"limiter cut its rate {cut:.0f}% ({before:.0f} -> {low:.0f}/s) but never "
                           f"came near the traffic (at most {offered_peak:.0f}/s offered, nothing refused): the "
                           "cut shed nothing, so it proves nothing", **evidence)
        how = (f"{rejected} calls refused" if rejected else
               f"rate below the {offered_peak:.0f}/s offered")
        return verdict(spec, True, f"limiter cut its rate {cut:.0f}% ({before:.0f} -> {low:.0f}/s, lowest at "
                       f"{low_t:.1f}s), needed {want:g}%; it limited: {how}", **evidence)


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
        lowest_before = min((r for _, r in _series_in(tl, base_end, start)), default=baseline)
        at_start = tl.rate_at(start)
        evidence = {"baseline_rate": baseline, "target_rate": round(target, 2), "deadline_s": round(deadline, 3),
                    "rate_at_start": at_start, "lowest_rate": low, "lowest_before_phase": lowest_before}
        if lowest_before >= target and (at_start is None or at_start >= target) and (low is None or low >= target):
            return nothing_to_judge(spec, f"the limiter never went below {target:.0f}/s ({want:g}% of baseline "
                                    f"{baseline:.0f}) after {base_name!r}: nothing was reduced to recover from",
                                    **evidence)
        reached = [(t, r) for t, r in tl.limiter_series() if start <= t <= deadline and r >= target]
        if at_start is not None and at_start >= target and not reached:
            reached = [(start, at_start)]
        if reached:
            t, r = reached[0]
            return verdict(spec, True, f"limiter back to {r:.0f}/s (>= {want:g}% of {baseline:.0f}) at "
                           f"{t:.1f}s, {t - start:.1f}s into the phase (it had been down to "
                           f"{min(lowest_before, low or lowest_before):.0f}/s)", reached_s=round(t, 3), **evidence)
        final = tl.rate_at(deadline)
        return verdict(spec, False, f"limiter only at {final or 0:.0f}/s by {deadline:.1f}s; needed "
                       f"{target:.0f}/s ({want:g}% of baseline {baseline:.0f})", final_rate=final, **evidence)


class LimiterObeys:
    """Admitted (client calls not refused) per period <= the highest rate in force x period + burst + slack."""

    name = "limiter_obeys"
    params = {"phase": Param("phase", help="default: the whole run"),
              "tolerance_pct": Param("number", help="admitted above the rate allowed (default 10)"),
              "burst_s": Param("number", help="the limiter's burst in seconds of its rate (default 0.05)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        start, end = phase_window(tl, spec)
        tol = spec.params.get("tolerance_pct", 10.0)
        burst = spec.params.get("burst_s", 0.05)
        series = tl.limiter_series()
        if not series:
            return verdict(spec, False, "no limiter rate was observed (no limiter events or agent_limiter_rate "
                           "samples): what it admits cannot be compared with anything")
        judged: list[dict[str, Any]] = []
        worst: dict[str, Any] | None = None
        for a, b, offered, rejected in _offered(tl, start, end):
            # The rate in force over the period, with a little of the period before (the agent's tick
            # grid is not the client's, and a call reaches it a moment after it was sent).
            rates = [r for t, r in series if a - tl.period_s / 2 < t < b] + [tl.rate_at(a - tl.period_s / 2) or 0.0]
            rate = max(rates)
            span = b - a
            allowed = rate * span * (1 + tol / 100) + max(1.0, rate * burst) + 2
            admitted = offered - rejected
            if offered <= allowed:
                continue        # nothing above the rate to refuse in this period
            row = {"t": round(a, 3), "offered": offered, "admitted": admitted, "rate": round(rate, 2),
                   "allowed": round(allowed, 1)}
            judged.append(row)
            if admitted > allowed and (worst is None or admitted - allowed > worst["admitted"] - worst["allowed"]):
                worst = row
        evidence = {"periods_judged": judged[:200], "tolerance_pct": tol, "burst_s": burst}
        if not judged:
            return nothing_to_judge(spec, f"the load offered never exceeded the limiter's rate in "
                                    f"{start:.1f}-{end:.1f}s, so nothing had to be refused", **evidence)
        if worst is not None:
            over = sum(1 for r in judged if r["admitted"] > r["allowed"])
            return verdict(spec, False, f"the limiter admitted {worst['admitted']} calls in the period at "
                           f"{worst['t']:.1f}s while reporting {worst['rate']:.0f}/s (at most {worst['allowed']:.0f} "
                           f"allowed, {worst['offered']} offered); {over} of {len(judged)} such periods over: "
                           "it does not enforce the rate it reports", **evidence)
        return verdict(spec, True, f"in all {len(judged)} periods with more offered than the rate allowed, the "
                       f"limiter admitted within its reported rate (+{tol:g}% and its burst)", **evidence)


# The largest growth of one adjustment each policy declares (agent_under_test/limiter.py): the seed
# rule's x1.1, the gradient limiter's busy_step x1.5. Unknown policies: the check's max_step_pct.
POLICY_STEP_PCT = {"seed": 10.0, "gradient": 50.0}
_STEP_SLACK_PCT = 0.5          # rounding of the rates in the events (6 decimals) and float noise


class LimiterStable:
    name = "limiter_stable"
    params = {"phase": Param("phase", help="default: the whole run"),
              "max_swing_pct": Param("number", help="(max - min) / 2 of the rate over its mean, in the phase's "
                                                    "second half (default 15)"),
              "max_step_pct": Param("number", help="largest growth of one adjustment, % (default: what the "
                                                   "limiter's policy declares: seed 10, gradient 50)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        start, end = phase_window(tl, spec)
        mid = (start + end) / 2
        swing_max = spec.params.get("max_swing_pct", 15.0)
        at_mid = tl.rate_at(mid)
        rates = ([at_mid] if at_mid is not None else []) + [r for _, r in _series_in(tl, mid, end)]
        if not rates:
            return verdict(spec, False, "no limiter rate was observed (no limiter events or agent_limiter_rate "
                           "samples): its stability cannot be judged")
        mean = sum(rates) / len(rates)
        swing = (max(rates) - min(rates)) / 2 / mean * 100 if mean > 0 else 0.0
        steps: list[dict[str, Any]] = []
        for e in tl.events_of("limiter"):
            old, new = e.data.get("old_rate"), e.data.get("new_rate")
            if start <= e.t <= end and isinstance(old, (int, float)) and isinstance(new, (int, float)) and 0 < old < new:
                policy = str(e.data.get("policy", ""))
                declared = spec.params.get("max_step_pct", POLICY_STEP_PCT.get(policy))
                steps.append({"t": round(e.t, 3), "old": old, "new": new, "pct": round((new / old - 1) * 100, 2),
                              "policy": policy, "declared_pct": declared})
        evidence = {"second_half_s": [round(mid, 3), round(end, 3)], "min": round(min(rates), 3),
                    "max": round(max(rates), 3), "mean": round(mean, 3), "swing_pct": round(swing, 2),
                    "max_swing_pct": swing_max, "growth_steps": len(steps),
                    "largest_step": max(steps, key=lambda s: s["pct"]) if steps else None}
        big = [s for s in steps if s["declared_pct"] is not None and s["pct"] > s["declared_pct"] + _STEP_SLACK_PCT]
        if big:
            s = max(big, key=lambda s: s["pct"])
            return verdict(spec, False, f"the limiter grew its rate {s['old']:.0f} -> {s['new']:.0f}/s at "
                           f"{s['t']:.1f}s (+{s['pct']:.0f}%), more than its {s['policy'] or 'declared'} policy's "
                           f"+{s['declared_pct']:g}% a step; {len(big)} of {len(steps)} growth steps too large",
                           **evidence)
        if swing > swing_max:
            return verdict(spec, False, f"the limiter's rate swung +-{swing:.0f}% around {mean:.0f}/s "
                           f"({min(rates):.0f}-{max(rates):.0f}/s) in the second half of "
                           f"{repr(spec.params['phase']) if spec.params.get('phase') else 'the run'}; "
                           f"at most +-{swing_max:g}%: it does not settle", **evidence)
        how = (f"largest growth step +{max(s['pct'] for s in steps):.1f}%" if steps else "no growth step")
        unjudged = "" if tl.events_of("limiter") else " (steps not judged: no limiter events, only scraped rates)"
        return verdict(spec, True, f"the limiter settled: +-{swing:.1f}% around {mean:.0f}/s in the second half "
                       f"(at most +-{swing_max:g}%), {how}{unjudged}", **evidence)


for _check in (LimiterReduces(), LimiterRecovers(), LimiterObeys(), LimiterStable()):
    CHECKS.add(_check.name, _check)
