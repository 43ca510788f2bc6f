"""`shadowtest chaos run` and `shadowtest chaos validate`."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from harness.outputs import stamped


@click.group("chaos")
def command() -> None:
    """Run chaos scenarios (YAML) against the agent or your own service, and check their verdicts.

    \b
    Examples:
      shadowtest chaos validate scenarios/*.yaml
      shadowtest chaos run scenarios/baseline.yaml
      shadowtest chaos run scenarios/jitter-and-cpu.yaml --report-dir out/ --junit out/junit.xml
      shadowtest chaos run my-service.yaml --strict
    """


@command.command("validate")
@click.argument("scenarios", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print machine-readable JSON")
def validate(scenarios: tuple[str, ...], as_json: bool) -> None:
    """Check scenario files without running them: each error says file, line and what is expected.

    It also works out how long the traffic lasts (a recording: its span / speed x loop; the generator:
    the whole run) and warns, with file and line, when it ends before the phases do. Exit 0 when every
    file is valid (warnings or not), 1 otherwise.

    \b
    Examples:
      shadowtest chaos validate scenarios/*.yaml
      shadowtest chaos validate my.yaml --json
    """
    from harness.console import print_error
    from harness.errors import ScenarioError
    from harness.scenario_load import load_scenario, scenario_warnings

    results: list[dict[str, Any]] = []
    for path in scenarios:
        try:
            s = load_scenario(path)
            found, traffic_s = scenario_warnings(s)
            results.append({"file": path, "ok": True, "name": s.name, "phases": len(s.phases),
                            "checks": len(s.expect), "duration_s": s.duration_s, "traffic_s": traffic_s,
                            "warnings": found})
        except ScenarioError as exc:
            results.append({"file": path, "ok": False, "error": str(exc), "line": exc.line})
    if as_json:
        click.echo(json.dumps(stamped("validate", {"scenarios": results}), indent=2))
    else:
        for r in results:
            if r["ok"]:
                click.echo(f"ok  {r['file']}: {r['name']}, {r['phases']} phases, {r['checks']} checks, "
                           f"{r['duration_s']:g}s")
                for warning in r["warnings"]:
                    _warn(warning)
            else:
                print_error(r["error"], prefix="bad")
    sys.exit(0 if all(r["ok"] for r in results) else 1)


def _warn(message: str) -> None:
    """`warn FILE:LINE: ...` on stderr, one line (yellow on a terminal)."""
    from rich.text import Text

    from harness.console import make_console, one_line

    make_console(stderr=True).print(Text.assemble(("warn", "bold yellow"), " ", one_line(message)),
                                    soft_wrap=True, highlight=False)


@command.command("run")
@click.argument("scenario", type=click.Path(dir_okay=False))
@click.option("--report-dir", type=click.Path(file_okay=False), default=None,
              help="where results.json, junit.xml, summary.md and timeline.png go "
                   "(default reports/NAME)")
@click.option("--junit", type=click.Path(dir_okay=False), default=None, help="JUnit XML path (default in --report-dir)")
@click.option("--scale", type=click.FloatRange(0.05, 10.0), default=1.0, show_default=True,
              help="multiply every phase duration (0.2 for a quick CI smoke run)")
@click.option("--clear-leftovers/--refuse-leftovers", default=True, show_default=True,
              help="undo faults a crashed run left behind before starting (default), or refuse to start")
@click.option("--no-png", is_flag=True, help="skip the PNG timeline")
@click.option("--json", "as_json", is_flag=True, help="print results.json to stdout instead of the table")
@click.option("--strict", is_flag=True,
              help="a skipped check (nothing to judge: e.g. no calls in its phase) fails the run")
def run(scenario: str, report_dir: str | None, junit: str | None, scale: float, clear_leftovers: bool,
        no_png: bool, as_json: bool, strict: bool) -> None:
    """Run one scenario: start the target, replay traffic through the fault proxy, apply faults per
    phase, follow /metrics and /events, check every expectation, write the reports.

    Exit 0 when every check passes, 99 when one fails (or none judged anything), 1 when the run could not
    run or was interrupted (Ctrl-C and SIGTERM end cleanly: faults removed, partial report written). A check with nothing to judge is skipped and
    fails nothing, unless --strict: then any skipped check fails the run, and the summary line says so.

    \b
    Examples:
      shadowtest chaos run scenarios/baseline.yaml
      shadowtest chaos run scenarios/overload.yaml --report-dir out/overload --junit out/junit.xml
      shadowtest chaos run scenarios/jitter-and-cpu.yaml --scale 0.5 --json > results.json
      shadowtest chaos run my-service.yaml --strict          # CI: a check that judged nothing fails
    """
    from harness.session import run_and_report

    code = run_and_report(scenario, report_dir=report_dir, junit=junit, scale=scale,
                          clear_leftovers=clear_leftovers, png=not no_png, as_json=as_json, strict=strict)
    sys.exit(code)
