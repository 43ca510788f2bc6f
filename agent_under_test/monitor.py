"""The period monitor: one HDR histogram per period of calls -> P50/P95/P99, counts and a verdict.

    finish(latency, outcome) --> PeriodRecorder (HDR histogram in microseconds, outcome counts)
                                     |  tick(now): swap in a fresh recorder
                                     v
                                 PeriodSummary(count, p50/p95/p99, ok, rejected, errors, state)

A period with fewer than `min_samples` finished calls is `insufficient`: its P99 would be one or two
slow calls, so it neither breaches nor heals an alert (see docs/protection.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hdrh.histogram import HdrHistogram

# Microsecond resolution from 1 us to 10 minutes at 3 significant digits (0.1 % value error).
_LOWEST_US = 1
_HIGHEST_US = 600_000_000
_DIGITS = 3

BREACHING = "breaching"
HEALTHY = "healthy"
INSUFFICIENT = "insufficient"
OUTCOMES = ("ok", "invalid", "error")


@dataclass(frozen=True)
class PeriodSummary:
    """What one period saw. Latencies are server-side, of calls that finished in the period."""

    period: int
    start: float
    end: float
    count: int          # finished calls: ok + invalid + error
    ok: int
    invalid: int
    errors: int
    rejected: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    state: str          # breaching | healthy | insufficient
    saturation: float | None = None   # the serving thread's busy share of the period (None: not measured)

    @property
    def seconds(self) -> float:
        return max(1e-9, self.end - self.start)

    def event_fields(self) -> dict[str, object]:
        """The `period` event's payload (keys the chaos harness codes against)."""
        data = asdict(self)
        for key in ("start", "end"):
            data.pop(key)
        data["period_s"] = round(self.seconds, 6)
        return data


class PeriodRecorder:
    """Collects one period's calls. Not thread-safe on its own: the guard holds a lock around it."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.hist = HdrHistogram(_LOWEST_US, _HIGHEST_US, _DIGITS)
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.rejected = 0

    def record(self, latency_s: float, outcome: str) -> None:
        """Count one finished call; unknown outcomes count as errors (never dropped)."""
        key = outcome if outcome in self.counts else "error"
        self.counts[key] += 1
        # Clamp into the histogram's range: a negative or absurd latency must not lose the call.
        us = min(_HIGHEST_US, max(_LOWEST_US, round(latency_s * 1e6)))   # round: 1.005e-3 * 1e6 is 1004.99...
        self.hist.record_value(us)

    def reject(self) -> None:
        self.rejected += 1

    def summarize(self, period: int, end: float, threshold_ms: float, min_samples: int,
                  saturation: float | None = None) -> PeriodSummary:
        """Quantiles and the period's verdict against `threshold_ms` (strictly above breaches)."""
        count = sum(self.counts.values())
        p50 = p95 = p99 = None
        if count:
            p50, p95, p99 = (self.hist.get_value_at_percentile(q) / 1000.0 for q in (50.0, 95.0, 99.0))
        return PeriodSummary(
            period=period, start=self.start, end=end, count=count, ok=self.counts["ok"],
            invalid=self.counts["invalid"], errors=self.counts["error"], rejected=self.rejected,
            p50_ms=p50, p95_ms=p95, p99_ms=p99,
            state=classify(count, p99, threshold_ms, min_samples), saturation=saturation)


def classify(count: int, p99_ms: float | None, threshold_ms: float, min_samples: int) -> str:
    """`insufficient` below `min_samples` calls, else `breaching` when P99 > threshold, else `healthy`."""
    if count < max(1, min_samples) or p99_ms is None:
        return INSUFFICIENT
    return BREACHING if p99_ms > threshold_ms else HEALTHY


def summary_from_values(period: int, start: float, end: float, latencies_ms: list[float],
                        threshold_ms: float, min_samples: int, rejected: int = 0,
                        errors: int = 0, saturation: float | None = None) -> PeriodSummary:
    """Build a summary from explicit latencies (tests and benchmarks); every latency counts as ok."""
    rec = PeriodRecorder(start)
    for ms in latencies_ms:
        rec.record(ms / 1000.0, "ok")
    for _ in range(errors):
        rec.record(0.001, "error")
    rec.rejected = rejected
    return rec.summarize(period, end, threshold_ms, min_samples, saturation)


class DependencyRecorder:
    """One period of a dependency's (Redis) operations and its circuit, for the DependencySlow alert.
    Not thread-safe on its own: the guard holds its lock around it."""

    def __init__(self, circuit: str = "closed") -> None:
        self.hist = HdrHistogram(_LOWEST_US, _HIGHEST_US, _DIGITS)
        self.count = 0
        self.circuit = circuit
        self.was_open = circuit == "open"   # open at any time in the period

    def record(self, seconds: float) -> None:
        self.count += 1
        self.hist.record_value(min(_HIGHEST_US, max(_LOWEST_US, round(seconds * 1e6))))

    def on_circuit(self, state: str) -> None:
        self.circuit = state
        self.was_open = self.was_open or state == "open"

    @property
    def p99_ms(self) -> float | None:
        return self.hist.get_value_at_percentile(99.0) / 1000.0 if self.count else None

    def verdict(self, threshold_ms: float, min_samples: int) -> str:
        """`breaching` when the circuit was open in the period or the ops' P99 > threshold (with at
        least `min_samples` ops), `healthy` with that many ops under it, else `insufficient`."""
        if self.was_open:
            return BREACHING
        return classify(self.count, self.p99_ms, threshold_ms, min_samples)

    def next_period(self) -> DependencyRecorder:
        """A fresh recorder that starts in this one's circuit state."""
        return DependencyRecorder(self.circuit)
