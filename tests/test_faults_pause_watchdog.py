"""A pause cannot outlive the harness: whoever holds a SIGSTOP is watched by a keeper process that
SIGCONTs the target when the holder dies, even by SIGKILL (2 s is the bound the issue sets; the
keeper reacts in milliseconds, the rest is slack for a loaded machine)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from faults.process import paused
from faults.state import FaultRegistry, proc_start_time
from wire.process import spawn

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
RESUME_BOUND_S = 2.0

HOLDER = textwrap.dedent("""
    import sys, time
    from faults.process import paused
    with paused(int(sys.argv[1])) as held:
        print("ready", held.keeper, flush=True)
        time.sleep(120)
""")

SCENARIO = """\
name: pause-then-kill
seed: 5
target: {agent: {limiter: seed, period_s: 0.5, p99_threshold_ms: 1000}}
proxy: false
traffic: {generator: {rate: 20}}
phases:
  - {name: warmup, duration: 1s}
  - {name: pause, duration: 60s, faults: [{process: pause, duration: 50s}]}
expect:
  - {no_loss: {}}
"""


def state_of(pid: int) -> str | None:
    """The process state letter (T: stopped), or None when it is gone."""
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if letter == "Z" else letter


def wait_for(pred: Callable[[], bool], within_s: float) -> float | None:
    """Seconds until `pred()` held (polled every 10 ms), or None if it did not within `within_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


def kill_if_same(pid: int, start: int | None) -> None:
    if start is not None and proc_start_time(pid) == start:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def target() -> Iterator[subprocess.Popen[bytes]]:
    p = spawn(["sleep", "120"])
    yield p
    p.kill()                  # SIGKILL ends a stopped process too
    p.wait()


def test_sigkill_of_the_holder_resumes_the_target(tmp_path: Path, state_dir: Path,
                                                  target: subprocess.Popen[bytes]) -> None:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    holder = spawn([PY, str(script), str(target.pid)], stdout=subprocess.PIPE, stderr=None, text=True,
                   env=dict(os.environ, SHADOWTEST_STATE_DIR=str(state_dir), PYTHONPATH=str(ROOT)))
    assert holder.stdout is not None
    words = holder.stdout.readline().split()
    assert words and words[0] == "ready", "the holder could not pause"
    keeper = int(words[1])
    assert state_of(target.pid) == "T" and state_of(keeper) is not None
    recorded = json.loads(next(state_dir.glob("holder-*.json")).read_text())["entries"]
    assert [e["keeper"]["pid"] for e in recorded.values()] == [keeper]   # `faults list` shows it

    holder.kill()
    holder.wait()
    took = wait_for(lambda: state_of(target.pid) not in ("T", "t"), RESUME_BOUND_S)
    assert took is not None, f"PID {target.pid} still stopped {RESUME_BOUND_S}s after the holder died"
    assert target.poll() is None                                          # resumed, not killed
    assert wait_for(lambda: state_of(keeper) is None, 5.0) is not None    # the keeper did its job and left


def test_normal_exit_resumes_once_and_reaps_the_keeper(state_dir: Path, target: subprocess.Popen[bytes]) -> None:
    reg = FaultRegistry(state_dir)
    with paused(target.pid, registry=reg) as held:
        assert state_of(target.pid) == "T"
        keeper = held.keeper
        assert keeper is not None and state_of(keeper) is not None
    assert state_of(target.pid) not in ("T", "t") and held.resumed_at is not None
    assert state_of(keeper) is None and not reg.path.exists()
    # Paused again: the keeper of the first pause is gone and cannot resume this one early.
    with paused(target.pid, registry=reg):
        time.sleep(0.2)
        assert state_of(target.pid) == "T"


def test_a_terminated_keeper_resumes_rather_than_strands(state_dir: Path, target: subprocess.Popen[bytes]) -> None:
    with paused(target.pid, registry=FaultRegistry(state_dir)) as held:
        assert held.keeper is not None
        os.kill(held.keeper, signal.SIGTERM)          # e.g. someone cleaning up processes by PID
        assert wait_for(lambda: state_of(target.pid) not in ("T", "t"), RESUME_BOUND_S) is not None
    assert state_of(target.pid) not in ("T", "t")


def test_kill_9_of_chaos_run_during_a_pause_resumes_the_agent(tmp_path: Path, state_dir: Path) -> None:
    scenario = tmp_path / "pause.yaml"
    scenario.write_text(SCENARIO)
    run = spawn([PY, "-m", "harness.cli", "chaos", "run", str(scenario), "--report-dir",
                 str(tmp_path / "out"), "--no-png"], cwd=str(ROOT), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True,
                env=dict(os.environ, SHADOWTEST_STATE_DIR=str(state_dir)))
    lines: list[str] = []
    agent, agent_start, keeper = 0, None, 0
    try:
        assert run.stdout is not None
        deadline = time.monotonic() + 120
        for line in run.stdout:
            lines.append(line)
            if "took effect" in line or time.monotonic() > deadline:
                break
        assert any("process:pause" in x and "took effect" in x for x in lines), "".join(lines)
        entry = next(e for f in state_dir.glob("holder-*.json")
                     for e in json.loads(f.read_text())["entries"].values() if e["kind"] == "paused")
        agent, agent_start, keeper = entry["pid"], entry["start"], entry["keeper"]["pid"]
        assert state_of(agent) == "T"

        run.kill()                                    # kill -9 of the harness, mid-pause
        run.wait()
        took = wait_for(lambda: state_of(agent) not in ("T", "t"), RESUME_BOUND_S)
        assert took is not None, f"the agent (PID {agent}) still stopped {RESUME_BOUND_S}s after kill -9"
        # Resumed, it acts on the parent-death SIGTERM that waited while it was stopped: it exits
        # and frees its ports instead of lingering as a stopped orphan.
        assert wait_for(lambda: state_of(agent) is None, 30.0) is not None, "the agent outlived its harness"
        assert wait_for(lambda: state_of(keeper) is None, 5.0) is not None
        cleared = subprocess.run([PY, "-m", "harness.cli", "faults", "clear", "--json"], cwd=ROOT, timeout=60,
                                 capture_output=True, text=True,
                                 env=dict(os.environ, SHADOWTEST_STATE_DIR=str(state_dir)))
        assert cleared.returncode == 0, cleared.stdout + cleared.stderr
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if agent:
            kill_if_same(agent, agent_start)
