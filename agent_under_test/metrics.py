"""Prometheus metrics of the agent: counters, gauges and fast histograms in the guard's own registry.

The HTTP endpoint that serves them (/metrics, /events, /healthz, /threshold) is `metrics_http.py`.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

OUTCOME_LABELS = ("ok", "rejected", "invalid", "error")
STAGES = ("parse", "features", "strategy", "risk", "order")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STAGE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A dependency's (Redis) operations: fine from 0.1 ms (a local hit) to 50 ms, plus an edge at the threshold.
_DEPENDENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01,
                       0.015, 0.02, 0.03, 0.05, 0.1, 0.5)
DEPENDENCY_OPS = ("get", "set", "ping")   # a lookup, a write batch, a health PING (cache.RedisTier)
DEPENDENCY_ERRORS = ("timeout", "error")
CACHE_RESULTS = ("hit_local", "hit_redis", "stale", "miss")
CIRCUIT_STATES = ("closed", "half_open", "open")   # agent_dependency_circuit_state = the index


_Child = TypeVar("_Child")


def latency_buckets(threshold_s: float) -> list[float]:
    """The request-latency buckets, always with an edge at exactly the P99 threshold."""
    return sorted(set(_LATENCY_BUCKETS) | {float(threshold_s)})


class _HistogramChild:
    """One series: per-bucket counts (not cumulative) and the sum, under one lock."""

    __slots__ = ("_bounds", "_last", "_lock", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds, self._lock = tuple(bounds), threading.Lock()
        self._last = len(bounds) - 1
        self.counts, self.sum = [0] * len(bounds), 0.0

    def observe(self, value: float) -> None:
        i = bisect_left(self._bounds, value)   # the first bucket with value <= le, as Prometheus counts
        if i > self._last:                     # NaN: only +Inf could hold it
            i = self._last
        with self._lock:
            self.counts[i] += 1
            self.sum += value


class _Family(Generic[_Child]):
    """A labelled family of series on a registry: the children by label values, made once each. Its
    subclasses say how a child is made and how the family is exposed (collect)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self._name, self._doc, self._labelnames = name, documentation, list(labelnames)
        self._children: dict[tuple[str, ...], _Child] = {}
        self._lock = threading.Lock()
        if not labelnames:
            self._children[()] = self._new_child()
        registry.register(self)

    def _new_child(self) -> _Child:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError

    def labels(self, *values: str) -> _Child:
        """The series for these label values (created once; keep it to skip this lookup)."""
        with self._lock:
            child = self._children.get(values)
            if child is None:
                child = self._children[values] = self._new_child()
            return child

    def _series(self) -> list[tuple[tuple[str, ...], _Child]]:
        with self._lock:
            return list(self._children.items())


class FastHistogram(_Family[_HistogramChild]):
    """A Prometheus histogram for the request path: observe() is a bisect and two additions under one
    lock (~0.4 us). prometheus_client's Histogram takes a lock per bucket and per sum and checks
    exemplars (~2-3 us), and the agent observes several times per call. Same exposition (no _created)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry,
                 labelnames: Sequence[str] = ()) -> None:
        self._bounds = sorted({float(b) for b in buckets} | {math.inf})
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self._bounds)

    def observe(self, value: float) -> None:
        """Unlabelled histograms only."""
        self._children[()].observe(value)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for values, child in self._series():
            with child._lock:
                counts, total = list(child.counts), child.sum
            cumulative, buckets = 0, []
            for bound, count in zip(self._bounds, counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), float(cumulative)))
            family.add_metric(list(values), buckets, total)
        yield family


class _CounterChild:
    """One counter series: inc() is one addition under a lock (~0.15 us; prometheus_client's Counter.inc
    also checks exemplars and costs ~1.5 us, on every call's path)."""

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self._lock, self.value = threading.Lock(), 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        with self._lock:
            self.value += amount


class FastCounter(_Family[_CounterChild]):
    """A Prometheus counter for the request path (see _CounterChild). Same exposition as
    prometheus_client's Counter (`<name>_total`), without the `_created` series."""

    def _new_child(self) -> _CounterChild:
        return _CounterChild()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        for values, child in self._series():
            family.add_metric(list(values), child.value)
        yield family


class Metrics:
    """Every metric the agent exports, on a private registry (no global state, one per guard)."""

    def __init__(self, threshold_s: float, alerts: tuple[str, ...], dependency_threshold_s: float = 0.01) -> None:
        r = self.registry = CollectorRegistry()
        self.latency = FastHistogram("agent_request_latency_seconds", "Server-side latency of admitted calls",
                                     latency_buckets(threshold_s), r)
        self.requests = FastCounter("agent_requests", "Calls by outcome", ["outcome"], r)
        self.outcome = {o: self.requests.labels(o) for o in OUTCOME_LABELS}
        self.limiter_rate = Gauge("agent_limiter_rate", "Limiter rate in calls/s (+Inf: off)", registry=r)
        self.period_latency = Gauge("agent_period_latency_seconds", "Last period's latency quantiles",
                                    ["quantile"], registry=r)
        self.period_count = Gauge("agent_period_requests", "Calls finished in the last period", registry=r)
        self.alert_firing = Gauge("agent_alert_firing", "1 while the alert fires", ["alert"], registry=r)
        self.tier = Gauge("agent_model_tier", "1 for the tier being served", ["tier"], registry=r)
        self.saturation = Gauge("agent_loop_saturation", "Serving thread's busy share of the last period "
                                "(on a CPU or waiting for one; 1 = no spare capacity)", registry=r)
        self.loop_stalls = Gauge("agent_loop_stalls", "Stalls of the serving loop seen so far (a heartbeat 2 ms or "
                                 "more late: throttled, starved of CPU, stopped)", registry=r)
        self.loop_stalled = Gauge("agent_loop_stalled_seconds", "Time the serving loop could not run, summed: "
                                  "requests that arrived meanwhile are timed from their arrival", registry=r)
        self.queue_depth = Gauge("agent_queue_depth", "Batcher queue depth after the last batch", registry=r)
        expired = FastCounter("agent_expired_calls", "Calls past their deadline (client gone) when their batch "
                              "formed: dropped before the forward pass, or computed for nobody", ["fate"], r)
        self.expired = {f: expired.labels(f) for f in ("dropped", "computed")}
        self.batch_size = FastHistogram("agent_batch_size", "Requests per forward pass", _BATCH_BUCKETS, r)
        self.stage = FastHistogram("agent_stage_latency_seconds", "Per pipeline stage latency", _STAGE_BUCKETS, r,
                                   ["stage"])
        self.stage_child = {s: self.stage.labels(s) for s in STAGES}
        self.threshold = Gauge("agent_p99_threshold_seconds", "The P99 threshold", registry=r)
        self.threshold.set(threshold_s)
        for alert in alerts:
            self.alert_firing.labels(alert).set(0)
        for q in ("0.5", "0.95", "0.99"):
            self.period_latency.labels(q).set(0)
        self._dependency_metrics(r, dependency_threshold_s)

    def _dependency_metrics(self, r: CollectorRegistry, threshold_s: float) -> None:
        """The response cache and its middleware (Redis): every series exists from the start, at zero,
        so rules and dashboards see them even before (or without) a cache."""
        self.dependency = FastHistogram("agent_dependency_seconds", "Time of each operation on a dependency "
                                        "(timeouts count at the time they were abandoned)",
                                        sorted(set(_DEPENDENCY_BUCKETS) | {float(threshold_s)}), r,
                                        ["dependency", "op"])
        errors = FastCounter("agent_dependency_errors", "Failed dependency operations by kind",
                             ["dependency", "op", "kind"], r)
        self.dependency_child = {op: self.dependency.labels("redis", op) for op in DEPENDENCY_OPS}
        self.dependency_errors = {(op, k): errors.labels("redis", op, k) for op in DEPENDENCY_OPS
                                  for k in DEPENDENCY_ERRORS}
        self.circuit_state = Gauge("agent_dependency_circuit_state", "Circuit breaker of a dependency: "
                                   "0 closed, 1 half_open, 2 open", ["dependency"], registry=r)
        self.circuit_state.labels("redis").set(0)
        cache = FastCounter("agent_cache", "Response cache lookups by result", ["result"], r)
        self.cache = {res: cache.labels(res) for res in CACHE_RESULTS}
        self.dependency_threshold = Gauge("agent_dependency_threshold_seconds", "The DependencySlow threshold",
                                          registry=r)
        self.dependency_threshold.set(threshold_s)

    def observe_dependency(self, op: str, seconds: float, error: str | None) -> None:
        """One Redis operation: its time, and its error kind (timeout | error) if it failed."""
        child = self.dependency_child.get(op)
        if child is not None:
            child.observe(seconds)
        if error is not None and (counter := self.dependency_errors.get((op, error))) is not None:
            counter.inc()

    def set_tier(self, tier: str) -> None:
        for name in ("full", "light"):
            self.tier.labels(name).set(1 if name == tier else 0)

    def observe_stage(self, stage: str, seconds: float) -> None:
        child = self.stage_child.get(stage)
        if child is None:   # a new stage name: create its series once, then reuse it
            child = self.stage_child[stage] = self.stage.labels(stage)
        child.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
