"""`record --cgroup DIR` records the processes of DIR and of every cgroup under it, and nothing else.

A pod's processes sit one level down (a cgroup per container under the pod's), so a filter on the
directory alone recorded nothing of them. Here a "pod" cgroup holds a "container" cgroup holding one HTTP
server; a second server outside it is called too. Both hierarchies where the host has them: cgroup v2
(matched in the kernel) and cgroup v1 (member processes in a map).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture.backends import RecordOptions
from capture.record import Recorder
from capture.recording import Recording
from wire.process import end_child, free_port, spawn

pytestmark = [pytest.mark.root, pytest.mark.ebpf,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, eBPF)")]


def _mount(kind: str) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (kind "v2"), or a v1 hierarchy ("v1")."""
    for line in Path("/proc/mounts").read_text().splitlines():
        _dev, where, fstype, opts = line.split()[:4]
        if kind == "v2" and fstype == "cgroup2":
            return Path(where)
        if kind == "v1" and fstype == "cgroup" and "cpu" in opts.split(","):
            return Path(where)
    return None


@pytest.fixture(params=["v2", "v1"])
def pod(request: pytest.FixtureRequest) -> Iterator[Path]:
    mount = _mount(request.param)
    if mount is None:
        pytest.skip(f"no cgroup {request.param} hierarchy mounted here")
    top = mount / f"shadowtest-test-pod-{os.getpid()}"
    (top / "container").mkdir(parents=True)
    yield top
    for d in (top / "container", top):       # emptied by then: the servers have exited
        for _ in range(50):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _server(port: int, root: Path) -> subprocess.Popen[bytes]:
    proc = spawn([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(root)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("http.server did not answer within 10 s")


def test_a_cgroup_and_the_cgroups_under_it_are_recorded_and_nothing_else(pod: Path, tmp_path: Path) -> None:
    inside_port, outside_port = free_port(), free_port()
    inside = _server(inside_port, tmp_path)
    outside = _server(outside_port, tmp_path)
    try:
        (pod / "container" / "cgroup.procs").write_text(str(inside.pid))
        out = tmp_path / "pod.rec"
        rec = Recorder(RecordOptions(output=str(out), cgroup=str(pod))).start()
        try:
            time.sleep(1.2)                        # a cgroup v1's members are refreshed every second
            for i in range(3):
                for port, who in ((inside_port, "in"), (outside_port, "out")):
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/{who}-{i}", timeout=5).read()
                    except urllib.error.HTTPError as exc:    # 404: the path is the marker, not the file
                        assert exc.code == 404
            time.sleep(0.5)
        finally:
            rec.stop()
    finally:
        for proc in (inside, outside):
            end_child(proc)
    with Recording(out) as r:
        got = sorted(c.method or "" for c in r.calls())
    assert got == [f"GET /in-{i}" for i in range(3)], got
