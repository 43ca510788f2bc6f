"""Soak: every bundled scenario N times in a row, unmodified agent; how often does each pass?

    .venv/bin/python bench/scenario_soak.py                     # every scenarios/*.yaml, 20 runs each
    .venv/bin/python bench/scenario_soak.py -n 3 --scale 0.5 scenarios/jitter-and-cpu.yaml
    .venv/bin/python bench/scenario_soak.py -n 20 --json soak.json

A chaos gate is only worth its false-failure rate: with a correct agent every run should pass. Prints,
per scenario, passed runs out of N, and for every check that ever failed (or was skipped: nothing to
judge) how often and the first summary, so a flaky check is named with its evidence, and for each fault
the spread of how far it moved the signal fault_effective judges it on (the margin to the floor). Needs root (CPU
quota faults) like `chaos run`. Exit status 0 when every run passed, else 1. Results go in
bench/RESULTS.md by hand, with the command, the date and the machine's load. http-faults.yaml plays
against the example nginx (deploy/http-example/): the soak starts it for that scenario (its own prefix in
a temp dir, ended by its PID) unless something already listens on 127.0.0.1:18080.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MAX_RUNS = 1000


@contextlib.contextmanager
def example_service(path: Path) -> Any:
    """The example nginx on 127.0.0.1:18080 for scenarios/http-faults.yaml (nothing for the others)."""
    if path.name != "http-faults.yaml" or _listening(18080):
        yield
        return
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    with tempfile.TemporaryDirectory(prefix="soak-web-") as d:
        proc = subprocess.Popen([nginx, "-p", d, "-c", str(ROOT / "deploy" / "http-example" / "nginx.conf")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while not _listening(18080):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the example nginx did not start (see {d}/error.log)")
                time.sleep(0.1)
            yield
        finally:
            proc.send_signal(signal.SIGQUIT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


# What each check measured, printed with its spread: how far a passing run stayed from the check's bound.
MARGINS = {"memory_flat": ("slope_mb_per_min", "growth_mb"), "limiter_stable": ("swing_pct",),
           "responses_valid": ("invalid",), "responses_match": ("mismatched",), "deadlines_honored": ("computed",)}


def soak(path: Path, runs: int, scale: float) -> dict[str, Any]:
    from harness.errors import HarnessError
    from harness.live import LiveView
    from harness.runner import Runner, RunOptions
    from harness.scenario_load import load_scenario

    scenario = load_scenario(path)
    if scale != 1.0:
        scenario = scenario.scaled(scale)
    passed = 0
    failures: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    first: dict[str, str] = {}
    errors: list[str] = []
    moved: dict[str, list[float]] = {}     # fault_effective: how far each fault moved its signal, per run
    started = time.monotonic()
    for i in range(runs):
        view = LiveView(scenario.name, stream=io.StringIO(), rich=False)
        try:
            result = Runner(scenario, RunOptions(view=view)).run()
        except HarnessError as exc:
            errors.append(f"run {i + 1}: {exc}")
            print(f"  {scenario.name} run {i + 1}/{runs}: could not run: {exc}", flush=True)
            continue
        passed += result.passed
        for v in result.verdicts:
            if v.skipped:
                skipped[v.id] += 1
            elif not v.passed:
                failures[v.id] += 1
                first.setdefault(v.id, v.summary)
            for key in MARGINS.get(v.kind, ()):            # the owner-fear checks' measures, per run
                if isinstance(v.evidence.get(key), (int, float)):
                    moved.setdefault(f"{v.id} {key}", []).append(float(v.evidence[key]))
            for f in v.evidence.get("faults") or []:      # fault_effective's per-fault results
                if isinstance(f, dict) and "moved" in f:
                    moved.setdefault(f"{v.id} {f['fault'].split(' ')[0]} {f['signal']}", []).append(f["moved"])
        bad = [v.id for v in result.verdicts if not v.passed]
        print(f"  {scenario.name} run {i + 1}/{runs}: {'PASSED' if result.passed else 'FAILED ' + ', '.join(bad)}"
              f"  (load {os.getloadavg()[0]:.1f})", flush=True)
    return {"scenario": scenario.name, "file": str(path), "runs": runs, "passed": passed, "scale": scale,
            "failures": dict(failures), "skipped": dict(skipped), "first_failure": first, "errors": errors,
            "moved": {k: {"min": min(v), "median": sorted(v)[len(v) // 2], "max": max(v)} for k, v in moved.items()},
            "wall_s": round(time.monotonic() - started, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenarios", nargs="*", help="scenario files (default: every scenarios/*.yaml)")
    ap.add_argument("-n", "--runs", type=int, default=20, help="runs per scenario (default 20)")
    ap.add_argument("--scale", type=float, default=1.0, help="every phase this many times as long (default 1)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if not 1 <= args.runs <= MAX_RUNS:
        ap.error(f"--runs must be between 1 and {MAX_RUNS}")
    if not 0.05 <= args.scale <= 10:
        ap.error("--scale must be between 0.05 and 10")
    paths = [Path(p) for p in args.scenarios] or sorted((ROOT / "scenarios").glob("*.yaml"))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        ap.error(f"no such scenario: {', '.join(missing)}")
    print(f"soak: {len(paths)} scenario(s) x {args.runs} run(s), scale {args.scale:g}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.cpu_count()} CPUs", flush=True)
    results = []
    for path in paths:
        with example_service(path):
            results.append(soak(path, args.runs, args.scale))
    print("\nscenario                  passed   failing checks (runs)")
    for r in results:
        fails = ", ".join(f"{k} ({n})" for k, n in sorted(r["failures"].items())) or "-"
        print(f"{r['scenario']:<25} {r['passed']:>3}/{r['runs']:<4} {fails}")
        for check, summary in r["first_failure"].items():
            print(f"    first {check}: {summary}")
        if r["skipped"]:
            print(f"    skipped (nothing to judge): {r['skipped']}")
        for key, m in r["moved"].items():
            word = "" if key.split(" ")[-1] in {k for keys in MARGINS.values() for k in keys} else " moved"
            print(f"    {key}{word}: min {m['min']:g}, median {m['median']:g}, max {m['max']:g}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(r["passed"] == r["runs"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
