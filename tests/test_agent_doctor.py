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
    assert checks["loopback sockets"]["ok"] is True and checks["python packages"]["ok"] is True
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
