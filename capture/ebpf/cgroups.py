"""`--cgroup DIR`: which processes a cgroup directory holds, itself and the cgroups under it.

A pod's processes are not in the pod's cgroup but in one child per container (kubepods-...-pod<UID>.slice/
cri-containerd-<id>.scope), a systemd service's may be in children too: recording "the pod" means
recording every cgroup under its directory. In the kernel, cgroup v2 is matched with
bpf_current_task_under_cgroup() against the directory (capture/ebpf/loader.py); cgroup v1 has no such
test, so its member processes are listed here and kept in a map, refreshed every second.
"""

from __future__ import annotations

from pathlib import Path

from capture.errors import CaptureError

MAX_CGROUPS = 4096     # directories walked under DIR at most: a cgroup tree is hostile input too


def is_v2(path: Path) -> bool:
    """Whether `path` is a directory of the cgroup v2 (unified) hierarchy."""
    return (path / "cgroup.controllers").exists()


def members(path: Path) -> set[int]:
    """The processes of cgroup `path` and of every cgroup under it. One line (CaptureError) when `path`
    itself cannot be read; a child that vanishes while walked is skipped."""
    try:
        pids = {int(x) for x in (path / "cgroup.procs").read_text().split()}
    except (OSError, ValueError) as exc:
        raise CaptureError(f"cannot read {path}/cgroup.procs: {getattr(exc, 'strerror', None) or exc}") from exc
    for walked, procs in enumerate(path.glob("*/**/cgroup.procs")):
        if walked >= MAX_CGROUPS:
            break
        try:
            pids.update(int(x) for x in procs.read_text().split())
        except (OSError, ValueError):
            continue
    return pids
