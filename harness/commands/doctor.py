"""`shadowtest doctor`."""

from __future__ import annotations

import json
import sys

import click
from rich.markup import escape
from rich.table import Table

from harness.console import make_console


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="print machine-readable JSON")
def command(as_json: bool) -> None:
    """Show what works on this host, each missing piece with how to fix it.

    Exit 0 when the core (replay, proxy, agent on CPU) works, 1 otherwise.

    \b
    Examples:
      shadowtest doctor
      shadowtest doctor --json | jq '.checks[] | select(.ok | not)'
    """
    from harness import doctor

    checks = doctor.run_checks()
    report = doctor.as_json(checks)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        table = Table(title="shadowtest doctor")
        for col in ("check", "status", "detail", "fix"):
            table.add_column(col, overflow="fold")
        for c in checks:
            status = "[green]ok[/]" if c.ok else ("[red]MISSING[/]" if c.core else "[yellow]no[/]")
            table.add_row(escape(c.name), status, escape(c.detail), "" if c.ok else escape(c.fix))
        console = make_console()
        console.print(table)
        for name, verdict in doctor.capture_backends(checks).items():
            console.print(f"capture backend [bold]{escape(name)}[/]: {escape(verdict)}")
    sys.exit(0 if report["ok"] else 1)
