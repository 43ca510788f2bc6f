"""`shadowtest infer`: name the methods of a recording's joined-connection calls from service descriptors."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from harness.outputs import stamped
from wire.clicktypes import Seconds

_FIX = ("to name the rest: pass the service's descriptors (--descriptors FILE.protoset, made with protoc "
        "--include_imports --descriptor_set_out, or reflection=HOST:PORT), or name a group by hand with "
        "--method-map FLOW:REF=/package.Service/Method")


@click.command("infer")
@click.argument("file", type=click.Path(exists=True, path_type=Path))
@click.option("--descriptors", "specs", multiple=True, metavar="SRC",
              help="FILE.protoset, reflection=HOST:PORT or module names; repeatable, tried in order")
@click.option("--method-map", "mapping", multiple=True, metavar="[FLOW:]REF=METHOD",
              help="name a group by hand (wins over inference); repeatable")
@click.option("--allow-target", "allow", multiple=True, help="allow this non-loopback reflection host/CIDR")
@click.option("--timeout", "timeout_s", type=Seconds(0.1, 60), default=2.0, show_default=True,
              help="per reflection call (seconds, or 500ms)")
@click.option("--json", "as_json", is_flag=True, help="print the groups as JSON")
@click.option("--dry-run", is_flag=True, help="show what would be assigned; write nothing")
@click.option("--salvage", is_flag=True,
              help="infer from the intact part of a damaged recording (the calls lost are reported; a file whose "
                   "pages are damaged is not written to)")
def command(file: Path, specs: tuple[str, ...], mapping: tuple[str, ...], allow: tuple[str, ...], timeout_s: float,
            as_json: bool, dry_run: bool, salvage: bool) -> None:
    """Infer the methods of FILE's calls whose `:path` was lost (connections joined mid-stream).

    Each group (the calls of one connection that share one lost `:path`) is matched against every
    method of the descriptors' services: by call shape, and by parsing every sampled message strictly
    as the method's types. A method is assigned only when exactly one fits, and written to FILE with
    how it was chosen (--method-map assignments too); a group left unknown is printed with why, or
    with the methods that fit it.

    Exit 0 when every group's method is known afterwards, 1 when some remain unknown, 2 on a usage error.
    A damaged recording is refused (exit 1) unless --salvage.

    \b
    Examples:
      shadowtest infer prod.rec --descriptors agent.protoset
      shadowtest infer prod.rec --descriptors reflection=127.0.0.1:50051 --dry-run
      shadowtest infer prod.rec --descriptors agent_under_test.proto.agent_pb2 --json
      shadowtest infer prod.rec --method-map 3:hpack:5=/shadowtest.agent.v1.TradingAgent/Decide
    """
    from harness.infer import resolve_groups, unmatched_map_keys

    if not specs and not mapping:
        raise click.UsageError("nothing to infer from: pass --descriptors SRC and/or --method-map [FLOW:]REF=METHOD")
    from capture.integrity import calls_lost, loss_text, open_for
    from capture.rotate import set_files

    if set_files(file) is not None:
        raise click.UsageError(f"{file} is a rotated set: infer stores the method map in the file it reads; run it "
                               "on each file of the set (their flows are numbered apart), or merge them first "
                               "(shadowtest merge DIR/*.rec -o one.rec)")
    manual = _parse_map(mapping)
    sources, notes = _load_sources(specs, allow, timeout_s)
    rec, found = open_for(file, "infer", salvage=salvage)
    try:
        if not found.intact:
            notes.append(f"{file} is damaged ({found.problems[0]}): read its intact part, "
                         f"{loss_text(calls_lost(rec, found))}")
            if not found.writable and not dry_run:
                notes.append(f"nothing written to {file}: its pages are damaged (name the groups for a replay "
                             "with --method-map, or write a salvaged copy with `shadowtest redact --salvage` first)")
                dry_run = True
        groups = rec.method_groups()
        if unmatched := unmatched_map_keys(groups, manual):
            raise click.BadParameter(f"no group {', '.join(unmatched)} in {file} (see `shadowtest infer {file} "
                                     f"--dry-run` or inspect)", param_hint="--method-map")
        states = resolve_groups(groups, lambda g: rec.group_calls(g.flow_id, g.ref), lambda g: sources, manual)
    finally:
        rec.close()
    # The file holds methods found, not doubts: the reasons for the unknown ones are printed.
    changed = [(s.flow_id, s.ref, s.method, s.how) for s in states if s.changed and s.method and s.how]
    if changed and not dry_run:
        from capture.recording import set_group_methods

        set_group_methods(file, changed)
    unknown = [s for s in states if s.method is None]
    _emit(file, states, notes, unknown, as_json, dry_run)
    sys.exit(1 if unknown else 0)


def _parse_map(mapping: tuple[str, ...]) -> dict[tuple[int | None, str], str]:
    from replay.method_map import MethodMapError, parse_method_map

    try:
        return parse_method_map(mapping)
    except MethodMapError as exc:
        raise click.BadParameter(str(exc), param_hint="--method-map") from exc


def _load_sources(specs: tuple[str, ...], allow: tuple[str, ...], timeout_s: float) -> tuple[list[Any], list[str]]:
    """Each source's methods; reflection that does not answer is a note (the other sources still
    count), an unreadable file or a refused target a usage error."""
    from harness.infer import load_source
    from replay.errors import CompareError, TargetNotAllowedError

    sources, notes = [], []
    for spec in specs:
        try:
            sources.append(load_source(spec, allow, timeout_s))
        except TargetNotAllowedError as exc:
            raise click.BadParameter(str(exc), param_hint="--descriptors") from exc
        except CompareError as exc:
            if not spec.startswith("reflection="):
                raise click.BadParameter(str(exc), param_hint="--descriptors") from exc
            notes.append(f"reflection not available: {exc}")
    return sources, notes


def _emit(file: Path, states: list[Any], notes: list[str], unknown: list[Any], as_json: bool, dry_run: bool) -> None:
    if as_json:
        doc = {"file": str(file), "dry_run": dry_run, "groups": [s.as_json() for s in states],
               "unknown_groups": len(unknown), "notes": notes}
        click.echo(json.dumps(stamped("infer", doc), indent=2))
        return
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if not states:
        click.echo(f"{file}: no group of calls of unknown method: nothing to infer")
        return
    click.echo(group_table(states))
    done = sum(s.changed and s.method is not None for s in states)
    verb = "would assign" if dry_run else "assigned"
    click.echo(f"{verb} {done} of {len(states)} groups; {len(unknown)} unknown" + ("" if dry_run else f" -> {file}"))
    if unknown:
        click.echo(_FIX)


def group_table(states: list[Any]) -> str:
    """flow, ref, calls, kinds, method or "unknown", how (or the candidates) as aligned plain text."""
    rows = [("flow", "ref", "calls", "kinds", "method", "how")]
    rows += [(str(s.flow_id), s.ref, str(s.calls), ",".join(f"{k}:{n}" for k, n in sorted(s.kinds.items())),
              s.method or "unknown", s.how or ("" if s.method else "not inferred: no descriptors")) for s in states]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5] for r in rows)
