"""The verdict table printed at the end of a run: rich on a terminal, plain lines otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from harness.report.write import RunResult


def print_verdicts(result: RunResult, stream: TextIO, rich: bool) -> None:
    """Print one row per check (PASS/FAIL, id, why) and the overall verdict."""
    head = result.headline()
    total = result.tally()
    if not rich:
        for v in result.verdicts:
            print(f"{v.mark}  {v.id}: {v.summary}", file=stream)
        print(f"{result.scenario.name}: {head}, {total}", file=stream)
        return
    from rich.markup import escape
    from rich.table import Table

    from harness.console import make_console

    # ids ("alert_fires[fault]") and evidence are text, not rich markup: escaped.
    table = Table(title=escape(f"{result.scenario.name}: verdicts (seed {result.scenario.seed})"))
    table.add_column("check", no_wrap=True)
    table.add_column("verdict")
    table.add_column("evidence", overflow="fold")
    for v in result.verdicts:
        table.add_row(escape(v.id), {"pass": "[green]PASS[/]", "fail": "[bold red]FAIL[/]",
                                     "skipped": "[yellow]SKIP[/]"}[v.status], escape(v.summary))
    console = make_console(file=stream)
    console.print(table)
    colour = "green" if result.passed else "red"
    console.print(f"[bold {colour}]{head}[/]: {total}", highlight=False)
