"""Crash-safe record of every fault in effect, written BEFORE the fault takes effect.

    <state dir>/holder-<pid>-<starttime>.json   mode 0600, replaced atomically (tmp + fsync + rename)
        {"holder": {"pid": .., "start": ..}, "entries": {"<id>": {"kind": "toxic", ...}}}

A fault is a context manager: it registers its entry, applies itself, and on exit (normal,
exception, SIGINT, SIGTERM under `handle_signals`) undoes itself and drops the entry. A run that
is SIGKILLed leaves its file behind; `faults.cleanup.clear_leftovers()` (and `shadowtest faults
clear`) undo those entries. Processes are identified by PID *and* start time, so a PID reused by
an unrelated process is never signalled.

The directory is $SHADOWTEST_STATE_DIR, else /run/shadowtest for root, else
$XDG_RUNTIME_DIR/shadowtest, else /tmp/shadowtest-<uid>.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from faults.errors import StateError

ENV = "SHADOWTEST_STATE_DIR"


def state_dir() -> Path:
    """Where fault records live (see module doc); not created here."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    if os.geteuid() == 0:
        return Path("/run/shadowtest")
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "shadowtest"
    return Path(f"/tmp/shadowtest-{os.geteuid()}")


def proc_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if fields and fields[0] == b"Z":  # a zombie has finished running: nothing left to undo on it
        return None
    return int(fields[19])


def same_process(pid: int, start: int | None) -> bool:
    """True when `pid` is alive and is the very process that had start time `start`."""
    return start is not None and proc_start_time(pid) == start


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise StateError(f"cannot write fault state {path}: {exc} "
                         f"(set {ENV} to a writable directory)") from exc


class FaultRegistry:
    """This process's fault entries, persisted in one holder file."""

    def __init__(self, directory: Path | str | None = None) -> None:
        self.dir = Path(directory) if directory is not None else state_dir()
        self.pid = os.getpid()
        self.start = proc_start_time(self.pid)
        self.path = self.dir / f"holder-{self.pid}-{self.start}.json"
        self.entries: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def _save(self) -> None:
        if not self.entries:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            return
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StateError(f"cannot create fault state directory {self.dir}: {exc} "
                             f"(set {ENV} to a writable directory)") from exc
        _write_atomic(self.path, {"holder": {"pid": self.pid, "start": self.start}, "entries": self.entries})

    def register(self, kind: str, **data: Any) -> str:
        """Record a fault about to be applied; returns its entry id. Durable when this returns."""
        with self._lock:
            entry_id = f"{kind}-{next(self._ids)}"
            self.entries[entry_id] = {"kind": kind, **data}
            self._save()
            return entry_id

    def update(self, entry_id: str, **data: Any) -> None:
        """Add facts learned while applying (e.g. the PID of a started stress process)."""
        with self._lock:
            self.entries[entry_id].update(data)
            self._save()

    def release(self, entry_id: str) -> None:
        """The fault is undone: forget it."""
        with self._lock:
            self.entries.pop(entry_id, None)
            self._save()

    @contextlib.contextmanager
    def hold(self, kind: str, undo: Callable[[dict[str, Any]], object], **data: Any) -> Iterator[str]:
        """Register, yield the id (apply the fault inside), then undo with the final entry and release."""
        entry_id = self.register(kind, **data)
        try:
            yield entry_id
        finally:
            with self._lock:
                entry = dict(self.entries.get(entry_id, {}))
            undo(entry)  # if this raises, the entry stays recorded: `faults clear` retries after we exit
            self.release(entry_id)


_default: FaultRegistry | None = None
_default_lock = threading.Lock()


def default_registry() -> FaultRegistry:
    """The registry of this process (a fresh one after fork), in `state_dir()` as it is now."""
    global _default
    with _default_lock:
        if _default is None or _default.pid != os.getpid() or _default.dir != state_dir():
            _default = FaultRegistry()
        return _default


class Terminated(SystemExit):
    """Raised in the main thread by SIGTERM/SIGHUP under `handle_signals`, so `with` blocks unwind."""


@contextlib.contextmanager
def handle_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into an exception for the duration (SIGINT already raises KeyboardInterrupt).

    Only the main thread can install handlers; elsewhere this is a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_exit(signum: int, frame: object) -> None:
        raise Terminated(128 + signum)

    old = {s: signal.signal(s, raise_exit) for s in signals}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
