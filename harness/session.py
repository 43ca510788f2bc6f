"""One chaos run from the command line's point of view: load, run with a live view, report, exit code."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from harness.console import is_terminal
from harness.live import LiveView
from harness.outputs import stamped, verdict_exit
from harness.report import RunResult, write_reports
from harness.report.table import print_verdicts
from harness.runner import Interrupted, Runner, RunOptions
from harness.scenario import Scenario
from harness.scenario_load import load_scenario


def default_report_dir(scenario: Scenario) -> str:
    return str(Path("reports") / scenario.name)   # /reports/ is git-ignored


def run_scenario(scenario: Scenario, *, report_dir: str | None = None, junit: str | None = None,
                 png: bool = True, stream: TextIO | None = None, rich: bool | None = None,
                 clear_leftovers: bool = True, notes: list[str] | None = None) -> tuple[RunResult, dict[str, str]]:
    """Run `scenario` with a live view on `stream`, write its reports; returns (result, report paths).

    Raises RunError when it cannot start, ReportError when reports cannot be written.
    """
    out = stream or sys.stdout
    view = LiveView(scenario.name, stream=out, rich=rich, every_s=scenario.period_s)
    runner = Runner(scenario, RunOptions(view=view, clear_leftovers=clear_leftovers, notes=notes or []))
    result = runner.run()
    paths = write_reports(result, report_dir or default_report_dir(scenario), junit=junit, png=png)
    return result, paths


def run_and_report(path: str, *, report_dir: str | None, junit: str | None, scale: float,
                   clear_leftovers: bool, png: bool, as_json: bool, strict: bool = False) -> int:
    """The `chaos run` command: exit 0 when every check passed, else 1. `strict`: a skipped check
    fails the run (the scenario carries it, so the verdict, summary line and reports agree)."""
    scenario = load_scenario(path)
    if scale != 1.0:
        scenario = scenario.scaled(scale)
    if strict:
        scenario = replace(scenario, strict=True)
    out = sys.stderr if as_json else sys.stdout
    try:
        result, paths = run_scenario(scenario, report_dir=report_dir, junit=junit, png=png, stream=out,
                                     clear_leftovers=clear_leftovers)
    except (KeyboardInterrupt, Interrupted):
        # Interrupted while the agent or proxy was starting: they were stopped on the way out, and
        # no traffic ran, so there is nothing to report.
        print("interrupted before the run started; everything started was stopped", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(stamped("results", result.as_dict() | {"reports": paths}), indent=2, default=str))
    else:
        print_verdicts(result, out, rich=is_terminal(out))
        for kind, p in paths.items():
            print(f"report {kind}: {p}", file=out)
    return verdict_exit(result.passed, result.interrupted is not None)
