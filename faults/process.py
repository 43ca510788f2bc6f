"""Process faults: pause (SIGSTOP, SIGCONT after a duration), and kill/restart of a process we own.

Every signal goes through `signal_if_same`, which checks PID *and* start time, so a PID that the
kernel reused for an unrelated process is never signalled. A pause is watched by a keeper process
(`PauseKeeper`) that resumes the target if the process holding the pause dies, even by SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faults.errors import ProcessFaultError
from faults.state import FaultRegistry, default_registry, proc_start_time, same_process
from wire.process import spawn


def signal_if_same(pid: int, start: int | None, sig: int) -> bool:
    """Send `sig` only if `pid` is still the process that started at `start`; True when sent."""
    if not same_process(pid, start):
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def group_members(pgid: int, comm_prefix: str, not_before: int) -> list[tuple[int, int]]:
    """(pid, start) of live processes in group `pgid` named `comm_prefix`*, started at/after `not_before`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != b"Z" and int(fields[19]) >= not_before \
                and _comm(int(entry)).startswith(comm_prefix):
            found.append((int(entry), int(fields[19])))
    return found


def kill_recorded(procs: Sequence[dict[str, Any]], sig: int = signal.SIGKILL) -> int:
    """Kill recorded processes (and, for group leaders, their group's same-named members)."""
    killed = 0
    for p in procs:
        pid, start = int(p["pid"]), p.get("start")
        targets = [(pid, start)]
        if p.get("group") and start is not None:
            targets += group_members(pid, str(p.get("comm", ""))[:15], int(start))
        for tpid, tstart in dict(targets).items():
            killed += signal_if_same(tpid, tstart, sig)
    return killed


def undo_processes(entry: dict[str, Any]) -> None:
    """Undo a "process" entry: kill what it started (verified by start time)."""
    kill_recorded(entry.get("procs", []))


def undo_pause(entry: dict[str, Any]) -> None:
    """Undo a "paused" entry: SIGCONT the process if it is still the same one."""
    signal_if_same(int(entry["pid"]), entry.get("start"), signal.SIGCONT)


# The keeper: a tiny stdlib-only process that holds a pause on the harness's behalf. It watches
# its parent through a pidfd (process-wide: a thread of the parent ending does not count) and its
# stdin pipe; when the parent dies -- even by SIGKILL -- or the keeper itself gets SIGTERM/SIGHUP,
# it SIGCONTs the target (if its start time still matches) and exits. "done" on stdin: the parent
# resumed the target itself; the keeper just exits.
_KEEPER = """
import os, select, signal, sys
pid, start, parent = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def resume(*_):
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            s = f.read()
        if s[s.rfind(b")") + 2:].split()[19].decode() == start:
            os.kill(pid, signal.SIGCONT)
    except (OSError, IndexError):
        pass
    os._exit(0)
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(s, resume)
try:
    pfd = os.pidfd_open(parent)
except OSError:
    pfd = -1  # gone (then getppid() differs), or no pidfd on this kernel: getppid() is polled
if os.getppid() != parent:
    resume()
sys.stdout.write("ready\\n")
sys.stdout.flush()
poller = select.poll()
if pfd >= 0:
    poller.register(pfd, select.POLLIN)
poller.register(0, select.POLLIN | select.POLLHUP)
buf = b""
while True:
    events = poller.poll(None if pfd >= 0 else 100)
    if pfd < 0 and os.getppid() != parent:
        resume()
    for fd, ev in events:
        if fd == pfd:
            resume()
        data = os.read(0, 64)
        if not data:
            resume()
        buf += data
        if b"done" in buf:
            os._exit(0)
"""
KEEPER_START_S = 10.0


class PauseKeeper:
    """The helper process that resumes a paused target if this process dies (see `_KEEPER`)."""

    def __init__(self, pid: int, start: int) -> None:
        import select
        import sys

        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _KEEPER, str(pid), str(start),
                                          str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise ProcessFaultError(f"cannot start the pause keeper: {exc}") from exc
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], KEEPER_START_S)
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.close(resume=False)
            raise ProcessFaultError(f"the pause keeper did not start within {KEEPER_START_S:g}s; "
                                    f"not pausing PID {pid}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self, resume: bool = False) -> None:
        """Tell the keeper the pause is over and reap it (`resume`: let it SIGCONT the target)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                if not resume:
                    self.proc.stdin.write(b"done\n")
                self.proc.stdin.close()      # EOF without "done": the keeper resumes the target
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()


@dataclass
class Pause:
    """A pause in effect: `paused_at`/`resumed_at` are time.monotonic() values; `keeper` the PID of
    the helper that resumes the target should this process die."""

    pid: int
    paused_at: float
    resumed_at: float | None = None
    keeper: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@contextlib.contextmanager
def paused(pid: int, duration_s: float | None = None, registry: FaultRegistry | None = None) -> Iterator[Pause]:
    """SIGSTOP `pid`; SIGCONT after `duration_s` (if given) or on exit, whichever is first.

    A keeper process is started first: if this process dies while the pause holds (even SIGKILL),
    the keeper resumes the target within milliseconds. Raises ProcessFaultError if the process
    does not exist or cannot be signalled, or the keeper cannot start.
    """
    reg = registry or default_registry()
    start = proc_start_time(pid)
    if start is None:
        raise ProcessFaultError(f"cannot pause PID {pid}: no such process")
    info = Pause(pid, 0.0)

    def resume(_entry: dict[str, Any] | None = None) -> None:
        with info._lock:
            if info.resumed_at is None:
                signal_if_same(pid, start, signal.SIGCONT)
                info.resumed_at = time.monotonic()

    with reg.hold("paused", resume, pid=pid, start=start) as entry_id:
        keeper = PauseKeeper(pid, start)
        info.keeper = keeper.pid
        try:
            reg.update(entry_id, keeper={"pid": keeper.pid, "start": proc_start_time(keeper.pid)})
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError as exc:
                raise ProcessFaultError(f"cannot pause PID {pid}: {exc} (run as its owner or root)") from exc
            _wait_stopped(pid)
            info.paused_at = time.monotonic()
            timer = threading.Timer(duration_s, resume) if duration_s is not None else None
            if timer is not None:
                timer.daemon = True
                timer.start()
            try:
                yield info
            finally:
                if timer is not None:
                    timer.cancel()
                resume()
        finally:
            keeper.close(resume=info.resumed_at is None)


def _wait_stopped(pid: int, timeout_s: float = 1.0) -> None:
    """Return once the kernel shows `pid` stopped: SIGSTOP is delivered asynchronously, and
    `paused_at` must be when the pause really took effect, not when we asked for it."""
    deadline = time.monotonic() + timeout_s
    stat = Path(f"/proc/{pid}/stat")
    while time.monotonic() < deadline:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        except OSError:
            return  # gone: nothing left to wait for
        time.sleep(0.001)


def pause_for(pid: int, seconds: float, registry: FaultRegistry | None = None) -> Pause:
    """Pause `pid` for `seconds` and return once it runs again."""
    with paused(pid, registry=registry) as info:
        time.sleep(seconds)
    return info


class OwnedProcess:
    """A process the harness starts and may kill and restart; recorded so a crash never leaks it.

    >>> with OwnedProcess(["sleep", "60"]) as p:
    ...     p.restart(downtime_s=0.5)
    """

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
                 registry: FaultRegistry | None = None, stdout: Any = subprocess.DEVNULL) -> None:
        self.argv, self.env, self.cwd, self.stdout = list(argv), env, cwd, stdout
        self.registry = registry or default_registry()
        self.proc: subprocess.Popen[bytes] | None = None
        self._entry: str | None = None
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> OwnedProcess:
        """Start the process (in its own session); raises ProcessFaultError if it cannot run."""
        if self._entry is None:
            self._entry = self.registry.register("process", argv=self.argv[:8], procs=[])
        try:
            # the harness's session, no death signal: a restart may come from a thread that then ends;
            # the registry entry ends it after a crash
            self.proc = spawn(self.argv, env=self.env, cwd=self.cwd, stdout=self.stdout, session=False,
                              death_signal=None)
        except OSError as exc:
            raise ProcessFaultError(f"cannot start {self.argv[0]}: {exc}") from exc
        rec = {"pid": self.proc.pid, "start": proc_start_time(self.proc.pid), "group": True,
               "comm": _comm(self.proc.pid)}
        self.registry.update(self._entry, procs=[rec])
        return self

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 5.0) -> int | None:
        """Signal the process group and wait for the process; returns its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    def restart(self, downtime_s: float = 0.0, sig: int = signal.SIGKILL) -> None:
        """Kill (default SIGKILL), stay down `downtime_s`, start again."""
        self.kill(sig)
        time.sleep(downtime_s)
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; forget the record."""
        self.kill(signal.SIGTERM)
        if self._entry is not None:
            self.registry.release(self._entry)
            self._entry = None

    def __enter__(self) -> OwnedProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
