"""Crash-safe record of every fault in effect, written BEFORE the fault takes effect.

    <state dir>/holder-<pid>-<starttime>.json   mode 0600, replaced atomically (tmp + fsync + rename)
        {"holder": {"pid": .., "start": ..}, "entries": {"<id>": {"kind": "toxic", ...}}}

A fault is a context manager: it registers its entry, applies itself, and on exit (normal,
exception, SIGINT, SIGTERM under `handle_signals`) undoes itself and drops the entry. A run that
is SIGKILLed leaves its file behind; `faults.cleanup.clear_leftovers()` (and `shadowtest faults
clear`) undo those entries. Processes are identified by PID *and* start time, so a PID reused by
an unrelated process is never signalled.

The directory is $SHADOWTEST_STATE_DIR, else /run/shadowtest for root, else
$XDG_RUNTIME_DIR/shadowtest, else /tmp/shadowtest-<uid>. It is private: created 0700, and refused
(`StateError`, one line) when it is a symlink, not owned by this user, or open to group or others.
Files in it are opened relative to the directory with O_NOFOLLOW: a planted symlink is never
followed, and a file that is not a regular file of ours (or over `MAX_STATE_BYTES`) is refused.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import re
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from faults.errors import StateError

ENV = "SHADOWTEST_STATE_DIR"
MAX_STATE_BYTES = 1 << 20         # a holder file of a real run is a few KB
HOLDER_RE = re.compile(r"holder-(\d{1,10})-(\d{1,20}|None)\.json")
_HINT = f"or set {ENV} to a private directory"


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
            stat_line = f.read()
    except OSError:
        return None
    fields = stat_line[stat_line.rfind(b")") + 2:].split()
    if fields and fields[0] == b"Z":  # a zombie has finished running: nothing left to undo on it
        return None
    return int(fields[19])


def same_process(pid: int, start: int | None) -> bool:
    """True when `pid` is alive and is the very process that had start time `start`."""
    return start is not None and pid > 0 and proc_start_time(pid) == start


class StateDir:
    """An open, verified-private state directory; every file operation is relative to its fd."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> StateDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def holder_names(self) -> list[str]:
        """Names of the holder files in the directory, sorted."""
        return sorted(n for n in os.listdir(self.fd) if HOLDER_RE.fullmatch(n))

    def read(self, name: str) -> dict[str, Any]:
        """A state file's JSON object; StateError when it is a symlink, not a regular file of ours,
        too large, or not a JSON object."""
        where = self.path / name
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StateError(f"fault state file {where} is a symlink; refusing to follow it "
                                 "(delete it if you did not create it)") from exc
            raise StateError(f"unreadable fault state {where}: {exc.strerror} (inspect it, then delete it)") from exc
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise StateError(f"fault state file {where} is not a regular file owned by uid {os.geteuid()}; "
                                 "refusing it (delete it if you did not create it)")
            raw = f.read(MAX_STATE_BYTES + 1)
        if len(raw) > MAX_STATE_BYTES:
            raise StateError(f"fault state file {where} is larger than {MAX_STATE_BYTES} bytes; refusing it "
                             "(inspect it, then delete it)")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StateError(f"unreadable fault state {where}: {exc} (inspect it, then delete it)") from exc
        if not isinstance(data, dict):
            raise StateError(f"unreadable fault state {where}: not a JSON object (inspect it, then delete it)")
        return data

    def write(self, name: str, data: dict[str, Any]) -> None:
        """Replace `name` atomically (tmp + fsync + rename), mode 0600, never through a symlink."""
        tmp = f".{name}.tmp"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.fd)      # a stale (or planted) tmp: removed, never opened
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self.fd)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as exc:
            raise StateError(f"cannot write fault state {self.path / name}: {exc.strerror} "
                             f"(set {ENV} to a writable directory)") from exc

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)


def open_state_dir(directory: Path | str | None = None, create: bool = False) -> StateDir | None:
    """The state directory, opened and verified private; None when it does not exist and not `create`.

    Raises StateError (one line) when it is a symlink, not a directory, owned by another user, or
    readable/writable by group or others (mode looser than 0700)."""
    path = Path(directory) if directory is not None else state_dir()
    made = False
    if create:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(path, 0o700)
            made = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise StateError(f"cannot create fault state directory {path}: {exc.strerror} "
                             f"(set {ENV} to a writable directory)") from exc
    if path.is_symlink():
        raise StateError(f"fault state directory {path} is a symlink; refusing to use it (remove it, {_HINT})")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise StateError(f"fault state directory {path} vanished while it was created") from None
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            what = "a symlink" if exc.errno == errno.ELOOP else "not a directory"
            raise StateError(f"fault state directory {path} is {what}; refusing to use it ({_HINT})") from exc
        raise StateError(f"cannot open fault state directory {path}: {exc.strerror} ({_HINT})") from exc
    try:
        if made:
            os.fchmod(fd, 0o700)        # whatever the umask made of it
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise StateError(f"fault state directory {path} is owned by uid {st.st_uid}, not by you "
                             f"(uid {os.geteuid()}); refusing to use it ({_HINT})")
        if st.st_mode & 0o077:
            mode = stat.S_IMODE(st.st_mode)
            raise StateError(f"fault state directory {path} has mode {mode:04o}; it must be private (0700): "
                             f"chmod 700 {path}, {_HINT}")
    except BaseException:
        os.close(fd)
        raise
    return StateDir(path, fd)


class FaultRegistry:
    """This process's fault entries, persisted in one holder file."""

    def __init__(self, directory: Path | str | None = None) -> None:
        self.dir = Path(directory) if directory is not None else state_dir()
        self.pid = os.getpid()
        self.start = proc_start_time(self.pid)
        self.name = f"holder-{self.pid}-{self.start}.json"
        self.path = self.dir / self.name
        self.entries: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def _save(self) -> None:
        d = open_state_dir(self.dir, create=bool(self.entries))
        if d is None:
            return                       # nothing recorded and no directory: nothing to remove
        with d:
            if not self.entries:
                d.unlink(self.name)
                return
            d.write(self.name, {"holder": {"pid": self.pid, "start": self.start}, "entries": self.entries})

    def register(self, kind: str, **data: Any) -> str:
        """Record a fault about to be applied; returns its entry id. Durable when this returns."""
        with self._lock:
            entry_id = f"{kind}-{next(self._ids)}"
            self.entries[entry_id] = {"kind": kind, **data}
            try:
                self._save()
            except StateError:
                del self.entries[entry_id]     # not recorded: the fault must not be applied
                raise
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
