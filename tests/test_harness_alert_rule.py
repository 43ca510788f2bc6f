"""alert_rule and percentiles_distinct on virtual services: exact trajectories, exact messages.

The "service" here is the agent's own alert state machine (`AlertMachine`) fed the period series; the
defective services are the same machine with a wrong N or M, or a monitor that counts what it should
not. The check reimplements the rule; these tests pin that its reimplementation and the agent agree,
and that each defect fails with the first differing period named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from agent_under_test.alerts import AlertMachine
from agent_under_test.config import ServeOptions
from agent_under_test.monitor import classify
from harness.checks import CHECKS, Verdict
from harness.checks.rule import AGENT_MIN_SAMPLES, AGENT_RESOLVE_PERIODS
from harness.scenario import CheckSpec
from harness.scenario_load import load_scenario, load_scenario_text
from harness.timeline import Event, Timeline

RULE = {"fire_after": 3, "resolve_after": 3, "threshold_ms": 20.0, "min_samples": 20}


@dataclass(frozen=True)
class P:
    """One period as the service measured it."""

    p99: float
    count: int = 100
    p95: float | None = None
    p50: float | None = None


OK, HOT = P(5.0), P(25.0)
FEW = P(30.0, count=5)          # insufficient: neither breaches nor heals
# 1-4 quiet; 5,6 breach, 7 insufficient, 8 the 3rd breach (fires), 9 breach; 10 heals, 11 breaks the heal,
# 12-14 heal (resolves at 14); 15 a one-period spike (pending), 16 drops it; 17-18 quiet.
TRAJECTORY = [OK] * 4 + [HOT, HOT, FEW, HOT, HOT, OK, HOT, OK, OK, OK, HOT, OK, OK, OK]


def service(periods: list[P], fire_after: int = 3, resolve_after: int = 3, min_samples: int = 20,
            p99_is_p95: bool = False, count_insufficient: bool = False,
            label: dict[int, str] | None = None, cut_last: bool = False) -> Timeline:
    """A timeline with the period and alert events a service emits for `periods` (period k ends at t=k)."""
    machine = AlertMachine("P99High", fire_after, resolve_after)
    events: list[Event] = []
    seq = 0

    def emit(t: float, kind: str, data: dict[str, object]) -> None:
        nonlocal seq
        seq += 1
        events.append(Event(t, kind, data | {"seq": seq}))

    for k, p in enumerate(periods, start=1):
        p95 = p.p95 if p.p95 is not None else round(p.p99 * 0.8, 3)
        p50 = p.p50 if p.p50 is not None else round(p.p99 * 0.5, 3)
        p99 = p95 if p99_is_p95 else p.p99
        state = classify(p.count, p99, 20.0, 1 if count_insufficient else min_samples)
        state = (label or {}).get(k, state)
        emit(float(k), "period", {"period": k, "count": p.count, "ok": p.count, "invalid": 0, "errors": 0,
                                  "rejected": 0, "p50_ms": p50, "p95_ms": p95, "p99_ms": p99, "state": state,
                                  "saturation": None, "period_s": 1.0, "rate": 400.0})
        verdict = classify(p.count, p99, 20.0, 1 if count_insufficient else min_samples)
        if (move := machine.observe(verdict, k)) is not None and not (cut_last and k == len(periods)):
            emit(float(k), "alert", move.event_fields())
    return Timeline(period_s=1.0, threshold_ms=20.0, phases=[("run", 0.0, float(len(periods)))], events=events,
                    alert_periods=3)


def judge(tl: Timeline, kind: str = "alert_rule", **params: object) -> Verdict:
    defaults = RULE if kind == "alert_rule" else {}
    return CHECKS[kind].evaluate(tl, CheckSpec(kind, {**defaults, **params}))


def test_a_correct_service_passes_with_every_transition_named() -> None:
    v = judge(service(TRAJECTORY))
    assert v.passed, v.summary
    assert v.summary == (
        "P99High follows its rule in all 18 periods (17 judged; fire on the 3rd breach of P99 > 20 ms, resolve "
        "after 3 healthy, < 20 calls insufficient): 5 transition(s) as the rule says: pending at period 5 "
        "(t=5.0s), firing at period 8 (t=8.0s), inactive at period 14 (t=14.0s), pending at period 15 "
        "(t=15.0s), inactive at period 16 (t=16.0s)")
    assert v.evidence["expected"] == v.evidence["actual"] == [
        [5, "inactive", "pending"], [8, "pending", "firing"], [14, "firing", "inactive"],
        [15, "inactive", "pending"], [16, "pending", "inactive"]]


@pytest.mark.parametrize(("defect", "message"), [
    ({"fire_after": 4},
     "period 8 (t=8.0s): p99 25 ms > 20 was the 3rd consecutive breach, the rule fires; the service did not "
     "(it stayed pending)"),
    ({"fire_after": 1},
     "period 5 (t=5.0s): p99 25 ms > 20 was only the 1st consecutive breach of 3, the rule goes pending; the "
     "service fired (inactive -> firing)"),
    ({"resolve_after": 10_000},
     "period 14 (t=14.0s): p99 5 ms <= 20 was the 3rd consecutive healthy period, the rule resolves; the "
     "service did not (it stayed firing)"),
    ({"resolve_after": 2},
     "period 13 (t=13.0s): p99 5 ms <= 20 was only the 2nd consecutive healthy period of 3, the rule keeps "
     "firing; the service resolved (firing -> inactive)"),
    ({"count_insufficient": True},
     "period 7 (t=7.0s): 5 calls < min_samples 20: insufficient, neither breaching nor healing, the rule stays "
     "pending; the service fired (pending -> firing) (the service labelled the period breaching)"),
])
def test_each_defect_fails_at_its_first_period(defect: dict[str, Any], message: str) -> None:
    v = judge(service(TRAJECTORY, **defect))
    assert not v.passed
    assert v.summary == message
    assert v.evidence["first_difference"]["period"] == int(message.split()[1])


def test_a_spurious_alert_in_a_quiet_run_fails() -> None:
    # A service that fires on any single breach, in a run whose only breach is one period long.
    quiet = [OK] * 6 + [HOT] + [OK] * 5
    assert judge(service(quiet)).passed
    v = judge(service(quiet, fire_after=1))
    assert v.summary == ("period 7 (t=7.0s): p99 25 ms > 20 was only the 1st consecutive breach of 3, the rule "
                         "goes pending; the service fired (inactive -> firing)")


def test_a_wrong_period_label_fails_even_when_the_alerts_agree() -> None:
    v = judge(service(TRAJECTORY, label={9: "healthy"}))
    assert not v.passed
    assert v.summary == "period 9 (t=9.0s): p99 25 ms > 20 is breaching by the rule; the service labelled it healthy"


def test_the_last_period_cut_by_the_end_of_the_run_is_not_judged() -> None:
    # The run's last poll can land between a period event and its alert events.
    ends_firing = [OK] * 3 + [HOT] * 3
    v = judge(service(ends_firing, cut_last=True))
    assert v.passed and "period 6, the last, not judged" in v.summary
    # ... but an alert the rule does not call for in that period still fails.
    v = judge(service([OK] * 3 + [HOT], fire_after=1))
    assert not v.passed and v.summary.startswith("period 4 (t=4.0s)")


def test_a_service_that_does_not_report_pending_is_judged_on_firing() -> None:
    def firing_only(tl: Timeline) -> Timeline:   # pending hidden: inactive -> firing -> inactive
        tl.events[:] = [Event(e.t, e.type, e.data | {"from": "inactive"}) if e.data.get("from") == "pending" else e
                        for e in tl.events if e.type != "alert" or e.data["to"] != "inactive"
                        or e.data["from"] == "firing"]
        tl.events[:] = [e for e in tl.events if e.type != "alert" or e.data["to"] != "pending"]
        return tl

    assert judge(firing_only(service(TRAJECTORY))).passed
    v = judge(firing_only(service(TRAJECTORY, fire_after=4)))
    assert v.summary == ("period 8 (t=8.0s): p99 25 ms > 20 was the 3rd consecutive breach, the rule fires; the "
                         "service did not (it stayed inactive)")


def test_nothing_to_judge_does_not_pass() -> None:
    empty = Timeline(period_s=1.0, threshold_ms=20.0, phases=[("run", 0.0, 5.0)])
    v = judge(empty)
    assert not v.passed and v.summary.startswith("nothing to judge: the service sent no period events")
    v = judge(service([FEW] * 6))
    assert not v.passed and v.summary == "nothing to judge: all 6 periods had fewer than 20 calls (insufficient)"
    v = CHECKS["alert_rule"].evaluate(service(TRAJECTORY), CheckSpec("alert_rule", {}))
    assert not v.passed and "give resolve_after and min_samples" in v.summary


def test_a_gap_or_an_unknown_period_fails() -> None:
    tl = service(TRAJECTORY)
    tl.events[:] = [e for e in tl.events if e.data.get("period") not in (10, 11)]
    v = judge(tl)
    assert not v.passed and v.summary.startswith("the service's period series is broken (periods 10-11 are missing)")
    tl = service([OK] * 5)
    tl.events.append(Event(9.0, "alert", {"alert": "P99High", "from": "inactive", "to": "firing", "period": 9,
                                          "seq": 99}))
    v = judge(tl)
    assert v.summary == "the service reported P99High inactive -> firing at period 9, which is not in its period series"


def test_percentiles_distinct_passes_a_real_p99_and_fails_a_p95_in_disguise() -> None:
    periods = [OK] * 10 + [HOT] * 5 + [OK] * 5
    good = judge(service(periods), "percentiles_distinct")
    assert good.passed, good.summary
    assert good.summary == ("P99 above P95 in 20 of 20 periods with at least 20 calls (equal in 0, 0 %; up to 90 % "
                            "allowed); P50 <= P95 <= P99 in all 20 periods")
    bad = judge(service(periods, p99_is_p95=True), "percentiles_distinct")
    assert not bad.passed
    assert bad.summary == ("P99 equals P95 in 20 of 20 periods with at least 20 calls (more than 90 %): the reported "
                           "P99 is not a P99; e.g. period 1 (t=1.0s): P95 = P99 = 4 ms over 100 calls")


def test_percentiles_distinct_allows_ties_in_small_or_stalled_periods() -> None:
    # Few calls: P95 and P99 are the same nearest rank. A stall: calls finishing together tie.
    stalled = P(600.0, count=50, p95=600.0)
    periods = [P(5.0, count=8, p95=5.0)] * 10 + [OK] * 10 + [stalled] * 6
    v = judge(service(periods), "percentiles_distinct")
    assert v.passed and "equal in 6, 38 %" in v.summary and v.evidence["judged_periods"] == 16


def test_percentiles_out_of_order_fail_in_any_period() -> None:
    v = judge(service([OK] * 6 + [P(9.0, p95=12.0)]), "percentiles_distinct")
    assert not v.passed
    assert v.summary == ("period 7 (t=7.0s): P95 12 ms > P99 9 ms over 100 calls: not percentiles of one "
                         "distribution")


def test_percentiles_distinct_with_nothing_to_judge_does_not_pass() -> None:
    v = judge(service([P(5.0, count=8)] * 10), "percentiles_distinct")
    assert not v.passed and v.summary.startswith("nothing to judge: 0 period(s) with at least 20 calls")


def test_the_loader_fills_in_the_rule_the_target_declares() -> None:
    text = """
name: s
target: {agent: {p99_threshold_ms: 50, alert_periods: 2, resolve_periods: 4, min_samples: 7}}
traffic: {generator: {rate: 10}}
phases: [{name: a, duration: 5s}]
expect:
  - alert_rule: {alert: P99High}
  - alert_rule: {resolve_after: 5}
"""
    first, second = load_scenario_text(text).expect
    assert first.params == {"alert": "P99High", "fire_after": 2, "resolve_after": 4, "threshold_ms": 50.0,
                            "min_samples": 7}
    assert second.params["resolve_after"] == 5   # the check's own value wins
    defaults = load_scenario_text(text.replace("p99_threshold_ms: 50, alert_periods: 2, resolve_periods: 4, "
                                               "min_samples: 7", "limiter: seed")).expect[0]
    assert defaults.params == {"alert": "P99High", "fire_after": ServeOptions.alert_periods,
                               "resolve_after": ServeOptions.resolve_periods,
                               "threshold_ms": ServeOptions.p99_threshold_ms, "min_samples": ServeOptions.min_samples}
    assert (AGENT_RESOLVE_PERIODS, AGENT_MIN_SAMPLES) == (ServeOptions.resolve_periods, ServeOptions.min_samples)


def test_every_bundled_scenario_judges_the_rule_and_the_percentiles() -> None:
    from pathlib import Path

    from harness.scenario import AgentTarget

    judged = 0
    for path in sorted(Path(__file__).parent.parent.glob("scenarios/*.yaml")):
        scenario = load_scenario(path)
        if not isinstance(scenario.target, AgentTarget) and not getattr(scenario.target, "metrics_url", None):
            continue        # a service with no series of its own (the example nginx): nothing to run its rule on
        kinds = [c.kind for c in scenario.expect]
        assert "alert_rule" in kinds and "percentiles_distinct" in kinds, path.name
        judged += 1
    assert judged >= 9


def test_alert_silent_over_a_short_spike_names_the_breach_and_catches_an_alert_on_one_period() -> None:
    # Two breaching periods (7, 8) under a rule that needs three: silence is right, and is shown to mean
    # something; the same spike under a service that fires on one breach is a false alarm.
    spike = [OK] * 6 + [HOT, HOT] + [OK] * 4
    v = judge(service(spike), "alert_silent", service_breach=True)
    assert v.passed and not v.skipped
    assert v.summary == ("P99High stayed silent from 0.0s to 12.0s; the service's own P99 breached 20 ms in "
                         "2 period(s) (7, 8; its rule fires on 3 in a row)")
    assert v.evidence["service_breach_periods"] == [7, 8]
    v = judge(service(spike, fire_after=1), "alert_silent", service_breach=True)
    assert not v.passed and v.summary == "P99High fired at 7.0s: a false alarm in 0.0-12.0s"


def test_alert_silent_without_the_spike_it_asks_for_has_nothing_to_judge() -> None:
    v = judge(service([OK] * 10), "alert_silent", service_breach=True)
    assert v.skipped and v.summary.startswith("nothing to judge: the service's own P99 never exceeded 20 ms")
    assert judge(service([OK] * 10), "alert_silent").passed     # without the option: a plain silence check
    assert not judge(service([OK] * 10), "alert_silent").skipped


def test_the_bundled_short_spike_is_shorter_than_its_alert_rule() -> None:
    # The stall must fit in fewer periods than the rule counts (with a period for the queue to drain),
    # or a correct agent would rightly fire and the scenario would fail at random.
    from pathlib import Path

    s = load_scenario(Path(__file__).parent.parent / "scenarios" / "short-spike.yaml")
    silent = [c for c in s.expect if c.kind == "alert_silent"]
    assert silent and all(c.params.get("service_breach") for c in silent)
    stalls = [f for ph in s.phases for f in ph.faults if f.for_s is not None]
    assert stalls and all(f.for_s + s.target.period_s <= (s.target.alert_periods - 1) * s.target.period_s
                          for f in stalls)
