"""The PNG timeline: latency percentiles over time with fault windows shaded and alert bands,
offered/achieved/limiter rates, and the model tier plus CPU."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # matplotlib is imported only when a plot is drawn
    from matplotlib.axes import Axes

    from harness.report.write import RunResult
    from harness.timeline import Timeline


def plot_timeline(result: RunResult, path: Path) -> None:
    """Draw the run into `path` (PNG). Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # never needs a display
    import matplotlib.pyplot as plt

    tl = result.timeline
    fig, (ax_lat, ax_rate, ax_tier) = plt.subplots(3, 1, figsize=(11, 8), sharex=True,
                                                   gridspec_kw={"height_ratios": [3, 2, 1]})
    mids = [p.start_s + tl.period_s / 2 for p in tl.periods]
    for q, style in (("p50_ms", "-"), ("p95_ms", "--"), ("p99_ms", "-")):
        ax_lat.plot(mids, [getattr(p, q) for p in tl.periods], style, label=f"client {q[:3].upper()}",
                    linewidth=2 if q == "p99_ms" else 1)
    server = [(e.t, e.data.get("p99_ms")) for e in tl.events_of("period") if e.data.get("p99_ms") is not None]
    if server:
        ax_lat.plot(*zip(*server, strict=True), ":", color="black", label="agent P99")
    ax_lat.axhline(tl.threshold_ms, color="red", linewidth=0.8, label=f"threshold {tl.threshold_ms:g} ms")
    for start, end in tl.alert_intervals():
        # A solid strip along the top: a translucent band would vanish under the fault shading.
        ax_lat.axvspan(start, end if end is not None else tl.duration_s, ymin=0.94, ymax=1.0, color="red",
                       alpha=0.7, label="P99High firing")
    ax_lat.set_ylabel("latency (ms)")
    _rates(ax_rate, tl, mids)
    _tier(ax_tier, tl)
    for ax in (ax_lat, ax_rate, ax_tier):
        _shade(ax, tl)
    _legend(ax_lat)
    _legend(ax_rate)
    verdict = result.headline()
    ax_lat.set_title(f"{result.scenario.name} (seed {result.scenario.seed}): {verdict}")
    ax_tier.set_xlabel("seconds into the run")
    ax_tier.set_xlim(0, tl.duration_s + tl.period_s)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _rates(ax: Axes, tl: Timeline, mids: list[float]) -> None:
    ax.plot(mids, [p.offered_rate for p in tl.periods], label="offered/s")
    ax.plot(mids, [p.achieved_rate for p in tl.periods], label="achieved/s")
    ax.plot(mids, [p.rejected / tl.period_s for p in tl.periods], label="rejected/s")
    limiter = tl.limiter_series()
    if limiter:
        xs = [t for t, _ in limiter] + [tl.duration_s]
        ys = [r for _, r in limiter] + [limiter[-1][1]]
        ax.step(xs, ys, where="post", color="purple", label="limiter rate")
        peak = max(max(p.offered_rate for p in tl.periods), 1.0)
        top = max(r for _, r in limiter)
        # Show the limiter, but a ceiling of 20,000/s would flatten the traffic: cap the axis at 4x it.
        ax.set_ylim(0, max(10.0, min(top * 1.1, peak * 4), peak * 1.3))
    ax.set_ylabel("calls/s")


def _tier(ax: Axes, tl: Timeline) -> None:
    tiers = tl.tier_series()
    if tiers:
        xs = [0.0] + [t for t, _ in tiers] + [tl.duration_s]
        ys = [1] + [0 if tier == "light" else 1 for _, tier in tiers]
        ys.append(ys[-1])
        ax.step(xs, ys, where="post", color="green")
    ax.set_yticks([0, 1], ["light", "full"])
    ax.set_ylim(-0.3, 1.3)
    if tl.cpu:
        cpu_ax = ax.twinx()
        cpu_ax.plot([c.t for c in tl.cpu], [c.host_pct for c in tl.cpu], color="gray", alpha=0.6)
        cpu_ax.set_ylabel("host CPU %")
        cpu_ax.set_ylim(0, 105)
    ax.set_ylabel("tier")


def _shade(ax: Axes, tl: Timeline) -> None:
    for f in tl.faults:
        if f.applied_s is not None:
            end = f.removed_s if f.removed_s is not None else tl.duration_s
            ax.axvspan(f.applied_s, end, color="orange", alpha=0.15, label=f"fault: {f.family}:{f.kind}" + (f" on {f.on}" if f.on else ""))
    for name, start, _ in tl.phases:
        ax.axvline(start, color="gray", linewidth=0.6)
        if ax is ax.figure.axes[0]:
            ax.text(start, 1.0, f" {name}", transform=ax.get_xaxis_transform(), va="bottom", fontsize=8)


def _legend(ax: Axes) -> None:
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))   # one entry per label, although each band adds one
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left")
