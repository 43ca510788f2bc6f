"""No vacuous passes: a check whose evidence compared nothing is skipped with the reason, never passed;
a phase without calls skips every check bound to it; `--strict` fails a run with skipped checks."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.checks import CHECKS, Verdict, evaluate_all
from harness.report import RunResult, write_reports
from harness.report.table import print_verdicts
from harness.scenario import CheckSpec
from harness.scenario_load import load_scenario_text
from harness.timeline import CallResult, CpuSample, Event, FaultWindow, MetricSample, Timeline

PHASES = [("baseline", 0.0, 5.0), ("fault", 5.0, 10.0), ("recovery", 10.0, 15.0)]


def calls(until_s: float = 15.0, per_s: int = 20, latency_ms: float = 5.0) -> list[CallResult]:
    """`per_s` ok calls a second from 0 until `until_s` (the traffic ran out there)."""
    out = []
    for k in range(int(until_s * per_s)):
        t = k / per_s
        out.append(CallResult(t, t, t + latency_ms / 1000, "/Decide", "ok"))
    return out


def timeline(**kw: Any) -> Timeline:
    return Timeline(period_s=1.0, threshold_ms=20.0, phases=PHASES, calls=kw.pop("calls", calls()),
                    alert_periods=3, **kw)


def run(kind: str, tl: Timeline, **params: Any) -> Verdict:
    return CHECKS[kind].evaluate(tl, CheckSpec(kind, params))


def _counters(ok: float) -> list[MetricSample]:
    return [MetricSample(-0.1, {'agent_requests_total{outcome="ok"}': 0.0}),
            MetricSample(15.5, {'agent_requests_total{outcome="ok"}': ok})]


def test_no_loss_without_request_counters_is_skipped_not_passed() -> None:
    # The case: the target exposes no counters; the client's books balance, nothing was compared.
    v = run("no_loss", timeline(replay_report={"scheduled": 300}))
    assert v.skipped and v.status == "skipped" and v.mark == "SKIP"
    assert v.summary == ("nothing to judge: the target exposes no request counters to compare "
                         "(agent_requests_total by outcome, scraped before and after the run); the client "
                         "accounted for all 300 calls")
    # The same run with counters that agree is a real pass, and one that disagrees still fails.
    ok = run("no_loss", timeline(samples=_counters(300), replay_report={"scheduled": 300}))
    assert ok.passed and not ok.skipped
    assert not run("no_loss", timeline(samples=_counters(299), replay_report={"scheduled": 300})).passed
    # A broken client accounting fails before any comparison.
    assert not run("no_loss", timeline(replay_report={"scheduled": 301})).passed


def test_alert_silent_needs_to_see_the_alert_state() -> None:
    # Nothing reported the alert: no events, no alert_firing gauge. Silence there is not seen.
    blind = run("alert_silent", timeline(), phase="baseline")
    assert blind.skipped and "reported no alert state" in blind.summary
    # The gauge scraped at 0 (or any event stream) is an observation of silence: a pass.
    gauge = [MetricSample(t, {'agent_alert_firing{alert="P99High"}': 0.0}) for t in (0.0, 7.0, 15.0)]
    seen = run("alert_silent", timeline(samples=gauge), phase="baseline")
    assert seen.passed and not seen.skipped
    assert run("alert_silent", timeline(events=[Event(1.0, "period", {"period": 1})]), phase="baseline").passed
    # A firing alert is a failure either way.
    assert not run("alert_silent", timeline(events=[Event(2.0, "alert", {"alert": "P99High", "to": "firing"})]),
                   phase="baseline").passed


def test_restores_with_a_tier_that_never_went_light_is_skipped() -> None:
    fired = [Event(6.0, "alert", {"alert": "P99High", "to": "firing"}),
             Event(9.0, "alert", {"alert": "P99High", "to": "inactive"})]
    v = run("restores", timeline(events=fired), phase="recovery")
    assert v.skipped and "the tier was never light by 15.0s (the target reported no tier at all)" in v.summary
    # Light, then full again: a real restore passes.
    went = fired + [Event(6.5, "tier", {"from": "full", "to": "light"}), Event(10.0, "tier", {"to": "full"})]
    assert run("restores", timeline(events=went), phase="recovery").passed
    # Still firing at the end is a failure whatever the tier did.
    assert not run("restores", timeline(events=fired[:1]), phase="recovery").passed


def test_a_pause_of_an_idle_target_is_nothing_to_judge() -> None:
    pause = [FaultWindow("process:pause (duration=2.0)", "fault", "process", "pause", 5.0, 5.0, 7.0)]

    def sched(before_pct: float) -> list[tuple[float, float, float]]:
        out, cpu = [], 0.0
        for k in range(31):
            t = k * 0.5
            out.append((t, cpu, 0.0))
            cpu += (0.0 if 5.0 <= t < 7.0 else before_pct) / 100 * 0.5
        return out

    idle = run("fault_effective", timeline(faults=pause, outside={"sched": sched(1.0)}), phase="fault",
               baseline="baseline")
    assert idle.skipped and "cannot be told from an idle one" in idle.summary
    busy = run("fault_effective", timeline(faults=pause, outside={"sched": sched(15.0)}), phase="fault",
               baseline="baseline")
    assert busy.passed and not busy.skipped and "while paused" in busy.summary


def test_checks_bound_to_a_phase_without_calls_are_skipped() -> None:
    # The traffic ran out at 9.5 s: the recovery phase (10-15 s) had no calls.
    tl = timeline(calls=calls(until_s=9.5), samples=_counters(190),
                  cpu=[CpuSample(float(t), 10.0, 20.0) for t in range(16)],
                  events=[Event(1.0, "limiter", {"old_rate": 100, "new_rate": 100})])
    specs = [CheckSpec("alert_silent", {"phase": "recovery"}), CheckSpec("error_rate", {"phase": "recovery"}),
             CheckSpec("slo", {"phase": "recovery"}), CheckSpec("restores", {"phase": "recovery"}),
             CheckSpec("fault_effective", {"phase": "fault", "baseline": "recovery", "signal": "host_cpu"}),
             CheckSpec("error_rate", {"phase": "fault"}), CheckSpec("no_loss", {})]
    verdicts = {v.id: v for v in evaluate_all(tl, specs)}
    for check in ("alert_silent[recovery]", "error_rate[recovery]", "slo[recovery]", "restores[recovery]",
                  "fault_effective[fault]"):
        assert verdicts[check].skipped, (check, verdicts[check].summary)
        assert verdicts[check].summary == "nothing to judge: no calls in the phase 'recovery' (10.0-15.0s)"
    # The phase that had calls, and the whole run, are judged as before.
    assert verdicts["error_rate[fault]"].passed and not verdicts["error_rate[fault]"].skipped
    assert verdicts["no_loss"].passed and not verdicts["no_loss"].skipped
    # Without the cut the recovery is judged: alert_silent passes (events seen), error_rate passes.
    full = evaluate_all(replace(tl, calls=calls()), specs[:2])
    assert [v.status for v in full] == ["pass", "pass"]
    # A run with no calls at all: a whole-run check has nothing to judge either.
    none = evaluate_all(replace(tl, calls=[]), [CheckSpec("no_loss", {})])
    assert none[0].skipped and none[0].summary == "nothing to judge: no calls in the run (0.0-15.0s)"


SCENARIO = """\
name: strict
target: {agent: {}}
traffic: {generator: {rate: 20}}
phases: [{name: baseline, duration: 5s}, {name: fault, duration: 5s}, {name: recovery, duration: 5s}]
expect:
  - {error_rate: {phase: baseline}}
  - {error_rate: {phase: recovery}}
"""


def test_strict_fails_a_run_with_skipped_checks_and_every_report_says_so(tmp_path: Path) -> None:
    s = load_scenario_text(SCENARIO, "strict.yaml")
    tl = timeline(calls=calls(until_s=9.5))
    verdicts = evaluate_all(tl, s.expect)
    assert [v.status for v in verdicts] == ["pass", "skipped"]
    lenient = RunResult(s, tl, verdicts)
    assert lenient.passed and lenient.headline() == "PASSED"
    strict = RunResult(replace(s, strict=True), tl, verdicts)
    assert not strict.passed
    out = io.StringIO()
    print_verdicts(strict, out, rich=False)
    assert out.getvalue().splitlines()[-1] == ("strict: FAILED (--strict: 1 check skipped), 1/2 checks passed, "
                                               "1 skipped (nothing to judge)")
    paths = write_reports(strict, tmp_path / "r", png=False)
    data = json.loads(Path(paths["json"]).read_text())
    assert data["passed"] is False and data["strict"] is True and data["checks"]["skipped"] == 1
    suite = ET.parse(paths["junit"]).getroot()
    assert suite.get("failures") == "1" and suite.get("skipped") == "0"
    failure = next(c for c in suite.iter("testcase") if c.get("name") == "error_rate[recovery]").find("failure")
    assert failure is not None and failure.get("type") == "skipped"
    assert "skipped under --strict: nothing to judge: no calls in the phase" in (failure.get("message") or "")
    md = Path(paths["markdown"]).read_text()
    assert "FAILED (--strict: 1 check skipped)" in md and "**skipped** (fails under --strict)" in md
    # A failure stays a plain failure under --strict, and the lenient JUnit marks the skip as skipped.
    assert RunResult(replace(s, strict=True), tl, [replace(verdicts[0], passed=False), verdicts[1]]).headline() \
        == "FAILED"
    lenient_junit = ET.parse(write_reports(lenient, tmp_path / "l", png=False)["junit"]).getroot()
    assert lenient_junit.get("failures") == "0" and lenient_junit.get("skipped") == "1"
