"""The service judged by its own numbers: alert_rule and percentiles_distinct.

Both read the service's `period` events (its own per-period P50/P95/P99, call count and verdict) and
its `alert` events, never the client's view, so nothing the service cannot observe can fail them:

    alert_rule            the period series run through the declared rule (fire on the N-th consecutive
                          breaching period, resolve after M consecutive healthy ones, a period with fewer
                          than min_samples calls neither breaches nor heals) must reproduce the service's
                          alert transitions period for period; the first differing period is named
    percentiles_distinct  P50 <= P95 <= P99 in every period, and the P99 differs from the P95 in more than
                          a few of the periods with enough calls (a "P99" equal to the P95 is not a P99)

The rule is reimplemented here from its specification (docs/protection.md), not imported from the
agent: a check that ran the service's own code would agree with any defect in it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from harness.checks.base import CHECKS, Param, Verdict, verdict
from harness.scenario import AgentTarget, CheckSpec, ExternalTarget
from harness.timeline import Event, Timeline

INACTIVE, PENDING, FIRING = "inactive", "pending", "firing"
BREACHING, HEALTHY, INSUFFICIENT = "breaching", "healthy", "insufficient"
# The bundled agent's defaults for what a scenario's target may leave out (docs/protection.md).
AGENT_RESOLVE_PERIODS = 3
AGENT_MIN_SAMPLES = 20
_EPS = 1e-9
_LISTED = 6          # transitions named in a passing summary (all of them are in the evidence)


def declare_rule(spec: CheckSpec, target: AgentTarget | ExternalTarget) -> CheckSpec:
    """`alert_rule` with the rule the scenario's target declares filled in where the check does not give
    it (fire_after <- alert_periods, resolve_after <- resolve_periods, threshold_ms <- p99_threshold_ms,
    min_samples <- min_samples; the agent's defaults for options left out). Other checks: unchanged."""
    if spec.kind != AlertRule.name:
        return spec
    declared: dict[str, Any] = {"fire_after": target.alert_periods, "threshold_ms": target.p99_threshold_ms}
    if isinstance(target, AgentTarget):
        declared["resolve_after"] = int(target.options.get("resolve_periods", AGENT_RESOLVE_PERIODS))
        declared["min_samples"] = int(target.options.get("min_samples", AGENT_MIN_SAMPLES))
    return replace(spec, params=declared | spec.params)


@dataclass(frozen=True)
class ServicePeriod:
    """One `period` event: the service's own numbers for one period, at `t` (its end) in run seconds."""

    period: int
    t: float
    seq: int
    count: int | None
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    state: str | None             # the service's own verdict label, when it gives one
    threshold_ms: float | None    # per-period values, when the service publishes them
    min_samples: int | None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def service_periods(tl: Timeline) -> list[ServicePeriod]:
    """The service's period series, in the order it emitted it (by `seq`, else as read)."""
    out = []
    for i, e in enumerate(tl.events_of("period")):
        d = e.data
        if _num(d.get("period")) is None:
            continue
        count, threshold, min_samples = _num(d.get("count")), _num(d.get("threshold_ms")), _num(d.get("min_samples"))
        out.append(ServicePeriod(int(d["period"]), e.t, _seq(e, i), None if count is None else int(count),
                                 _num(d.get("p50_ms")), _num(d.get("p95_ms")), _num(d.get("p99_ms")),
                                 str(d["state"]) if "state" in d else None, threshold,
                                 None if min_samples is None else int(min_samples)))
    return sorted(out, key=lambda p: p.seq)


def _seq(e: Event, fallback: int) -> int:
    seq = _num(e.data.get("seq"))
    return int(seq) if seq is not None else fallback


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _ms(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class Step:
    """The rule's reading of one period: its verdict and the alert's state before and after."""

    p: ServicePeriod
    verdict: str
    before: str
    after: str
    breaches: int       # consecutive breaching periods so far (insufficient ones skipped)
    heals: int          # consecutive healthy periods while firing
    threshold_ms: float
    min_samples: int


def run_rule(periods: list[ServicePeriod], fire_after: int, resolve_after: int, threshold_ms: float,
             min_samples: int) -> list[Step]:
    """The declared rule over the series, from an inactive alert at the first period."""
    state, breaches, heals, steps = INACTIVE, 0, 0, []
    for p in periods:
        threshold = p.threshold_ms if p.threshold_ms is not None else threshold_ms
        needed = p.min_samples if p.min_samples is not None else min_samples
        if p.count is None or p.count < max(1, needed) or p.p99_ms is None:
            verdict_ = INSUFFICIENT
        else:
            verdict_ = BREACHING if p.p99_ms > threshold else HEALTHY
        before = state
        if verdict_ == BREACHING:
            breaches, heals = breaches + 1, 0
            if state != FIRING:
                state = FIRING if breaches >= fire_after else PENDING
        elif verdict_ == HEALTHY:
            breaches = 0
            if state == PENDING:
                state = INACTIVE
            elif state == FIRING:
                heals += 1
                if heals >= resolve_after:
                    state, heals = INACTIVE, 0
        steps.append(Step(p, verdict_, before, state, breaches, heals, threshold, needed))
    return steps


def _measure(s: Step) -> str:
    """What the period measured against the rule: 'p99 25 ms > 20', '5 calls < min_samples 20'."""
    p = s.p
    if s.verdict != INSUFFICIENT:
        return f"p99 {_ms(p.p99_ms or 0.0)} ms {'>' if s.verdict == BREACHING else '<='} {_ms(s.threshold_ms)}"
    if p.count is None:
        return "no call count"
    if p.count < max(1, s.min_samples):
        return f"{p.count} calls < min_samples {s.min_samples}"
    return f"{p.count} calls but no p99"


def _explain(s: Step, fire_after: int, resolve_after: int) -> str:
    """The period's measurement and what the rule makes of it."""
    m = _measure(s)
    if s.verdict == INSUFFICIENT:
        return f"{m}: insufficient, neither breaching nor healing, the rule stays {s.before}"
    if s.verdict == BREACHING:
        if s.before == FIRING:
            return f"{m}, the rule keeps firing"
        if s.after == FIRING:
            return f"{m} was the {_ordinal(s.breaches)} consecutive breach, the rule fires"
        return (f"{m} was only the {_ordinal(s.breaches)} consecutive breach of {fire_after}, "
                f"the rule {'goes' if s.before == INACTIVE else 'stays'} pending")
    if s.before == FIRING and s.after == INACTIVE:
        return f"{m} was the {_ordinal(resolve_after)} consecutive healthy period, the rule resolves"
    if s.before == FIRING:
        return (f"{m} was only the {_ordinal(s.heals)} consecutive healthy period of {resolve_after}, "
                "the rule keeps firing")
    return f"{m}, the rule {'drops pending (inactive)' if s.before == PENDING else 'stays inactive'}"


def _service_story(before: str, after: str) -> str:
    if before == after:
        return f"the service did not (it stayed {after})"
    what = {FIRING: "fired", PENDING: "went pending"}.get(after, "resolved" if before == FIRING else "dropped pending")
    return f"the service {what} ({before} -> {after})"


class AlertRule:
    name = "alert_rule"
    params = {"alert": Param("choice:P99High", help="the alert whose rule is judged (P99High)"),
              "fire_after": Param("int", help="N: fire on the N-th consecutive breach (the target's alert_periods)"),
              "resolve_after": Param("int", help="M: resolve after M healthy periods (the target's resolve_periods)"),
              "threshold_ms": Param("number", help="breach when P99 > this (the target's p99_threshold_ms)"),
              "min_samples": Param("int", help="fewer calls: insufficient (the target's min_samples)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        alert = spec.params.get("alert", "P99High")
        n = int(spec.params.get("fire_after", tl.alert_periods))
        m, min_samples = spec.params.get("resolve_after"), spec.params.get("min_samples")
        threshold = float(spec.params.get("threshold_ms", tl.threshold_ms))
        if m is None or min_samples is None:
            return verdict(spec, False, f"the {alert} rule is not fully declared: give resolve_after and "
                           "min_samples (an external target does not declare them)")
        rule = {"alert": alert, "fire_after": n, "resolve_after": m, "threshold_ms": threshold,
                "min_samples": min_samples}
        periods = service_periods(tl)
        if not periods:
            return verdict(spec, False, f"nothing to judge: the service sent no period events, so its {alert} "
                           "rule cannot be reproduced (does the target serve /events?)", **rule)
        numbers = [p.period for p in periods]
        gaps = [(a, b) for a, b in zip(numbers, numbers[1:], strict=False) if b != a + 1]
        if gaps:
            a, b = gaps[0]
            what = f"periods {a + 1}-{b - 1} are missing" if b > a + 1 else f"period {b} follows period {a}"
            return verdict(spec, False, f"the service's period series is broken ({what}): its {alert} rule "
                           "cannot be reproduced", periods=len(periods), **rule)
        steps = run_rule(periods, n, m, threshold, min_samples)
        judged = sum(s.verdict != INSUFFICIENT for s in steps)
        declared = (f"fire on the {_ordinal(n)} breach of P99 > {_ms(threshold)} ms, resolve after {m} healthy, "
                    f"< {min_samples} calls insufficient")
        evidence: dict[str, Any] = dict(rule, periods=len(steps), judged_periods=judged,
                                        expected=[[s.p.period, s.before, s.after] for s in steps
                                                  if s.before != s.after])
        if not judged:
            return verdict(spec, False, f"nothing to judge: all {len(steps)} periods had fewer than "
                           f"{min_samples} calls (insufficient)", **evidence)
        actual, orphans = self._actual(tl, alert, periods)
        evidence["actual"] = [[p, f, t] for p, moves in sorted(actual.items()) for f, t in moves]
        if orphans:
            return verdict(spec, False, f"the service reported {alert} {orphans[0][1]} -> {orphans[0][2]} at "
                           f"period {orphans[0][0]}, which is not in its period series", **evidence)
        pending_shown = any(PENDING in move for moves in actual.values() for move in moves)
        shown = (lambda s: s) if pending_shown or n == 1 else (lambda s: INACTIVE if s == PENDING else s)  # noqa: E731
        state, note = INACTIVE, ""
        for i, s in enumerate(steps):
            before = state
            for _, to in actual.get(s.p.period, []):
                state = to
            label = s.p.state
            label_wrong = label in (BREACHING, HEALTHY, INSUFFICIENT) and label != s.verdict
            if shown(state) == shown(s.after) and not label_wrong:
                continue
            if i == len(steps) - 1 and shown(state) == shown(before) and not label_wrong:
                # The run ended between this period's event and its alert events: not judged.
                note = f"; period {s.p.period}, the last, not judged (its alert events came after the run)"
                break
            where = f"period {s.p.period} (t={s.p.t:.1f}s): "
            evidence["first_difference"] = {"period": s.p.period, "t": round(s.p.t, 3), "count": s.p.count,
                                            "p99_ms": s.p.p99_ms, "rule": [s.before, s.after],
                                            "service": [before, state], "verdict": s.verdict, "label": label}
            if shown(state) == shown(s.after):
                return verdict(spec, False, f"{where}{_measure(s)} is {s.verdict} by the rule; the service "
                               f"labelled it {label}", **evidence)
            labelled = f" (the service labelled the period {label})" if label_wrong else ""
            return verdict(spec, False, f"{where}{_explain(s, n, m)}; {_service_story(before, state)}{labelled}",
                           **evidence)
        moves = [f"{s.after} at period {s.p.period} (t={s.p.t:.1f}s)" for s in steps
                 if shown(s.before) != shown(s.after)]
        listed = ", ".join(moves[:_LISTED]) + (f" and {len(moves) - _LISTED} more" if len(moves) > _LISTED else "")
        told = f"{len(moves)} transition(s) as the rule says: {listed}" if moves else "no transition, as the rule says"
        shown_all = f"all {len(steps)} periods" if not note else f"{len(steps) - 1} of {len(steps)} periods"
        return verdict(spec, True, f"{alert} follows its rule in {shown_all} ({judged} judged; "
                       f"{declared}): {told}{note}", **evidence)

    @staticmethod
    def _actual(tl: Timeline, alert: str, periods: list[ServicePeriod]
                ) -> tuple[dict[int, list[tuple[str, str]]], list[tuple[int, str, str]]]:
        """The service's transitions of `alert` by period (its `period` field, else the period event
        before it in the stream) and those naming a period the series does not hold."""
        known = {p.period for p in periods}
        marks = [(p.seq, p.period) for p in periods]
        actual: dict[int, list[tuple[str, str]]] = {}
        orphans: list[tuple[int, str, str]] = []
        evs = [e for e in tl.events if e.type == "alert" and e.data.get("alert", alert) == alert]
        for e in sorted(evs, key=lambda e: _seq(e, 0)):
            move = (str(e.data.get("from", "")), str(e.data.get("to", "")))
            number = _num(e.data.get("period"))
            if number is None:
                seq = _seq(e, 0)
                before = [p for s, p in marks if s < seq]
                number = float(before[-1]) if before else -1.0
            if int(number) in known:
                actual.setdefault(int(number), []).append(move)
            else:
                orphans.append((int(number), *move))
        return actual, orphans


class PercentilesDistinct:
    name = "percentiles_distinct"
    params = {"min_calls": Param("int", help="periods with fewer calls are not compared (20)"),
              "max_equal_pct": Param("number", help="of those, the share allowed a P99 equal to the P95 (90)"),
              "min_periods": Param("int", help="periods with min_calls calls needed for a verdict (5)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        min_calls = int(spec.params.get("min_calls", 20))
        max_equal = float(spec.params.get("max_equal_pct", 90.0))
        min_periods = int(spec.params.get("min_periods", 5))
        periods = service_periods(tl)
        evidence: dict[str, Any] = {"min_calls": min_calls, "max_equal_pct": max_equal, "periods": len(periods)}
        if not periods:
            return verdict(spec, False, "nothing to judge: the service sent no period events with percentiles "
                           "(does the target serve /events?)", **evidence)
        for p in periods:
            pairs = [("P50", p.p50_ms, "P95", p.p95_ms), ("P95", p.p95_ms, "P99", p.p99_ms),
                     ("P50", p.p50_ms, "P99", p.p99_ms)]
            for lo_name, lo, hi_name, hi in pairs:
                if lo is not None and hi is not None and lo > hi + _EPS:
                    return verdict(spec, False, f"period {p.period} (t={p.t:.1f}s): {lo_name} {_ms(lo)} ms > "
                                   f"{hi_name} {_ms(hi)} ms over {p.count} calls: not percentiles of one "
                                   "distribution", **evidence)
        judged = [p for p in periods if p.count is not None and p.count >= max(1, min_calls)
                  and p.p95_ms is not None and p.p99_ms is not None]
        evidence["judged_periods"] = len(judged)
        if len(judged) < max(1, min_periods):
            return verdict(spec, False, f"nothing to judge: {len(judged)} period(s) with at least {min_calls} "
                           f"calls and a P95 and P99, {max(1, min_periods)} needed", **evidence)
        equal = [p for p in judged if abs((p.p99_ms or 0.0) - (p.p95_ms or 0.0)) <= _EPS]
        share = 100.0 * len(equal) / len(judged)
        evidence |= {"equal_periods": [p.period for p in equal], "equal_pct": round(share, 1)}
        if share > max_equal + _EPS:
            first = equal[0]
            also_p50 = [p for p in equal if p.p50_ms is not None and abs(p.p50_ms - (p.p99_ms or 0.0)) <= _EPS]
            p50 = " (and equals the P50 in all of them)" if len(also_p50) == len(equal) else ""
            return verdict(spec, False, f"P99 equals P95 in {len(equal)} of {len(judged)} periods with at least "
                           f"{min_calls} calls (more than {max_equal:g} %){p50}: the reported P99 is not a P99; "
                           f"e.g. period {first.period} (t={first.t:.1f}s): P95 = P99 = {_ms(first.p99_ms or 0.0)} "
                           f"ms over {first.count} calls", **evidence)
        return verdict(spec, True, f"P99 above P95 in {len(judged) - len(equal)} of {len(judged)} periods with "
                       f"at least {min_calls} calls (equal in {len(equal)}, {share:.0f} %; up to {max_equal:g} % "
                       f"allowed); P50 <= P95 <= P99 in all {len(periods)} periods", **evidence)


for _check in (AlertRule(), PercentilesDistinct()):
    CHECKS.add(_check.name, _check)
