"""What the traffic generator reports: rates, latency percentiles from intended send time (nearest rank,
wire/stats.py), errors by code."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from agent_under_test.traffic_lanes import CallResult
from wire.stats import percentiles


@dataclass
class TrafficReport:
    target: str
    pattern: str
    seed: int
    rate: float               # requested mean calls/s
    duration_s: float         # requested
    sent: int
    ok: int
    achieved_rate: float      # calls sent / seconds spent sending
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    send_lag_p99_ms: float | None   # how late sends left vs their schedule (the generator's own health)
    errors: dict[str, int]          # by gRPC code name, e.g. {"RESOURCE_EXHAUSTED": 12}
    by_method: dict[str, int]
    results: list[CallResult] = field(default_factory=list, repr=False)

    def to_dict(self, include_results: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["results"] = [asdict(r) for r in self.results] if include_results else None
        if not include_results:
            d.pop("results")
        return d


def _pcts(values: list[float], *qs: float) -> list[float | None]:
    """Nearest-rank percentiles (wire/stats.py), in ms to 3 decimals; None for no values."""
    if not values:
        return [None] * len(qs)
    got = percentiles(values, qs)
    return [round(got[q], 3) for q in qs]


def summarize(target: str, pattern: str, seed: int, rate: float, duration_s: float,
              results: list[CallResult], start_ns: int, end_ns: int) -> TrafficReport:
    """Aggregate per-call results into a report (latency only over calls answered OK)."""
    ok = [r for r in results if r.code == "OK"]
    lat = [(r.done_ns - r.intended_ns) / 1e6 for r in ok]
    lag = [(r.sent_ns - r.intended_ns) / 1e6 for r in results]
    span = max((end_ns - start_ns) / 1e9, 1e-9)
    codes = Counter(r.code or "UNANSWERED" for r in results if r.code != "OK")
    methods = Counter(r.method.rsplit("/", 1)[-1] for r in results)
    p50, p95, p99 = _pcts(lat, 0.5, 0.95, 0.99)
    (lag99,) = _pcts(lag, 0.99)
    return TrafficReport(target, pattern, seed, rate, duration_s, len(results), len(ok),
                         round(len(results) / span, 1), p50, p95, p99, lag99, dict(codes), dict(methods), results)
