"""Reports and the live view from a synthetic run: JUnit, Markdown, results.json, PNG, plain lines."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

from harness.checks import evaluate_all
from harness.live import LiveView, Snapshot, plain_line, sparkline
from harness.report import RunResult, write_reports
from harness.report.table import print_verdicts
from harness.scenario_load import load_scenario_text
from harness.timeline import CallResult, Event, FaultWindow, Timeline

ROOT = Path(__file__).resolve().parent.parent
TEXT = """\
name: synthetic
seed: 3
target: {agent: {p99_threshold_ms: 20}}
traffic: {generator: {rate: 20}}
phases: [{name: baseline, duration: 3s}, {name: fault, duration: 3s}]
expect:
  - {alert_silent: {phase: baseline}}
  - {alert_fires: {phase: fault}}
"""


def _result() -> RunResult:
    s = load_scenario_text(TEXT)
    calls = [CallResult(i * 0.05, i * 0.05, i * 0.05 + (0.005 if i < 60 else 0.05), "/Decide", "ok")
             for i in range(120)]
    tl = Timeline(1.0, 20.0, [("baseline", 0.0, 3.0), ("fault", 3.0, 6.0)], calls=calls,
                  events=[Event(4.0, "limiter", {"old_rate": 100, "new_rate": 90}),
                          Event(7.5, "alert", {"alert": "P99High", "to": "firing"}),
                          Event(7.0, "tier", {"from": "full", "to": "light"})],
                  faults=[FaultWindow("cpu:quota", "fault", "cpu", "quota", 3.0, 3.1, 6.0)], min_samples=5)
    return RunResult(s, tl, evaluate_all(tl, s.expect), log=["[0.00s] phase baseline starts"])


def test_every_report_is_written_and_says_the_same(tmp_path: Path) -> None:
    result = _result()
    assert [v.passed for v in result.verdicts] == [True, False]   # truth 6.0 s, deadline 7.0 s, fired 7.5 s: late
    paths = write_reports(result, tmp_path / "r", junit=str(tmp_path / "j.xml"))
    suite = ET.parse(paths["junit"]).getroot()
    assert suite.get("tests") == "2" and suite.get("failures") == "1"
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["alert_silent[baseline]"].find("failure") is None
    failure = cases["alert_fires[fault]"].find("failure")
    assert failure is not None and "ground_truth_s" in (failure.text or "")
    data = json.loads(Path(paths["json"]).read_text())
    assert data["passed"] is False and data["checks"] == {"total": 2, "failed": 1, "skipped": 0}
    assert data["timeline"]["faults"][0]["applied_s"] == 3.1 and len(data["timeline"]["periods"]) == 6
    md = Path(paths["markdown"]).read_text()
    assert "FAILED" in md and "| `alert_fires[fault]` | **FAIL** |" in md and "![timeline](timeline.png)" in md
    assert Path(paths["png"]).read_bytes()[:4] == b"\x89PNG"
    out = io.StringIO()
    print_verdicts(result, out, rich=False)
    assert out.getvalue().splitlines()[-1] == "synthetic: FAILED, 1/2 checks passed"


def test_live_view_plain_lines_once_per_period() -> None:
    assert sparkline([1.0, 2.0, None, 8.0]) == "▁▂ █"
    snap = Snapshot(elapsed_s=2.0, total_s=6.0, phase="fault", offered=20, achieved=19, p99=[5.0, 50.0],
                    limiter_rate=90.0, alert="firing", tier="light", faults=["cpu:quota"])
    line = plain_line(snap)
    assert "phase=fault" in line and "p99=50.0ms" in line and "alert=firing" in line and "faults=cpu:quota" in line
    out = io.StringIO()
    with LiveView("x", stream=out, rich=False, every_s=1.0) as view:
        for t in (0.0, 0.25, 0.5, 1.0, 1.5, 2.0):
            view.update(Snapshot(elapsed_s=t, total_s=6.0, phase="p"))
        view.log("fault cpu:quota took effect")
    assert len(out.getvalue().splitlines()) == 4   # t = 0, 1, 2 and the log line


def test_live_alert_column_names_each_alert_it_shows() -> None:
    # A RejectedRatioHigh going pending must not show as P99High pending (the column once held the
    # latest alert event's state whatever its alert).
    from harness.runner import alert_column
    from harness.timeline import Event

    def move(t: float, alert: str, to: str) -> Event:
        return Event(t, "alert", {"alert": alert, "to": to})

    assert alert_column([]) == "inactive"
    assert alert_column([move(1, "RejectedRatioHigh", "pending")]) == "RejectedRatioHigh:pending"
    events = [move(1, "RejectedRatioHigh", "pending"), move(2, "P99High", "pending"),
              move(3, "RejectedRatioHigh", "inactive"), move(4, "P99High", "firing"), Event(5, "tier", {"to": "light"})]
    assert alert_column(events) == "P99High:firing"
    assert alert_column(events + [move(6, "RejectedRatioHigh", "firing")]) == "P99High:firing,RejectedRatioHigh:firing"
    assert alert_column(events + [move(6, "P99High", "inactive")]) == "inactive"


def test_rich_view_renders_on_a_terminal_like_stream() -> None:
    out = io.StringIO()
    with LiveView("x", stream=out, rich=True) as view:
        view.update(Snapshot(elapsed_s=1.0, total_s=2.0, phase="fault", p99=[1.0, 30.0], alert="firing"))
    assert "fault" in out.getvalue() and "firing" in out.getvalue()


def test_ci_workflow_runs_a_scenario_and_publishes_junit() -> None:
    flow = yaml.safe_load((ROOT / "deploy" / "github-actions.yml").read_text())
    steps = flow["jobs"]["chaos"]["steps"]
    run = next(s for s in steps if s.get("name") == "Run the chaos scenario")["run"]
    assert "shadowtest chaos run" in run and "--junit" in run
    assert any("junit" in str(s.get("with", {}).get("report_paths", "")) for s in steps)
    for scenario in flow["jobs"]["chaos"]["strategy"]["matrix"]["scenario"]:
        assert (ROOT / scenario).exists()


def test_ci_workflow_runs_the_own_service_example_with_unique_artifact_names() -> None:
    flow = yaml.safe_load((ROOT / "deploy" / "github-actions.yml").read_text())
    steps = flow["jobs"]["http-example"]["steps"]
    script = "\n".join(str(s.get("run", "")) for s in steps)
    # The example's parts are in the repository, and the job starts the service before it runs the scenario.
    for path in ("deploy/http-example/nginx.conf", "scenarios/http-faults.yaml"):
        assert path in script and (ROOT / path).exists(), path
    assert script.index("nginx -p") < script.index("shadowtest chaos run scenarios/http-faults.yaml")
    assert "18080" in (ROOT / "deploy" / "http-example" / "nginx.conf").read_text()
    assert "127.0.0.1:18080" in (ROOT / "scenarios" / "http-faults.yaml").read_text()
    # Artifact names differ between the jobs, between matrix entries and between attempts of a run.
    names = [s["with"]["name"] for job in flow["jobs"].values() for s in job["steps"]
             if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    assert len(names) == len(set(names)) == 2
    assert all("github.run_attempt" in n for n in names)
    assert "strategy.job-index" in names[0] or "matrix" in names[0]
