"""CPU faults: competing load pinned to the target's CPUs, and a cgroup CPU quota on the target.

Contention methods are registered by name behind one small protocol (`ContentionMethod.argv`):
"stress-ng" (`--cpu N --cpu-load P --taskset CPUS`) when installed, "builtin" (python busy workers,
`faults.busy`) otherwise. Quota: cgroup v1 `cpu.cfs_quota_us` or v2 `cpu.max`. The target is moved
into a child cgroup that we create (nested under its own, so existing limits still hold) and moved
back afterwards; or, with `cgroup_dir=`, an existing cgroup's limit is changed in place and the
original value written back. Either way the state file records what to undo before anything changes.

Workers get their own process group (so they can be killed as one) but stay in the caller's
session: with the kernel's autogroup scheduling (sched_autogroup_enabled=1), CFS shares CPU
between *sessions* first, so workers in a new session would only take one session's share.
Start the target from the same session (as `faults.process.OwnedProcess` does) for full effect.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from faults.errors import CpuFaultError
from faults.process import _comm, kill_recorded
from faults.state import FaultRegistry, default_registry, proc_start_time, same_process
from wire.process import spawn
from wire.registry import Registry

CGROUP_ROOT = Path("/sys/fs/cgroup")
_ids = itertools.count(1)


class ContentionMethod(Protocol):
    """How to burn CPU: the command lines of the worker processes to start."""

    def argv(self, workers: int, load_pct: int, cpus: list[int], seconds: float) -> list[list[str]]: ...


class StressNg:
    def argv(self, workers: int, load_pct: int, cpus: list[int], seconds: float) -> list[list[str]]:
        return [["stress-ng", "--cpu", str(workers), "--cpu-load", str(load_pct), "--taskset",
                 ",".join(map(str, cpus)), "--timeout", f"{max(1, int(seconds))}s", "--quiet"]]


class Builtin:
    def argv(self, workers: int, load_pct: int, cpus: list[int], seconds: float) -> list[list[str]]:
        return [[sys.executable, "-m", "faults.busy", "--load", str(load_pct), "--cpu", str(cpus[i % len(cpus)]),
                 "--seconds", str(seconds)] for i in range(workers)]


METHODS: Registry[str, ContentionMethod] = Registry("contention method", {"stress-ng": StressNg(), "builtin": Builtin()},
                                                   error=CpuFaultError)


def pick_method(method: str = "auto") -> str:
    """"auto" -> "stress-ng" when on PATH, else "builtin"."""
    if method == "auto":
        return "stress-ng" if shutil.which("stress-ng") else "builtin"
    if method not in METHODS:
        raise CpuFaultError(f"unknown contention method {method!r}; use one of auto, {', '.join(METHODS.names())}")
    return method


@dataclass
class Contention:
    """Competing load in effect."""

    method: str
    workers: int
    load_pct: int
    cpus: list[int]
    pids: list[int] = field(default_factory=list)
    started_at: float = 0.0
    start_cpu_s: float = 0.0      # what the workers had burned when they had all started

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the workers and every process under them have used so far,
        reaped children included. Read it before the workers are killed."""
        return sum(tree_cpu_seconds(pid) for pid in self.pids)

    def asked_cores(self) -> float:
        """Cores' worth of CPU asked for: workers x load, at most the CPUs they are pinned to."""
        return min(float(len(self.cpus)), self.workers * self.load_pct / 100.0)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its descendants (live ones, and those it reaped); 0 when
    it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + (t.children_user + t.children_system if p is root else 0.0)
    return total


@contextlib.contextmanager
def cpu_contention(target_pid: int | None = None, workers: int | None = None, load_pct: int = 100,
                   cpus: list[int] | None = None, method: str = "auto", max_seconds: float = 3600,
                   registry: FaultRegistry | None = None) -> Iterator[Contention]:
    """Run `workers` CPU burners at `load_pct`% pinned to `cpus` (default: the target's allowed CPUs).

    The workers stop on exit, or by themselves after `max_seconds` (a last line of defence).
    Raises CpuFaultError when the workers cannot start.
    """
    if not 1 <= load_pct <= 100:
        raise CpuFaultError(f"load_pct must be 1..100, got {load_pct}")
    cpu_list = sorted(cpus if cpus is not None else os.sched_getaffinity(target_pid or 0))
    n = workers or len(cpu_list)
    name = pick_method(method)
    info = Contention(name, n, load_pct, cpu_list)
    reg = registry or default_registry()
    with reg.hold("process", lambda e: kill_recorded(e.get("procs", []), signal.SIGKILL),
                  purpose="cpu_contention", method=name, procs=[]) as entry_id:
        procs = []
        for argv in METHODS[name].argv(n, load_pct, cpu_list, max_seconds):
            try:
                p = spawn(argv, session=False)   # the target's session: see spawn
            except OSError as exc:
                raise CpuFaultError(f"cannot start {argv[0]}: {exc} (install stress-ng or use method='builtin')") from exc
            procs.append({"pid": p.pid, "start": proc_start_time(p.pid), "group": True, "comm": _comm(p.pid)})
            reg.update(entry_id, procs=procs)
            info.pids.append(p.pid)
        info.started_at = time.monotonic()
        info.start_cpu_s = info.cpu_seconds()
        yield info


# --- cgroup quota ------------------------------------------------------------------------------

def cgroup_version(root: Path = CGROUP_ROOT) -> int:
    """1 when the v1 cpu controller is mounted at root/cpu, 2 for a unified hierarchy, else 0."""
    if (root / "cpu" / "cpu.cfs_quota_us").exists():
        return 1
    if (root / "cgroup.controllers").exists():
        return 2
    return 0


def _own_cgroup(pid: int, version: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if version == 2 and hid == "0":
            return path
        if version == 1 and "cpu" in controllers.split(","):
            return path
    raise CpuFaultError(f"PID {pid} has no {'cpu' if version == 1 else 'unified'} cgroup")


def _mount(version: int, root: Path) -> Path:
    return root / "cpu" if version == 1 else root


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise CpuFaultError(f"cannot write {value!r} to {path}: {exc} (needs root and a writable cgroup fs)") from exc


def _limit_files(version: int, cg: Path, quota_us: int, period_us: int) -> list[tuple[Path, str]]:
    if version == 1:
        return [(cg / "cpu.cfs_period_us", str(period_us)), (cg / "cpu.cfs_quota_us", str(quota_us))]
    return [(cg / "cpu.max", f"{quota_us} {period_us}")]


def undo_cgroup(entry: dict[str, Any]) -> None:
    """Undo a "cgroup" entry: put moved processes back, restore file values, remove our cgroup."""
    for move in entry.get("moves", []):
        if same_process(int(move["pid"]), move.get("start")):
            with contextlib.suppress(OSError):
                Path(move["back"]).write_text(str(move["pid"]))
    for f in reversed(entry.get("files", [])):
        with contextlib.suppress(OSError):
            Path(f["path"]).write_text(f["original"])
    created = entry.get("created")
    if created and Path(created).exists():
        for _ in range(50):  # the kernel empties a cgroup asynchronously after the last move
            try:
                Path(created).rmdir()
                return
            except OSError as exc:
                err = exc
                time.sleep(0.02)
        raise CpuFaultError(f"cannot remove cgroup {created}: {err} (processes still inside? "
                            "`shadowtest faults clear` retries)")


def _read_original(path: Path) -> str:
    text = path.read_text().strip()
    return text


@dataclass
class Quota:
    """A CPU quota in effect: `cpus` CPUs' worth of time per period, in cgroup `path`."""

    pid: int | None
    cpus: float
    quota_us: int
    period_us: int
    version: int
    path: str

    def throttling(self) -> dict[str, int] | None:
        """The cgroup's throttling counters so far: periods, periods throttled, time throttled (us);
        None when cpu.stat cannot be read. (v2 `throttled_usec`; v1 `throttled_time` in ns.)"""
        return read_throttling(Path(self.path))


def read_throttling(cg: Path) -> dict[str, int] | None:
    """`nr_periods`, `nr_throttled` and `throttled_us` from `cg`/cpu.stat, or None."""
    try:
        lines = (cg / "cpu.stat").read_text().splitlines()
    except OSError:
        return None
    raw = {k: int(v) for k, _, v in (line.partition(" ") for line in lines) if v.strip().isdigit()}
    if "nr_throttled" not in raw:
        return None
    us = raw["throttled_usec"] if "throttled_usec" in raw else raw.get("throttled_time", 0) // 1000
    return {"nr_periods": raw.get("nr_periods", 0), "nr_throttled": raw["nr_throttled"], "throttled_us": us}


@contextlib.contextmanager
def cpu_quota(pid: int | None = None, cpus: float = 0.5, period_us: int = 100_000, cgroup_dir: str | None = None,
              registry: FaultRegistry | None = None, root: Path = CGROUP_ROOT) -> Iterator[Quota]:
    """Limit `pid` (moved into a new child cgroup) or an existing `cgroup_dir` to `cpus` CPUs.

    Raises CpuFaultError without cgroup support or privileges; whatever was changed is undone.
    """
    version = cgroup_version(root)
    if version == 0:
        raise CpuFaultError(f"no cgroup cpu controller under {root} (mount cgroup v1 cpu or cgroup2)")
    if (pid is None) == (cgroup_dir is None):
        raise CpuFaultError("give exactly one of pid= or cgroup_dir=")
    quota_us = max(1000, int(cpus * period_us))
    reg = registry or default_registry()
    if cgroup_dir is not None:
        cg = Path(cgroup_dir)
        files = [(p, v) for p, v in _limit_files(version, cg, quota_us, period_us)]
        originals = [{"path": str(p), "original": _read_original(p)} for p, _ in files]
        with reg.hold("cgroup", undo_cgroup, version=version, files=originals):
            for p, v in files:
                _write(p, v)
            yield Quota(None, cpus, quota_us, period_us, version, str(cg))
        return
    assert pid is not None
    yield from _quota_moved(pid, cpus, quota_us, period_us, version, root, reg)


def _quota_moved(pid: int, cpus: float, quota_us: int, period_us: int, version: int, root: Path,
                 reg: FaultRegistry) -> Iterator[Quota]:
    start = proc_start_time(pid)
    if start is None:
        raise CpuFaultError(f"cannot limit PID {pid}: no such process")
    mount = _mount(version, root)
    own = _own_cgroup(pid, version)
    parent = mount / own.lstrip("/") if version == 1 else mount
    cg = parent / f"shadowtest-{os.getpid()}-{next(_ids)}"
    back = mount / own.lstrip("/") / "cgroup.procs"
    with reg.hold("cgroup", undo_cgroup, version=version, created=str(cg),
                  moves=[{"pid": pid, "start": start, "back": str(back)}]):
        try:
            cg.mkdir()
        except OSError as exc:
            raise CpuFaultError(f"cannot create cgroup {cg}: {exc} (needs root)") from exc
        if version == 2:
            with contextlib.suppress(CpuFaultError):
                _write(mount / "cgroup.subtree_control", "+cpu")
        for p, v in _limit_files(version, cg, quota_us, period_us):
            _write(p, v)
        _write(cg / "cgroup.procs", str(pid))
        yield Quota(pid, cpus, quota_us, period_us, version, str(cg))
