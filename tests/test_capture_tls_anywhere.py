"""TLS read wherever the process finds its OpenSSL: a container's own copy of libssl, a process that starts
after the recorder, and the per-process report (`record --list-tls`) of what is read and why not.

A "container" here is nginx in its own mount namespace (`unshare -m`) with a copy of libssl.so.3
bind-mounted over the system path: the same bytes, another file (inode), so probes on the host's libssl
never fire for it. The recorder must find the copy through the process's maps and root, probe it, and
record the calls nginx logged, credentials masked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from capture.backends import RecordOptions
from capture.ebpf.tls import find_libssl
from capture.ebpf.tlslibs import Inspector
from capture.record import Recorder
from capture.recording import Recording
from tests.test_capture_tls import TOKEN_CURL, Nginx, _calls, _curl, _file_bytes
from wire.process import spawn

pytestmark = [pytest.mark.root, pytest.mark.ebpf,
              pytest.mark.skipif(shutil.which("nginx") is None or shutil.which("curl") is None,
                                 reason="needs nginx and curl (apt-get install nginx curl; scripts/setup.sh does)"),
              pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)"),
              pytest.mark.skipif(find_libssl() is None, reason="no system libssl.so.3")]

REPO = Path(__file__).resolve().parents[1]


def in_own_mount_ns(copy: Path) -> Callable[[list[str]], list[str]]:
    """argv -> the same command in a new mount namespace where `copy` is bind-mounted over the system libssl."""
    libssl = find_libssl()
    assert libssl is not None

    def wrap(argv: list[str]) -> list[str]:
        script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(copy), libssl, *argv]
    return wrap


@pytest.fixture
def libssl_copy(tmp_path: Path) -> Path:
    libssl = find_libssl()
    assert libssl is not None
    copy = tmp_path / "container-libssl.so.3"
    shutil.copy2(libssl, copy)
    return copy


@pytest.fixture
def nginxes() -> Iterator[list[Nginx]]:
    started: list[Nginx] = []
    yield started
    for n in started:
        n.stop()


def _own_libssl(pid: int, copy: Path) -> str:
    """The libssl path process `pid` maps, checked to be the copy (not the host's file)."""
    proc = Inspector().process(pid)
    (f,) = [f for f in proc.files if f.kind == "openssl"]
    assert f.ino == copy.stat().st_ino and f.ino != os.stat(str(find_libssl())).st_ino, proc
    return f.path


def test_a_containers_own_libssl_is_found_and_read_before_and_after_the_recorder_starts(
        tmp_path: Path, libssl_copy: Path, nginxes: list[Nginx]) -> None:
    (tmp_path / "before").mkdir()
    before = Nginx(tmp_path / "before", in_own_mount_ns(libssl_copy))
    nginxes.append(before)
    seen_path = _own_libssl(before.proc.pid, libssl_copy)
    out = tmp_path / "containers.rec"
    rec = Recorder(RecordOptions(output=str(out), port=before.port)).start()
    try:
        _curl(before)
        logged = before.log_lines()
        before.stop()
        nginxes.remove(before)
        (tmp_path / "after").mkdir()     # the same port, a process started while recording
        after = Nginx(tmp_path / "after", in_own_mount_ns(libssl_copy), port=before.port)
        nginxes.append(after)
        time.sleep(2.5)                  # the recorder inspects new processes every second
        _curl(after)
        time.sleep(0.3)
    finally:
        rec.stop()
    logged += after.log_lines()
    with Recording(out) as r:
        tls = r.meta["tls"]
    assert isinstance(tls, dict) and tls["capture"] == "on", tls
    copies = [lib for lib in tls["libraries"] if lib["inode"] == libssl_copy.stat().st_ino]
    assert len(copies) == 1 and copies[0]["attached"] is True and copies[0]["path"] == seen_path, tls["libraries"]
    assert {before.proc.pid, after.proc.pid} <= set(copies[0]["pids"]) or copies[0]["processes"] >= 2, copies
    calls = _calls(out)
    got = sorted((c.method, c.status) for c in calls)
    assert got == sorted(logged) and len(got) == 6, (got, logged)
    auth = [v for c in calls for k, v in c.request_metadata if k.lower() == "authorization"]
    assert len(auth) == 6 and not any(TOKEN_CURL in v for v in auth), auth
    assert TOKEN_CURL.encode() not in _file_bytes(out)


def test_list_tls_names_what_each_process_runs(tmp_path: Path, libssl_copy: Path, nginxes: list[Nginx]) -> None:
    (tmp_path / "ns").mkdir()
    n = Nginx(tmp_path / "ns", in_own_mount_ns(libssl_copy))
    nginxes.append(n)
    path = _own_libssl(n.proc.pid, libssl_copy)
    out = subprocess.run([sys.executable, "-m", "harness.cli", "record", "--list-tls", "--port", str(n.port),
                          "--json"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["processes"]
    assert {r["pid"] for r in rows} >= {n.proc.pid}, rows
    mine = next(r for r in rows if r["pid"] == n.proc.pid)
    assert mine["verdict"].startswith(f"read: openssl {path}"), mine
    (f,) = [f for f in mine["files"] if f["kind"] == "openssl"]
    assert f["ino"] == libssl_copy.stat().st_ino and f["attach_path"].startswith(f"/proc/{n.proc.pid}/")
    text = subprocess.run([sys.executable, "-m", "harness.cli", "record", "--list-tls", "--pid", str(n.proc.pid)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert text.returncode == 0 and f"{n.proc.pid}" in text.stdout and "read: openssl" in text.stdout, text.stdout
    doctor = subprocess.run([sys.executable, "-m", "harness.cli", "doctor", "--json", "--pid", str(n.proc.pid)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert json.loads(doctor.stdout)["process"]["verdict"] == mine["verdict"], doctor.stdout[-2000:]


def test_list_tls_names_node_as_read_and_grpcio_as_not_read_with_the_reason(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("needs node")
    proc = spawn([node, "-e", "require('https');setInterval(()=>{},1000);console.log('ready')"],
                 stdout=subprocess.PIPE, stderr=None, text=True)
    py = spawn([sys.executable, "-c", "import grpc, ssl, sys; print('ready', flush=True); sys.stdin.read()"],
               stdout=subprocess.PIPE, stdin=subprocess.PIPE, stderr=None, text=True, cwd=str(REPO))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert py.stdout is not None and py.stdout.readline().strip() == "ready"
        outs = [subprocess.run([sys.executable, "-m", "harness.cli", "record", "--list-tls", "--pid", str(p.pid), "--json"],
                               capture_output=True, text=True, timeout=60, cwd=REPO) for p in (proc, py)]
    finally:
        proc.kill()
        proc.wait(10)
        py.kill()
        py.wait(10)
    assert all(out.returncode == 0 for out in outs), [out.stderr for out in outs]
    rows = {r["pid"]: r for out in outs for r in json.loads(out.stdout)["processes"]}
    assert rows[proc.pid]["verdict"] == f"read: node {os.path.realpath(node)}", rows[proc.pid]
    kinds = {f["kind"] for f in rows[py.pid]["files"]}
    assert kinds == {"openssl", "boringssl-static"}, rows[py.pid]
    assert any("BoringSSL linked statically into cygrpc" in f["why_not"] for f in rows[py.pid]["files"])


def test_list_tls_names_a_jvm_as_not_read_with_the_reason(tmp_path: Path) -> None:
    """A JVM's TLS is JSSE (Java code): named, never guessed. The "JVM" is a process that maps a shared
    library named libjvm.so (a copy of zlib: the name is what the inspection goes by)."""
    import ctypes.util

    zlib = ctypes.util.find_library("z")
    assert zlib is not None
    found = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    src = next(line.split(" => ")[1] for line in found.splitlines() if line.strip().startswith(zlib))
    jvm = tmp_path / "lib" / "server" / "libjvm.so"
    jvm.parent.mkdir(parents=True)
    shutil.copy2(src, jvm)
    proc = spawn([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print('ready', "
                  "flush=True); sys.stdin.read()", str(jvm)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                 stderr=None, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        out = subprocess.run([sys.executable, "-m", "harness.cli", "record", "--list-tls", "--pid", str(proc.pid),
                              "--json"], capture_output=True, text=True, timeout=60, cwd=REPO)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["processes"]
    java = [f for f in row["files"] if f["kind"] == "java-jsse"]
    assert len(java) == 1 and java[0]["path"] == str(jvm) and not java[0]["readable"], row
    assert "JSSE" in java[0]["why_not"] and "plaintext side" in java[0]["why_not"]
