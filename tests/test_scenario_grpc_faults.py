"""gRPC call faults in scenarios: `network: grpc_delay` / `network: grpc_error` validated with FILE:LINE,
applied through the fault proxy's per-call toxics on a real agent, undone at the phase end, and reported."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import ScenarioError
from harness.faultrun import toxic_of
from harness.scenario import Scenario
from harness.scenario_load import load_scenario, load_scenario_text
from harness.timeline import CallResult

ROOT = Path(__file__).resolve().parent.parent
DECIDE = "/shadowtest.agent.v1.TradingAgent/Decide"

TEMPLATE = """\
name: g
target: {agent: {period_s: 0.5}}
traffic: {generator: {rate: 50}}
phases:
  - {name: base, duration: 2s}
  - name: fault
    duration: 3s
    faults:
      - {network: FAULT}
"""


def _load(fault: str) -> Scenario:
    return load_scenario_text(TEMPLATE.replace("FAULT", fault), "g.yaml")


@pytest.mark.parametrize(("fault", "message"), [
    ("grpc_error, share: 1.5", "phases[1].faults[0].share 1.5 must be between 0 and 1 (the share of calls affected)"),
    ("grpc_error, share_pct: 150", "phases[1].faults[0].share_pct 150 must be between 0 and 100% of the calls"),
    ("grpc_error, share: 0.5, share_pct: 50",
     "phases[1].faults[0].share_pct: give share (0..1) or share_pct (0..100), not both"),
    ("grpc_error, status: 0", "phases[1].faults[0].status 0 must be a whole number between 1 and 16 (a gRPC status"),
    ("grpc_error, status: 17", "phases[1].faults[0].status 17 must be a whole number between 1 and 16"),
    ("grpc_error, status: 2.5", "phases[1].faults[0].status 2.5 must be a whole number between 1 and 16"),
    ("grpc_error, status: UNAVAILABLEX", "phases[1].faults[0].status: 'UNAVAILABLEX' is not a gRPC status; use a code"),
    ("grpc_error, method: 'Decide; rm -rf'",
     "phases[1].faults[0].method 'Decide; rm -rf' must be a gRPC method: /pkg.Service/Method"),
    ("grpc_error, message: 'caf\u00e9'", "phases[1].faults[0].message must be printable ASCII of at most 200"),
    ("grpc_error, toxicity: 0.5", "unknown key 'toxicity'"),
    ("grpc_delay", "(network: grpc_delay): missing 'delay_ms'"),
    ("grpc_delay, delay_ms: -1", "phases[1].faults[0].delay_ms -1 must be a whole number between 0 and 60000 ms"),
    ("grpc_delay, delay_ms: 10, jitter_ms: 1e9", "phases[1].faults[0].jitter_ms 1e9 must be a whole number"),
    ("grpc_delay, delay_ms: 10, share: -0.1", "phases[1].faults[0].share -0.1 must be between 0 and 1"),
    ("grpc_delay, delay_ms: 10, status: 14", "unknown key 'status'"),
])
def test_bad_grpc_faults_name_file_line_and_what_is_expected(fault: str, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        _load(fault)
    text = str(info.value)
    assert text.startswith("g.yaml:9: ") and message in text, text
    assert (info.value.file, info.value.line) == ("g.yaml", 9) and "\n" not in text


def test_chaos_validate_prints_one_line_for_a_bad_grpc_fault(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(TEMPLATE.replace("FAULT", "grpc_error,\n         status: 99"))
    out = subprocess.run([sys.executable, "-m", "harness.cli", "chaos", "validate", str(bad)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr
    said = (out.stdout + out.stderr).strip().splitlines()
    assert len(said) == 1 and f"{bad}:10:" in said[0] and "status 99 must be a whole number between 1 and 16" in said[0]


def test_good_faults_map_onto_the_proxys_call_toxics() -> None:
    s = _load(f"grpc_error, status: 8, share_pct: 25, method: {DECIDE}, message: busy")
    assert toxic_of(s.phases[1].faults[0]) == {
        "type": "grpc_error", "stream": "upstream", "toxicity": 1.0,
        "attributes": {"status": 8, "message": "busy", "share": 0.25, "method": DECIDE}}
    s = _load("grpc_delay, delay_ms: 80, jitter_ms: 5, share: 0.5, method: Decide")
    assert toxic_of(s.phases[1].faults[0]) == {
        "type": "grpc_delay", "stream": "upstream", "toxicity": 1.0,
        "attributes": {"delay": 80, "jitter": 5, "share": 0.5, "method": "Decide"}}


def test_a_status_may_be_given_by_name() -> None:
    for text, code in (("UNAVAILABLE", 14), ("resource_exhausted", 8), ("Internal", 13), ("16", 16)):
        s = _load(f"grpc_error, status: {text}")
        assert toxic_of(s.phases[1].faults[0])["attributes"]["status"] == code, text


def test_the_bundled_scenario_is_short_and_uses_both() -> None:
    s = load_scenario(ROOT / "scenarios" / "grpc-faults.yaml")
    kinds = {f.kind for p in s.phases for f in p.faults}
    assert kinds == {"grpc_delay", "grpc_error"} and s.duration_s <= 25


RUN = """\
name: grpc-run
seed: 3
target: {agent: {limiter: off, period_s: 0.5, p99_threshold_ms: 1000}}
traffic: {generator: {rate: 120, stream_share: 0.3}}
phases:
  - {name: base, duration: 1.5s}
  - name: errors
    duration: 4s
    faults: [{network: grpc_error, status: 13, share: 0.3, method: Decide, message: chaos says no}]
  - name: delay
    duration: 3s
    faults: [{network: grpc_delay, delay_ms: 300, share: 0.5, method: DECIDE}]
  - {name: after, duration: 1.5s}
expect:
  - {no_loss: {}}
""".replace("DECIDE", DECIDE)


@pytest.mark.slow
def test_a_real_run_fails_the_share_asked_for_with_that_status_only_on_that_method(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.live import LiveView
    from harness.report import write_reports
    from harness.runner import Runner, RunOptions

    monkeypatch.setenv("SHADOWTEST_STATE_DIR", str(tmp_path / "state"))
    scenario = load_scenario_text(RUN, "run.yaml")
    with (tmp_path / "live.txt").open("w") as stream:
        result = Runner(scenario, RunOptions(view=LiveView(scenario.name, stream=stream, rich=False))).run()
    tl = result.timeline
    err_w, delay_w = tl.faults
    assert (err_w.kind, delay_w.kind) == ("grpc_error", "grpc_delay") and not err_w.error and not delay_w.error
    assert err_w.applied_s is not None and err_w.removed_s is not None

    def sent_between(a: float, b: float) -> list[CallResult]:
        return [c for c in tl.calls if c.sent_s is not None and a <= c.sent_s < b]

    # While the error toxic held (0.2 s margins for calls in flight at the edges):
    during = sent_between(err_w.applied_s + 0.2, err_w.removed_s - 0.2)
    decide = [c for c in during if c.method == DECIDE]
    others = [c for c in during if c.method != DECIDE]
    failed = [c for c in decide if c.outcome == "error"]
    assert len(decide) >= 150 and len(others) >= 50, (len(decide), len(others))
    assert {c.code for c in failed} == {"INTERNAL"}          # the status asked for, nothing else
    share = len(failed) / len(decide)
    sigma = math.sqrt(0.3 * 0.7 / len(decide))
    assert abs(share - 0.3) <= 4 * sigma, (share, len(decide))        # 0.3 within 4 sigma (binomial)
    assert all(c.outcome == "ok" for c in others)                     # the method filter holds
    # Undone at the phase end: nothing fails before or after it.
    outside = [c for c in tl.calls if c.sent_s is not None
               and not err_w.applied_s - 0.2 <= c.sent_s < err_w.removed_s + 0.2]
    assert outside and all(c.outcome == "ok" for c in outside), {c.code for c in outside}

    # grpc_delay: about half of Decide held >= 300 ms; the streams (other method) never are.
    assert delay_w.applied_s is not None and delay_w.removed_s is not None
    held = sent_between(delay_w.applied_s + 0.2, delay_w.removed_s - 0.4)
    slow = [c for c in held if c.method == DECIDE and (c.done_s or 0) - (c.sent_s or 0) >= 0.29]
    n = sum(c.method == DECIDE for c in held)
    assert n >= 100 and abs(len(slow) / n - 0.5) <= 4 * math.sqrt(0.25 / n), (len(slow), n)

    paths = write_reports(result, tmp_path / "report", png=False)
    data = json.loads(Path(paths["json"]).read_text())
    shown = {f["kind"]: f for f in data["timeline"]["faults"]}
    assert shown["grpc_error"]["family"] == "network" and "13 INTERNAL" in shown["grpc_error"]["detail"]
    assert "30% of Decide calls" in shown["grpc_error"]["detail"]
    md = Path(paths["markdown"]).read_text()
    assert "network:grpc_error" in md and "network:grpc_delay" in md and "held 300 ms" in md
    import xml.etree.ElementTree as ET
    props = [p.get("value", "") for p in ET.parse(paths["junit"]).getroot().iter("property") if p.get("name") == "fault"]
    assert len(props) == 2 and "network:grpc_error" in props[0] and "13 INTERNAL" in props[0] and "removed" in props[0]
    assert not list((tmp_path / "state").glob("holder-*.json"))       # nothing left recorded


def test_chaos_validate_accepts_the_bundled_scenario() -> None:
    out = subprocess.run([sys.executable, "-m", "harness.cli", "chaos", "validate",
                          str(ROOT / "scenarios" / "grpc-faults.yaml")], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=dict(os.environ))
    assert out.returncode == 0, out.stdout + out.stderr
