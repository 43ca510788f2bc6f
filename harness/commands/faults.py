"""`shadowtest faults list|clear`: what faults are recorded, and undo those a killed run left."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from harness.console import is_terminal, make_console
from harness.outputs import stamped


def _print(lines: list[str], title: str) -> None:
    if is_terminal(sys.stdout):
        console = make_console()
        console.print(title, style="bold", markup=False, highlight=False)
        for line in lines:
            console.print(f"  {line}", markup=False, highlight=False)
    else:
        click.echo(title)
        for line in lines:
            click.echo(f"  {line}")


@click.group("faults")
def command() -> None:
    """Inspect and clean up faults (toxics, cgroup limits, stress processes, paused processes).

    \b
    Examples:
      shadowtest faults list                 every recorded fault, live or left behind
      shadowtest faults clear                undo what a crashed run left (exit 1 if something remains)
      SHADOWTEST_STATE_DIR=/tmp/st shadowtest faults clear --json
    """


@command.command("list")
@click.option("--state-dir", type=click.Path(file_okay=False), help="state directory (default: $SHADOWTEST_STATE_DIR, /run/shadowtest)")
@click.option("--json", "as_json", is_flag=True, help="print machine-readable JSON")
def list_(state_dir: str | None, as_json: bool) -> None:
    """List recorded faults: those of live runs and leftovers of dead ones. Exit 1 if leftovers exist.

    \b
    Examples:
      shadowtest faults list
      shadowtest faults list --json | jq '.leftovers | length'
    """
    from faults.cleanup import check_leftovers
    from faults.state import state_dir as default_dir

    d = state_dir or str(default_dir())
    leftovers = check_leftovers(d)
    live = _live_entries(d, {(str(x.file), x.entry_id) for x in leftovers})
    if as_json:
        click.echo(json.dumps(stamped("faults", {"state_dir": d, "live": live,
                                                 "leftovers": [{"run_pid": x.holder_pid, "id": x.entry_id, **x.entry}
                                                               for x in leftovers]}), indent=2))
    else:
        _print([f"{e['id']}: {e['kind']} (run PID {e['run_pid']})" for e in live] or ["none"],
               f"live faults in {d}")
        _print([x.describe() for x in leftovers] or ["none"], "left behind by dead runs")
    sys.exit(1 if leftovers else 0)


def _live_entries(d: str, dead: set[tuple[str, str]]) -> list[dict[str, Any]]:
    from pathlib import Path

    out = []
    for path in sorted(Path(d).glob("holder-*.json")) if Path(d).exists() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for entry_id, entry in data.get("entries", {}).items():
            if (str(path), entry_id) not in dead:
                out.append({"id": entry_id, "run_pid": data.get("holder", {}).get("pid"), **entry})
    return out


@command.command("clear")
@click.option("--state-dir", type=click.Path(file_okay=False), help="state directory (default: $SHADOWTEST_STATE_DIR, /run/shadowtest)")
@click.option("--json", "as_json", is_flag=True, help="print machine-readable JSON")
def clear(state_dir: str | None, as_json: bool) -> None:
    """Undo every fault left by runs that are no longer alive (live runs are left alone).

    Toxics are removed through the proxy API's /reset, cgroup limits restored and our cgroups
    removed, stress processes killed (only if PID and start time both match), paused processes
    resumed. Exit 0 when nothing remains, 1 when something could not be undone.

    \b
    Examples:
      shadowtest faults clear
      shadowtest faults clear --json
    """
    from faults.cleanup import clear_leftovers
    from faults.state import state_dir as default_dir

    d = state_dir or str(default_dir())
    result = clear_leftovers(d)
    if as_json:
        click.echo(json.dumps(stamped("faults", {"state_dir": d, "cleared": [x.describe() for x in result.cleared],
                                                 "failed": [{"fault": x.describe(), "error": err}
                                                            for x, err in result.failed]}), indent=2))
    else:
        _print([x.describe() for x in result.cleared] or ["nothing to clear"], f"cleared ({d})")
        if result.failed:
            _print([f"{x.describe()}: {err}" for x, err in result.failed], "could NOT undo (still recorded)")
    sys.exit(0 if result.ok else 1)
