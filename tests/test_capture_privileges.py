"""The eBPF recorder with least privilege: an unprivileged user holding exactly the capabilities
capture/privileges.py names records nginx's HTTPS calls in plaintext into a file it owns (0600); with
fewer, it refuses in one line that names what is missing."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture import privileges
from capture.ebpf.tls import find_libssl
from capture.recording import Recording
from tests.test_capture_tls import TOKEN_CURL, Nginx, _curl, _wait_started
from tests.test_capture_tls_anywhere import in_own_mount_ns
from wire.process import spawn

REPO = Path(__file__).resolve().parents[1]
SETPRIV = shutil.which("setpriv")


def test_missing_capabilities_are_read_from_the_effective_set() -> None:
    status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000000c000080004\nCapBnd:\t000001ffffffffff\n"
    have = privileges.effective(status)
    assert have == 0xC000080004                          # BPF (39), PERFMON (38), SYS_PTRACE (19), DAC_READ_SEARCH (2)
    assert privileges.missing(privileges.RECORDER, have) == []
    assert privileges.missing(privileges.RECORDER + privileges.TLS, have) == ["CAP_DAC_OVERRIDE"]
    assert privileges.missing(privileges.RECORDER, 1 << 39) == ["CAP_PERFMON", "CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE"]
    line = privileges.refusal("the ebpf backend", ["CAP_BPF"], privileges.RECORDER)
    assert "\n" not in line and "lacks CAP_BPF" in line and "setcap cap_bpf,cap_perfmon" in line


root_only = [pytest.mark.root, pytest.mark.ebpf,
             pytest.mark.skipif(SETPRIV is None, reason="needs setpriv (util-linux)"),
             pytest.mark.skipif(shutil.which("nginx") is None or shutil.which("curl") is None,
                                reason="needs nginx and curl (scripts/setup.sh installs them)"),
             pytest.mark.skipif(find_libssl() is None, reason="no system libssl.so.3")]


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A directory only `nobody` may write (pytest's own tmp dirs are root's, mode 0700)."""
    d = Path(tempfile.mkdtemp(prefix="shadowtest-nobody-"))
    os.chown(d, pwd.getpwnam("nobody").pw_uid, -1)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Nginx]:
    n = Nginx(tmp_path)
    yield n
    n.stop()


def _as_nobody(caps: tuple[str, ...], argv: list[str]) -> list[str]:
    spec = ",".join("+" + c.removeprefix("CAP_").lower() for c in caps)
    return [str(SETPRIV), "--reuid=nobody", "--regid=nogroup", "--clear-groups", f"--inh-caps={spec}",
            f"--ambient-caps={spec}", *argv]


def _record_as_nobody(nginx: Nginx, out: Path) -> dict[str, object]:
    """`record --tls on` of nginx's port as nobody with exactly the recorder's capabilities, around three
    curl calls; its JSON summary."""
    argv = [sys.executable, "-m", "harness.cli", "record", "--port", str(nginx.port), "--tls", "on",
            "--duration", "60", "--json", "-o", str(out)]
    rec = spawn(_as_nobody(privileges.RECORDER + privileges.TLS, argv), cwd=str(REPO),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_started(out, rec)
        time.sleep(1.0)
        _curl(nginx)
        time.sleep(0.5)
    finally:
        rec.send_signal(signal.SIGINT)
        stdout, stderr = rec.communicate(timeout=60)
    assert rec.returncode == 0, stderr[-2000:]
    return dict(json.loads(stdout))


@pytest.mark.parametrize("_", [pytest.param(0, marks=root_only)])
def test_an_unprivileged_user_with_the_named_capabilities_records_https(_: int, nginx: Nginx,
                                                                       nobody_dir: Path) -> None:
    out = nobody_dir / "https.rec"
    result = _record_as_nobody(nginx, out)
    assert result["calls"] == 3 and result["tls"]["capture"] == "on", result
    st = out.stat()
    assert st.st_uid == pwd.getpwnam("nobody").pw_uid and stat.S_IMODE(st.st_mode) == 0o600
    with Recording(out) as r:
        got = sorted((c.method, c.status) for c in r.calls())
    assert got == sorted(nginx.log_lines()), got
    assert TOKEN_CURL.encode() not in out.read_bytes()


@pytest.mark.parametrize("_", [pytest.param(0, marks=root_only)])
def test_with_the_named_capabilities_a_containers_own_libssl_is_read(_: int, tmp_path: Path,
                                                                     nobody_dir: Path) -> None:
    """A library in another mount namespace is probed as /proc/PID/root/usr/lib/x86_64-linux-gnu/libssl.so.3.
    Without CAP_SYS_ADMIN bcc adds the uprobe through tracefs under an event name made from that path,
    which the kernel refused as too long: every call of a container's TLS service was lost to a recorder
    with least privilege (a DaemonSet's) while root recorded it."""
    copy = tmp_path / "container-libssl.so.3"
    shutil.copy2(str(find_libssl()), copy)
    n = Nginx(tmp_path, in_own_mount_ns(copy))
    try:
        result = _record_as_nobody(n, nobody_dir / "container.rec")
        logged = n.log_lines()
    finally:
        n.stop()
    tls = result["tls"]
    assert isinstance(tls, dict)
    (lib,) = [lib for lib in tls["libraries"] if lib["inode"] == copy.stat().st_ino]
    assert lib["attached"] is True and lib["why_not"] == "", lib
    assert result["calls"] == 3 and len(logged) == 3, (result["calls"], logged)


@pytest.mark.parametrize("_", [pytest.param(0, marks=root_only)])
def test_without_the_capabilities_the_recorder_refuses_in_one_line(_: int, nobody_dir: Path) -> None:
    argv = [sys.executable, "-m", "harness.cli", "record", "--port", "1", "--duration", "1",
            "-o", str(nobody_dir / "x.rec")]
    done = subprocess.run(_as_nobody(("CAP_BPF", "CAP_PERFMON"), argv), cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "lacks CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE" in lines[0], lines[0]
    assert not (nobody_dir / "x.rec").exists()
