"""The demo, shortened (a 3 s recording, the chaos run at 0.2x length), and a bundled scenario scaled down."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest

from capture.recording import Recording
from harness.demo import record_production, run_demo
from harness.scenario_load import load_scenario
from harness.session import run_scenario

pytestmark = pytest.mark.usefixtures("state_dir")   # SHADOWTEST_STATE_DIR in the test's tmp dir (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.root
@pytest.mark.ebpf
@pytest.mark.slow
def test_demo_records_with_ebpf_replays_under_faults_and_reports(tmp_path: Path) -> None:
    out = io.StringIO()
    result, paths = run_demo(str(tmp_path / "demo"), record_s=3.0, rate=40.0, stream=out, scale=0.2,
                             backends=("ebpf",))
    text = out.getvalue()
    assert "recording with ebpf" in text and "lost events 0" in text, text
    rec_path = tmp_path / "demo" / "prod.rec"
    assert stat.S_IMODE(os.stat(rec_path).st_mode) == 0o600
    with Recording(rec_path) as rec:
        assert rec.count("calls") >= 60          # ~120 sent in 3 s at 40/s; generous for a busy host
    assert [v.kind for v in result.verdicts] == ["alert_silent", "fault_effective", "alert_fires",
                                                 "limiter_reduces", "degrades", "restores", "no_loss"]
    faults = result.timeline.faults
    assert len(faults) == 3 and all(f.applied_s is not None and f.removed_s is not None for f in faults)
    assert result.timeline.replay_report["scheduled"] > 0
    no_loss = next(v for v in result.verdicts if v.kind == "no_loss")
    assert no_loss.passed, no_loss.summary
    assert "capture backend: ebpf" in result.notes and Path(paths["png"]).exists()


@pytest.mark.slow
def test_demo_says_which_fallback_it_used_and_why(tmp_path: Path) -> None:
    lines: list[str] = []
    capture = record_production(tmp_path, 2.0, 30.0, 1, lines.append, backends=("nosuch", "proxy"))
    assert capture.backend == "proxy" and capture.fallbacks and capture.fallbacks[0].startswith("nosuch: ")
    assert any("capture backend nosuch cannot run here" in x for x in lines)
    assert any(x.startswith("recording with proxy (fallback: nosuch:") for x in lines)
    assert int(capture.stats["calls"]) >= 30


@pytest.mark.root
@pytest.mark.slow
def test_bundled_baseline_scenario_runs_scaled_down(tmp_path: Path) -> None:
    scenario = load_scenario(ROOT / "scenarios" / "baseline.yaml").scaled(0.2)   # 7 s instead of 35 s
    assert scenario.duration_s == pytest.approx(7.0)
    result, paths = run_scenario(scenario, report_dir=str(tmp_path / "r"), stream=io.StringIO(), png=False)
    verdicts = {v.kind: v for v in result.verdicts}
    assert set(verdicts) == {"alert_silent", "slo", "error_rate", "no_loss", "alert_rule", "percentiles_distinct"}
    # Latency verdicts depend on how busy the host is; accounting never does.
    assert verdicts["no_loss"].passed and verdicts["error_rate"].passed, [v.summary for v in result.verdicts]
    assert Path(paths["junit"]).read_text().count("<testcase") == 6
