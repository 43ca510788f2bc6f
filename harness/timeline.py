"""The run's timeline: client-side truth per call, the agent's events, scraped metrics, fault windows.

Every time is seconds from the start of the run (t=0 when the first phase starts), converted from
CLOCK_MONOTONIC, which the replayer, the harness and the agent's events (`mono`) all share on Linux.

    per-call results (replayer / generator) --> periods(): client P50/P95/P99, offered, achieved, ...
    /events (period, limiter, alert, tier)   --> limiter_series(), alert_intervals(), tier_series()
    /metrics scrapes                         --> the same series when a target has no events
    fault adapters                           --> fault windows (requested, took effect, removed)
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from wire.stats import percentile

OUTCOMES = ("ok", "rejected", "error", "timeout", "not_sent")


@dataclass(frozen=True)
class CallResult:
    """One call as the client saw it. Latency counts from the intended send time (no coordinated omission)."""

    intended_s: float
    sent_s: float | None
    done_s: float | None
    method: str
    outcome: str            # ok | rejected | error | timeout | not_sent
    code: str | None = None
    invalid: tuple[str, ...] = ()   # responses_valid: the rules an OK response broke ("invalid[ID]: ...")

    @property
    def latency_ms(self) -> float | None:
        return None if self.done_s is None else (self.done_s - self.intended_s) * 1000.0


@dataclass(frozen=True)
class PeriodStats:
    """Client-side statistics of the calls due in one period (`completed`: finished in it)."""

    index: int
    start_s: float
    end_s: float
    phase: str | None
    offered: int
    completed: int
    ok: int
    rejected: int
    errors: int
    timeouts: int
    not_sent: int
    p50_ms: float | None     # over admitted (ok) calls; None when too few to say
    p95_ms: float | None
    p99_ms: float | None

    @property
    def offered_rate(self) -> float:
        return self.offered / (self.end_s - self.start_s)

    @property
    def achieved_rate(self) -> float:
        return self.completed / (self.end_s - self.start_s)


@dataclass(frozen=True)
class Event:
    """One of the target's events (`type`: period | limiter | alert | tier), at `t` seconds into the run."""

    t: float
    type: str
    data: dict[str, Any]


@dataclass(frozen=True)
class MetricSample:
    """One scrape of /metrics: flattened names like 'agent_requests_total{outcome="ok"}' -> value."""

    t: float
    values: dict[str, float]


@dataclass
class FaultWindow:
    """When a fault was asked for, when it really took effect, when it was removed (None: never), and
    `effect`: what the fault was measured to do, read as it was removed (None: not measured)."""

    label: str
    phase: str
    family: str
    kind: str
    requested_s: float
    applied_s: float | None = None
    removed_s: float | None = None
    detail: str = ""
    error: str | None = None
    effect: dict[str, Any] | None = None
    on: str | None = None            # the dependency whose link it faulted (None: the target's inbound link)


@dataclass(frozen=True)
class CpuSample:
    t: float
    target_pct: float | None     # the target process's CPU use, % of one core
    host_pct: float              # all CPUs busy, % of the machine


@dataclass
class Timeline:
    period_s: float
    threshold_ms: float
    phases: list[tuple[str, float, float]]
    calls: list[CallResult] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    samples: list[MetricSample] = field(default_factory=list)
    cpu: list[CpuSample] = field(default_factory=list)
    faults: list[FaultWindow] = field(default_factory=list)
    replay_report: dict[str, Any] = field(default_factory=dict)
    metric_names: dict[str, str] = field(default_factory=dict)
    partial: bool = False
    min_samples: int = 10
    alert_periods: int = 3
    # Measured outside the target (harness.checks.truth): proxy upstream legs, the target's scheduler
    # stats, what a Prometheus server saw. Keys absent: not measured in this run.
    outside: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.phases[-1][2] if self.phases else 0.0

    def phase_bounds(self, name: str) -> tuple[float, float] | None:
        return next(((s, e) for n, s, e in self.phases if n == name), None)

    def phase_at(self, t: float) -> str | None:
        return next((n for n, s, e in self.phases if s <= t < e), None)

    @cached_property
    def periods(self) -> list[PeriodStats]:
        """Client-side stats per period, computed only from the per-call results.

        Calls belong to the period they were due in (their fate and latency, from the intended send
        time), so a period whose calls got stuck shows their full latency even if they completed
        much later; only `completed` (achieved rate) counts by completion time. Calls due after the
        end (never sent because the run stopped) are left out.
        """
        count = max(1, math.ceil(self.duration_s / self.period_s - 1e-9))
        offered = [0] * count
        completed = [0] * count
        by_outcome = [dict.fromkeys(OUTCOMES, 0) for _ in range(count)]
        lat: list[list[float]] = [[] for _ in range(count)]
        for c in self.calls:
            if c.intended_s >= self.duration_s and c.outcome == "not_sent":
                continue
            i = self._index(c.intended_s, count)
            offered[i] += 1
            by_outcome[i][c.outcome if c.outcome in OUTCOMES else "error"] += 1
            if c.outcome in ("ok", "timeout") and c.latency_ms is not None:
                lat[i].append(c.latency_ms)   # a timeout is an admitted call that took at least that long
            if c.done_s is not None and c.outcome != "not_sent":
                completed[self._index(c.done_s, count)] += 1
        return [self._period(i, offered[i], completed[i], by_outcome[i], sorted(lat[i])) for i in range(count)]

    def _index(self, t: float, count: int) -> int:
        return min(count - 1, max(0, int(t // self.period_s)))

    def _period(self, i: int, offered: int, completed: int, outcomes: dict[str, int],
                lat: list[float]) -> PeriodStats:
        start = i * self.period_s
        enough = len(lat) >= self.min_samples
        q = (lambda p: round(percentile(lat, p), 3) if enough else None)  # noqa: E731
        return PeriodStats(i, start, start + self.period_s, self.phase_at(start + self.period_s / 2), offered,
                           completed, outcomes["ok"],
                           outcomes["rejected"], outcomes["error"], outcomes["timeout"], outcomes["not_sent"],
                           q(0.50), q(0.95), q(0.99))

    @cached_property
    def _due_times(self) -> list[float]:
        return sorted(c.intended_s for c in self.calls)

    def calls_due(self, start: float, end: float) -> int:
        """How many calls were due in [start, end) (planned there, whatever became of them)."""
        return bisect.bisect_left(self._due_times, end) - bisect.bisect_left(self._due_times, start)

    def calls_between(self, start: float, end: float) -> list[CallResult]:
        """Calls that completed (or were due, if never done) in [start, end)."""
        return [c for c in self.calls if start <= (c.done_s if c.done_s is not None else c.intended_s) < end]

    # --- the target's view -------------------------------------------------------------------------
    def events_of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.type == kind]

    def metric(self, name: str) -> list[tuple[float, float]]:
        """(t, value) for one flattened metric name across scrapes."""
        return [(s.t, s.values[name]) for s in self.samples if name in s.values]

    def limiter_series(self) -> list[tuple[float, float]]:
        """The limiter's rate over time: exact from events, else scraped (agent_limiter_rate)."""
        scraped = self.metric(self.metric_names.get("limiter_rate", "agent_limiter_rate"))
        events = [(e.t, float(e.data["new_rate"])) for e in self.events_of("limiter") if "new_rate" in e.data]
        if not events:
            return scraped
        first = self.events_of("limiter")[0]
        start = [(min(0.0, first.t), float(first.data["old_rate"]))] if "old_rate" in first.data else []
        return start + events

    def rate_at(self, t: float) -> float | None:
        """The limiter rate in force at time t (the last change at or before t)."""
        value = None
        for when, rate in self.limiter_series():
            if when > t:
                break
            value = rate
        return value

    def alert_metric(self, alert: str = "P99High") -> str:
        """The scraped series of the alert's firing gauge (agent_alert_firing{alert=...} by default)."""
        return self.metric_names.get("alert_firing", "agent_alert_firing") + f'{{alert="{alert}"}}'

    def alert_intervals(self, alert: str = "P99High") -> list[tuple[float, float | None]]:
        """(start, end) of each firing interval; end None when still firing at the end."""
        evs = [e for e in self.events_of("alert") if e.data.get("alert", alert) == alert]
        if evs:
            return _intervals([(e.t, e.data.get("to") == "firing") for e in evs])
        name = self.alert_metric(alert)
        return _intervals([(t, v >= 1) for t, v in self.metric(name)])

    def alert_observed(self, alert: str = "P99High") -> bool:
        """Whether the run could see the alert's state at all: the target's event stream (which carries
        its alert transitions) said something, or a scrape held its firing gauge. Without either, an
        alert that never fired is not known to have stayed silent."""
        name = self.alert_metric(alert)
        return bool(self.events) or any(name in s.values for s in self.samples)

    def tier_series(self) -> list[tuple[float, str]]:
        """(t, tier) at each tier change: events, else scraped agent_model_tier{tier="light"}."""
        evs = self.events_of("tier")
        if evs:
            return [(e.t, str(e.data.get("to"))) for e in evs]
        name = self.metric_names.get("model_tier", "agent_model_tier") + '{tier="light"}'
        out: list[tuple[float, str]] = []
        for t, v in self.metric(name):
            tier = "light" if v >= 1 else "full"
            if not out or out[-1][1] != tier:
                out.append((t, tier))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"period_s": self.period_s, "threshold_ms": self.threshold_ms, "partial": self.partial,
                "phases": [{"name": n, "start_s": s, "end_s": e} for n, s, e in self.phases],
                "periods": [asdict(p) for p in self.periods],
                "faults": [asdict(f) for f in self.faults],
                "limiter": self.limiter_series(), "alerts": self.alert_intervals(),
                "tiers": self.tier_series(), "events": [asdict(e) for e in self.events],
                "cpu": [asdict(c) for c in self.cpu], "replay": self.replay_report}


def _intervals(points: list[tuple[float, bool]]) -> list[tuple[float, float | None]]:
    out: list[tuple[float, float | None]] = []
    start: float | None = None
    for t, on in points:
        if on and start is None:
            start = t
        elif not on and start is not None:
            out.append((start, t))
            start = None
    if start is not None:
        out.append((start, None))
    return out
