"""Undo what a killed run left behind: `check_leftovers()` before every run, `clear_leftovers()` to fix.

A holder file whose process (PID + start time) is gone is a leftover. Each entry is undone by the
function registered for its kind, newest first; entries that could not be undone stay in the file
and are reported, so nothing is forgotten silently.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faults.cpu import undo_cgroup
from faults.errors import StateError
from faults.process import undo_pause, undo_processes
from faults.state import _write_atomic, same_process, state_dir


def undo_toxic_leftover(entry: dict[str, Any]) -> None:
    """Toxics of a dead run: POST /reset on its API (a vanished embedded proxy took them with it)."""
    api = str(entry["api"]).rstrip("/")
    req = urllib.request.Request(api + "/reset", data=b"", method="POST")
    try:
        urllib.request.urlopen(req, timeout=5).close()
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return  # the proxy died with the run: its toxics are gone too
        raise


UNDO: dict[str, Callable[[dict[str, Any]], None]] = {
    "toxic": undo_toxic_leftover,
    "cgroup": undo_cgroup,
    "process": undo_processes,
    "paused": undo_pause,
}


@dataclass
class Leftover:
    """One fault entry of a run that is no longer alive."""

    file: Path
    holder_pid: int
    entry_id: str
    entry: dict[str, Any]

    def describe(self) -> str:
        e = self.entry
        what = {"toxic": lambda: f"toxic {e.get('toxic')} on proxy {e.get('proxy')} at {e.get('api')}",
                "cgroup": lambda: f"cgroup {e.get('created') or [f['path'] for f in e.get('files', [])]}",
                "process": lambda: f"processes {[p['pid'] for p in e.get('procs', [])]} ({e.get('purpose', '')})",
                "paused": lambda: f"paused PID {e.get('pid')}"}.get(e.get("kind", ""), lambda: json.dumps(e))
        return f"{e.get('kind')}: {what()} (run PID {self.holder_pid})"


@dataclass
class ClearResult:
    cleared: list[Leftover] = field(default_factory=list)
    failed: list[tuple[Leftover, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed


def _holder_files(directory: Path) -> list[tuple[Path, dict[str, Any]]]:
    if not directory.exists():
        return []
    out = []
    for path in sorted(directory.glob("holder-*.json")):
        try:
            out.append((path, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            raise StateError(f"unreadable fault state {path}: {exc} (inspect it, then delete it)") from exc
    return out


def _order(entry_id: str) -> int:
    return int(entry_id.rsplit("-", 1)[-1]) if entry_id.rsplit("-", 1)[-1].isdigit() else 0


def check_leftovers(directory: Path | str | None = None) -> list[Leftover]:
    """Faults recorded by runs that are no longer alive (newest first within a run)."""
    d = Path(directory) if directory is not None else state_dir()
    found = []
    for path, data in _holder_files(d):
        holder = data.get("holder", {})
        if same_process(int(holder.get("pid", -1)), holder.get("start")):
            continue  # a live run (maybe a parallel one) still owns these
        for entry_id in sorted(data.get("entries", {}), key=_order, reverse=True):
            found.append(Leftover(path, int(holder.get("pid", -1)), entry_id, data["entries"][entry_id]))
    return found


def clear_leftovers(directory: Path | str | None = None) -> ClearResult:
    """Undo every leftover; files are removed once empty, failures stay recorded and are returned."""
    result = ClearResult()
    remaining: dict[Path, dict[str, Any]] = {}
    for left in check_leftovers(directory):
        undo = UNDO.get(str(left.entry.get("kind")))
        try:
            if undo is None:
                raise StateError(f"unknown fault kind {left.entry.get('kind')!r}")
            undo(left.entry)
            result.cleared.append(left)
        except Exception as exc:  # noqa: BLE001 - report every failure, keep going with the rest
            result.failed.append((left, f"{type(exc).__name__}: {exc}"))
            remaining.setdefault(left.file, {})[left.entry_id] = left.entry
    for path in {left.file for left in result.cleared} | set(remaining):
        if path in remaining:
            data = json.loads(path.read_text())
            data["entries"] = remaining[path]
            _write_atomic(path, data)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return result
