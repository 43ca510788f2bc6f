"""A Markdown summary for CI job pages: the verdicts first, then phases, faults and the client view."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.report.write import RunResult


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.1f}{unit}"


def markdown(result: RunResult, png_name: str | None = None, command: str = "chaos") -> str:
    """The run summarised in Markdown (verdict table, fault windows, per-phase client stats)."""
    s, tl = result.scenario, result.timeline
    head = result.headline(partial="")
    lines = [f"## shadowtest {command}: {s.name} -- {head}", "",
             f"{result.tally()}; seed {s.seed}; "
             f"{tl.duration_s:.1f}s; period {tl.period_s:g}s; P99 threshold {tl.threshold_ms:g} ms."]
    if result.interrupted:
        lines += ["", f"**Run interrupted ({result.interrupted}): partial report.**"]
    lines += ["", "| check | verdict | why |", "|---|---|---|"]
    skipped = "**skipped** (fails under --strict)" if result.strict else "skipped"
    for v in result.verdicts:
        mark = {"pass": "pass", "fail": "**FAIL**", "skipped": skipped}[v.status]
        lines.append(f"| `{v.id}` | {mark} | {v.summary.replace('|', '/')} |")
    lines += ["", "### Phases (client-side view)", "",
              "| phase | time | offered/s | achieved/s | ok | rejected | errors | worst period P50 ms | worst period P99 ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, start, end in tl.phases:
        ps = [p for p in tl.periods if p.phase == name]
        span = max(1e-9, end - start)
        p99s = [p.p99_ms for p in ps if p.p99_ms is not None]
        p50s = [p.p50_ms for p in ps if p.p50_ms is not None]
        lines.append(f"| {name} | {start:.1f}-{end:.1f}s | {sum(p.offered for p in ps) / span:.0f} | "
                     f"{sum(p.completed for p in ps) / span:.0f} | {sum(p.ok for p in ps)} | "
                     f"{sum(p.rejected for p in ps)} | {sum(p.errors + p.timeouts for p in ps)} | "
                     f"{_fmt(max(p50s) if p50s else None)} | {_fmt(max(p99s) if p99s else None)} |")
    deps = tl.outside.get("dependencies") or []
    if deps:
        lines += ["", "### Dependencies", "", "| dependency | address | its proxy | started |", "|---|---|---|---|"]
        for d in deps:
            started = f"pid {d['started_pid']}" if d.get("started_pid") else "external"
            lines.append(f"| {d['name']} ({d['kind']}) | {d['address']} | {d['proxy']} | {started} |")
    if tl.faults:
        lines += ["", "### Faults", "", "| fault | phase | asked | took effect | removed | note |",
                  "|---|---|---|---|---|---|"]
        for f in tl.faults:
            lines.append(f"| {f.label} | {f.phase} | {f.requested_s:.2f}s | {_fmt(f.applied_s, 's')} | "
                         f"{_fmt(f.removed_s, 's')} | {f.error or f.detail} |")
    for note in result.notes:
        lines += ["", f"> {note}"]
    if png_name:
        lines += ["", f"![timeline]({png_name})"]
    return "\n".join(lines) + "\n"
