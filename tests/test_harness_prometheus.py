"""Alerts as deployed: a scenario's Prometheus rules evaluated by a real Prometheus during a chaos run.

The bundled scenarios/prometheus-alerts.yaml runs as it ships: a real agent, a CPU fault, and the
`prometheus` binary scraping the agent every second with deploy/prometheus/alerts-ci.yml. Its ALERTS
series must stay empty in the baseline and show P99High firing in the fault.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harness.checks import CHECKS
from harness.errors import ScenarioError
from harness.live import LiveView
from harness.runner import Runner, RunOptions
from harness.scenario import CheckSpec
from harness.scenario_load import load_scenario, load_scenario_text
from harness.timeline import CallResult, Event, Timeline

pytestmark = pytest.mark.usefixtures("state_dir")   # SHADOWTEST_STATE_DIR in the test's tmp dir (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus binary (apt-get install "
                                      "prometheus; scripts/setup.sh installs it)")

BASE = """\
name: p
target: {agent: {limiter: seed}}
traffic: {generator: {rate: 10}}
phases: [{name: only, duration: 2s}]
%s
expect: [{no_loss: {}}]
"""


def test_the_prometheus_key_is_validated_with_file_and_line(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text("groups: []\n")
    ok = load_scenario_text(BASE % "prometheus: {rules: [rules.yml], interval: 500ms}", "s.yaml", tmp_path)
    assert ok.prometheus is not None and ok.prometheus.rules == (str(rules.resolve()),)
    assert ok.prometheus.interval_s == 0.5
    for body, line, message in (
            ("prometheus: {rules: [nope.yml]}", 5, "s.yaml:5: prometheus.rules: no rule file 'nope.yml'"),
            ("prometheus: {rules: [rules.yml], interval: 5s}", 5, "prometheus.interval 5s must be between 100ms and 1s"),
            ("prometheus: {rule: [rules.yml]}", 5, "prometheus: unknown key 'rule'"),
            ("prometheus: {rules: []}", 5, "prometheus.rules: expected 1 to 32 rule files, got 0")):
        with pytest.raises(ScenarioError) as err:
            load_scenario_text(BASE % body, "s.yaml", tmp_path)
        assert message in str(err.value), str(err.value)
        assert f"s.yaml:{line}" in str(err.value), str(err.value)


def _tl(prom: dict | None) -> Timeline:
    calls_breach = []
    for i in range(12):
        lat = 0.05 if 4 <= i < 8 else 0.005
        calls_breach += [CallResult(i + j * 0.04, i + j * 0.04, i + j * 0.04 + lat, "/Decide", "ok") for j in range(20)]
    tl = Timeline(period_s=1.0, threshold_ms=20.0, phases=[("baseline", 0.0, 4.0), ("fault", 4.0, 12.0)],
                  calls=calls_breach, events=[Event(7.5, "alert", {"alert": "P99High", "to": "firing"})])
    if prom is not None:
        tl.outside["prometheus"] = prom
    return tl


def test_alert_checks_read_prometheus_alerts_not_the_services() -> None:
    fires = CHECKS["alert_fires"]
    spec = CheckSpec("alert_fires", {"phase": "fault", "source": "prometheus", "within_periods": 2})
    # The service fired at 7.5 s, but the deployed rule never did: the deployed alert is what pages.
    v = fires.evaluate(_tl({"alerts": {}}), spec)
    assert not v.passed and 'ALERTS{alertname="P99High"} fired never' in v.summary
    v = fires.evaluate(_tl({"alerts": {"P99High": [[8.5, 11.0]]}}), spec)
    assert v.passed and v.evidence["alert_source"] == "prometheus" and v.evidence["fired_s"] == 8.5
    no_prom = fires.evaluate(_tl(None), spec)
    assert not no_prom.passed and "no Prometheus ran" in no_prom.summary
    silent = CHECKS["alert_silent"]
    bad = silent.evaluate(_tl({"alerts": {"P99High": [[1.0, 3.0]]}}),
                          CheckSpec("alert_silent", {"phase": "baseline", "source": "prometheus"}))
    assert not bad.passed and "false alarm" in bad.summary


@needs_prometheus
@pytest.mark.root
@pytest.mark.slow
def test_a_chaos_scenario_is_judged_through_a_real_prometheus(tmp_path: Path) -> None:
    scenario = load_scenario(ROOT / "scenarios" / "prometheus-alerts.yaml")
    with (tmp_path / "live.txt").open("w") as stream:
        runner = Runner(scenario, RunOptions(view=LiveView(scenario.name, stream=stream, rich=False)))
        result = runner.run()
    verdicts = {v.id: v for v in result.verdicts}
    prom = result.timeline.outside["prometheus"]
    firing = prom["alerts"].get("P99High", [])
    base_start, base_end = result.timeline.phase_bounds("baseline") or (0.0, 0.0)
    fault_start, fault_end = result.timeline.phase_bounds("fault") or (0.0, 0.0)
    # Silent in the baseline, firing in the fault, as Prometheus itself evaluated the deployed rule.
    assert not [iv for iv in firing if iv[0] < base_end and (iv[1] is None or iv[1] > base_start)], firing
    assert any(fault_start <= iv[0] <= fault_end + 4 for iv in firing), (firing, result.log)
    silent, fires = verdicts["alert_silent[baseline]"], verdicts["alert_fires[fault]"]
    assert silent.passed and silent.evidence["alert_source"] == "prometheus", silent.summary
    assert fires.passed and fires.evidence["alert_source"] == "prometheus", fires.summary
    # Prometheus was ended by its PID and its folder removed.
    assert runner._prom is not None and runner._prom.proc is None
    pid = next(int(line.split("(pid ")[1].split(")")[0]) for line in result.log if "prometheus http" in line)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert runner._prom.folder and not Path(runner._prom.folder).exists()


def test_folders_of_killed_runs_are_swept_and_live_ones_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys
    import tempfile

    from harness.childserver import sweep_stale

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = tmp_path / f"shadowtest-legs-{gone.stdout.strip()}-abc"
    alive = tmp_path / f"shadowtest-legs-{os.getpid()}-def"
    other = tmp_path / "shadowtest-legs-notapid"
    for d in (dead, alive, other):
        d.mkdir()
    (dead / "legs.txt").write_text("1 2 1\n")
    assert sweep_stale("shadowtest-legs-") == [str(dead)]
    assert not dead.exists() and alive.exists() and other.exists()
