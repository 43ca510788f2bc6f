"""wire/process.py: the one way shadowtest starts a child. Real processes: a parent Python process that
spawns `sleep`, then dies by SIGKILL, and the child's fate read from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.polling import wait_for
from wire.process import end_child, spawn

ROOT = Path(__file__).resolve().parents[1]

# A parent that starts `sleep 60` through spawn(ARGS), prints its pid, then waits to be killed.
PARENT = """
import sys, time
sys.path.insert(0, sys.argv[1])
from wire.process import spawn
child = spawn(["sleep", "60"], death_signal=None if sys.argv[2] == "none" else 15)
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie (a child of a dead parent is reaped by init, or lingers as Z briefly)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _orphan(death: str) -> int:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(ROOT), death], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    parent.kill()                 # SIGKILL: the parent cleans up nothing
    parent.wait(10)
    return pid


def test_a_child_dies_with_the_process_that_spawned_it_even_one_killed_with_sigkill() -> None:
    pid = _orphan("term")
    assert wait_for(lambda: not _alive(pid), 5.0), f"child {pid} outlived its parent"


def test_without_a_death_signal_the_child_outlives_its_parent() -> None:
    pid = _orphan("none")
    try:
        time.sleep(0.5)
        assert _alive(pid)
    finally:
        os.kill(pid, signal.SIGKILL)     # ours: started by the parent this test ran


def test_a_child_has_its_own_session_or_its_own_group_in_ours() -> None:
    own = spawn(["sleep", "30"])
    shared = spawn(["sleep", "30"], session=False)
    try:
        assert os.getsid(own.pid) == own.pid and os.getpgid(own.pid) == own.pid
        assert os.getpgid(shared.pid) == shared.pid and os.getsid(shared.pid) == os.getsid(0)
    finally:
        end_child(own)
        end_child(shared)
    assert own.returncode == -signal.SIGTERM and shared.returncode == -signal.SIGTERM


def test_a_child_never_reads_the_terminal_of_the_process_that_spawned_it() -> None:
    """The parent's stdin is a pipe held open and never written: a child reading it would wait forever;
    spawn gives it /dev/null, so `cat` sees end of input at once."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from wire.process import spawn; " \
           "p = spawn(['cat'], stdout=-1); print(p.communicate(timeout=10)[0] == b'', p.returncode)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert parent.stdin is not None and parent.stdout is not None
    try:
        out = parent.stdout.readline()     # while the parent's stdin is still open
    finally:
        parent.stdin.close()
        parent.wait(20)
    assert out.split() == ["True", "0"]
