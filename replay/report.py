"""The final report of a run: the JSON fields the CLI writes and the harness reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from replay.stats import RunStats, percentiles_ms, percentiles_us


@dataclass
class ReplayReport:
    """What a run did. `invariant_ok`: scheduled == ok + rejected + errors + timeouts + not_sent."""

    scheduled: int
    sent: int
    ok: int
    rejected: int
    errors: dict[str, int]
    timeouts: int
    not_sent: int
    not_sent_reasons: dict[str, int]
    duration_s: float
    achieved_rate: float
    latency_ms: dict[str, float]
    latency_from_send_ms: dict[str, float]
    lag_us: dict[str, float]
    drift_pct: float
    end_lag_us: float
    mismatches: dict[str, Any]
    invariant_ok: bool
    target: str = ""
    speed: float = 1.0
    seed: int = 0
    workers: int = 1
    problems: list[str] = field(default_factory=list)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _drift(stats: RunStats) -> tuple[float, float]:
    """(total drift: how late the last send was, in percent of the intended span; that lag in us).

    Measured at the end, as tcpreplay measures its total time error: a scheduler that sleeps
    relative to the previous send accumulates its errors here; an absolute schedule does not."""
    if not stats.last_sent:
        return 0.0, 0.0
    end_lag = stats.last_sent - stats.last_intended
    intended = stats.last_intended - stats.first_intended
    return (round(100.0 * end_lag / intended, 4) if intended > 0 else 0.0), end_lag / 1000


def build(stats: RunStats, t0_ns: int, end_ns: int, *, target: str, options: Any, problems: list[str],
          comparer: Any = None, workers: int = 1) -> ReplayReport:
    """Assemble the report from (merged) stats; `options` is a ReplayOptions."""
    duration = max(0, end_ns - t0_ns) / 1e9
    span = (stats.last_sent - t0_ns) / 1e9 if stats.last_sent else 0.0  # from t0: a late start counts
    sent = stats.sent
    rate = sent / span if span > 0 else (sent / duration if duration > 0 else 0.0)
    drift_pct, end_lag = _drift(stats)
    o = stats.outcomes
    unknown = stats.not_sent.get("unknown_method", 0)
    if unknown:
        problems = [*problems, f"{unknown} calls not sent: their method is unknown (recorded on a connection "
                    "joined mid-stream); `shadowtest inspect FILE` lists their groups: name them with "
                    "--method-map FLOW:REF=METHOD, or `shadowtest infer FILE`"]
    return ReplayReport(
        scheduled=stats.scheduled, sent=sent, ok=o["ok"], rejected=o["rejected"], errors=dict(stats.errors),
        timeouts=o["timeout"], not_sent=o["not_sent"], not_sent_reasons=dict(stats.not_sent),
        duration_s=round(duration, 3), achieved_rate=round(rate, 1),
        latency_ms=percentiles_ms(stats.latency), latency_from_send_ms=percentiles_ms(stats.from_send),
        lag_us=percentiles_us(stats.lag), drift_pct=drift_pct, end_lag_us=end_lag,
        mismatches=comparer.summary() if comparer is not None else {},
        invariant_ok=stats.invariant_ok(), target=target, speed=options.schedule.speed,
        seed=options.schedule.seed, workers=workers, problems=list(problems))
