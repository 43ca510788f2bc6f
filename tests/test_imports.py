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
