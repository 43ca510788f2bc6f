"""A core install (`pip install shadowtest`, no extras): every command works, or says in one line which
extra it needs (exit 1, no traceback). Built from this checkout's tracked files into a fresh venv that
has none of the extras (torch, numpy, locust, matplotlib, redis)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.outputs import CHECK_ENV, check_output

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("torch", "numpy", "locust", "matplotlib", "redis")


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the core venv's shadowtest, a work dir holding a small recording)."""
    base = tmp_path_factory.mktemp("core")
    src = base / "src"
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True,
                           timeout=60).stdout.decode().split("\0")
    for name in filter(None, files):   # the tracked tree only: no build/ or egg-info left in the checkout
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                          "-c", str(ROOT / "constraints.txt"), str(src)], capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-3000:]
    probe = f"import importlib.util as u; print([m for m in {EXTRAS!r} if u.find_spec(m)])"
    present = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=60)
    assert present.stdout.strip() == "[]", present.stdout + present.stderr   # truly core: no extra came along
    work = base / "work"
    work.mkdir()
    shutil.copy2(ROOT / "scenarios" / "http-faults.rec", work / "s.rec")
    return venv / "bin" / "shadowtest", work


def _run(core: tuple[Path, Path], *args: str) -> subprocess.CompletedProcess[str]:
    exe, work = core
    env = {k: v for k, v in os.environ.items() if k != CHECK_ENV}   # the schema check needs jsonschema (dev)
    return subprocess.run([str(exe), *args], cwd=work, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["--help"],
    ["inspect", "s.rec", "--json"],
    ["replay", "s.rec", "--target", "127.0.0.1:1", "--dry-run", "--json"],
    ["export", "s.rec", "-o", "x.pcapng", "--json"],
    ["redact", "s.rec", "--default-redaction", "-o", "r.rec", "--force", "--json"],
    ["chaos", "validate", "--json", str(ROOT / "scenarios" / "baseline.yaml")],
    ["record", "--help"],
    ["proxy", "serve", "--help"],
    ["faults", "--help"],
])
def test_core_commands_work(core: tuple[Path, Path], args: list[str]) -> None:
    res = _run(core, *args)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    if "--json" in args:
        check_output(json.loads(res.stdout))   # what it printed matches its schema (checked here: jsonschema is dev)


@pytest.mark.slow
def test_import_after_export_and_doctor_judge_the_core_install(core: tuple[Path, Path]) -> None:
    assert _run(core, "export", "s.rec", "-o", "x2.pcapng").returncode == 0
    imported = _run(core, "import", "x2.pcapng", "-o", "y.rec", "--json")
    assert imported.returncode == 0 and json.loads(imported.stdout)["calls"] > 0, imported.stderr
    doctor = _run(core, "doctor", "--json")
    checks = json.loads(doctor.stdout)["checks"]
    text = json.dumps(checks)
    assert "pip install shadowtest " not in text and "pip install 'shadowtest'" not in text   # already installed
    assert "shadowtest[agent]" in text                   # names the extra that brings the agent


@pytest.mark.slow
@pytest.mark.parametrize("args, extra", [
    (["agent", "serve", "--port", "0"], "shadowtest[agent]"),
    (["traffic", "--target", "127.0.0.1:1", "--rate", "1", "--duration", "1"], "shadowtest[agent]"),
    (["locust", "--help"], "shadowtest[locust]"),
    (["chaos", "run", str(ROOT / "scenarios" / "baseline.yaml"), "--report-dir", "out"], "shadowtest[agent]"),
])
def test_a_command_that_needs_an_extra_says_which_in_one_line(core: tuple[Path, Path], args: list[str],
                                                              extra: str) -> None:
    res = _run(core, *args)
    assert res.returncode == 1 and "Traceback" not in res.stderr + res.stdout, res.stderr[-2000:]
    said = [line for line in (res.stdout + res.stderr).splitlines() if extra in line]
    assert len(said) == 1 and f"pip install '{extra}'" in said[0], res.stdout[-1500:] + res.stderr[-1500:]
