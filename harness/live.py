"""The live view while a scenario runs: rich panel on a terminal, one plain line per period otherwise.

    phase  [#######.....]  12.0/45.0s   offered 400/s  achieved 398/s
    P50 ▁▁▂▁  P95 ▁▂▅▇  P99 ▂▃▇█ 31.2ms   limiter 812/s   alert firing   tier light
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from harness.console import is_terminal, make_console

if TYPE_CHECKING:
    from rich.panel import Panel

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float | None], width: int = 24) -> str:
    """A unicode sparkline of the last `width` values (None drawn as a space)."""
    vals = values[-width:]
    known = [v for v in vals if v is not None]
    if not known:
        return " " * len(vals)
    low, high = min(known), max(known)
    span = (high - low) or 1.0
    return "".join(" " if v is None else _BARS[min(7, int((v - low) / span * 7.999))] for v in vals)


@dataclass
class Snapshot:
    """What the runner knows at one instant (all rates per second, latencies in ms). p50/p95/p99 are
    the completed periods' values, oldest first; None for a period without calls (or too few)."""

    elapsed_s: float
    total_s: float
    phase: str
    offered: float = 0.0
    achieved: float = 0.0
    p50: list[float | None] = field(default_factory=list)
    p95: list[float | None] = field(default_factory=list)
    p99: list[float | None] = field(default_factory=list)
    limiter_rate: float | None = None
    alert: str = "inactive"
    tier: str = "full"
    faults: list[str] = field(default_factory=list)
    rejected: int = 0
    errors: int = 0


def _last(values: list[float | None]) -> str:
    """The latest period's value, or `-` when that period has none (no calls, or too few for a
    percentile): never an older period's value repeated as if it were now."""
    return f"{values[-1]:.1f}ms" if values and values[-1] is not None else "-"


def plain_line(s: Snapshot) -> str:
    """One line per period for logs and CI (no colours, no cursor tricks)."""
    rate = "-" if s.limiter_rate is None else f"{s.limiter_rate:.0f}/s"
    faults = ",".join(s.faults) or "none"
    return (f"[{s.elapsed_s:6.1f}s/{s.total_s:.0f}s] phase={s.phase} offered={s.offered:.0f}/s "
            f"achieved={s.achieved:.0f}/s p50={_last(s.p50)} p95={_last(s.p95)} p99={_last(s.p99)} "
            f"limiter={rate} alert={s.alert} tier={s.tier} rejected={s.rejected} errors={s.errors} faults={faults}")


class LiveView:
    """Shows snapshots: a rich Live panel on a TTY, plain lines (one per `every_s`) otherwise."""

    def __init__(self, title: str, stream: TextIO | None = None, rich: bool | None = None,
                 every_s: float = 1.0) -> None:
        self.stream = stream or sys.stdout
        self.rich = is_terminal(self.stream) if rich is None else rich
        self.title = title
        self.every_s = every_s
        self._live: Any = None
        self._last_plain = -1e9

    def __enter__(self) -> LiveView:
        if self.rich:
            from rich.live import Live

            self._live = Live(console=make_console(file=self.stream), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def log(self, line: str) -> None:
        """A runner event (fault applied, phase started) shown above the live panel."""
        if self._live is not None:
            self._live.console.print(line, highlight=False, markup=False)
        else:
            print(line, file=self.stream, flush=True)

    def update(self, s: Snapshot) -> None:
        if self._live is not None:
            self._live.update(self._panel(s))
        elif s.elapsed_s - self._last_plain >= self.every_s:
            self._last_plain = s.elapsed_s
            print(plain_line(s), file=self.stream, flush=True)

    def _panel(self, s: Snapshot) -> Panel:
        from rich.markup import escape
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        grid = Table.grid(padding=(0, 2))
        bar = ProgressBar(total=max(s.total_s, 1e-9), completed=s.elapsed_s, width=40)
        grid.add_row(f"[bold]{escape(s.phase)}[/]", bar, f"{s.elapsed_s:.1f}/{s.total_s:.0f}s")
        grid.add_row("rate", f"offered {s.offered:.0f}/s  achieved {s.achieved:.0f}/s",
                     f"rejected {s.rejected}  errors {s.errors}")
        for name, values in (("P50", s.p50), ("P95", s.p95), ("P99", s.p99)):
            grid.add_row(name, sparkline(values), _last(values))
        style = "bold red" if "firing" in s.alert else "yellow" if "pending" in s.alert else ""
        alert = f"[{style}]{escape(s.alert)}[/]" if style else escape(s.alert)
        rate = "-" if s.limiter_rate is None else f"{s.limiter_rate:.0f}/s"
        grid.add_row("limiter", rate, f"alert {alert}   tier {escape(s.tier)}")
        grid.add_row("faults", escape(", ".join(s.faults)) or "none", "")
        return Panel(grid, title=escape(self.title), expand=False)
