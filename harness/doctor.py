"""`shadowtest doctor`: what works on this host, and how to fix what does not.

Each probe really tries the thing (loads a tracepoint program, binds a socket, reads the cgroup
files) rather than guessing from versions. Probes never raise: a failure is a row with a fix hint.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

_BPF_PROBE = r"""
BPF_RINGBUF_OUTPUT(events, 1);
TRACEPOINT_PROBE(syscalls, sys_enter_getpid) { return 0; }
"""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    core: bool = False  # the core (replay, proxy, agent on CPU) needs it; others unlock features


def _root() -> Check:
    ok = os.geteuid() == 0
    return Check("root", ok, "running as root" if ok else f"uid {os.geteuid()}",
                 "run as root (sudo) for eBPF capture, cgroup quotas and raw-socket pcap capture")


_EXTRAS = {"agent": "the reference agent (agent serve, demo, chaos run of the bundled scenarios, traffic)",
           "locust": "Locust's distributed mode (replay --workers, shadowtest locust)",
           "plots": "the PNG timelines of chaos run and capacity"}


def requirements(requires: list[str] | None = None) -> dict[str, list[str]]:
    """{"": core distributions, "agent": [...], ...}: what this shadowtest declares, from its installed
    metadata (else the checkout's pyproject.toml); the dev extra (tests) is left out."""
    import re

    if requires is None:
        requires = _declared()
    out: dict[str, list[str]] = {"": []}
    for req in requires:
        name = re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0]
        extra = re.search(r"extra\s*==\s*[\"']([^\"']+)[\"']", req)
        group = extra.group(1) if extra else ""
        if group in ("dev", "all") or name == "shadowtest":
            continue
        out.setdefault(group, []).append(name)
    return out


def _declared() -> list[str]:
    from importlib import metadata

    try:
        return metadata.requires("shadowtest") or []
    except metadata.PackageNotFoundError:   # run from a checkout that was never installed
        import tomllib

        project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
        return list(project["dependencies"]) + [f'{r}; extra == "{extra}"'
                                                for extra, reqs in project["optional-dependencies"].items()
                                                for r in reqs]


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def python_checks(declared: dict[str, list[str]] | None = None,
                  installed: Callable[[str], bool] = _installed) -> list[Check]:
    """The core install (a missing package there is a broken install) and each extra (optional: what it
    unlocks and the one command that adds it)."""
    declared = requirements() if declared is None else declared
    missing = [d for d in declared.get("", []) if not installed(d)]
    checks = [Check("python packages (core)", not missing,
                    f"all {len(declared.get('', []))} core packages installed" if not missing
                    else f"missing: {', '.join(missing)}",
                    "" if not missing else "the install is incomplete: pip install --force-reinstall shadowtest",
                    core=True)]
    for extra, dists in declared.items():
        if not extra:
            continue
        lacking = [d for d in dists if not installed(d)]
        what = _EXTRAS.get(extra, f"the {extra} extra")
        checks.append(Check(f"extra [{extra}]", not lacking,
                            f"installed: {what}" if not lacking else f"not installed ({', '.join(lacking)}): {what}",
                            "" if not lacking else f"optional: pip install 'shadowtest[{extra}]'"))
    return checks


def _loopback() -> Check:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return Check("loopback sockets", True, "bind on 127.0.0.1 port 0 works", core=True)
    except OSError as exc:
        return Check("loopback sockets", False, str(exc), "enable the loopback interface", core=True)


def _kernel_headers() -> Check:
    build = Path("/lib/modules") / platform.release() / "build"
    ok = (build / "include").exists()
    return Check("kernel headers", ok, f"{build} -> {os.path.realpath(build)}" if ok else f"{build} missing",
                 "apt-get install linux-headers-amd64 and link /lib/modules/$(uname -r)/build to "
                 "/usr/src/linux-headers-*-amd64 (`make setup` does this)")


def _bcc() -> Check:
    try:
        importlib.import_module("bcc")
    except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception on a broken libbcc
        return Check("bcc importable", False, str(exc) or type(exc).__name__,
                     "apt-get install python3-bpfcc and expose /usr/lib/python3/dist-packages/bcc to "
                     "this interpreter (`make setup` links it into .venv)")
    return Check("bcc importable", True, "import bcc works")


def _tracepoint() -> Check:
    fix = ("needs root, python3-bpfcc, kernel headers and tracefs mounted at /sys/kernel/tracing "
           "(`mount -t tracefs tracefs /sys/kernel/tracing`); without it use --backend pcap or proxy")
    try:
        from bcc import BPF

        b = BPF(text=_BPF_PROBE.encode())
        b.cleanup()
    except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception
        return Check("eBPF tracepoint program", False, str(exc).splitlines()[0][:120], fix)
    return Check("eBPF tracepoint program", True, "syscalls:sys_enter_getpid attached, ring buffer ok")


def tls_capture_check() -> Check:
    """TLS plaintext capture: the system libssl found, and a uprobe on it attached and fired (this
    process's own ssl module runs a handshake step through it)."""
    name = "TLS capture (uprobes on libssl)"
    fix = ("needs root (or the capabilities capture/privileges.py names), bcc and uprobes (CONFIG_UPROBE_EVENTS) and the system libssl.so.3 (apt-get install "
           "libssl3); without it TLS flows are recorded as ciphertext and listed as encrypted")
    try:
        from capture.ebpf.tls import find_libssl, libssl_version, probe_uprobe

        libssl = find_libssl()
        if libssl is None:
            return Check(name, False, "no libssl.so.3 found (ldconfig -p)", fix)
        from capture import privileges

        needed = privileges.RECORDER + privileges.TLS
        if lacking := privileges.missing(needed):
            return Check(name, False, f"{libssl} found; {privileges.refusal('uprobes', lacking, needed)}", fix)
        hits = probe_uprobe(libssl)
    except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception
        return Check(name, False, f"uprobe does not attach: {str(exc).splitlines()[0][:120]}", fix)
    if hits < 1:
        return Check(name, False, f"{libssl}: uprobe on SSL_do_handshake attached but did not fire", fix)
    return Check(name, True, f"{libssl} ({libssl_version(libssl)}): uprobe on SSL_do_handshake attached "
                             f"and fired; record captures TLS plaintext (--tls off to disable)")


def _tool(name: str, what: str, fix: str) -> Callable[[], Check]:
    def probe() -> Check:
        path = shutil.which(name)
        return Check(name, path is not None, path or f"not on PATH ({what})", fix)
    return probe


def _cgroup_cpu() -> Check:
    v1 = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v1.exists():
        return Check("cgroup cpu controller", os.access(v1.parent, os.W_OK), f"v1 at {v1.parent}",
                     "run as root to create cgroups under /sys/fs/cgroup/cpu")
    if v2.exists() and "cpu" in v2.read_text().split():
        return Check("cgroup cpu controller", os.access(v2.parent, os.W_OK), "v2 at /sys/fs/cgroup",
                     "run as root to write cpu.max")
    return Check("cgroup cpu controller", False, "no cpu controller mounted",
                 "mount cgroup v2 or the v1 cpu controller; CPU quota faults are unavailable")


def _cuda() -> Check:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return Check("CUDA", False, "torch not installed", "pip install 'shadowtest[agent]' for the agent's model")
    if torch.cuda.is_available():
        return Check("CUDA", True, f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})")
    return Check("CUDA", False, f"no CUDA device (torch {torch.__version__}); the agent runs on CPU",
                 "optional: a machine with an NVIDIA GPU and a CUDA build of torch")


PROBES: list[Callable[[], Check]] = [
    _root, _loopback, _bcc, _kernel_headers, _tracepoint, tls_capture_check,
    _tool("stress-ng", "CPU contention falls back to built-in workers", "apt-get install stress-ng"),
    _tool("toxiproxy-server", "the embedded Toxiproxy-compatible proxy is used",
          "optional: install Shopify's toxiproxy-server to drive the real one"),
    _tool("promtool", "Prometheus rule tests are skipped", "apt-get install prometheus"),
    _tool("tshark", "export cannot be checked by Wireshark's dissector", "apt-get install tshark"),
    _cgroup_cpu, _cuda,
]


def run_checks() -> list[Check]:
    checks = [probe() for probe in PROBES]
    return checks[:1] + python_checks() + checks[1:]


def capture_backends(checks: list[Check]) -> dict[str, str]:
    """Which capture backends will work here, and why (shown below the table)."""
    by = {c.name: c for c in checks}
    ebpf = by["eBPF tracepoint program"]
    tls = by.get("TLS capture (uprobes on libssl)")
    root = by["root"].ok
    out = {
        "ebpf": "works" if ebpf.ok else f"unavailable: {ebpf.detail}",
        "pcap": "works (raw socket as root)" if root else "unavailable: needs root or CAP_NET_RAW",
        "proxy": "works (unprivileged: records through a local TCP proxy in the request path)",
    }
    if tls is not None:   # not a backend: what the ebpf backend does with TLS flows
        out["ebpf TLS"] = ("plaintext of processes using the system libssl (record --tls off to disable)"
                           if tls.ok and ebpf.ok else "ciphertext only: " + (tls.detail if ebpf.ok else "no eBPF"))
    return out


def as_json(checks: list[Check]) -> dict[str, object]:
    return {"ok": all(c.ok for c in checks if c.core), "checks": [asdict(c) for c in checks],
            "capture_backends": capture_backends(checks)}
