"""`shadowtest capacity`: SLO/step/expect parsing, the knee on synthetic steps, the verdicts, the reports,
and real runs against the bundled agent (a subprocess on loopback, stopped by the command).

The synthetic steps are StepResults built from CallResults with known latencies, so every knee, break
and limiter step below is exact. The end-to-end runs are short (1-2 s steps, 2-3 steps) and use an SLO
loose enough that a busy CI host does not break the first steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import harness
from capture.recording import Call, Flow, Message, RecordingWriter
from harness.capacity import (
    CapacityError,
    CapacityReport,
    Expectation,
    StepResult,
    find_knee,
    judge,
    parse_expect,
    parse_slo,
    parse_steps,
    plot_capacity,
    ramp,
    ramp_steps,
    run_result,
    summarise,
)
from harness.commands.capacity import command
from harness.scenario import AgentTarget, GeneratorTraffic, Phase, Scenario
from harness.timeline import CallResult
from replay.testing import DECIDE, snapshot_bytes

SLOS = [parse_slo("p99<20ms"), parse_slo("errors<0.5%")]


# ---- parsing ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, metric, op, limit, unit", [
    ("p99<20ms", "p99", "<", 20.0, "ms"),
    ("p99.9<=0.2s", "p99.9", "<=", 200.0, "ms"),
    ("P50 < 500us", "p50", "<", 0.5, "ms"),
    ("errors<0.5%", "errors", "<", 0.5, "%"),
    ("rejected<=0%", "rejected", "<=", 0.0, "%"),
])
def test_slo_parses(text: str, metric: str, op: str, limit: float, unit: str) -> None:
    slo = parse_slo(text)
    assert (slo.metric, slo.op, slo.limit, slo.unit) == (metric, op, pytest.approx(limit), unit)


@pytest.mark.parametrize("text, says", [
    ("p99<20", "give the latency's unit (ms, s or us), e.g. p99<20ms"),
    ("p100<20ms", "between p0 and p100"),
    ("p0<20ms", "between p0 and p100"),
    ("errors<0.5", "give it in %, e.g. errors<0.5%"),
    ("errors<150%", "above 100% always holds"),
    ("latency<20ms", "unknown metric 'latency'"),
    ("p99>20ms", "expected METRIC<LIMIT"),
    ("p99<0ms", "nothing is below 0"),
    ("", "expected METRIC<LIMIT"),
])
def test_a_bad_slo_is_one_line_that_says_what_is_expected(text: str, says: str) -> None:
    with pytest.raises(CapacityError) as err:
        parse_slo(text)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_steps_parse_and_must_rise() -> None:
    assert parse_steps("100,200, 400") == [100.0, 200.0, 400.0]
    assert ramp_steps(100, 100, 400) == [100.0, 200.0, 300.0, 400.0]
    assert ramp_steps(100, 150, 400) == [100.0, 250.0, 400.0]
    assert ramp_steps(0.5, 0.1, 0.8) == [0.5, 0.6, 0.7, 0.8]
    for text, says in (("100,50", "the steps must rise, but 50 follows 100"), ("100,100", "100 follows 100"),
                       ("0,100", "0 calls/s; every rate must be above 0"), ("a,b", "expected calls/s separated"),
                       (",", "no rate given"), (",".join(str(i) for i in range(1, 102)), "101 steps; at most 100")):
        with pytest.raises(CapacityError, match=says):
            parse_steps(text)
    with pytest.raises(CapacityError, match="--max 50 is below --start 100"):
        ramp_steps(100, 10, 50)
    with pytest.raises(CapacityError, match="makes 991 steps; at most 100"):
        ramp_steps(10, 1, 1000)


def test_expectations_parse() -> None:
    assert parse_expect("capacity_at_least=300") == Expectation("capacity_at_least", 300.0)
    assert parse_expect("capacity_at_least=250/s").id == "capacity_at_least=250"
    assert parse_expect("limiter_engages_before_knee") == Expectation("limiter_engages_before_knee")
    for bad in ("capacity_at_least", "capacity_at_least=-1", "capacity_at_least=x", "knee", "limiter_engages_before_knee=1"):
        with pytest.raises(CapacityError):
            parse_expect(bad)


@pytest.mark.parametrize("args, says", [
    (["--agent", "--slo", "p99<20"], "Invalid value for '--slo': 'p99<20': give the latency's unit"),
    (["--agent", "--steps", "200,100"], "the steps must rise, but 100 follows 200"),
    (["--agent", "--steps", "100", "--start", "50"], "give either --steps or --start/--step/--max, not both"),
    (["--agent", "--target", "127.0.0.1:5"], "give --agent (the bundled agent) or --target HOST:PORT"),
    ([], "give --agent (the bundled agent) or --target HOST:PORT"),
    (["--agent", "--expect", "fast"], "expected one of capacity_at_least=RATE, limiter_engages_before_knee"),
    (["--target", "10.1.2.3:50051"], "refusing to replay to 10.1.2.3:50051 (10.1.2.3): not loopback and not allowed"),
    (["--agent", "--steps", "1000,200000", "--step-s", "5"], "200000/s for 5s is 1000000 calls; at most 500000"),
])
def test_usage_errors_exit_2_with_one_error_line(args: list[str], says: str) -> None:
    out = CliRunner().invoke(command, args)
    assert out.exit_code == 2, out.output
    errors = [line for line in out.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and says in errors[0], out.output


def test_an_unreachable_target_is_one_line_and_exit_1() -> None:
    from harness.cli import cli

    out = CliRunner().invoke(cli, ["capacity", "--target", "127.0.0.1:1", "--steps", "10"])
    assert out.exit_code == 1
    assert out.output.strip() == "error: cannot reach 127.0.0.1:1: Connection refused; is the service listening there?"


def test_an_empty_recording_is_one_line_and_exit_1(tmp_path: Path) -> None:
    from harness.cli import cli

    with RecordingWriter(tmp_path / "empty.rec") as w:
        w.add_flow(Flow(("127.0.0.1", 41000), ("127.0.0.1", 50051), protocol="grpc"))
    out = CliRunner().invoke(cli, ["capacity", str(tmp_path / "empty.rec"), "--target", "127.0.0.1:1"])
    assert out.exit_code == 1
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and "empty.rec: the recording plays no calls" in lines[0], out.output


# ---- synthetic steps: the knee, the limiter, the verdicts -------------------------------------------
def _step(index: int, rate: float, latency_ms: float, *, rejected: int = 0, errors: int = 0,
          confirm_of: int | None = None, n: int = 200) -> StepResult:
    """A 1 s step of `n` calls at `rate`: all answered in `latency_ms` but `rejected` refused, `errors` failed."""
    calls = []
    for i in range(n):
        t = i / n
        outcome = "rejected" if i < rejected else "error" if i < rejected + errors else "ok"
        done = t + (0.0005 if outcome == "rejected" else latency_ms / 1000.0)
        calls.append(CallResult(t, t, done, DECIDE, outcome))
    return summarise(calls, index, rate, 1.0, SLOS, confirm_of)


def test_summarise_counts_latency_from_the_intended_send_and_keeps_refusals_out_of_errors() -> None:
    calls = [CallResult(0.0, 0.010, 0.015, DECIDE, "ok"),            # sent 10 ms late: 15 ms, not 5
             CallResult(0.1, 0.1, 0.102, DECIDE, "ok"),
             CallResult(0.2, 0.2, 2.2, DECIDE, "timeout"),           # an admitted call that took >= 2 s
             CallResult(0.3, 0.3, 0.3001, DECIDE, "rejected"),
             CallResult(0.4, None, None, DECIDE, "not_sent")]
    step = summarise(calls, 0, 5.0, 1.0, SLOS)
    assert (step.offered, step.ok, step.rejected, step.timeouts, step.not_sent) == (5, 2, 1, 1, 1)
    assert step.percentiles_ms == {"p50": pytest.approx(15.0), "p95": pytest.approx(2000.0),
                                   "p99": pytest.approx(2000.0)}
    assert step.error_pct == pytest.approx(40.0) and step.rejected_pct == pytest.approx(20.0)
    assert step.goodput == 2.0 and step.latency_samples == 3
    assert step.breaches == ["p99 2e+03 ms >= 20 ms (p99<20ms)", "errors 40% >= 0.5% (errors<0.5%)"]


def test_the_knee_is_the_last_step_that_held_before_the_first_break() -> None:
    steps = [_step(0, 100, 5), _step(1, 200, 8), _step(2, 400, 35), ]
    knee = find_knee(steps)
    assert (knee.knee, knee.broke, knee.limiter, knee.bounded) == (1, 2, None, True)
    assert steps[2].breaches == ["p99 35 ms >= 20 ms (p99<20ms)"]


def test_errors_break_a_step_too_and_a_first_break_leaves_no_knee() -> None:
    steps = [_step(0, 100, 5, errors=2)]            # 1% errors >= 0.5%
    assert steps[0].breaches == ["errors 1% >= 0.5% (errors<0.5%)"]
    knee = find_knee(steps)
    assert (knee.knee, knee.broke) == (None, 0)


def test_a_ramp_that_never_breaks_has_its_last_step_as_an_unbounded_knee() -> None:
    knee = find_knee([_step(0, 100, 5), _step(1, 200, 6), _step(2, 300, 7)])
    assert (knee.knee, knee.broke, knee.bounded) == (2, None, False)


def test_confirm_a_blip_whose_rerun_held_does_not_end_the_ramp() -> None:
    steps = [_step(0, 100, 5), _step(1, 200, 30), _step(2, 200, 9, confirm_of=1), _step(3, 300, 10),
             _step(4, 400, 40), _step(5, 400, 45, confirm_of=4)]
    knee = find_knee(steps)
    assert (knee.knee, knee.broke) == (3, 4)
    steps = [_step(0, 100, 5), _step(1, 200, 30), _step(2, 200, 31, confirm_of=1)]
    assert (find_knee(steps).knee, find_knee(steps).broke) == (0, 1)


def test_the_limiter_step_is_the_first_with_any_refusal() -> None:
    steps = [_step(0, 100, 5), _step(1, 200, 6, rejected=3), _step(2, 300, 7, rejected=40), _step(3, 400, 25)]
    knee = find_knee(steps)
    assert (knee.knee, knee.broke, knee.limiter) == (2, 3, 1)
    assert steps[1].held and steps[1].error_pct == 0.0      # refusals are not errors


def test_ramp_stops_at_the_first_break_and_confirm_reruns_it() -> None:
    p99 = {100.0: [5], 200.0: [30, 8], 300.0: [40, 50], 400.0: [5]}
    asked: list[tuple[int, float, int | None]] = []

    def measure(index: int, rate: float, confirm_of: int | None) -> StepResult:
        asked.append((index, rate, confirm_of))
        return _step(index, rate, p99[rate].pop(0), confirm_of=confirm_of)

    assert [s.rate for s in ramp([100, 200, 300, 400], False, measure)] == [100, 200]
    p99 = {100.0: [5], 200.0: [30, 8], 300.0: [40, 50], 400.0: [5]}
    asked.clear()
    steps = list(ramp([100, 200, 300, 400], True, measure))
    assert asked == [(0, 100, None), (1, 200, None), (2, 200, 1), (3, 300, None), (4, 300, 3)]
    assert (find_knee(steps).knee, find_knee(steps).broke) == (2, 3)


def test_capacity_at_least_passes_and_fails_with_numbers() -> None:
    steps = [_step(0, 100, 5), _step(1, 200, 8), _step(2, 400, 35)]
    knee = find_knee(steps)
    ok = judge(Expectation("capacity_at_least", 200), steps, knee)
    assert ok.passed and ok.summary.startswith("knee 200/s >= 200/s (step 2 at 200/s: goodput 200.0/s, p99 8 ms")
    assert "400/s broke: p99 35 ms >= 20 ms (p99<20ms)" in ok.summary
    bad = judge(Expectation("capacity_at_least", 300), steps, knee)
    assert not bad.passed and bad.summary.startswith("knee 200/s < 300/s")
    assert bad.evidence["knee_rate"] == 200 and bad.evidence["broke_rate"] == 400
    first = [_step(0, 100, 35)]
    none = judge(Expectation("capacity_at_least", 50), first, find_knee(first))
    assert not none.passed
    assert none.summary == "no knee (0/s < 50/s): the first step, 100/s, already broke: p99 35 ms >= 20 ms (p99<20ms)"


def test_limiter_engages_before_knee_passes_and_fails_with_evidence() -> None:
    exp = Expectation("limiter_engages_before_knee")
    before = [_step(0, 100, 5), _step(1, 200, 8, rejected=4), _step(2, 400, 35, rejected=50)]
    v = judge(exp, before, find_knee(before))
    assert v.passed and v.summary.startswith("the limiter first refused at 200/s (step 2: 4 of 200 calls, 2.00%), "
                                             "at or before the break: 400/s (step 3) broke")
    at_break = [_step(0, 100, 5), _step(1, 200, 35, rejected=50)]
    assert judge(exp, at_break, find_knee(at_break)).passed          # knee + 1: still in time
    never = [_step(0, 100, 5), _step(1, 200, 35)]
    v = judge(exp, never, find_knee(never))
    assert not v.passed and v.summary.startswith("the limiter never refused (0 RESOURCE_EXHAUSTED in 400 calls over "
                                                 "2 steps), but 200/s (step 2) broke: p99 35 ms")
    assert v.evidence["rejected"] == [0, 0]
    late = [_step(0, 100, 5), _step(1, 200, 35), _step(2, 200, 36, rejected=9, confirm_of=1)]
    v = judge(exp, late, find_knee(late))
    assert not v.passed and "refused at 200/s (step 3: 9 of 200 calls, 4.50%), only after the break" in v.summary
    calm = [_step(0, 100, 5), _step(1, 200, 6)]
    v = judge(exp, calm, find_knee(calm))
    assert v.skipped and v.passed and "no step broke the SLOs up to 200/s and the limiter never refused" in v.summary
    shed = [_step(0, 100, 5), _step(1, 200, 6, rejected=20)]
    assert judge(exp, shed, find_knee(shed)).status == "pass"


def _report(steps: list[StepResult], *expect: Expectation) -> CapacityReport:
    return CapacityReport([s.rate for s in steps], SLOS, 1.0, False, {"address": "127.0.0.1:1", "pid": None,
                          "agent": None}, {"kind": "generator", "pattern": "poisson"}, steps, list(expect))


def test_reports_go_through_the_chaos_writers_one_row_per_step(tmp_path: Path) -> None:
    from harness.report.junit import junit_xml
    from harness.report.markdown import markdown

    report = _report([_step(0, 100, 5), _step(1, 200, 35)], Expectation("capacity_at_least", 150))
    assert not report.passed and [v.status for v in report.verdicts] == ["pass", "fail"]
    scenario = Scenario("capacity", AgentTarget({}), GeneratorTraffic(1.0), (Phase("capacity", 1.0),), proxy=False)
    result = run_result(report, scenario)
    xml = junit_xml(result)
    assert 'tests="2" failures="1"' in xml and 'name="capacity_at_least=150"' in xml and "knee 100/s &lt; 150/s" in xml
    md = markdown(result)
    assert "| step1@100/s | 0.0-1.0s | 200 | 200 | 200 | 0 | 0 | 5.0 | 5.0 |" in md
    assert "| step2@200/s | 1.0-2.0s | 200 | 200 | 200 | 0 | 0 | 35.0 | 35.0 |" in md
    data = report.as_dict()
    assert (data["schema"], data["shadowtest_version"]) == ("shadowtest.capacity/v1", harness.__version__)
    assert data["knee"] == {"index": 0, "rate": 100, "goodput": 200.0, "p99_ms": 5.0}
    assert data["broke"]["breaches"] == ["p99 35 ms >= 20 ms (p99<20ms)"] and data["limiter"] is None
    plot_capacity(report, tmp_path / "knee.png")
    assert (tmp_path / "knee.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- end to end: the bundled agent ------------------------------------------------------------------
def _run(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    from harness.cli import cli

    out = CliRunner().invoke(cli, ["capacity", *args, "--json", str(tmp_path / "cap.json")])
    return out.exit_code, json.loads((tmp_path / "cap.json").read_text()), out.output


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_ramp_against_the_bundled_agent(tmp_path: Path) -> None:
    code, data, output = _run(tmp_path, "--agent", "--tier", "light", "--steps", "50,100,150", "--step-s", "2",
                              "--warmup-s", "0.5", "--slo", "p99<150ms", "--slo", "errors<1%",
                              "--png", str(tmp_path / "cap.png"), "--junit", str(tmp_path / "junit.xml"),
                              "--expect", "capacity_at_least=50")
    assert code == 0, output
    steps = data["steps"]
    assert [s["rate"] for s in steps] == [50, 100, 150]
    offered = [s["offered_rate"] for s in steps]
    assert offered == sorted(offered) and all(abs(o - s["rate"]) < 0.25 * s["rate"] for o, s in zip(offered, steps, strict=True))
    for s in steps:
        assert s["held"] and s["goodput"] >= 0.95 * s["offered_rate"], s
        assert s["cpu_pct"] is not None and 0 < s["cpu_pct"] < 400
        assert s["rejected_server"] == s["rejected"] == 0
    assert data["knee"]["rate"] == 150 and data["bounded"] is False
    assert (tmp_path / "cap.png").read_bytes()[:4] == b"\x89PNG"
    assert 'name="capacity_at_least=50"' in (tmp_path / "junit.xml").read_text()
    assert "knee: 150/s (step 3), no step broke" in output
    assert _gone(data["target"]["pid"])                      # the agent it started is stopped


def test_an_impossible_slo_breaks_the_first_step(tmp_path: Path) -> None:
    code, data, output = _run(tmp_path, "--agent", "--tier", "light", "--steps", "50,100", "--step-s", "1",
                              "--warmup-s", "0", "--slo", "p99<0.001ms", "--expect", "capacity_at_least=50")
    assert code == 99, output          # ran and judged: the expectation failed
    assert len(data["steps"]) == 1 and not data["steps"][0]["held"]
    assert data["knee"] is None and data["broke"]["index"] == 0 and data["passed"] is False
    failed = [v for v in data["verdicts"] if not v["passed"]]
    assert [v["id"] for v in failed] == ["capacity_at_least=50"]
    assert failed[0]["summary"].startswith("no knee (0/s < 50/s): the first step, 50/s, already broke: p99 ")
    assert "FAIL  capacity_at_least=50" in output and "knee: none (the first step broke)" in output
    assert _gone(data["target"]["pid"])


def test_a_recording_is_time_warped_to_each_steps_rate(tmp_path: Path) -> None:
    """A 2 s recording of 20 Decide calls/s, played at 60 then 120 calls/s against an agent the test started."""
    from agent_under_test.launch import AgentProcess

    base = 10_000_000_000
    with RecordingWriter(tmp_path / "d.rec") as w:
        fid = w.add_flow(Flow(("127.0.0.1", 41000), ("127.0.0.1", 50051), protocol="grpc"))
        for i in range(40):
            t = base + i * 50_000_000
            w.add_call(Call(protocol="grpc", method=DECIDE, request_ts_ns=t, flow_id=fid, status=0,
                            requests=[Message("c2s", 0, t, snapshot_bytes(i))]))
    with AgentProcess(tier="light", device="cpu", metrics_port=-1) as agent:
        code, data, output = _run(tmp_path, str(tmp_path / "d.rec"), "--target", agent.grpc_address, "--pid",
                                  str(agent.pid), "--steps", "60,120", "--step-s", "1.5", "--warmup-s", "0",
                                  "--slo", "p99<150ms")
    assert code == 0, output
    assert data["traffic"] == {"kind": "recording", "path": str(tmp_path / "d.rec"), "base_rate": 20.0}
    for s in data["steps"]:
        assert abs(s["offered_rate"] - s["rate"]) <= 0.1 * s["rate"] + 1, s    # evenly spaced: close to exact
        assert s["ok"] == s["offered"] and s["cpu_pct"] is not None
    assert data["target"]["pid"] == agent.pid and os.path.exists(tmp_path / "cap.json")
