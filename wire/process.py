"""How shadowtest starts, and ends, a child process: one way, for every package.

    spawn(argv, ...)      own process group (and session), PR_SET_PDEATHSIG, stdin from /dev/null
    end_child(proc)       SIGTERM, then SIGKILL; reaped
    free_port()           a loopback TCP port free now, for a child that cannot take port 0 itself

Servers the harness runs (Prometheus, Redis, the fault proxy, the agent), CPU and GPU burners, replay
shards and the processes a scenario restarts all start through `spawn`; what differs between them is a
parameter, said where they call it. Stdlib only.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
from collections.abc import Sequence
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a child server that cannot take port 0 itself (it may be
    taken again before the child binds it: callers retry)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def end_child(proc: subprocess.Popen[Any], term_s: float = 10.0, kill_s: float = 5.0) -> None:
    """End a child we started: SIGTERM, then SIGKILL if it has not exited within `term_s`; reaped."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(term_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(kill_s)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """preexec_fn: PR_SET_PDEATHSIG, so a helper never outlives the thread that spawned it."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)


def spawn(argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
          stdin: Any = subprocess.DEVNULL, stdout: Any = subprocess.DEVNULL, stderr: Any = subprocess.DEVNULL,
          text: bool = False, session: bool = True, death_signal: int | None = signal.SIGTERM) -> subprocess.Popen[Any]:
    """Start a child the way shadowtest starts its children (servers, burners, proxies, replay shards):

    * in a process group of its own, so a signal to the group ends it with whatever it started; by
      default in a session of its own too, so a terminal's Ctrl-C reaches only the harness, which ends it
      in order (`session=False`: the harness's session, which CPU burners need, since the scheduler
      shares a core between sessions before it shares it between processes);
    * with PR_SET_PDEATHSIG `death_signal`, so it never outlives the thread that started it, even one
      killed with SIGKILL (None: a process that must outlive that thread; its registry entry ends it);
    * stdin from /dev/null unless a pipe is asked for (a child never reads the harness's terminal).

    End it with `end_child` (SIGTERM, then SIGKILL). OSError when it cannot run: the caller says what to
    install in its own words. The pause keeper is the one process started otherwise (it must outlive
    the thread that paused, and watches the whole process instead)."""
    return subprocess.Popen(list(argv), env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                            start_new_session=session, process_group=None if session else 0,
                            preexec_fn=None if death_signal is None
                            else lambda: die_with_parent(death_signal))  # noqa: PLW1509
