"""`shadowtest doctor`."""

from __future__ import annotations

import json
import sys

import click
from rich.markup import escape
from rich.table import Table

from harness.console import make_console
from harness.outputs import stamped


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="print machine-readable JSON")
@click.option("--pid", type=int, default=None, help="also say what TLS this process runs and whether it will be read")
def command(as_json: bool, pid: int | None) -> None:
    """Show what works on this host, each missing piece with how to fix it.

    Exit 0 when the core (replay, proxy, agent on CPU) works, 1 otherwise.

    \b
    Examples:
      shadowtest doctor
      shadowtest doctor --json | jq '.checks[] | select(.ok | not)'
      shadowtest doctor --pid $(pgrep -o nginx)
    """
    from harness import doctor

    checks = doctor.run_checks()
    report = doctor.as_json(checks)
    if pid is not None:
        from capture.ebpf.tlslibs import Inspector

        report["process"] = Inspector().process(pid).as_dict()
    if as_json:
        click.echo(json.dumps(stamped("doctor", report), indent=2))
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
        if pid is not None:
            proc = report["process"]
            assert isinstance(proc, dict)
            console.print(f"TLS of process {pid} ({escape(str(proc['comm']))}): {escape(str(proc['verdict']))}")
    sys.exit(0 if report["ok"] else 1)
