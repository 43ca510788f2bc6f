"""Scenario loading: a valid file becomes the model; every mistake names file, line and what is expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.durations import format_duration, parse_duration
from harness.errors import ScenarioError
from harness.scenario import AgentTarget, ExternalTarget, GeneratorTraffic, RecordingTraffic
from harness.scenario_load import load_scenario, load_scenario_text

GOOD = """\
name: jitter-and-cpu
seed: 7
target: {agent: {limiter: seed, p99_threshold_ms: 20, alert_periods: 3}}
traffic: {recording: prod.rec, speed: 2.0}
phases:
  - {name: baseline, duration: 15s}
  - name: fault
    duration: 30s
    faults:
      - {network: latency, latency_ms: 5, jitter_ms: 15}
      - {cpu: contention, load_pct: 90, after: 2s}
  - {name: recovery, duration: 20s}
expect:
  - {alert_fires: {alert: P99High, phase: fault, within_periods: 1}}
  - {alert_silent: {phase: baseline}}
  - {limiter_reduces: {phase: fault, at_least_pct: 20}}
  - {limiter_recovers: {phase: recovery, to_pct_of_baseline: 90, within_s: 15s}}
  - {no_loss: {}}
"""


def test_durations() -> None:
    assert parse_duration("15s") == 15 and parse_duration("500ms") == 0.5
    assert parse_duration("1m30s") == 90 and parse_duration(2) == 2.0 and parse_duration("1.5s") == 1.5
    for bad in ("soon", "15", "s", "-1s", "1s2", True):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert [format_duration(x) for x in (0.5, 15, 90, 120)] == ["500ms", "15s", "1m30s", "2m"]


def test_valid_scenario_builds_the_model(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(GOOD)
    s = load_scenario(path)
    assert s.name == "jitter-and-cpu" and s.seed == 7 and s.duration_s == 65
    assert isinstance(s.target, AgentTarget) and s.p99_threshold_ms == 20 and s.alert_periods == 3
    assert isinstance(s.traffic, RecordingTraffic) and s.traffic.path == str(tmp_path / "prod.rec")
    fault = s.phases[1].faults[1]
    assert (fault.family, fault.kind, fault.params, fault.after_s, fault.line) == \
        ("cpu", "contention", {"load_pct": 90.0}, 2.0, 11)
    assert [c.id for c in s.expect] == ["alert_fires[fault]", "alert_silent[baseline]", "limiter_reduces[fault]",
                                       "limiter_recovers[recovery]", "no_loss"]
    assert s.expect[3].params["within_s"] == 15.0
    assert s.phase_bounds()["recovery"] == (45.0, 65.0)
    short = s.scaled(0.1)
    assert short.duration_s == pytest.approx(6.5) and short.phases[1].faults[1].after_s == pytest.approx(0.2)


def test_external_target_and_generator() -> None:
    s = load_scenario_text("""
name: mine
target:
  external:
    address: 127.0.0.1:7000
    metrics_url: http://127.0.0.1:9000/metrics
    metrics: {limiter_rate: my_rate}
traffic: {generator: {rate: 50, pattern: bursty}}
phases: [{name: only, duration: 1s}]
""")
    assert isinstance(s.target, ExternalTarget) and s.target.metrics.limiter_rate == "my_rate"
    assert s.target.metrics.requests_total == "agent_requests_total"
    assert s.traffic == GeneratorTraffic(rate=50.0, pattern="bursty")


@pytest.mark.parametrize("edit, line, expected", [
    (("duration: 15s}", "duration: soon}"), 6, "phases[0].duration: expected a duration like 15s"),
    (("latency_ms: 5, ", ""), 10, "missing 'latency_ms'"),
    (("network: latency", "network: lag"), 10, "unknown network fault 'lag'; expected one of:"),
    (("limiter: seed", "limiter: magic"), 3, "target.agent.limiter: expected one of seed, gradient, off"),
    (("phase: fault, at_least_pct", "phase: faults, at_least_pct"), 16, "no phase named 'faults'"),
    (("{no_loss: {}}", "{no_leaks: {}}"), 18, "unknown check 'no_leaks'; expected one of:"),
    (("within_periods: 1", "within_periods: one"), 14, "within_periods: expected a whole number"),
    (("seed: 7", "seed: 7\nspeed: 2"), 3, "scenario: unknown key 'speed'"),
    (("{name: recovery", "{name: baseline"), 12, "duplicate phase name 'baseline'"),
    (("recording: prod.rec, ", "recording: prod.rec, generator: {rate: 1}, "), 4, "exactly one of"),
    (("phases:", "phases: ["), 6, "not valid YAML"),
])
def test_errors_say_file_line_and_what_is_expected(edit: tuple[str, str], line: int, expected: str) -> None:
    text = GOOD.replace(*edit)
    assert text != GOOD
    with pytest.raises(ScenarioError) as info:
        load_scenario_text(text, "s.yaml")
    assert expected in str(info.value)
    assert info.value.file == "s.yaml" and info.value.line == line, str(info.value)


def test_missing_file_and_sections(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read the scenario"):
        load_scenario(tmp_path / "absent.yaml")
    with pytest.raises(ScenarioError, match="missing 'phases'"):
        load_scenario_text("name: x\ntarget: {agent: {}}\ntraffic: {generator: {rate: 1}}\n")
    with pytest.raises(ScenarioError, match="the file is empty"):
        load_scenario_text("")


def test_every_bundled_scenario_loads() -> None:
    files = sorted(Path(__file__).parent.parent.joinpath("scenarios").glob("*.yaml"))
    for f in files:
        s = load_scenario(f)
        assert s.duration_s <= 90, f"{f} is too long for CI"


def test_agent_options_are_options_the_agent_has() -> None:
    from dataclasses import fields

    from agent_under_test.config import ServeOptions
    from harness.scenario_load import AGENT_OPTIONS

    assert set(AGENT_OPTIONS) <= {f.name for f in fields(ServeOptions)}
