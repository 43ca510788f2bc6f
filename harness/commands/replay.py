"""`shadowtest replay`: replay a recording open-loop with its original timing (see replay/)."""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click

from harness.outputs import stamped, verdict_exit
from replay.options import click_options

_PCT = click.FloatRange(0, 100)
_FILE = click.Path(dir_okay=False)


# ---- TLS and header options: the model's groups, shared with `traffic` and `capacity` -----------------
tls_options = click_options("tls")          # --tls, --ca, --cert, --key, --insecure, --server-name
header_options = click_options("headers")   # --set-header, --set-query, --set-field, --drop-header, ...


def build_tls(tls: bool, ca: str | None, cert: str | None, key: str | None, insecure: bool,
              server_name: str | None, sender: str = "auto") -> Any:
    """The TlsConfig of the TLS options, None without them; a bad file or combination: click.UsageError (exit 2)."""
    from replay.senders.tls import TlsConfig, TlsConfigError

    try:
        return TlsConfig.from_options(tls, ca, cert, key, insecure, server_name, sender)
    except TlsConfigError as exc:
        raise click.UsageError(str(exc)) from exc


def _json_on_error(f: Any) -> Any:
    """--json is written on every exit: an error (a refused file or target, a bad option value, a
    comparison that cannot start) writes {"error", "exit_code", "passed": false, ...} before the CLI
    prints its one line."""
    @functools.wraps(f)
    def wrapped(**kwargs: Any) -> Any:
        try:
            return f(**kwargs)
        except Exception as exc:   # SystemExit (the verdict's exit) is not an Exception: it passes
            json_out = kwargs.get("json_out")
            if json_out:
                _write_json(_error_report(exc, kwargs), json_out)
            raise
    return wrapped


def _error_report(exc: Exception, kwargs: dict[str, Any]) -> dict[str, Any]:
    message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
    code = exc.exit_code if isinstance(exc, click.ClickException) else 1
    return {"error": " ".join(message.split()), "exit_code": code, "passed": False, "failures": [message],
            "file": str(kwargs.get("file")), "target": kwargs.get("target")}


def _sampling_factor(file: Path) -> float:
    """100 / the share of connections a sampled recording kept (--scale-to-full); a usage error otherwise."""
    from capture.errors import RecordingError
    from capture.recording import Recording

    try:
        with Recording(file) as rec:
            sampling = rec.meta.get("sampling")
    except RecordingError as exc:
        raise click.BadParameter(str(exc), param_hint="FILE") from exc
    pct = sampling.get("pct") if isinstance(sampling, dict) else None
    if not isinstance(pct, (int, float)) or not 0 < pct <= 100:
        raise click.UsageError(f"--scale-to-full: {file} was not recorded with --sample (its meta has no sampling)")
    factor = 100.0 / float(pct)
    click.echo(f"scaling to full load: x{factor:.3g} connections ({pct:g} % of connections were recorded)", err=True)
    return factor


@click.command("replay")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--target", required=True, metavar="HOST:PORT", help="where to send (loopback unless allowed)")
@click.option("--workers", type=int, default=1, show_default=True,
              help="processes sharing the calls (round-robin by call; each opens its own connections)")
@click.option("--scale-to-full", is_flag=True,
              help="a sampled recording (record --sample PCT): multiply --scale by 100 / PCT, so the replay "
                   "sends full load with new connections shaped like the recorded ones")
@click_options("replay")
@click.option("--compare", is_flag=True, help="compare responses with the recorded ones")
@click.option("--descriptors", default="reflection", show_default=True,
              help="for --compare: reflection, bytes, FILE.protoset or module names")
@click.option("--ignore-field", "ignore", multiple=True,
              help="for --compare: field glob to ignore (protobuf field paths, JSON paths of HTTP bodies)")
@click.option("--max-mismatch-pct", type=_PCT, metavar="P",
              help="with --compare: calls whose response differs at most P % of those compared  [default: 0, "
                   "any mismatch fails]")
@click.option("--salvage", is_flag=True,
              help="replay the intact part of a damaged recording; the calls lost count as not sent "
                   "(damaged_recording) and fail the run unless --max-not-sent-pct allows them")
@click_options("tls", "headers")
@click.option("--dry-run", is_flag=True, help="print the plan and send nothing")
@click.option("--json", "--json-out", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              is_flag=False, flag_value="-", help="--json: the report as JSON on stdout; --json-out FILE: to a file")
@click.option("--max-error-pct", type=_PCT, metavar="P",
              help="threshold: errors + timeouts (connection errors included) at most P % of the calls sent; "
                   "rejections do not count (see --max-rejected-pct)")
@click.option("--max-rejected-pct", type=_PCT, metavar="P",
              help="threshold: calls rejected (RESOURCE_EXHAUSTED, HTTP 429) at most P % of the calls sent")
@click.option("--max-not-sent-pct", type=_PCT, metavar="P",
              help="threshold: calls not sent (any reason, unknown_method included) at most P % of those scheduled")
@click.option("--max-p99-ms", type=click.FloatRange(min=0), metavar="MS",
              help="threshold: p99 latency from the intended send time at most MS")
@click.option("--max-lag-p99-us", type=click.FloatRange(min=0), metavar="US",
              help="threshold: the replayer's own send lag p99 at most US (above it the replay was not faithful)")
@click.option("--min-ok", type=click.IntRange(min=0), metavar="N",
              help="threshold: at least N calls ok  [default: 1 when any call is scheduled; 0: off]")
@_json_on_error
def command(file: Path, target: str, workers: int, scale_to_full: bool, compare: bool, descriptors: str,
            ignore: tuple[str, ...], max_mismatch_pct: float | None, salvage: bool, dry_run: bool,
            json_out: Path | None, max_error_pct: float | None, max_rejected_pct: float | None,
            max_not_sent_pct: float | None, max_p99_ms: float | None, max_lag_p99_us: float | None,
            min_ok: int | None, **values: Any) -> None:
    """Replay FILE to --target with its original timing (open loop), then summarise.

    Exit 0 when the run passed; 99 when it ran and a threshold failed: one given by a --max-* option
    (or --min-ok) exceeded, and, by default, no call succeeded; 1 when the run broke: a scheduled call
    not accounted for (ok + rejected + errors + timeouts + not sent), or calls lost to a damaged
    recording; 2 on a usage error.
    The summary (and --json's `thresholds`, `failures`) says which threshold failed with its
    numbers, and why the first call of each error kind failed.

    Calls whose method is unknown (recorded on a connection joined mid-stream, not named by the
    file's method map) are never sent blind: they count as not sent, unknown_method, unless
    --method-map names their group.

    A damaged recording (cut off, a damaged WAL or page, a row failing its checksum) is refused unless
    --salvage. With --compare any response that differs from the recording fails the run unless
    --max-mismatch-pct allows it; --json is written on every exit, an error's too.

    \b
    Examples:
      shadowtest replay prod.rec --target 127.0.0.1:50051
      shadowtest replay prod.rec --target 127.0.0.1:50051 --speed 2 --loop 3 --json out.json
      shadowtest replay prod.rec --target 127.0.0.1:50051 --max-error-pct 1 --max-p99-ms 50
      shadowtest replay prod.rec --target 127.0.0.1:50051 --window 10:70 --method Decide --compare
      shadowtest replay prod.rec --target shadow.internal:50051 --allow-target shadow.internal --workers 2
      shadowtest replay prod.rec --target 127.0.0.1:50051 --dry-run
      shadowtest replay prod.rec --target 127.0.0.1:50051 --method-map 3:hpack:5,4,3=/pkg.Svc/Method
      shadowtest replay web.rec --target 127.0.0.1:8443 --tls --ca ca.pem --set-header 'authorization=Bearer shadow'
      shadowtest replay web.rec --target 127.0.0.1:8080 --set-query api_key=shadow-key --set-field password=shadow-pass

    TLS (--tls, --ca, --cert/--key, --insecure, --server-name) works with every sender. Every call
    carries x-shadowtest-replay: 1 (--no-marker) and no trace context (--keep-trace-context); redacted
    credentials are never replayed: give the replay its own with --set-header. Query parameters and
    body fields the recorder masked go out as the recorded run of '*' unless --set-query/--set-field
    give them a value.
    """
    from dataclasses import replace

    from capture.rotate import as_one
    from replay.compare import CompareSpec
    from replay.errors import TargetNotAllowedError
    from replay.options import CLI, OptionError, build
    from replay.report import Thresholds, judge
    from replay.target import check_target

    if workers < 1:
        raise click.BadParameter("must be at least 1", param_hint="--workers")
    file = Path(as_one(file, salvage))   # a rotated set (a directory or a glob): one recording
    if scale_to_full:
        values["scale"] *= _sampling_factor(file)
    try:   # bad option values and a refused target are usage errors: exit 2, nothing sent
        opts = build(values)
        check_target(target, opts.allow_targets)
    except OptionError as exc:
        raise click.UsageError(exc.spelled(CLI)) from exc
    except TargetNotAllowedError as exc:
        raise click.UsageError(str(exc)) from exc
    found = refuse_damaged(file, salvage)   # a damaged file is refused (one line naming --salvage) or salvaged
    opts = replace(opts, salvage=salvage, compare=CompareSpec(descriptors, ignore, opts.tls,
                                                              _reflection_metadata(opts.headers)) if compare else None)
    opts = _infer_methods(file, target, opts.allow_targets, opts, found)   # groups still unknown: the target's reflection
    sched = opts.schedule
    if dry_run:
        _dry_run(file, sched, json_out, found)
        return
    limits = Thresholds(max_error_pct=max_error_pct, max_rejected_pct=max_rejected_pct,
                        max_not_sent_pct=max_not_sent_pct, max_p99_ms=max_p99_ms, max_lag_p99_us=max_lag_p99_us,
                        min_ok=min_ok, max_mismatch_pct=max_mismatch_pct)
    report = judge(_run(file, target, opts, workers, found), limits)
    _emit(report, json_out)
    if str(json_out) == "-":  # stdout is the JSON: say why the run failed on stderr, one line each
        for failure in report.failures:
            click.echo(f"replay FAILED: {failure}", err=True)
    sys.exit(verdict_exit(bool(report.passed), report.broken))


_REFLECTION_TIMEOUT_S = 2.0


def refuse_damaged(file: Path, salvage: bool) -> Any:
    """The file's capture.integrity check; without --salvage a damaged file is a one-line error (exit 1)."""
    from capture.errors import CorruptRecordingError
    from capture.integrity import check

    found = check(file)
    if not found.intact and not salvage:
        raise CorruptRecordingError(found.refusal("replay"))
    return found


def _reflection_metadata(policy: Any) -> tuple[tuple[str, str], ...]:
    """What the replay's own calls add (--set-header credentials, the marker), for its reflection calls."""
    from replay.senders.headers import DEFAULT_POLICY

    return tuple((policy or DEFAULT_POLICY).apply([], "grpc"))
_SHOWN_GROUPS = 10


def _infer_methods(file: Path, target: str, allow: tuple[str, ...], opts: Any, found: Any) -> Any:
    """Name the groups of calls still unknown (by neither the file's method map nor --method-map)
    from the target's reflection (read-only; the target passed check_target above), for this replay
    only: the file is not changed. Returns `opts` with what fits added to its method map."""
    from dataclasses import replace

    from capture.salvage import open_salvaged
    from harness.infer import describe, load_source, resolve_groups
    from replay.errors import ReplayError

    sched = opts.schedule
    rec = open_salvaged(file, wal_damaged=found.wal_damaged)
    try:
        rec.map_methods({(flow, ref): m for flow, ref, m in sched.method_map})
        groups = [g for g in rec.method_groups() if g.method is None and g.protocol == "grpc"
                  and (not sched.flows or g.flow_id in sched.flows)]
        if not groups:
            return opts
        try:
            source = load_source(f"reflection={target}", allow, _REFLECTION_TIMEOUT_S, tls=opts.tls,
                                 metadata=_reflection_metadata(opts.headers))
        except ReplayError as exc:
            click.echo(f"methods: {len(groups)} groups of calls of unknown method are not sent; reflection not "
                       f"available ({exc}); name them with --method-map FLOW:REF=METHOD", err=True)
            return opts
        states = resolve_groups(groups, lambda g: rec.group_calls(g.flow_id, g.ref), lambda g: [source])
    finally:
        rec.close()
    for state in states[:_SHOWN_GROUPS]:
        click.echo(f"methods (this replay only): {describe(state)}", err=True)
    if len(states) > _SHOWN_GROUPS:
        click.echo(f"methods: ... {len(states) - _SHOWN_GROUPS} more groups", err=True)
    found = tuple((s.flow_id, s.ref, s.method) for s in states if s.method)
    return replace(opts, schedule=replace(sched, method_map=sched.method_map + found))


def _dry_run(file: Path, sched: Any, json_out: Path | None, found: Any) -> None:
    from harness.console import make_console
    from replay.plan import plan_from_recording
    from replay.view import plan_table

    rec, plan = plan_from_recording(file, sched, salvage=found)
    head: list[Any] = []
    total, last, conns = 0, 0, set()
    for p in plan:
        head += [p] if len(head) < 20 else []
        total, last = total + 1, p.due_ns
        conns.add(p.connection)
    rec.close()
    if json_out:
        data = {"dry_run": True, "scheduled": total, "connections": len(conns), "span_s": last / 1e9,
                "first": [{"index": p.index, "due_ms": p.due_ns / 1e6, "connection": p.connection,
                           "method": p.method, "kind": p.kind, "messages": len(p.messages)} for p in head]}
        _write_json(data, json_out)
    if str(json_out) != "-":
        make_console().print(plan_table(head, total, len(conns), last / 1e9))


def _run(file: Path, target: str, opts: Any, workers: int, found: Any) -> Any:
    from harness.console import make_console
    from replay.plan import estimate_total
    from replay.stats import RunStats

    console = make_console(stderr=True)
    total = estimate_total(file, opts.schedule, found)
    holder: dict[str, Any] = {"stats": RunStats()}
    if workers > 1:
        from replay.workers import WorkerPool
        runner: Any = WorkerPool(file, target, opts, workers,
                                 on_progress=lambda s: holder.__setitem__("stats", s))
    else:
        from replay.engine import ReplayRun
        runner = ReplayRun(file, target, opts)
        holder["stats"] = runner.stats
    thread = threading.Thread(target=lambda: holder.__setitem__("report", _guarded(runner, holder)))
    started = time.monotonic()
    thread.start()
    try:
        _watch(console, thread, holder, total, started)
    except KeyboardInterrupt:
        runner.stop()  # Ctrl-C: a clean early stop; the rest is counted as not sent
        thread.join()
    if "error" in holder:
        raise holder["error"]
    return holder["report"]


def _guarded(runner: Any, holder: dict[str, Any]) -> Any:
    try:
        return runner.run()
    except Exception as exc:  # re-raised in the main thread so the CLI prints one red line
        holder["error"] = exc
        return None


def _watch(console: Any, thread: threading.Thread, holder: dict[str, Any], total: int, started: float) -> None:
    from replay.view import live_panel

    if not console.is_terminal:
        while thread.is_alive():
            thread.join(1.0)
            s = holder["stats"]
            if thread.is_alive():
                print(f"replay: {sum(s.outcomes.values())}/{total} done, {s.sent} sent", file=sys.stderr)
        return
    from rich.live import Live
    with Live(console=console, refresh_per_second=4, transient=True) as live:
        while thread.is_alive():
            live.update(live_panel(holder["stats"], total, time.monotonic() - started))
            thread.join(0.25)


def _emit(report: Any, json_out: Path | None) -> None:
    from harness.console import make_console
    from replay.view import mismatch_table, summary_rows, summary_table

    if json_out:
        _write_json(report.to_json(), json_out)
    if str(json_out) == "-":
        return
    console = make_console()
    if console.is_terminal:
        console.print(summary_table(report))
        if report.mismatches:
            console.print(mismatch_table(report.mismatches))
    else:
        for label, value in summary_rows(report):
            print(f"{label}: {value}")


def _write_json(data: dict[str, Any], json_out: Path) -> None:
    text = json.dumps(stamped("replay", data), indent=2)
    if str(json_out) == "-":
        click.echo(text)
    else:
        json_out.write_text(text + "\n")
