"""The recorder as a node agent: deploy/recorder/daemonset.yaml agrees with the recorder, and the image
deploy/recorder/Containerfile builds (from a Debian root filesystem made by debootstrap: no registry is
reachable here) and, run with the DaemonSet's own arguments and capabilities, records a process on the host.

The image test is slow (debootstrap, an image build: ~2 minutes) and needs root, podman, debootstrap and the
network to Debian's mirror (scripts/setup.sh installs the tools); where the mirror cannot be reached it is
skipped and says so. A build or a run that fails is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from capture import privileges
from capture.ebpf.tls import find_libssl
from capture.recording import Recording
from tests.polling import recording_meta, wait_for
from tests.test_capture_bounded import ALERT, _post
from tests.test_capture_tls import TOKEN_CURL, Nginx, _curl
from wire.process import free_port, spawn

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "deploy" / "recorder" / "daemonset.yaml"
MIRROR = "http://deb.debian.org/debian"
PACKAGE_FILES = ("pyproject.toml", "README.md", "capture", "replay", "faults", "harness", "agent_under_test", "wire")


def _pod() -> dict[str, Any]:
    """The DaemonSet's pod spec."""
    doc = yaml.safe_load(MANIFEST.read_text())
    assert doc["kind"] == "DaemonSet"
    return dict(doc["spec"]["template"]["spec"])


def _container() -> dict[str, Any]:
    (container,) = _pod()["containers"]
    return dict(container)


def test_the_daemonset_asks_for_the_recorders_capabilities_and_mounts_and_its_args_parse() -> None:
    import click

    from capture.ring import parse_window
    from harness.cli import cli

    pod = _pod()
    (container,) = pod["containers"]
    sc = container["securityContext"]
    wanted = [c.removeprefix("CAP_") for c in privileges.RECORDER + privileges.TLS]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": wanted}, sc   # exactly these: drift fails here
    assert not sc.get("privileged") and pod["hostPID"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/sys/kernel/tracing", "/sys/kernel/debug", "/sys/fs/bpf", "/host/lib/modules", "/out"} <= mounts
    args = container["args"]
    assert args[0] == "record"
    record = cli.commands["record"]
    env = {"$(POD_IP)": "10.0.0.7", "$(NODE_NAME)": "node-1"}
    parsed = list(args[1:])
    for k, v in env.items():
        parsed = [a.replace(k, v) for a in parsed]
    ctx = record.make_context("record", parsed)         # unknown options or bad values raise here
    assert ctx.params["trigger_listen"] == "10.0.0.7:9099" and ctx.params["output"] == "/out/node-1", ctx.params
    assert parse_window(ctx.params["ring"]) == 600.0
    with pytest.raises(click.NoSuchOption):            # what the check above would meet after a rename
        record.make_context("record", ["--ring-minutes", "10"])


def _can(*tools: str) -> bool:
    return all(shutil.which(t) for t in tools)


image_marks = [pytest.mark.slow, pytest.mark.root, pytest.mark.ebpf,
               pytest.mark.skipif(os.geteuid() != 0, reason="needs root (podman build and run)"),
               pytest.mark.skipif(not _can("podman", "debootstrap"),
                                  reason="needs podman and debootstrap (scripts/setup.sh installs them)"),
               pytest.mark.skipif(not _can("nginx", "curl"), reason="needs nginx and curl (scripts/setup.sh)"),
               pytest.mark.skipif(find_libssl() is None, reason="no system libssl.so.3")]


def _run(argv: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def _podman() -> list[str]:
    # crun refuses a host whose cgroups are mounted v1 and v2 side by side ("hybrid"); runc runs there
    return ["podman", "--runtime", "runc"] if shutil.which("runc") else ["podman"]


def _remove_stale_images() -> None:
    """Images an earlier run made and could not remove (it was killed): tagged with a PID now gone."""
    listed = _run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"], timeout=60)
    for ref in listed.stdout.split():
        repo, _, tag = ref.rpartition(":")
        if repo in (f"localhost/shadowtest-{k}-test" for k in ("recorder", "bookworm")) and tag.isdigit() \
                and not Path(f"/proc/{tag}").exists():
            _run(["podman", "rmi", "-f", ref], timeout=120)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _remove_stale_images()
    work = tmp_path_factory.mktemp("image")
    tag = f"localhost/shadowtest-recorder-test:{os.getpid()}"
    base = f"localhost/shadowtest-bookworm-test:{os.getpid()}"
    made: list[str] = []
    try:
        rootfs = work / "rootfs"
        boot = _run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), MIRROR], timeout=600)
        if boot.returncode != 0:
            pytest.skip(f"debootstrap could not make a bookworm root filesystem from {MIRROR}: "
                        f"{(boot.stdout + boot.stderr).strip().splitlines()[-1:]}")
        tar = spawn(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE, stderr=None)
        imported = _run(["podman", "import", "-q", "-", base], timeout=300, stdin=tar.stdout)
        tar.wait(60)
        assert imported.returncode == 0, imported.stderr[-2000:]
        made.append(base)
        shutil.rmtree(rootfs)
        # the build cannot reach PyPI through this host's TLS-intercepting proxy: the wheels are made here
        # and mounted, as the Containerfile's comment tells air-gapped users to do
        # (from a copy of the sources: building in the checkout would leave build/ there)
        src = work / "src"
        for part in PACKAGE_FILES:
            if (REPO / part).is_dir():
                shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                src.mkdir(exist_ok=True)
                shutil.copy2(REPO / part, src / part)
        wheels = work / "wheels"
        built = _run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(wheels), "-c",
                      str(REPO / "constraints.txt"), str(src), "setuptools>=68"], timeout=600)
        assert built.returncode == 0, built.stderr[-2000:]
        build = _run(["podman", "build", "-q", "--layers=false", "--isolation", "chroot", "--network", "host",
                      "--volume", f"{wheels}:/wheels:ro",
                      "--build-arg", "PIP_OPTIONS=--no-index --find-links /wheels", "--build-arg", f"BASE={base}",
                      "-f", str(REPO / "deploy" / "recorder" / "Containerfile"), "-t", tag, str(REPO)],
                     timeout=900)
        assert build.returncode == 0, (build.stdout + build.stderr)[-3000:]
        made.append(tag)
        yield tag
    finally:
        for name in reversed(made):
            _run(["podman", "rmi", "-f", name], timeout=120)


def _volumes(out: Path) -> list[str]:
    """The DaemonSet's mounts as podman -v arguments, its output directory replaced by `out`: the node's
    kernel headers under /host (the entrypoint links them), tracefs, bpffs, the cgroup tree."""
    pod = _pod()
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    (container,) = pod["containers"]
    argv = []
    for m in container["volumeMounts"]:
        src = str(out) if m["mountPath"] == "/out" else host[m["name"]]
        if Path(src).exists():
            argv += ["-v", f"{src}:{m['mountPath']}" + (":ro" if m.get("readOnly") else "")]
    return argv


def _limits() -> list[str]:
    # Without CAP_SYS_RESOURCE (this sandbox has none) a container may not be given limits above ours,
    # and podman's defaults are higher: ask for lower ones.
    return ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


@pytest.mark.parametrize("_", [pytest.param(0, marks=image_marks)])
def test_the_image_holds_the_core_install_only(_: int, image: str) -> None:
    probe = ("import importlib.util as u; print([m for m in ('torch', 'numpy', 'locust', 'matplotlib', 'redis')"
             " if u.find_spec(m)], bool(u.find_spec('bcc')), bool(u.find_spec('scapy')))")
    done = _run([*_podman(), "run", "--rm", *_limits(), "--entrypoint", "/opt/shadowtest/bin/python", image,
                 "-c", probe], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]", "True", "True"], done.stdout


@pytest.mark.parametrize("_", [pytest.param(0, marks=image_marks)])
def test_the_entrypoint_links_the_hosts_kernel_headers_else_its_own(_: int, image: str) -> None:
    show = ("/usr/local/bin/shadowtest-entrypoint --version >/dev/null && "
            "readlink /lib/modules/$(uname -r)/build && ls /lib/modules/$(uname -r)/build/include >/dev/null")
    own = _run([*_podman(), "run", "--rm", *_limits(), "--entrypoint", "sh", image, "-c", show], timeout=120)
    assert own.returncode == 0 and own.stdout.strip().startswith("/usr/src/linux-headers-"), own.stdout + own.stderr
    build = Path(f"/lib/modules/{os.uname().release}/build")
    if not (build / "include").exists():
        pytest.skip(f"this host has no kernel headers at {build} to mount")
    host = _run([*_podman(), "run", "--rm", *_limits(), "-v", "/lib/modules:/host/lib/modules:ro",
                 "-v", "/usr/src:/host/usr/src:ro", "--entrypoint", "sh", image, "-c", show], timeout=120)
    assert host.returncode == 0 and host.stdout.strip().startswith("/host/"), host.stdout + host.stderr


@pytest.mark.parametrize("_", [pytest.param(0, marks=image_marks)])
def test_the_image_run_as_the_daemonset_records_a_host_process_and_dumps_on_an_alert(
        _: int, image: str, tmp_path: Path) -> None:
    """The DaemonSet's args (port and trigger address set for this host) with its capabilities only, the
    host's PID namespace and the mounts it names: nginx on the host, HTTPS, is recorded in plaintext
    through its own libssl (another file than the image's), and an Alertmanager webhook writes the dump."""
    container = _container()
    caps = ",".join(c.lower() for c in container["securityContext"]["capabilities"]["add"])
    hook = free_port()
    out = tmp_path / "out"
    out.mkdir()
    n = Nginx(tmp_path)
    args = [a.replace("$(POD_IP)", "127.0.0.1").replace("$(NODE_NAME)", "node-1") for a in container["args"]]
    args = [f"--port={n.port}" if a.startswith("--port=") else a for a in args]
    args = [f"--trigger-listen=127.0.0.1:{hook}" if a.startswith("--trigger-listen=") else a for a in args]
    name = f"shadowtest-recorder-test-{os.getpid()}"
    argv = [*_podman(), "run", "--rm", "--name", name, *_limits(), "--pid=host", "--network=host",
            "--cap-drop=all", f"--cap-add={caps}", "--security-opt", "seccomp=unconfined",
            *_volumes(out), image, *args, "--json"]
    rec = spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ring_meta = out / "node-1" / ".ring"
    try:
        assert wait_for(lambda: rec.poll() is not None or any(
            "backend_settings" in recording_meta(p) for p in ring_meta.glob("*.rec")), timeout_s=120), \
            "the recorder in the container did not start"
        assert rec.poll() is None, rec.communicate(timeout=30)[1][-2000:]
        time.sleep(2.0)                      # past the start's CPU, under the DaemonSet's CPU budget
        _curl(n)
        time.sleep(0.5)
        assert _post(f"http://127.0.0.1:{hook}/", json.dumps(ALERT).encode()) == 202
        assert wait_for(lambda: any((out / "node-1").glob("*-P99High.rec")), timeout_s=30)
    finally:
        rec.send_signal(signal.SIGINT)      # podman passes it to the recorder
        try:
            stdout, stderr = rec.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            _run(["podman", "rm", "-f", name], timeout=60)
            stdout, stderr = rec.communicate(timeout=30)
        logged = n.log_lines()
        n.stop()
    assert rec.returncode == 0, stderr[-3000:]
    assert "shadowtest-entrypoint" not in stderr, stderr[-2000:]      # headers and tracefs were found
    result = json.loads(stdout)
    (dump,) = result["dumps"]
    path = out / "node-1" / Path(dump["file"]).name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not ring_meta.exists()
    host_libssl = os.stat(str(find_libssl())).st_ino          # nginx's: another file than the image's
    (lib,) = [lib for lib in result["tls"]["libraries"] if lib["inode"] == host_libssl]
    assert lib["attached"] is True, result["tls"]["libraries"]
    with Recording(path) as r:
        got = sorted((c.method, c.status) for c in r.calls())
        assert r.meta["trigger"]["name"] == "P99High"
    assert got == sorted(logged) and len(got) == 3, (got, logged)
    assert TOKEN_CURL.encode() not in path.read_bytes()
