"""A helper server the harness owns for one run (a private Redis, a private Prometheus): one shape for all.

    with SomeServer(...) as s:      # the binary is checked, a crashed run's leftovers swept, a folder
        s.pid, s.folder             # <prefix><harness pid>-XXXX made, the child started on a free port
                                    # (wire.process.spawn: its own group, parent-death signal) and waited for
    # exit (or a failed start): the child ended by PID (end_child), the folder removed

A subclass names its `prefix`, says what is missing when its binary is not on PATH (`missing`), and
gives `_argv(port)` and `_ready(port)`; a port taken between the probe and the child's bind is retried
on another. A run killed with kill -9 leaves its folder behind: `sweep_stale(prefix)` removes the
folders whose harness process is gone, at the next start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from harness.errors import RunError
from wire.process import end_child, free_port, spawn

_PORT_TRIES = 3


class ChildServer:
    prefix = "shadowtest-child-"
    name = "child server"
    log_name = "server.log"
    ready_timeout_s = 15.0
    in_use = "in use"          # what the child's log says when its port was taken meanwhile

    def __init__(self, binary: str | None) -> None:
        self.binary = binary
        self.proc: subprocess.Popen[bytes] | None = None
        self.folder = ""       # its files while it runs (removed on exit; the name is kept)
        self.port = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # -- what a subclass gives --
    def missing(self) -> str:
        """The one-line error when the binary is not on PATH (what to install)."""
        return f"no {self.name} binary on PATH"

    def _argv(self, port: int) -> list[str]:
        raise NotImplementedError

    def _ready(self, port: int) -> bool:
        """One readiness probe (called until True, the timeout, or the child's exit)."""
        raise NotImplementedError

    def _prepare(self) -> None:
        """Before the first start: files the child reads (its config) in self.folder."""

    def _started(self) -> None:
        """After the child is ready: anything else to wait for (Prometheus' first scrape)."""

    def _sweep(self) -> None:
        sweep_stale(self.prefix)

    # -- the lifecycle --
    def __enter__(self) -> Self:
        if not self.binary:
            raise RunError(self.missing())
        self._sweep()
        self.folder = tempfile.mkdtemp(prefix=f"{self.prefix}{os.getpid()}-")
        try:
            self._prepare()
            self._start()
            self._started()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        log_path = Path(self.folder, self.log_name)
        last = ""
        for _ in range(_PORT_TRIES):
            port = free_port()
            with open(log_path, "wb") as log:
                self.proc = spawn(self._argv(port), stdout=log, stderr=subprocess.STDOUT)
            Path(self.folder, "child.pid").write_text(str(self.proc.pid))
            if self._wait_ready(port):
                self.port = port
                return
            last = log_tail(log_path)
            self.stop_child()
            if self.in_use not in last:
                break
        raise RunError(f"{self.name} did not start: {last or 'no output'}")

    def _wait_ready(self, port: int) -> bool:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if self._ready(port):
                return True
            time.sleep(0.05)
        return False

    def stop_child(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            end_child(proc)

    def __exit__(self, *exc: object) -> None:
        self.stop_child()
        if self.folder:      # the name stays, so a caller can tell what was removed
            shutil.rmtree(self.folder, ignore_errors=True)


def sweep_stale(prefix: str) -> list[str]:
    """Remove temp folders `<prefix><pid>-*` whose harness process is gone (a run killed with kill -9
    cannot clean up after itself); folders of live processes are left alone. Returns what it removed."""
    removed: list[str] = []
    for entry, _holder in stale_folders(prefix):
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(str(entry))
    return removed


def stale_folders(prefix: str) -> list[tuple[Path, int]]:
    """(folder, the harness PID in its name) of each `<prefix><pid>-*` folder of ours whose harness is gone."""
    root = Path(tempfile.gettempdir())
    try:
        entries = [e for e in root.iterdir() if e.name.startswith(prefix)][:1000]
    except OSError:
        return []
    out = []
    for entry in entries:
        pid_text = entry.name[len(prefix):].split("-", 1)[0]
        try:
            if not pid_text.isdigit() or entry.is_symlink() or not entry.is_dir() \
                    or entry.stat().st_uid != os.getuid() or _alive(int(pid_text)):
                continue
        except OSError:
            continue
        out.append((entry, int(pid_text)))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def log_tail(path: Path, lines: int = 3) -> str:
    """The last `lines` lines of a child's log, on one line ("" when unreadable)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])
