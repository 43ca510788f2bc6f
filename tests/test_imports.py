"""Every module of every package imports on its own, as the first project module an interpreter sees.

An import cycle fails in one order only: with faultrun importing faultimpl at its end and faultimpl
importing names from faultrun at its top, `import harness.faultrun` worked and `import
harness.faultimpl` raised ImportError (a partially initialised module). The test suite imports
modules in whatever order its files do, so such a cycle hides there. Here, in a fresh interpreter,
each module is imported after every module of the project's packages was removed from sys.modules:
the project's import order is exactly that of `python -c "import MODULE"`, while third-party modules
(torch, grpc, numpy) stay loaded, which keeps it to a few seconds. An import that patches the
interpreter (gevent's monkey-patching, which importing locust applies) ends that interpreter: the
modules after it are imported in a new one.

A third-party module that is not installed (an optional extra) is not a failure here; a project
module that cannot be found is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("capture", "replay", "faults", "agent_under_test", "harness", "wire")

# Reads module names (JSON) on stdin; prints one JSON line per module: [name, problem or null, patched].
_IMPORT_EACH = r"""
import importlib, json, sys
packages = set(sys.argv[1].split(","))
for name in json.loads(sys.stdin.read()):
    for loaded in [m for m in sys.modules if m.partition(".")[0] in packages]:
        del sys.modules[loaded]
    problem = None
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] in packages:
            problem = f"ModuleNotFoundError: {exc}"
    except BaseException as exc:
        problem = f"{type(exc).__name__}: {exc}"
    monkey = sys.modules.get("gevent.monkey")
    patched = bool(monkey is not None and monkey.is_anything_patched())
    print(json.dumps([name, problem, patched]), flush=True)
    if patched:
        break
"""


def modules_of(root: Path, packages: tuple[str, ...]) -> list[str]:
    """Dotted names of every module and package under `root`'s `packages` (sorted)."""
    names = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def import_each(root: Path, packages: tuple[str, ...], timeout_s: float = 240) -> dict[str, str]:
    """module -> why it cannot be imported first, for every module of `packages` that cannot."""
    pending = modules_of(root, packages)
    failures: dict[str, str] = {}
    while pending:
        done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, ",".join(packages)], cwd=root,
                              input=json.dumps(pending), capture_output=True, text=True, timeout=timeout_s)
        results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
        if not results:   # the interpreter died on the first module
            failures[pending[0]] = f"the interpreter exited {done.returncode}: {done.stderr.strip()[-500:]}"
            results = [[pending[0], None, False]]
        for name, problem, _patched in results:
            if problem is not None:
                failures[name] = problem
        pending = pending[len(results):]
    return failures


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    modules = modules_of(ROOT, PACKAGES)
    assert "harness.faultimpl" in modules and "wire" in modules and len(modules) > 100
    assert import_each(ROOT, PACKAGES) == {}


def test_the_check_catches_an_import_cycle(tmp_path: Path) -> None:
    """The shape the faultrun/faultimpl cycle had: fine from one end, ImportError from the other."""
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "run.py").write_text("def register(f):\n    return f\n\n\nfrom cyc.impl import helper  # noqa\n")
    (pkg / "impl.py").write_text("from cyc.run import register\n\n\n@register\ndef helper():\n    pass\n")
    (pkg / "fine.py").write_text("import cyc.run\n")
    failures = import_each(tmp_path, ("cyc",))
    assert set(failures) == {"cyc.impl"}
    assert failures["cyc.impl"].startswith("ImportError") and "partially initialized" in failures["cyc.impl"]


def test_a_missing_optional_dependency_is_not_a_failure_but_a_missing_project_module_is(tmp_path: Path) -> None:
    pkg = tmp_path / "opt"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "extra.py").write_text("import shadowtest_no_such_extra_module\n")
    (pkg / "broken.py").write_text("import opt.gone\n")
    assert set(import_each(tmp_path, ("opt",))) == {"opt.broken"}


# What recording and replay hosts install (`pip install shadowtest`) must not need the extras:
# the agent's model (torch, numpy), Locust (and gevent, which it brings), the PNG plots (matplotlib),
# or the test-only HTTP/2 peer (h2).
EXTRAS = ("numpy", "torch", "matplotlib", "locust", "gevent", "h2")
_LOADED_EXTRAS = r"""
import importlib, json, pkgutil, sys
import harness.commands
names = ["harness.cli", "capture.record", "capture.recording", "capture.pcap_import", "capture.pcap_export",
         "replay.engine", "replay.compare", "harness.runner", "harness.scenario_load", "faults.proxy.main"]
names += [f"harness.commands.{m.name}" for m in pkgutil.iter_modules(harness.commands.__path__)]
for name in names:
    importlib.import_module(name)
extras = set(sys.argv[1].split(","))
print(json.dumps(sorted({m.partition(".")[0] for m in sys.modules} & extras)))
"""


def test_the_core_commands_load_no_optional_extra() -> None:
    """`shadowtest` and every one of its commands import without numpy, torch, matplotlib, Locust or h2."""
    done = subprocess.run([sys.executable, "-c", _LOADED_EXTRAS, ",".join(EXTRAS)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


_WITHOUT_AGENT_EXTRA = r"""
import sys
sys.modules["numpy"] = None   # as if `pip install shadowtest` had not installed the agent extra
sys.modules["torch"] = None
from harness.cli import main
sys.argv = ["shadowtest"] + sys.argv[1:]
main()
"""


def test_the_agent_without_its_extra_says_what_to_install_in_one_line() -> None:
    for args in (["agent", "serve", "--port", "0"], ["agent", "save-weights", "/nonexistent/w.pt"],
                 ["traffic", "--target", "127.0.0.1:1", "--rate", "1", "--duration", "1"]):
        done = subprocess.run([sys.executable, "-c", _WITHOUT_AGENT_EXTRA, *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, (args, done.stderr)
        assert "Traceback" not in done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "pip install 'shadowtest[agent]'" in lines[0], (args, lines)
