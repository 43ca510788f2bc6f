"""What a service owner fears beyond the protection checks: a limiter that does not settle (`limiter_stable`)
and memory that grows (`memory_flat`). Exact synthetic timelines here; real agents, one broken on purpose
for each, in test_checks_broken_agents.py."""

from __future__ import annotations

from typing import Any

from harness.checks import CHECKS, Verdict
from harness.scenario import CheckSpec
from harness.timeline import CallResult, Event, Timeline

PHASES = [("baseline", 0.0, 10.0), ("steady", 10.0, 20.0)]


def _calls() -> list[CallResult]:
    return [CallResult(t / 10, t / 10, t / 10 + 0.005, "/Decide", "ok") for t in range(200)]


def timeline(events: list[Event] | None = None, **outside: Any) -> Timeline:
    return Timeline(period_s=1.0, threshold_ms=20.0, phases=PHASES, calls=_calls(), events=events or [],
                    outside=outside)


def run(kind: str, tl: Timeline, **params: Any) -> Verdict:
    return CHECKS[kind].evaluate(tl, CheckSpec(kind, params))


def steps(start: float, rate: float, factors: list[float], policy: str = "seed", every: float = 1.0) -> list[Event]:
    out = []
    for i, f in enumerate(factors):
        out.append(Event(start + i * every, "limiter", {"policy": policy, "old_rate": rate, "new_rate": rate * f}))
        rate *= f
    return out


def test_a_limiter_that_grows_by_its_policy_and_settles_is_stable() -> None:
    # The seed limiter: x1.1 a healthy second from 100/s to its 146/s cap, reached at 13 s, then flat.
    tl = timeline(steps(10.0, 100.0, [1.1] * 4))
    v = run("limiter_stable", tl, phase="steady")
    assert v.passed and not v.skipped, v.summary
    assert v.summary == ("the limiter settled: +-0.0% around 146/s in the second half (at most +-15%), largest "
                         "growth step +10.0%")
    assert v.evidence["growth_steps"] == 4 and v.evidence["largest_step"]["pct"] == 10.0


def test_a_limiter_that_doubles_fails_on_its_step_whatever_its_swing() -> None:
    # x2 a healthy period: the same cap reached in one step less; steady by the second half all the same.
    tl = timeline(steps(10.0, 50.0, [2.0, 1.46]))
    v = run("limiter_stable", tl, phase="steady")
    assert not v.passed
    assert v.summary == ("the limiter grew its rate 50 -> 100/s at 10.0s (+100%), more than its seed policy's "
                         "+10% a step; 2 of 2 growth steps too large")
    # The gradient policy declares x1.5 towards its ceiling: +40% passes, +60% does not; the check's own bound
    # replaces the policy's.
    assert run("limiter_stable", timeline(steps(10.0, 100.0, [1.4], "gradient")), phase="steady").passed
    assert not run("limiter_stable", timeline(steps(10.0, 100.0, [1.6], "gradient")), phase="steady").passed
    assert run("limiter_stable", tl, phase="steady", max_step_pct=100).passed


def test_a_limiter_that_never_settles_fails_on_its_swing() -> None:
    # Grows by the book, x1.1 five times, then halves, again and again: every step legal, never steady.
    cycle = [1.1] * 5 + [0.5 * 1.1 ** -5 * 1.1 ** 5]
    tl = timeline(steps(10.0, 100.0, cycle * 2, every=0.8))
    v = run("limiter_stable", tl, phase="steady")
    assert not v.passed and "does not settle" in v.summary, v.summary
    assert v.evidence["swing_pct"] > 15
    assert run("limiter_stable", tl, phase="steady", max_swing_pct=60).passed
    # Cuts are not growth: only the rise is held to the policy's step.
    assert v.evidence["largest_step"]["pct"] == 10.0


def test_no_limiter_is_said_not_passed() -> None:
    v = run("limiter_stable", timeline(), phase="steady")
    assert not v.passed and "no limiter rate was observed" in v.summary


def _memory(mb_at: Any, until: float = 20.0) -> list[tuple[float, float]]:
    return [(k / 2, mb_at(k / 2)) for k in range(int(until * 2) + 1)]


def test_memory_that_grows_is_a_leak_and_flat_memory_passes() -> None:
    leak = timeline(memory=_memory(lambda t: 134.0 + 6.0 * t), memory_of="process 42 (RSS)")
    v = run("memory_flat", leak)
    assert not v.passed
    # 6 MB/s = 360 MB/min, after the 2 s warm-up: 149 -> 251 MB (the medians of the first and last 3) over 18 s
    assert v.evidence["slope_mb_per_min"] == 360.0 and v.evidence["first_mb"] == 149.0
    assert v.summary.startswith("memory grows: process 42 (RSS): 149 -> 251 MB (max 254) over 18s, +360.0 MB/min")
    # Noise around a flat line (an allocator returning and taking a few MB) is not a leak.
    flat = timeline(memory=_memory(lambda t: 200.0 + (3.0 if int(t * 2) % 3 == 0 else -2.0)))
    ok = run("memory_flat", flat)
    assert ok.passed and abs(ok.evidence["slope_mb_per_min"]) < 20, ok.summary
    # A steep slope over a few MB (a cache filling once) stays under the growth floor: not failed ...
    small = timeline(memory=_memory(lambda t: 100.0 + min(t, 6.0)))
    assert run("memory_flat", small, phase="steady").passed
    # ... but judged on the window asked for: the baseline's growth is left out of the steady phase.
    ramp = timeline(memory=_memory(lambda t: 100.0 + 10 * min(t, 10.0)))
    assert not run("memory_flat", ramp, phase="baseline").passed
    assert run("memory_flat", ramp, phase="steady").passed


def test_without_memory_samples_there_is_nothing_to_judge() -> None:
    v = run("memory_flat", timeline())
    assert v.skipped and "needs `pid:` or `cgroup:`" in v.summary
    few = run("memory_flat", timeline(memory=[(0.0, 1.0), (19.5, 9.0)]), phase="steady")
    assert few.skipped and "too few for a slope" in few.summary


def _expired(dropped: float, computed: float) -> list:
    from harness.timeline import MetricSample

    key = 'agent_expired_calls_total{fate="%s"}'
    return [MetricSample(0.0, {key % "dropped": 0.0, key % "computed": 0.0}),
            MetricSample(20.0, {key % "dropped": dropped, key % "computed": computed})]


def test_deadlines_honored_reads_the_targets_expired_calls_by_fate() -> None:
    from harness.timeline import CallResult

    timeouts = [CallResult(t / 10, t / 10, None, "/Decide", "timeout") for t in range(30)]
    tl = timeline()
    tl.calls = _calls() + timeouts
    tl.samples = _expired(60, 1)
    v = run("deadlines_honored", tl)
    assert v.passed and not v.skipped
    assert v.summary == ("61 calls were past their deadline when their batch formed: 60 dropped, 1 computed (the "
                         "client timed out 30); at most 3 computed allowed")
    tl.samples = _expired(0, 61)
    bad = run("deadlines_honored", tl)
    assert not bad.passed and "it computes answers nobody will read (at most 3 allowed)" in bad.summary
    tl.samples = _expired(0, 0)
    assert run("deadlines_honored", tl).skipped
    tl.samples = []
    none = run("deadlines_honored", tl)
    assert none.skipped and "exports no agent_expired_calls_total" in none.summary and "30 calls" in none.summary


def test_a_traffic_deadline_is_read_and_bounded() -> None:
    import pytest

    from harness.errors import ScenarioError
    from harness.scenario_load import load_scenario_text

    text = "name: t\ntarget: {agent: {}}\ntraffic: {generator: {rate: 10, timeout_ms: TIMEOUT}}\n" \
           "phases: [{name: a, duration: 1s}]\n"
    assert load_scenario_text(text.replace("TIMEOUT", "250")).traffic.timeout_ms == 250
    with pytest.raises(ScenarioError, match=r"^t.yaml:3: traffic.generator.timeout_ms 0 must be between 1 and 600000"):
        load_scenario_text(text.replace("TIMEOUT", "0"), "t.yaml")


def test_response_rules_read_json_and_protobuf_alike() -> None:
    from types import SimpleNamespace

    from harness.responses import ResponseRule, ResponseRules, Validator, broken_rules, values_at
    from replay.compare import descriptors_from_modules

    doc = {"order": {"id": "7", "items": [{"qty": 2}, {"qty": 0}]}, "state": "accepted", "note": ""}
    assert values_at(doc, "order.items.qty") == [2, 0] and values_at(doc, "order.nope") == []
    assert broken_rules(ResponseRule("order.items.qty", min=1), doc, {}) == "order.items.qty: 0 < 1"
    assert broken_rules(ResponseRule("state", allowed=("accepted", "queued")), doc, {}) is None
    assert broken_rules(ResponseRule("state", allowed=("queued",)), doc, {}) == "state: 'accepted' not in ['queued']"
    assert broken_rules(ResponseRule("note", non_empty=True), doc, {}) == "note: empty"
    assert broken_rules(ResponseRule("order.id", equals_request="id"), doc, {"id": "7"}) is None
    assert broken_rules(ResponseRule("order.id", equals_request="id"), doc, {"id": "8"}) == \
        "order.id: '7' != request.id '8'"
    assert broken_rules(ResponseRule("missing", max=3), doc, {}) == "missing: missing"
    # The engine's comparer slot: OK calls of the method only; protobuf by the method's types, JSON otherwise.
    from agent_under_test.proto import agent_pb2

    v = Validator({"responses_valid": ResponseRules((ResponseRule("sequence_id", equals_request="sequence_id"),
                                                     ResponseRule("confidence", max=1)), "Decide")},
                  descriptors_from_modules("agent_under_test.proto.agent_pb2"))
    method = "/shadowtest.agent.v1.TradingAgent/Decide"
    req = SimpleNamespace(method=method, messages=[SimpleNamespace(
        data=agent_pb2.MarketSnapshot(sequence_id=41).SerializeToString())])

    def out(**fields: Any) -> Any:
        return SimpleNamespace(outcome="ok", responses=[agent_pb2.Decision(**fields).SerializeToString()])

    assert v.compare(req, out(sequence_id=41, confidence=0.9)) == []
    assert v.compare(req, out(sequence_id=40, confidence=1.5)) == [
        "invalid[responses_valid]: sequence_id: '40' != request.sequence_id '41'",
        "invalid[responses_valid]: confidence: 1.5 > 1"]
    assert v.compare(req, SimpleNamespace(outcome="error", responses=[])) == []
    assert v.compare(SimpleNamespace(method="/x.Y/Other", messages=[]), out(confidence=9)) == []
    assert v.summary()["responses_checked"] == 2 and v.summary()["responses_invalid"] == 1


def test_bad_response_rules_name_their_line() -> None:
    import pytest

    from harness.errors import ScenarioError
    from harness.scenario_load import load_scenario_text

    text = ("name: r\ntarget: {agent: {}}\ntraffic: {generator: {rate: 10}}\nphases: [{name: a, duration: 1s}]\n"
            "expect:\n  - responses_valid: {rules: RULES}\n")
    for rules, message in (("[]", "expected at least one rule"),
                           ("[{min: 0}]", "missing 'field'"),
                           ("[{field: x}]", "a rule needs at least one of min, max, in"),
                           ("[{field: x, between: 3}]", "unknown key 'between'"),
                           ("[{field: 'a..b', min: 0}]", "must be a dotted path of field names"),
                           ("[{field: x, in: []}]", "expected 1 to 1000 allowed values")):
        with pytest.raises(ScenarioError, match=r"^r.yaml:6: ") as info:
            load_scenario_text(text.replace("RULES", rules), "r.yaml")
        assert message in str(info.value), (rules, str(info.value))
