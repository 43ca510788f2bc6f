"""What a person sees: a live panel while replaying and a summary table after (rich), or plain lines."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from replay.report import ReplayReport, error_lines, mismatch_where, threshold_line
from replay.stats import RunStats, percentiles_ms, percentiles_us

if TYPE_CHECKING:
    from replay.schedule import PlannedCall


def live_panel(stats: RunStats, total: int, elapsed_s: float) -> Group:
    """Progress bar, rate, p50/p99, lag and errors for the run so far."""
    done = sum(stats.outcomes.values())
    lat, lag = percentiles_ms(stats.latency), percentiles_us(stats.lag)
    rate = stats.sent / elapsed_s if elapsed_s > 0 else 0.0
    errs = sum(stats.errors.values()) + stats.outcomes["timeout"]
    line = Text.assemble(
        (f"{done}/{total} ", "bold"), f"rate {rate:,.0f}/s  ", f"p50 {lat['p50']:.2f} ms  ",
        f"p99 {lat['p99']:.2f} ms  ", f"lag p99 {lag['p99']:.0f} us  ",
        (f"rejected {stats.outcomes['rejected']}  ", "yellow"),
        (f"errors {errs}  ", "red" if errs else "green"), f"not sent {stats.outcomes['not_sent']}")
    return Group(ProgressBar(total=max(total, 1), completed=min(done, total), width=60), line)


def _fmt(d: dict[str, float], unit: str) -> str:
    return "  ".join(f"{k} {v:,.2f}{unit}" for k, v in d.items())


def summary_rows(rep: ReplayReport) -> list[tuple[str, str]]:
    """(label, value) pairs, shared by the table and the plain output."""
    errors = ", ".join(f"{k} {v}" for k, v in sorted(rep.errors.items())) or "0"
    not_sent = ", ".join(f"{k} {v}" for k, v in sorted(rep.not_sent_reasons.items())) or "0"
    rows = [("scheduled", str(rep.scheduled)), ("sent", str(rep.sent)), ("ok", str(rep.ok)),
            ("rejected", str(rep.rejected)), ("errors", errors), *[("error", line) for line in error_lines(rep)],
            ("timeouts", str(rep.timeouts)),
            ("not sent", not_sent), ("duration", f"{rep.duration_s:.2f} s"),
            ("achieved rate", f"{rep.achieved_rate:,.1f} calls/s"),
            ("latency (from intended)", _fmt(rep.latency_ms, " ms")),
            ("latency (from send)", _fmt(rep.latency_from_send_ms, " ms")),
            ("send lag", _fmt(rep.lag_us, " us")), ("drift", f"{rep.drift_pct:+.4f} %"),
            ("invariant", "ok" if rep.invariant_ok else "BROKEN: scheduled != accounted")]
    if len(rep.workers) > 1:  # each worker's share (--workers)
        rows += [(f"worker {w['worker']}", worker_line(w)) for w in rep.workers]
    if rep.mismatches:
        rows.append(("mismatches", str(rep.mismatches.get("total", 0))))
        rows += [("mismatch", mismatch_where(c)) for c in rep.mismatches.get("calls", [])[:_MISMATCH_ROWS]]
        if rep.mismatches.get("not_comparable"):   # recorded calls damaged or without a status: not compared
            rows.append(("not comparable", str(rep.mismatches["not_comparable"])))
    rows += [("problem", p) for p in rep.problems]
    rows += [("threshold", threshold_line(c)) for c in rep.thresholds]
    if rep.passed is not None:  # judged (replay.report.judge)
        rows.append(("verdict", "passed" if rep.passed else "FAILED: " + "; ".join(rep.failures)))
    return rows


_MISMATCH_ROWS = 5   # mismatched calls the summary lists (--json has up to 20)


def worker_line(w: dict[str, Any]) -> str:
    """"scheduled 344, sent 344, ok 344, not sent 0, lag p99 120 us" for one worker's share."""
    return (f"scheduled {w['scheduled']}, sent {w['sent']}, ok {w['ok']}, not sent {w['not_sent']}, "
            f"lag p99 {w['lag_p99_us']:,.0f} us" + ("" if w.get("complete", True) else " (final counts missing)"))


def summary_table(rep: ReplayReport) -> Table:
    title = f"replay to {rep.target} at {rep.speed:g}x ({len(rep.workers)} worker(s), seed {rep.seed})"
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", overflow="fold")
    for label, value in summary_rows(rep):
        failed = (label == "invariant" and not rep.invariant_ok) or label in ("problem", "error", "mismatch") \
            or (label in ("threshold", "verdict") and value.startswith("FAILED"))
        style = "red" if failed else "green" if label == "verdict" else None
        table.add_row(label, value, style=style)
    return table


def mismatch_table(mismatches: dict[str, Any]) -> Table:
    table = Table(title="responses compared with the recording")
    for col in ("method", "compared", "mismatched", "top fields", "not comparable"):
        table.add_column(col)
    for method, e in mismatches.get("by_method", {}).items():
        top = ", ".join(f"{f} {n}" for f, n in list(e["fields"].items())[:4])
        why = ", ".join(f"{w} {n}" for w, n in list(e.get("why", {}).items())[:3])
        table.add_row(method, str(e["compared"]), str(e["mismatched"]), top,
                      f"{e.get('not_comparable', 0)}" + (f" ({why})" if why else ""))
    return table


def plan_table(rows: list[PlannedCall], total: int, connections: int, span_s: float) -> Table:
    table = Table(title=f"dry run: {total} calls on {connections} connections over {span_s:.3f} s (nothing sent)")
    for col in ("#", "due ms", "connection", "method", "kind", "messages"):
        table.add_column(col)
    for p in rows:
        name = p.method or ("<unknown: not sent>" if p.protocol in ("grpc", "http2") else p.protocol)
        table.add_row(str(p.index), f"{p.due_ns / 1e6:.3f}", p.connection, name, p.kind, str(len(p.messages)))
    return table
