"""`shadowtest merge`: many recordings (one per host) into one, aligned by wall clock."""

from __future__ import annotations

import json

import click

from harness.outputs import stamped


@click.command("merge")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="the merged recording to create")
@click.option("--allow-disjoint", is_flag=True,
              help="merge recordings whose time ranges do not overlap (placed one after another by wall clock)")
@click.option("--salvage", is_flag=True, help="take the intact part of a damaged recording (the loss is stated)")
@click.option("--force", is_flag=True, help="replace OUTPUT if it exists")
@click.option("--json", "as_json", is_flag=True, help="print the counts and the alignment as JSON")
def command(files: tuple[str, ...], output: str, allow_disjoint: bool, salvage: bool, force: bool,
            as_json: bool) -> None:
    """Merge recordings of several hosts into one, aligned by wall clock, every flow keeping its host.

    Each recording's stamps are on its own host's monotonic clock; each also holds the wall clock read
    with it at its start, and the merge shifts every file onto the earliest one's clock by the difference
    (as good as the hosts' wall clocks: NTP keeps them within milliseconds). Recordings whose time ranges
    do not overlap are refused unless --allow-disjoint. Replay the result as any recording: with
    --workers it is sharded by call as usual.

    \b
    Examples:
      shadowtest merge web-1.rec web-2.rec web-3.rec -o fleet.rec
      shadowtest merge monday.rec tuesday.rec --allow-disjoint -o week.rec
    """
    from capture.merge import merge_recordings

    result = merge_recordings(list(files), output, overwrite=force, allow_disjoint=allow_disjoint, salvage=salvage)
    if as_json:
        click.echo(json.dumps(stamped("merge", result), indent=2))
        return
    click.echo(f"merged {result['calls']} calls on {result['flows']} flows from {len(files)} recordings -> {output}")
    for src in result["from"]:
        click.echo(f"  {src['file']}: host {src['host']}, flows {'-'.join(map(str, src['flows'])) or 'none'}, "
                   f"shifted {src['shift_ns'] / 1e9:+.6f} s")
    for p in result["problems"]:
        click.echo(f"problem: {p}", err=True)
