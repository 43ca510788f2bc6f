"""Traffic that lasts the run: `chaos validate` warns (FILE:LINE) when a recording ends before the phases,
`loop: until_end` repeats it to the end, a run says when its traffic ran out, and the live view shows `-`
for the percentiles of a period without calls.

The runs are real: the harness's runner, the open-loop replayer and a real gRPC server in its own process
(tests/hostile_server.py's Echo, an external target that starts in well under a second), with a
recording written here; no proxy, to keep each run a few seconds.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from capture.recording import Call, Flow, Message, RecordingWriter
from harness.commands.chaos import command as chaos
from harness.errors import ScenarioError
from harness.live import Snapshot, plain_line
from harness.runner import live_snapshot
from harness.scenario import UNTIL_END, RecordingTraffic
from harness.scenario_load import load_scenario_text, scenario_warnings
from harness.timeline import CallResult, Timeline
from harness.traffic import coverage, recording_span
from wire.process import end_child, spawn

pytestmark = pytest.mark.usefixtures("state_dir")   # SHADOWTEST_STATE_DIR in the test's tmp dir (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
ECHO = "/test.Bytes/Echo"
BASE = 10_000_000_000


def write_recording(path: Path, seconds: float, rate: float) -> Path:
    """`seconds` of unary Echo calls at `rate` a second on one connection (a pass of `seconds`)."""
    with RecordingWriter(path) as w:
        fid = w.add_flow(Flow(("127.0.0.1", 41000), ("127.0.0.1", 50051), protocol="grpc"))
        for i in range(round(seconds * rate)):
            t = BASE + round(i * 1e9 / rate)
            w.add_call(Call(protocol="grpc", method=ECHO, request_ts_ns=t, flow_id=fid, status=0,
                            requests=[Message("c2s", 0, t, b"ping %d" % i)]))
    return path


# The case: a 5 s recording played 3 times into 24 s of phases.
SHORT = """\
name: short
target: {agent: {}}
traffic:
  recording: prod.rec
  loop: LOOP
phases:
  - {name: baseline, duration: 8s}
  - {name: fault, duration: 8s}
  - {name: recovery, duration: 8s}
expect:
  - {error_rate: {phase: recovery}}
"""


def test_validate_warns_with_file_and_line_when_the_recording_ends_before_the_scenario(tmp_path: Path) -> None:
    write_recording(tmp_path / "prod.rec", 5.0, 10.0)
    path = tmp_path / "short.yaml"
    path.write_text(SHORT.replace("LOOP", "3"))
    out = CliRunner().invoke(chaos, ["validate", str(path)])
    assert out.exit_code == 0, out.output          # a warning, not an error
    lines = out.output.splitlines()
    assert lines[0] == f"ok  {path}: short, 3 phases, 1 checks, 24s"
    assert lines[1] == (
        f"warn {path}:5: traffic runs out at 15.0s of the scenario's 24s: 5s a pass x loop 3 lasts 15s, the "
        "phases use 24s of it; no calls after 15.0s in phase fault; none at all in recovery (checks bound to a "
        "phase without calls are skipped); use 'loop: until_end' (or 'loop: 5')"), out.output
    data = json.loads(CliRunner().invoke(chaos, ["validate", "--json", str(path)]).output)["scenarios"]
    assert data[0]["traffic_s"] == 15.0 and len(data[0]["warnings"]) == 1
    # until_end (or enough passes) lasts the run: no warning.
    for loop in ("until_end", "5"):
        path.write_text(SHORT.replace("LOOP", loop))
        out = CliRunner().invoke(chaos, ["validate", str(path)])
        assert out.exit_code == 0 and out.output.splitlines() == [f"ok  {path}: short, 3 phases, 1 checks, 24s"], \
            (loop, out.output)
    # Twice the speed and twice the load in the fault phase use the recording up even sooner.
    s = load_scenario_text(SHORT.replace("LOOP", "4").replace("prod.rec", "prod.rec\n  speed: 2.0")
                           .replace("duration: 8s}\n  - {name: recovery", "duration: 8s, load: 2.0}\n  - {name: "
                                    "recovery"), "fast.yaml", tmp_path)
    cov = coverage(s)   # 4 passes of 2.5 s = 10 s of base time: 8 s of baseline, then 1 s of the load-2 fault
    assert (cov.lasts_s, cov.needs_s, cov.ends_s, cov.phase, cov.loops_needed) == (10.0, 32.0, 9.0, "fault", 13)
    warnings, _ = scenario_warnings(s)
    assert warnings[0].startswith("fast.yaml:6: traffic runs out at 9.0s of the scenario's 24s: 2.5s a pass at "
                                  "speed 2 x loop 4 lasts 10s, the phases use 32s of it (their durations x load)")
    # A recording that is not there (git-ignored in CI) cannot be measured: said, still valid.
    path.write_text(SHORT.replace("LOOP", "3").replace("prod.rec", "gone.rec"))
    out = CliRunner().invoke(chaos, ["validate", str(path)])
    assert out.exit_code == 0 and f"warn {path}:5: traffic: cannot tell how long the recording lasts: " in out.output


def test_loop_until_end_is_read_and_a_bad_loop_names_its_line(tmp_path: Path) -> None:
    s = load_scenario_text(SHORT.replace("LOOP", "until_end"), "s.yaml", tmp_path)
    assert isinstance(s.traffic, RecordingTraffic) and s.traffic.loop == UNTIL_END and s.traffic.until_end
    assert s.traffic.line == 5
    with pytest.raises(ScenarioError) as info:
        load_scenario_text(SHORT.replace("LOOP", "forever"), "s.yaml", tmp_path)
    assert str(info.value) == ("s.yaml:5: traffic.loop: expected a whole number of passes or until_end (repeat the "
                               "recording until the scenario ends), got 'forever'")
    with pytest.raises(ScenarioError, match=r"^s.yaml:5: traffic.loop 0 must be a whole number between 1 and 1000"):
        load_scenario_text(SHORT.replace("LOOP", "0"), "s.yaml", tmp_path)
    # until_end plays as many passes as the phases use, one spare: the plan is cut where the last phase ends.
    write_recording(tmp_path / "prod.rec", 5.0, 10.0)
    span = recording_span(s.traffic)
    assert (span.pass_s, span.last_s, span.calls) == (5.0, 4.9, 50) and abs(span.gap_s - 0.1) < 1e-9
    assert span.loops_for(24.0) == 6 and span.lasts_s(5) == 25.0


def test_the_live_view_shows_a_dash_for_a_period_without_calls() -> None:
    # Two periods of calls at 5 ms, then the traffic stops: the third period has no calls.
    calls = [CallResult(k / 40, k / 40, k / 40 + 0.005, ECHO, "ok") for k in range(80)]
    tl = Timeline(period_s=1.0, threshold_ms=20.0, phases=[("run", 0.0, 3.0)], calls=calls)
    s = load_scenario_text(SHORT.replace("LOOP", "3"), "s.yaml")
    live = live_snapshot(2.9, "fault", s, tl.periods[:2], None, None, [])
    assert "offered=40/s" in plain_line(live) and "p50=5.0ms p95=5.0ms p99=5.0ms" in plain_line(live)
    empty = live_snapshot(3.9, "fault", s, tl.periods, None, None, [])
    line = plain_line(empty)
    assert "offered=0/s achieved=0/s p50=- p95=- p99=-" in line, line     # not 5.0ms repeated
    assert "p99=-" in plain_line(Snapshot(1.0, 3.0, "x", p99=[None]))
    assert "p99=7.0ms" in plain_line(Snapshot(1.0, 3.0, "x", p99=[None, 7.0]))


# ---- real runs --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def echo_server() -> Iterator[str]:
    """tests/hostile_server.py (a LeanServer with test.Bytes/Echo) in its own process; its address."""
    proc = spawn([sys.executable, str(ROOT / "tests" / "hostile_server.py"), "--max-lifetime-s", "120"],
                 cwd=str(ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line, deadline = b"", time.monotonic() + 20.0
    while not line.endswith(b"\n") and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            line += os.read(proc.stdout.fileno(), 64)
    try:
        assert line.strip().isdigit(), f"the echo server did not start: {line!r}"
        yield f"127.0.0.1:{int(line)}"
    finally:
        end_child(proc)


RUN = """\
name: lasts
target: {external: {address: "ADDRESS", period_s: 0.5, p99_threshold_ms: 1000}}
proxy: false
traffic: {recording: prod.rec, loop: LOOP}
phases:
  - {name: first, duration: 1.5s}
  - {name: second, duration: 1.5s}
expect:
  - {error_rate: {phase: first}}
  - {error_rate: {phase: second}}
  - {slo: {phase: second, p99_ms: 1000}}
  - {no_loss: {}}
"""


def _run_cli(tmp_path: Path, address: str, loop: str, *flags: str) -> tuple[int, str, dict[str, Any]]:
    write_recording(tmp_path / "prod.rec", 1.5, 40.0)
    path = tmp_path / "lasts.yaml"
    path.write_text(RUN.replace("ADDRESS", address).replace("LOOP", loop))
    out = CliRunner().invoke(chaos, ["run", str(path), "--report-dir", str(tmp_path / "r"), "--no-png", *flags])
    return out.exit_code, out.output, json.loads((tmp_path / "r" / "results.json").read_text())


def test_a_recording_that_runs_out_is_said_and_its_empty_phase_skipped_and_strict_fails(
        tmp_path: Path, echo_server: str) -> None:
    code, output, data = _run_cli(tmp_path, echo_server, "1", "--strict")
    status = {v["id"]: v["status"] for v in data["verdicts"]}
    summary = {v["id"]: v["summary"] for v in data["verdicts"]}
    assert status == {"error_rate[first]": "pass", "error_rate[second]": "skipped", "slo[second]": "skipped",
                      "no_loss": "skipped"}, summary
    assert summary["slo[second]"] == "nothing to judge: no calls in the phase 'second' (1.5-3.0s)"
    assert summary["no_loss"].startswith("nothing to judge: the target exposes no request counters to compare")
    # One line, when it happened: 60 calls due 0-1.475 s (1.48 at 2 places), the second phase empty.
    ran_out = [line for line in output.splitlines() if "traffic ran out" in line]
    assert len(ran_out) == 1 and re.fullmatch(
        r"\[ *\d+\.\d\ds\] traffic ran out: its last call was due at 1\.48s, 1\.5s before the run ends; no calls "
        r"in phase second \(the recording played 1 time; 'loop: until_end' repeats it until the scenario ends\)",
        ran_out[0]), ran_out
    assert ran_out[0].split("] ", 1)[1] in data["notes"]
    # The live view: percentiles while there were calls, `-` once there were none.
    live = [line for line in output.splitlines() if " phase=" in line]
    assert any("p50=" in line and "ms" in line.split("p50=")[1].split()[0] for line in live), live
    assert any("phase=second offered=0/s" in line and "p50=- p95=- p99=-" in line for line in live), live
    # --strict: the skipped checks fail the run, and the summary line says so.
    assert code == 99, output
    assert "lasts: FAILED (--strict: 3 checks skipped), 1/4 checks passed, 3 skipped (nothing to judge)" in output
    assert data["passed"] is False and data["strict"] is True


def test_loop_until_end_keeps_the_traffic_to_the_end_of_the_run(tmp_path: Path, echo_server: str) -> None:
    code, output, data = _run_cli(tmp_path, echo_server, "until_end")
    status = {v["id"]: v["status"] for v in data["verdicts"]}
    assert status == {"error_rate[first]": "pass", "error_rate[second]": "pass", "slo[second]": "pass",
                      "no_loss": "skipped"}, [v["summary"] for v in data["verdicts"]]
    assert "traffic ran out" not in output and code == 0, output
    assert "lasts: PASSED, 3/4 checks passed, 1 skipped (nothing to judge)" in output
    # Calls were due to the very end: the last period of the run was offered its share (40/s x 0.5 s).
    periods = data["timeline"]["periods"]
    assert len(periods) == 6 and all(p["offered"] >= 15 for p in periods), [p["offered"] for p in periods]
