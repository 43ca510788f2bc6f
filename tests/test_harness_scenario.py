"""Scenario loading: a valid file becomes the model; every mistake names file, line and what is expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.errors import ScenarioError
from harness.faultspecs import cpu_count
from harness.scenario import AgentTarget, ExternalTarget, GeneratorTraffic, RecordingTraffic
from harness.scenario_load import load_scenario, load_scenario_text
from wire.durations import format_duration, parse_duration

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
    assert [format_duration(x) for x in (3600, 86400, 5400)] == ["1h", "24h", "1h30m"]
    for infinite in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite"):
            parse_duration(infinite)


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


# ---- ranges: every number is checked at load, one line with file and line --------------------------------
RANGES = """\
name: ranges
seed: SEED
target: {agent: AGENT}
traffic: {TRAFFIC}
phases:
  - {name: baseline, duration: BASE}
  - {name: fault, duration: 10s, LOADfaults: [FAULT]}
expect:
  - CHECK
"""
_DEFAULTS = {"SEED": "7", "AGENT": "{limiter: seed}", "TRAFFIC": "generator: {rate: 100}", "BASE": "10s",
             "LOAD": "", "FAULT": "{network: latency, latency_ms: 5}", "CHECK": "no_loss: {}"}


def _ranges(**parts: str) -> str:
    text = RANGES
    for key, value in (_DEFAULTS | parts).items():
        text = text.replace(key, value)
    return text


_CPUS = cpu_count()
_WORKERS = f"a whole number between 1 and {4 * _CPUS} (4 per CPU; this machine has {_CPUS})"
_F = "phases[1].faults[0]"
_TOXIC_MS = "a whole number between 0 and 60000 ms"
_SEED = "a whole number between 0 and 9223372036854775807"


@pytest.mark.parametrize("parts, line, message", [
    # traffic
    ({"TRAFFIC": "generator: {rate: -5}"}, 4, "traffic.generator.rate -5 must be between 0.1 and 100000 calls/s"),
    ({"TRAFFIC": "generator: {rate: 1e12}"}, 4, "traffic.generator.rate 1e12 must be between 0.1 and 100000 calls/s"),
    ({"TRAFFIC": "generator: {rate: 1.0e+12}"}, 4,
     "traffic.generator.rate 1.0e+12 must be between 0.1 and 100000 calls/s"),
    ({"TRAFFIC": "generator: {rate: .nan}"}, 4, "traffic.generator.rate .nan must be between 0.1 and 100000 calls/s"),
    ({"TRAFFIC": "generator: {rate: .inf}"}, 4, "traffic.generator.rate .inf must be between 0.1 and 100000 calls/s"),
    ({"TRAFFIC": "generator: {rate: 100, stream_share: 1.5}"}, 4,
     "traffic.generator.stream_share 1.5 must be between 0 and 1"),
    ({"TRAFFIC": "generator: {rate: 100, seed: -1}"}, 4, f"traffic.generator.seed -1 must be {_SEED}"),
    ({"TRAFFIC": "recording: p.rec, speed: 0"}, 4, "traffic.speed 0 must be between 0.1 and 100 x the recorded pace"),
    ({"TRAFFIC": "recording: p.rec, speed: 1000"}, 4,
     "traffic.speed 1000 must be between 0.1 and 100 x the recorded pace"),
    ({"TRAFFIC": "recording: p.rec, loop: 2.5"}, 4, "traffic.loop 2.5 must be a whole number between 1 and 1000 times"),
    ({"TRAFFIC": "recording: p.rec, window: '30s:10s'"}, 4,
     "traffic.window 30s:10s is empty; use START:END with START before END"),
    ({"TRAFFIC": "recording: p.rec, window: '0s:25h'"}, 4,
     "traffic.window: 90000 s is out of range (at most 86400 s)"),
    ({"TRAFFIC": "recording: p.rec, flows: [x]"}, 4, "traffic.flows: 'x' is not a flow id (a whole number; inspect lists them)"),
    # phases
    ({"BASE": "0s"}, 6, "phases[0].duration 0s must be more than 0s and at most 24h"),
    ({"BASE": "25h"}, 6, "phases[0].duration 25h must be more than 0s and at most 24h"),
    ({"BASE": "23h59m55s"}, 6, "phases last 24h5s in all; a run may last at most 24h"),
    ({"LOAD": "load: 0, "}, 7, "phases[1].load 0 must be between 0.01 and 100 x the traffic's rate"),
    ({"TRAFFIC": "generator: {rate: 50000}", "LOAD": "load: 3, "}, 7,
     "phases[1].load 3 makes 150000 calls/s (traffic.generator.rate 50000 x 3); at most 100000 calls/s"),
    # fault timing
    ({"FAULT": "{network: latency, latency_ms: 5, after: 10s}"}, 7,
     f"{_F}.after 10s must be less than the phase's duration 10s (the fault would never start)"),
    ({"FAULT": "{network: latency, latency_ms: 5, for: 0s}"}, 7, f"{_F}.for 0s must be more than 0s and at most 24h"),
    # toxics (Toxiproxy's attributes)
    ({"FAULT": "{network: latency, latency_ms: -1}"}, 7, f"{_F}.latency_ms -1 must be {_TOXIC_MS}"),
    ({"FAULT": "{network: latency, latency_ms: 2.5}"}, 7, f"{_F}.latency_ms 2.5 must be {_TOXIC_MS}"),
    ({"FAULT": "{network: latency, latency_ms: 5, jitter_ms: 60001}"}, 7, f"{_F}.jitter_ms 60001 must be {_TOXIC_MS}"),
    ({"FAULT": "{network: latency, latency_ms: 5, toxicity: 1.5}"}, 7,
     f"{_F}.toxicity 1.5 must be between 0 and 1 (the share of connections affected)"),
    ({"FAULT": "{network: bandwidth, rate_kbps: 0}"}, 7,
     f"{_F}.rate_kbps 0 must be a whole number more than 0 and at most 10000000 KB/s"),
    ({"FAULT": "{network: slow_close, delay_ms: -5}"}, 7, f"{_F}.delay_ms -5 must be {_TOXIC_MS}"),
    ({"FAULT": "{network: timeout, timeout_ms: 100000}"}, 7, f"{_F}.timeout_ms 100000 must be {_TOXIC_MS}"),
    ({"FAULT": "{network: reset_peer, timeout_ms: -1}"}, 7, f"{_F}.timeout_ms -1 must be {_TOXIC_MS}"),
    ({"FAULT": "{network: slicer, average_size: 0}"}, 7,
     f"{_F}.average_size 0 must be a whole number between 1 and 1048576 bytes"),
    ({"FAULT": "{network: slicer, average_size: 10, size_variation: 10}"}, 7,
     f"{_F}.size_variation 10 must be less than average_size 10 (Toxiproxy's slicer)"),
    ({"FAULT": "{network: slicer, average_size: 10, delay_us: -1}"}, 7,
     f"{_F}.delay_us -1 must be a whole number between 0 and 60000000 us"),
    ({"FAULT": "{network: limit_data, bytes: -1}"}, 7,
     f"{_F}.bytes -1 must be a whole number between 0 and 1099511627776 bytes"),
    # CPU and process faults
    ({"FAULT": "{cpu: contention, workers: 100000}"}, 7, f"{_F}.workers 100000 must be {_WORKERS}"),
    ({"FAULT": "{cpu: contention, workers: 1e12}"}, 7, f"{_F}.workers 1e12 must be {_WORKERS}"),
    ({"FAULT": "{cpu: contention, workers: 0}"}, 7, f"{_F}.workers 0 must be {_WORKERS}"),
    ({"FAULT": "{cpu: contention, load_pct: 101}"}, 7, f"{_F}.load_pct 101 must be a whole number between 1 and 100%"),
    ({"FAULT": "{cpu: contention, load_pct: 0}"}, 7, f"{_F}.load_pct 0 must be a whole number between 1 and 100%"),
    ({"FAULT": "{cpu: quota, pct: -50}"}, 7, f"{_F}.pct -50 must be between 1 and 100% of one core"),
    ({"FAULT": "{cpu: quota, pct: 0}"}, 7, f"{_F}.pct 0 must be between 1 and 100% of one core"),
    ({"FAULT": "{process: pause, duration: 0s}"}, 7, f"{_F}.duration 0s must be more than 0s and at most 24h"),
    # targets
    ({"AGENT": "{p99_threshold_ms: 0}"}, 3, "target.agent.p99_threshold_ms 0 must be more than 0 and at most 60000 ms"),
    ({"AGENT": "{alert_periods: 0}"}, 3, "target.agent.alert_periods 0 must be a whole number between 1 and 100 periods"),
    ({"AGENT": "{period_s: 0}"}, 3, "target.agent.period_s 0 must be between 0.01 and 3600 s"),
    ({"AGENT": "{initial_rate: -1}"}, 3, "target.agent.initial_rate -1 must be more than 0 and at most 1000000 calls/s"),
    ({"AGENT": "{min_rate: 700, max_rate: 600}"}, 3, "target.agent.min_rate 700 must be at most max_rate 600"),
    ({"AGENT": "{max_rate: 5}"}, 3, "target.agent.max_rate 5 must be at least min_rate 10 (the agent's default)"),
    ({"AGENT": "{max_batch: 0}"}, 3, "target.agent.max_batch 0 must be a whole number between 1 and 1024"),
    ({"AGENT": "{rejected_ratio_threshold: 2}"}, 3,
     "target.agent.rejected_ratio_threshold 2 must be between 0 and 1 (a share of the offered calls)"),
    ({"AGENT": "{seed: 1.5}"}, 3, f"target.agent.seed 1.5 must be {_SEED}"),
    ({"SEED": "-1"}, 2, f"seed -1 must be {_SEED}"),
    # checks
    ({"CHECK": "alert_fires: {phase: fault, within_periods: -1}"}, 9,
     "expect[0].alert_fires.within_periods -1 must be a whole number between 0 and 100 periods"),
    ({"CHECK": "alert_fires: {phase: fault, consecutive: 0}"}, 9,
     "expect[0].alert_fires.consecutive 0 must be a whole number between 1 and 100 periods"),
    ({"CHECK": "alert_fires: {phase: fault, threshold_ms: 0}"}, 9,
     "expect[0].alert_fires.threshold_ms 0 must be more than 0 and at most 60000 ms"),
    ({"CHECK": "limiter_reduces: {phase: fault, at_least_pct: 0}"}, 9,
     "expect[0].limiter_reduces.at_least_pct 0 must be more than 0 and at most 100%"),
    ({"CHECK": "limiter_recovers: {phase: fault, to_pct_of_baseline: 150}"}, 9,
     "expect[0].limiter_recovers.to_pct_of_baseline 150 must be more than 0 and at most 100%"),
    ({"CHECK": "error_rate: {max_pct: 101}"}, 9, "expect[0].error_rate.max_pct 101 must be between 0 and 100%"),
    ({"CHECK": "limiter_obeys: {tolerance_pct: -1}"}, 9, "expect[0].limiter_obeys.tolerance_pct -1 must be between 0 and 100%"),
    ({"CHECK": "slo: {p99_ms: -3}"}, 9, "expect[0].slo.p99_ms -3 must be more than 0 and at most 60000 ms"),
    ({"CHECK": "slo: {settle_s: 25h}"}, 9, "expect[0].slo.settle_s 25h must be between 0s and 24h"),
    ({"CHECK": "restores: {phase: fault, within_s: 0s}"}, 9,
     "expect[0].restores.within_s 0s must be more than 0s and at most 24h"),
    ({"CHECK": "fault_effective: {phase: fault, min_increase_pct: -5}"}, 9,
     "expect[0].fault_effective.min_increase_pct -5 must be between 0 and 10000%"),
    ({"CHECK": "fault_effective: {phase: fault, min_increase_ms: -1}"}, 9,
     "expect[0].fault_effective.min_increase_ms -1 must be between 0 and 86400000 ms"),
])
def test_out_of_range_values_name_file_line_and_range(parts: dict[str, str], line: int, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        load_scenario_text(_ranges(**parts), "s.yaml")
    assert str(info.value) == f"s.yaml:{line}: {message}"
    assert (info.value.file, info.value.line) == ("s.yaml", line)
    assert "\n" not in str(info.value)


def test_the_range_template_itself_is_valid() -> None:
    s = load_scenario_text(_ranges(), "s.yaml")
    assert s.phases[1].faults[0].params == {"latency_ms": 5}
    edge = load_scenario_text(_ranges(TRAFFIC="generator: {rate: 100000}", BASE="86390s",
                                      FAULT=f"{{cpu: contention, workers: {4 * _CPUS}, load_pct: 100}}",
                                      AGENT="{min_rate: 600, max_rate: 600}", SEED="0"), "s.yaml")
    assert edge.traffic == GeneratorTraffic(rate=100000) and edge.duration_s == 86400   # the bounds are allowed
    assert edge.phases[1].faults[0].params == {"workers": 4 * _CPUS, "load_pct": 100}


def test_too_many_phases_is_refused_where_the_list_starts() -> None:
    many = "".join(f"  - {{name: p{i}, duration: 1s}}\n" for i in range(101))
    text = _ranges().split("phases:\n")[0] + "phases:\n" + many
    with pytest.raises(ScenarioError) as info:
        load_scenario_text(text, "s.yaml")
    assert str(info.value) == "s.yaml:6: phases has 101 phases; a scenario may have at most 100"


def test_a_billion_workers_as_a_float_is_refused(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from harness.commands.chaos import command as chaos

    path = tmp_path / "w.yaml"
    path.write_text(_ranges(FAULT="{cpu: contention, workers: 1.0e+12}"))
    out = CliRunner().invoke(chaos, ["validate", str(path)])
    assert out.exit_code == 1
    assert f"bad {path}:7: {_F}.workers 1.0e+12 must be {_WORKERS}" in out.output


@pytest.mark.parametrize("expect, line", [("expect: []\n", 8), ("expect:\n", 8)])
def test_an_empty_expect_list_is_an_error(expect: str, line: int) -> None:
    text = _ranges().split("expect:")[0] + expect
    with pytest.raises(ScenarioError) as info:
        load_scenario_text(text, "s.yaml")
    assert str(info.value) == (
        f"s.yaml:{line}: expect: the list is empty; add at least one check (e.g. '- no_loss: {{}}'), or leave "
        "'expect' out to run the scenario unjudged (the run then fails with 'no checks')")


def test_no_expect_at_all_is_valid_and_the_run_says_nothing_was_judged() -> None:
    import io

    from harness.report import RunResult
    from harness.report.table import print_verdicts
    from harness.runner import judge
    from harness.timeline import Timeline

    s = load_scenario_text(_ranges().split("expect:")[0], "s.yaml")
    assert s.expect == ()
    tl = Timeline(1.0, 20.0, [("baseline", 0.0, 10.0), ("fault", 10.0, 20.0)])
    verdicts = judge(tl, s)
    assert [(v.id, v.passed) for v in verdicts] == [("no_checks", False)]
    out = io.StringIO()
    print_verdicts(RunResult(s, tl, verdicts), out, rich=False)
    assert out.getvalue().splitlines() == [
        "FAIL  no_checks: nothing was judged: s.yaml has no 'expect' checks; add some (docs/harness.md, Checks) "
        "for a verdict",
        "ranges: FAILED, 0/1 checks passed"]


def test_the_six_bundled_scenarios_validate_on_the_command_line() -> None:
    from click.testing import CliRunner

    from harness.commands.chaos import command as chaos

    files = sorted(str(f) for f in Path(__file__).parent.parent.joinpath("scenarios").glob("*.yaml"))
    assert len(files) >= 6          # the six first bundled, and those added since
    out = CliRunner().invoke(chaos, ["validate", *files])
    assert out.exit_code == 0, out.output
    assert [line.split(":")[0] for line in out.output.splitlines()] == [f"ok  {f}" for f in files]


# ---- external targets pass replay's allowlist at load (validation only: nothing is dialled) -------------
EXTERNAL = """\
name: ext
target:
  external:
    address: "ADDRESS"
ALLOW
traffic: {generator: {rate: 5}}
phases: [{name: only, duration: 1s}]
"""


@pytest.fixture
def no_configured_allowlist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import replay.target

    monkeypatch.delenv("SHADOWTEST_ALLOW_TARGETS", raising=False)
    monkeypatch.setattr(replay.target, "CONFIG_FILE", tmp_path / "no-allow-targets")


def _external(address: str, allow: str = "") -> str:
    return EXTERNAL.replace("ADDRESS", address).replace("ALLOW\n", f"    allow: {allow}\n" if allow else "")


@pytest.mark.usefixtures("no_configured_allowlist")
def test_external_target_off_loopback_is_refused_with_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "ext.yaml"
    f.write_text(_external("10.255.255.1:50051"))
    with pytest.raises(ScenarioError) as info:
        load_scenario(f)
    assert info.value.file == str(f) and info.value.line == 4, str(info.value)
    assert "10.255.255.1:50051" in str(info.value) and "not loopback and not allowed" in str(info.value)
    assert "allow: true" in str(info.value)


@pytest.mark.usefixtures("no_configured_allowlist")
@pytest.mark.parametrize("address, allow", [
    ("127.0.0.1:7000", ""), ("[::1]:7000", ""),
    ("10.255.255.1:50051", "true"), ("10.255.255.1:50051", "[10.0.0.0/8]"), ("10.255.255.1:50051", "10.255.255.1"),
])
def test_external_target_allowed(address: str, allow: str) -> None:
    s = load_scenario_text(_external(address, allow))
    assert isinstance(s.target, ExternalTarget) and s.target.address == address


@pytest.mark.usefixtures("no_configured_allowlist")
@pytest.mark.parametrize("allow, expected", [
    ("false", "not loopback and not allowed"), ("[192.168.0.0/16]", "not loopback and not allowed"),
    ("{x: 1}", "target.external.allow: expected a list"),
])
def test_external_target_allow_must_cover_it(allow: str, expected: str) -> None:
    with pytest.raises(ScenarioError, match=expected):
        load_scenario_text(_external("10.255.255.1:50051", allow))


def test_external_target_allowed_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHADOWTEST_ALLOW_TARGETS", "10.255.0.0/16")
    assert load_scenario_text(_external("10.255.255.1:50051")).target.address == "10.255.255.1:50051"
