"""`shadowtest inspect`: what a recording holds."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from harness.console import is_terminal, make_console
from harness.outputs import stamped


@click.command("inspect")
@click.argument("file", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print machine-readable JSON")
@click.option("--calls", "show_calls", type=int, default=0, help="also list the first N calls")
@click.option("--strict", is_flag=True,
              help="exit 1 unless the recording is complete (no gap, loss, damaged or unanswered call, encrypted flow)")
def command(file: str, as_json: bool, show_calls: int, strict: bool) -> None:
    """Summarise a recording: flows, calls per method, rate over time, payload sizes, loss, joins.

    Exit 0 for a sound recording, 1 when it is damaged (cut off, a damaged WAL or page, a row that fails
    its checksum, written from a damaged source; what was readable is still shown). Every
    problem is listed, also those that leave the file usable but incomplete (gaps, lost or truncated
    events, damaged calls, calls without a status, bodies not captured, TLS flows): `complete` is
    then false, and `--strict` exits 1 for them too.
    JSON keys include flows, calls, methods, lost_events, truncated_events, unknown_method_calls,
    duration_s (first to last timestamp of the traffic), capture_duration_s (how long the recorder ran), joined_flows, rate_per_s, request_bytes, response_bytes, calls_pending, problems.
    A `--decode later` file (or a killed at-stop one) has no calls until `shadowtest record --finish`:
    that is listed as a problem, with the command to run.

    Connections joined mid-stream: calls whose :path the recorder never saw are grouped per connection
    and HPACK reference (`method_groups`: flow, ref, calls, kinds, method or unknown, how it was
    found). Calls whose method is still unknown are a problem (complete false, exit 1) naming the fix:
    `shadowtest infer FILE --descriptors X.protoset` or `--method-map FLOW:REF=METHOD`.

    \b
    Examples:
      shadowtest inspect prod.rec
      shadowtest inspect prod.rec --json | jq .methods
      shadowtest inspect prod.rec --calls 5
    """
    from capture.integrity import check
    from capture.rotate import as_one, set_files
    from capture.salvage import open_salvaged
    from capture.summary import summarize

    shown, file = file, as_one(file)   # a rotated set (a directory or a glob): read as one recording
    integrity = check(file)      # cut, WAL, pages, row checksums: what reading alone would not see
    with open_salvaged(file, wal_damaged=integrity.wal_damaged) as rec:
        report = summarize(rec, integrity=integrity)
        calls = [_call_row(c) for _, c in zip(range(show_calls), rec.calls(), strict=False)]
        blocking = report.pop("blocking_problems", len(report["problems"]))
        damaged = bool(rec.problems) or blocking > 0
        report["problems"] = list(dict.fromkeys(report["problems"] + rec.problems))
        report["complete"] = report["complete"] and not report["problems"]
    if shown != file:
        report["file"] = shown
        report["set_files"] = len(set_files(shown) or [])
    if calls:
        report["first_calls"] = calls
    if as_json:
        click.echo(json.dumps(stamped("inspect", report), indent=2))
    elif is_terminal(sys.stdout):
        _rich(report)
    else:
        _plain(report)
    sys.exit(1 if damaged or (strict and not report["complete"]) else 0)


def _call_row(c: Any) -> dict[str, object]:
    return {k: getattr(c, k) for k in ("method", "kind", "status", "stream_id", "request_ts_ns", "method_unknown",
                                     "method_ref", "method_how")} | {
        "requests": len(c.requests), "responses": len(c.responses)}


_GROUPS_SHOWN = 50


def _group_text(g: dict[str, Any]) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in g["kinds"].items())
    named = f"{g['method']} ({g['how']})" if g["method"] else "unknown"
    return f"{g['calls']} calls ({kinds}) -> {named}"


def _plain(r: dict[str, Any]) -> None:
    from capture.summary import sparkline

    for key in ("file", "backend", "flows", "joined_flows", "calls", "duration_s", "capture_duration_s", "lost_events",
                "truncated_events", "unknown_method_calls", "protocols", "statuses", "request_bytes",
                "response_bytes", "redaction_rules"):
        click.echo(f"{key}: {r[key]}")
    for name, n in r["methods"].items():
        click.echo(f"method {name}: {n}")
    click.echo(f"complete: {str(r['complete']).lower()}")
    if r["method_groups"] or r["unknown_method_ungrouped"]:
        click.echo(f"unresolved_method_calls: {r['unresolved_method_calls']}")
        click.echo(f"unknown_method_ungrouped: {r['unknown_method_ungrouped']}")
    for g in r["method_groups"][:_GROUPS_SHOWN]:
        click.echo(f"group flow {g['flow']} {g['ref']}: {_group_text(g)}")
    if len(r["method_groups"]) > _GROUPS_SHOWN:
        click.echo(f"group ... {len(r['method_groups']) - _GROUPS_SHOWN} more (--json lists them all)")
    click.echo(f"rate: {sparkline([int(x) for x in r['rate_per_s']])}")
    for p in r["problems"]:
        click.echo(f"problem: {p}")
    for c in r.get("first_calls", []):
        click.echo(f"call: {c}")


def _rich(r: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from capture.summary import sparkline

    con = make_console()   # values are escaped: a path or method with [brackets] is not rich markup
    rate = r["rate_per_s"]
    head = Table.grid(padding=(0, 2))
    loss_style = "red" if r["lost_events"] or r["truncated_events"] else "green"
    for k, v in (("file", escape(str(r["file"]))), ("backend", escape(str(r["backend"]))),
                 ("duration", f"{r['duration_s']:.2f} s"),
                 ("flows", f"{r['flows']} ({r['joined_flows']} joined mid-stream)"), ("calls", r["calls"]),
                 ("loss", f"[{loss_style}]lost {r['lost_events']}, truncated {r['truncated_events']}[/]"),
                 ("unknown method", r["unknown_method_calls"]), ("protocols", escape(str(r["protocols"]))),
                 ("complete", "[green]yes[/]" if r["complete"] else "[red]no[/] (see the problems below)"),
                 ("rate", f"{sparkline([int(x) for x in rate])}  peak {max(rate, default=0):.0f}/s"),
                 ("request bytes", escape(str(r["request_bytes"]))),
                 ("response bytes", escape(str(r["response_bytes"]))),
                 ("redaction", escape(", ".join(r["redaction_rules"])) or "none")):
        head.add_row(f"[bold]{k}[/]", str(v))
    con.print(head)
    table = Table(title="calls per method")
    table.add_column("method")
    table.add_column("calls", justify="right")
    for name, n in r["methods"].items():
        table.add_row(escape(name), str(n))
    con.print(table)
    if r["method_groups"]:
        groups = Table(title="method groups (connections joined mid-stream; name them with shadowtest infer)")
        for col in ("flow", "ref", "calls", "kinds", "method", "how"):
            groups.add_column(col, overflow="fold")
        for g in r["method_groups"][:_GROUPS_SHOWN]:
            groups.add_row(str(g["flow"]), escape(str(g["ref"])), str(g["calls"]),
                           escape(", ".join(f"{k} {n}" for k, n in g["kinds"].items())),
                           escape(g["method"]) if g["method"] else "[red]unknown[/]", escape(g["how"] or ""))
        if len(r["method_groups"]) > _GROUPS_SHOWN:
            groups.caption = f"{len(r['method_groups']) - _GROUPS_SHOWN} more: --json lists them all"
        con.print(groups)
    if r["unknown_method_ungrouped"]:
        con.print(f"{r['unknown_method_ungrouped']} call(s) of joined connections began before the recording "
                  "(request headers not seen): no method, not replayed")
    for p in r["problems"]:
        con.print(f"[red]problem:[/] {escape(str(p))}")
    for c in r.get("first_calls", []):
        con.print(c)
