"""no_flapping on synthetic timelines: passes, fails with the exact message, nothing to judge."""

from __future__ import annotations

import pytest

from harness.checks import CHECKS, Verdict
from harness.errors import ScenarioError
from harness.scenario import CheckSpec
from harness.scenario_load import load_scenario_text
from harness.timeline import Event, MetricSample, Timeline

PHASES = [("baseline", 0.0, 5.0), ("fault", 5.0, 15.0), ("recovery", 15.0, 20.0)]


def tier(t: float, to: str) -> Event:
    return Event(t, "tier", {"from": "full" if to == "light" else "light", "to": to, "reason": "queue"})


def timeline(events: list[Event] | None = None, samples: list[MetricSample] | None = None) -> Timeline:
    return Timeline(period_s=1.0, threshold_ms=20.0, phases=PHASES, events=events or [], samples=samples or [])


def run(tl: Timeline, **params: object) -> Verdict:
    return CHECKS["no_flapping"].evaluate(tl, CheckSpec("no_flapping", params))


def alternating(times: list[float]) -> list[Event]:
    return [tier(t, "light" if i % 2 == 0 else "full") for i, t in enumerate(times)]


def test_changes_spread_out_pass_with_their_times_as_evidence() -> None:
    v = run(timeline(alternating([5.3, 7.3, 9.4, 16.0])), max_changes=3, per_s=6.0)
    assert v.passed, v.summary
    assert v.summary == "4 tier change(s) in 0.0-20.0s, at most 3 within any 6s (limit 3)"
    assert v.evidence["change_times_s"] == [5.3, 7.3, 9.4, 16.0] and v.evidence["source"] == "events"
    assert v.evidence["busiest_window_s"] == [5.3, 11.3]
    assert [c["to"] for c in v.evidence["changes"]] == ["light", "full", "light", "full"]


def test_a_change_exactly_per_s_later_starts_the_next_window() -> None:
    # Once per 2 periods, the agent's hold: 0, 2, 4 in [0, 6); the one at 6.0 is the next window's.
    assert run(timeline(alternating([0.0, 2.0, 4.0, 6.0])), max_changes=3, per_s=6.0).passed
    assert not run(timeline(alternating([0.0, 2.0, 4.0, 5.999])), max_changes=3, per_s=6.0).passed


def test_flapping_fails_with_the_exact_message() -> None:
    # The finding of issue 15: full <-> light about 12 times in 8 s.
    times = [5.0 + 0.7 * i for i in range(12)]
    v = run(timeline(alternating(times)), max_changes=4, per_s=10.0)
    assert not v.passed
    assert v.summary == ("the tier changed 12 times within 10s (5.0-15.0s, at 5.00, 5.70, 6.40, 7.10, 7.80, "
                         "8.50, 9.20, 9.90, ...); at most 4 allowed: it flaps")
    assert v.evidence["busiest"] == 12 and len(v.evidence["change_times_s"]) == 12


def test_only_the_phase_counts() -> None:
    tl = timeline(alternating([1.0, 1.5, 2.0, 2.5, 6.0, 12.0]))
    v = run(tl, phase="fault", max_changes=1, per_s=5.0)
    assert v.passed and v.phase == "fault" and v.evidence["change_times_s"] == [6.0, 12.0]
    assert not run(tl, phase="baseline", max_changes=1, per_s=5.0).passed


def test_no_tier_data_says_so_and_does_not_pass() -> None:
    v = run(timeline(), max_changes=4, per_s=6.0)
    assert not v.passed
    assert v.summary == ("no tier data: the target reported no tier events and no agent_model_tier samples, "
                         "so flapping cannot be judged")


def test_without_events_the_scraped_tier_gauge_is_the_source() -> None:
    name = 'agent_model_tier{tier="light"}'
    flat = [MetricSample(float(t), {name: 0.0}) for t in range(20)]
    v = run(timeline(samples=flat), max_changes=0, per_s=6.0)
    assert v.passed and v.summary == "the tier never changed in 0.0-20.0s (metrics)"
    flips = [MetricSample(float(t), {name: float(t in (3, 4, 8))}) for t in range(20)]
    v = run(timeline(samples=flips), max_changes=1, per_s=6.0)
    assert not v.passed and v.evidence["change_times_s"] == [3.0, 5.0, 8.0, 9.0]
    assert v.evidence["source"] == "metrics"


SCENARIO = """\
name: s
target: {agent: {}}
traffic: {generator: {rate: 10}}
phases: [{name: fault, duration: 5s}]
expect:
  - no_flapping: %s
"""


def test_the_scenario_declares_n_per_m_and_bad_values_are_refused() -> None:
    spec = load_scenario_text(SCENARIO % "{max_changes: 4, per_s: 6s}").expect[0]
    assert spec.params == {"max_changes": 4, "per_s": 6.0} and spec.id == "no_flapping"
    for bad in ("{}", "{max_changes: 4, per_s: 0s}", "{max_changes: -1, per_s: 6s}"):
        with pytest.raises(ScenarioError):
            load_scenario_text(SCENARIO % bad)
