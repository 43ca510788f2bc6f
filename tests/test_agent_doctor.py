"""`shadowtest doctor --json` reports the capabilities this machine really has."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys


def _doctor() -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "harness.cli", "doctor", "--json"], capture_output=True, text=True,
                         timeout=120)
    return out.returncode, json.loads(out.stdout)


def test_doctor_json_matches_this_host() -> None:
    code, doc = _doctor()
    checks = {c["name"]: c for c in doc["checks"]}
    assert code == (0 if doc["ok"] else 1)
    assert checks["root"]["ok"] is (os.geteuid() == 0)
    assert checks["stress-ng"]["ok"] is (shutil.which("stress-ng") is not None)
    assert checks["loopback sockets"]["ok"] is True and checks["python packages (core)"]["ok"] is True
    assert doc["ok"] is True  # the core (agent on CPU, replay, proxy) works on every supported host
    # eBPF: reported working exactly when a tracepoint program really loads here.
    from harness import doctor

    assert checks["eBPF tracepoint program"]["ok"] is doctor._tracepoint().ok
    assert (doc["capture_backends"]["ebpf"] == "works") is checks["eBPF tracepoint program"]["ok"]
    if importlib.util.find_spec("torch") is not None:
        import torch

        assert checks["CUDA"]["ok"] is torch.cuda.is_available()
    for c in doc["checks"]:
        assert c["ok"] or c["fix"], f"{c['name']} fails without a fix hint"


def test_a_core_install_passes_and_each_missing_extra_is_named_with_the_command_that_adds_it() -> None:
    from harness import doctor

    declared = doctor.requirements(["grpcio>=1.85", "rich>=13", 'torch>=2.2; extra == "agent"',
                                    'numpy>=1.24 ; extra == "agent"', 'locust>=2.20; extra == "locust"',
                                    'pytest>=8; extra == "dev"', 'shadowtest[agent,locust]; extra == "all"'])
    assert declared == {"": ["grpcio", "rich"], "agent": ["torch", "numpy"], "locust": ["locust"]}
    core_only = doctor.python_checks(declared, installed=lambda d: d in ("grpcio", "rich"))
    by = {c.name: c for c in core_only}
    assert by["python packages (core)"].ok and by["python packages (core)"].core
    agent = by["extra [agent]"]
    assert not agent.ok and not agent.core and agent.fix == "optional: pip install 'shadowtest[agent]'"
    assert "torch, numpy" in agent.detail
    assert all(c.ok for c in core_only if c.core)      # so doctor's verdict (and exit code) is ok
    broken = {c.name: c for c in doctor.python_checks(declared, installed=lambda d: d != "rich")}
    core = broken["python packages (core)"]
    assert not core.ok and core.core and core.detail == "missing: rich" and "--force-reinstall" in core.fix
    # what this checkout declares: the dev extra (tests) is not something a user is told to install
    assert "dev" not in doctor.requirements() and "grpcio" in doctor.requirements()[""]
