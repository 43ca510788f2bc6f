"""The verdict table printed at the end of a run: rich on a terminal, plain lines otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from harness.report.write import RunResult


def print_verdicts(result: RunResult, stream: TextIO, rich: bool) -> None:
    """Print one row per check (PASS/FAIL, id, why) and the overall verdict."""
    failed = sum(not v.passed for v in result.verdicts)
    head = "PASSED" if result.passed else ("INTERRUPTED (partial)" if result.interrupted else "FAILED")
    total = f"{len(result.verdicts) - failed}/{len(result.verdicts)} checks passed"
    if not rich:
        for v in result.verdicts:
            print(f"{'PASS' if v.passed else 'FAIL'}  {v.id}: {v.summary}", file=stream)
        print(f"{result.scenario.name}: {head}, {total}", file=stream)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result.scenario.name}: verdicts (seed {result.scenario.seed})")
    table.add_column("check", no_wrap=True)
    table.add_column("verdict")
    table.add_column("evidence", overflow="fold")
    for v in result.verdicts:
        table.add_row(v.id, "[green]PASS[/]" if v.passed else "[bold red]FAIL[/]", v.summary)
    console = Console(file=stream)
    console.print(table)
    colour = "green" if result.passed else "red"
    console.print(f"[bold {colour}]{head}[/]: {total}")
