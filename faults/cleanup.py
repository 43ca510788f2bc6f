"""Undo what a killed run left behind: `check_leftovers()` before every run, `clear_leftovers()` to fix.

A holder file whose process (PID + start time) is gone is a leftover. Each entry is undone by the
function registered for its kind, newest first; entries that could not be undone stay in the file
and are reported, so nothing is forgotten silently.

A state file is data that `faults clear` acts on as root, so before anything is undone the entry
is checked against what shadowtest itself creates (`refusal()`): cgroups named
`shadowtest-<holder pid>-<n>` under the cgroup mount, only the CPU limit files and `cgroup.procs`
written there, toxics reset only through an http(s) API, and only processes of this user whose
start time (/proc/PID/stat field 22) matches the record -- stress processes also started after the
run that recorded them. An entry that fails a check is refused: kept, reported, nothing touched.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from faults import cpu
from faults.cpu import undo_cgroup
from faults.errors import StateError
from faults.process import undo_pause, undo_processes
from faults.state import HOLDER_RE, open_state_dir, proc_start_time, same_process
from wire.registry import Registry

MAX_ENTRIES = 1000                # per holder file; a real run holds a handful
MAX_PROCS = 1024                  # per entry
_LIMIT_FILES = {"cpu.max", "cpu.cfs_quota_us", "cpu.cfs_period_us"}
_LIMIT_VALUE = re.compile(r"(max|-?\d{1,20})( \d{1,20})?")


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


UNDO: Registry[str, Callable[[dict[str, Any]], None]] = Registry("fault kind", {
    "toxic": undo_toxic_leftover,
    "cgroup": undo_cgroup,
    "process": undo_processes,
    "paused": undo_pause,
}, error=StateError)


@dataclass
class Leftover:
    """One fault entry of a run that is no longer alive."""

    file: Path
    holder_pid: int
    entry_id: str
    entry: dict[str, Any]
    holder_start: int | None = None

    def describe(self) -> str:
        e = self.entry
        what = {"toxic": lambda: f"toxic {e.get('toxic')} on proxy {e.get('proxy')} at {e.get('api')}",
                "cgroup": lambda: f"cgroup {e.get('created') or [f.get('path') for f in e.get('files', [])]}",
                "process": lambda: f"processes {[p.get('pid') for p in e.get('procs', [])]} ({e.get('purpose', '')})",
                "paused": lambda: f"paused PID {e.get('pid')}"}.get(e.get("kind", ""), lambda: json.dumps(e)[:200])
        try:
            text = what()
        except (AttributeError, TypeError):      # a malformed entry: shown as it is (bounded)
            text = json.dumps(e, default=str)[:200]
        return f"{e.get('kind')}: {text} (run PID {self.holder_pid})"


@dataclass
class ClearResult:
    cleared: list[Leftover] = field(default_factory=list)
    failed: list[tuple[Leftover, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed


# ---- what an entry may touch ----------------------------------------------------------------------

def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not a whole number")
    return value


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _own_process(pid: Any, start: Any, not_before: int | None) -> str | None:
    """Why (pid, start) must not be signalled, or None when it is ours to signal (or already gone)."""
    pid = _int(pid)
    if pid <= 1:
        return f"PID {pid} is not a process shadowtest starts"
    if start is None:
        return f"PID {pid} has no recorded start time"
    start = _int(start)
    now = proc_start_time(pid)
    if now is None or now != start:
        return None                       # gone, or a reused PID: undo skips it, nothing is signalled
    if _uid_of(pid) != os.geteuid():
        return f"PID {pid} belongs to uid {_uid_of(pid)}, not to you"
    if not_before is not None and start < not_before:
        return f"PID {pid} started before the run that recorded it"
    return None


class _Unsafe(ValueError):
    """An entry names something outside what shadowtest creates."""


def _cgroup_path(value: Any, roots: list[Path]) -> Path:
    """A path that resolves inside the cgroup mount and has no '..' in it; _Unsafe otherwise."""
    if not isinstance(value, str) or not value.startswith("/"):
        raise _Unsafe(f"{value!r} is not an absolute path")
    path = Path(value)
    real = Path(os.path.realpath(value))   # v1 mounts are often links (cpu -> cpu,cpuacct): resolved, then checked
    if ".." in path.parts or not any(real.is_relative_to(r) and real != r for r in roots):
        raise _Unsafe(f"{value} is not inside the cgroup mount {roots[0]}")
    return path


def refusal(left: Leftover) -> str | None:
    """Why this leftover must not be undone (it names something shadowtest did not create), or None."""
    e = left.entry
    try:
        kind = e.get("kind")
        if kind == "toxic":
            url = urlparse(str(e.get("api", "")))
            if url.scheme not in ("http", "https") or not url.hostname:
                return f"toxic API {e.get('api')!r} is not an http(s) URL"
        elif kind == "cgroup":
            roots = [Path(os.path.realpath(cpu.CGROUP_ROOT))]
            created = e.get("created")
            if created is not None:
                path = _cgroup_path(created, roots)
                if not re.fullmatch(rf"shadowtest-{left.holder_pid}-\d{{1,9}}", path.name):
                    return f"cgroup {created} is not named shadowtest-{left.holder_pid}-N (the run's own prefix)"
            for move in e.get("moves", [])[:MAX_PROCS + 1]:
                if _cgroup_path(move.get("back"), roots).name != "cgroup.procs":
                    return f"{move.get('back')} is not a cgroup.procs file"
                why = _own_process(move.get("pid"), move.get("start"), None)
                if why:
                    return why
            for f in e.get("files", []):
                if _cgroup_path(f.get("path"), roots).name not in _LIMIT_FILES:
                    return f"{f.get('path')} is not a CPU limit file ({', '.join(sorted(_LIMIT_FILES))})"
                if not isinstance(f.get("original"), str) or not _LIMIT_VALUE.fullmatch(f["original"]):
                    return f"{f.get('original')!r} is not a CPU limit value"
            if len(e.get("moves", [])) > MAX_PROCS:
                return f"more than {MAX_PROCS} processes"
        elif kind == "process":
            procs = e.get("procs", [])
            if not isinstance(procs, list) or len(procs) > MAX_PROCS:
                return f"procs is not a list of at most {MAX_PROCS} processes"
            for p in procs:
                why = _own_process(p.get("pid"), p.get("start"), left.holder_start)
                if why:
                    return why
        elif kind == "paused":
            return _own_process(e.get("pid"), e.get("start"), None)
        else:
            return f"unknown fault kind {kind!r}"
    except _Unsafe as exc:
        return str(exc)
    except (AttributeError, TypeError, ValueError) as exc:
        return f"malformed entry: {exc}"
    return None


# ---- reading and clearing -------------------------------------------------------------------------

def _order(entry_id: str) -> int:
    return int(entry_id.rsplit("-", 1)[-1]) if entry_id.rsplit("-", 1)[-1].isdigit() else 0


def _holder(name: str, data: dict[str, Any], where: Path) -> tuple[int, int | None, dict[str, Any]]:
    holder, entries = data.get("holder"), data.get("entries", {})
    m = HOLDER_RE.fullmatch(name)
    ok = isinstance(holder, dict) and isinstance(entries, dict) and m is not None \
        and holder.get("pid") == int(m.group(1)) and str(holder.get("start")) == m.group(2) \
        and all(isinstance(v, dict) for v in entries.values()) and len(entries) <= MAX_ENTRIES
    if not ok:
        raise StateError(f"malformed fault state {where}: holder or entries do not match its name "
                         f"(at most {MAX_ENTRIES} entries); inspect it, then delete it")
    assert isinstance(holder, dict)
    start = holder.get("start")
    return int(holder["pid"]), start if isinstance(start, int) and not isinstance(start, bool) else None, entries


def check_leftovers(directory: Path | str | None = None) -> list[Leftover]:
    """Faults recorded by runs that are no longer alive (newest first within a run).

    Raises StateError when the directory is not private or a file in it is not a sound state file."""
    found = []
    d = open_state_dir(directory)
    if d is None:
        return []
    with d:
        for name in d.holder_names():
            pid, start, entries = _holder(name, d.read(name), d.path / name)
            if same_process(pid, start):
                continue  # a live run (maybe a parallel one) still owns these
            for entry_id in sorted(entries, key=_order, reverse=True):
                found.append(Leftover(d.path / name, pid, entry_id, entries[entry_id], start))
    return found


def clear_leftovers(directory: Path | str | None = None) -> ClearResult:
    """Undo every leftover; files are removed once empty, failures (and refusals) stay recorded and are returned."""
    result = ClearResult()
    remaining: dict[Path, dict[str, Any]] = {}
    for left in check_leftovers(directory):
        why = refusal(left)
        try:
            if why is not None:
                raise StateError(f"refused, nothing touched: {why} (not something shadowtest created; "
                                 f"delete {left.file} if you did not write it)")
            UNDO[str(left.entry["kind"])](left.entry)
            result.cleared.append(left)
        except Exception as exc:  # noqa: BLE001 - report every failure, keep going with the rest
            result.failed.append((left, f"{type(exc).__name__}: {exc}"))
            remaining.setdefault(left.file, {})[left.entry_id] = left.entry
    touched = {left.file for left in result.cleared} | set(remaining)
    if not touched:
        return result
    d = open_state_dir(directory)
    if d is None:
        return result
    with d:
        for path in touched:
            if path in remaining:
                data = d.read(path.name)
                data["entries"] = remaining[path]
                d.write(path.name, data)
            else:
                d.unlink(path.name)
    return result
