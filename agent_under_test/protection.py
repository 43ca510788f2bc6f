"""Self-protection for the agent: the real Guard (limiter, P99 monitor, alerts, degradation, metrics).

    admit()  ---> limiter.try_acquire(now) ---> None | retry-after s (counted as rejected)
    finish() ---> PeriodRecorder (HDR) + Prometheus latency/outcome
    choose_tier(depth) ---> TierSelector.on_queue        on_batch() ---> queue depth, batch size
    tick(now), once per period on a thread driven by the clock:
        summary (+ the serving thread's saturation, when a source is set) -> "period" event -> alerts ("alert" events) -> limiter ("limiter") -> tier ("tier")
    on_cache() / on_dependency() / on_circuit() (the response cache, cache.py) ---> cache and Redis metrics,
        "circuit" events, and the DependencyRecorder the DependencySlow alert judges at each tick

All decisions happen in `tick(now)` and the hooks, under one lock, with time passed in: tests build a
`ProtectionGuard` on a `FakeClock` and call `tick()` themselves (never `start()`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable

from agent_under_test.alerts import AlertSet, Transition
from agent_under_test.degrade import TierChange, TierSelector
from agent_under_test.events import EventLog
from agent_under_test.hooks import Guard, GuardConfig, NullGuard
from agent_under_test.limiter import Adjustment, Limiter, LimiterSettings, make_limiter
from agent_under_test.metrics import CIRCUIT_STATES, Metrics
from agent_under_test.metrics_http import MetricsServer
from agent_under_test.monitor import DependencyRecorder, PeriodRecorder, PeriodSummary
from wire.clock import Clock, MonotonicClock

P99_ALERT = "P99High"
_log = logging.getLogger(__name__)


class ProtectionGuard:
    """The Guard the agent serves with. Thread-safe: hooks may come from any thread."""

    def __init__(self, config: GuardConfig, clock: Clock | None = None) -> None:
        _validate(config)
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self.limiter: Limiter = make_limiter(config.limiter, LimiterSettings(
            threshold_ms=config.p99_threshold_ms, initial_rate=config.initial_rate,
            min_rate=config.min_rate, max_rate=config.max_rate, burst_s=config.burst_s))
        self.alerts = AlertSet(config.alert_periods, config.resolve_periods, config.error_ratio_threshold,
                               config.rejected_ratio_threshold, config.min_samples)
        self.tiers = TierSelector(config.tier, config.queue_light_depth, config.queue_drain_depth,
                                  hold_periods=config.tier_hold_periods, sustain_s=config.queue_sustain_s,
                                  period_s=config.period_s)
        self.events = EventLog(self.clock)
        self.metrics = Metrics(config.p99_threshold_ms / 1000.0, tuple(self.alerts.machines),
                               config.dependency_threshold_ms / 1000.0)
        self.metrics.limiter_rate.set(self.limiter.rate)
        self.metrics.set_tier(self.tiers.tier)
        self.metrics_url: str | None = None
        self.period = 0
        self.last_summary: PeriodSummary | None = None
        self._lock = threading.Lock()
        self._recorder = PeriodRecorder(self.clock.now())
        self._dependency = DependencyRecorder()
        self._server: MetricsServer | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._saturation: Callable[[], float | None] | None = None

    # -- the request path (hooks.Guard) -------------------------------------------------------------

    def admit(self, method: str) -> float | None:
        with self._lock:
            retry = self.limiter.try_acquire(self.clock.now())
            if retry is not None:
                self._recorder.reject()
        if retry is not None:
            self.metrics.outcome["rejected"].inc()
        return retry

    def finish(self, method: str, latency_s: float, outcome: str) -> None:
        with self._lock:
            self._recorder.record(latency_s, outcome)
        self.metrics.outcome.get(outcome, self.metrics.outcome["error"]).inc()
        self.metrics.latency.observe(latency_s)

    def choose_tier(self, queue_depth: int) -> str:
        with self._lock:
            change = self.tiers.on_queue(queue_depth, self.clock.now())
            tier = self.tiers.tier
        if change is not None:
            self._tier_event(change)
        return tier

    def on_batch(self, size: int, queue_depth: int, tier: str) -> None:
        self.metrics.batch_size.observe(size)
        self.metrics.queue_depth.set(queue_depth)

    def drops_expired(self) -> bool:
        return True

    def on_expired(self, fate: str, n: int) -> None:
        self.metrics.expired[fate].inc(n)

    def on_stage(self, stage: str, seconds: float) -> None:
        self.metrics.observe_stage(stage, seconds)

    # -- the response cache (cache.CacheHooks) ----------------------------------------------------------

    def on_cache(self, result: str) -> None:
        counter = self.metrics.cache.get(result)
        if counter is not None:
            counter.inc()

    def on_dependency(self, dependency: str, op: str, seconds: float, error: str | None) -> None:
        self.metrics.observe_dependency(op, seconds, error)
        with self._lock:
            self._dependency.record(seconds)

    def on_circuit(self, dependency: str, old: str, new: str) -> None:
        with self._lock:
            self._dependency.on_circuit(new)
        self.metrics.circuit_state.labels(dependency).set(CIRCUIT_STATES.index(new))
        self.events.emit("circuit", {"dependency": dependency, "from": old, "to": new})

    def set_saturation_source(self, source: Callable[[], float | None] | None) -> None:
        """Where each period's saturation comes from (`saturation.ThreadSaturation(tid).sample` for the
        serving thread); called once per period, at its end. None: periods carry no saturation."""
        self._saturation = source

    # -- periods --------------------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> PeriodSummary:
        """Close the current period at `now` (default: the clock's now) and act on it."""
        now = self.clock.now() if now is None else now
        source = self._saturation   # read /proc before taking the lock every admit() needs
        saturation = source() if source is not None else None
        with self._lock:
            self.period += 1
            summary = self._recorder.summarize(self.period, now, self.config.p99_threshold_ms,
                                               self.config.min_samples, saturation)
            self._recorder = PeriodRecorder(now)
            dependency = self._dependency.verdict(self.config.dependency_threshold_ms, self.config.min_samples)
            self._dependency = self._dependency.next_period()
            # alerts=False is the deliberately broken agent the chaos checks must catch.
            transitions = self.alerts.observe(summary) if self.config.alerts else []
            if self.config.alerts and (t := self.alerts.observe_dependency(dependency, self.period)) is not None:
                transitions.append(t)
            adjustment = self.limiter.on_period(summary)
            change = self.tiers.on_period(self.alerts.firing(P99_ALERT), summary.state, now)
            self.last_summary = summary
        self._publish(summary, transitions, adjustment, change, now)
        return summary

    def _publish(self, summary: PeriodSummary, transitions: list[Transition], adjustment: Adjustment | None,
                 change: TierChange | None, now: float) -> None:
        fields = summary.event_fields()
        fields["rate"] = _finite(self.limiter.rate)
        self.events.emit("period", fields, mono=now)
        m = self.metrics
        for q, value in (("0.5", summary.p50_ms), ("0.95", summary.p95_ms), ("0.99", summary.p99_ms)):
            m.period_latency.labels(q).set((value or 0.0) / 1000.0)
        m.period_count.set(summary.count)
        if summary.saturation is not None:
            m.saturation.set(summary.saturation)
        for t in transitions:
            self.events.emit("alert", t.event_fields(), mono=now)
            m.alert_firing.labels(t.alert).set(1 if t.to_state == "firing" else 0)
        if adjustment is not None:
            self.events.emit("limiter", adjustment.event_fields(), mono=now)
        m.limiter_rate.set(self.limiter.rate)
        if change is not None:
            self._tier_event(change, now)

    def _tier_event(self, change: TierChange, mono: float | None = None) -> None:
        self.events.emit("tier", change.event_fields(), mono=mono)
        self.metrics.set_tier(change.to_tier)

    def set_threshold(self, threshold_ms: float) -> None:
        """Change the P99 threshold from the next period on (e.g. to restore it after a test lowered it).

        The latency histogram keeps its bucket edge at the threshold it started with (Prometheus
        buckets are fixed for a process). Raises ValueError for a threshold that is not a finite positive
        number (an infinite one would keep the P99 alert from ever firing); nothing changes then."""
        if not (math.isfinite(threshold_ms) and threshold_ms > 0):
            raise ValueError("the P99 threshold must be a finite positive number")
        with self._lock:
            self.config = dataclasses.replace(self.config, p99_threshold_ms=threshold_ms)
            self.limiter.set_threshold(threshold_ms)
        self.metrics.threshold.set(threshold_ms / 1000.0)

    @property
    def tier(self) -> str:
        return self.tiers.tier

    def alert_state(self, name: str = P99_ALERT) -> str:
        return self.alerts.machines[name].state

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the metrics endpoint (if a port is configured) and start the period ticker thread.

        Raises ServeError when the metrics port cannot be bound; nothing is left running then."""
        if self._ticker is not None:
            return
        if self.config.metrics_port is not None:
            self._server = _bind(self.config, self.metrics, self.events, self.set_threshold)
            self._server.start()
            self.metrics_url = self._server.url
        with self._lock:
            self._recorder.start = self.clock.now()
        self._ticker = threading.Thread(target=self._run_ticks, name="agent-guard-ticks", daemon=True)
        self._ticker.start()

    def _run_ticks(self) -> None:
        # Ticks land on a fixed grid (start + n * period): a slow tick does not shift later ones.
        next_at = self.clock.now() + self.config.period_s
        while not self.clock.wait(self._stop, next_at - self.clock.now()):
            try:
                self.tick(next_at)
            except Exception:  # noqa: BLE001 - one bad period must not stop every later one
                _log.exception("guard period tick failed; the next period continues")
            next_at += self.config.period_s
            behind = self.clock.now() - next_at
            if behind > self.config.period_s:   # asleep for whole periods (e.g. SIGSTOP): skip them
                next_at += math.ceil(behind / self.config.period_s) * self.config.period_s

    def stop(self) -> None:
        """Stop ticking and close the endpoint; idempotent."""
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(timeout=5)
        if self._server is not None:
            self._server.stop()
            self._server = None


def _bind(config: GuardConfig, metrics: Metrics, events: EventLog,
          set_threshold: Callable[[float], None]) -> MetricsServer:
    from agent_under_test.errors import ServeError

    try:
        return MetricsServer(config.metrics_host, int(config.metrics_port or 0), metrics, events, set_threshold)
    except OSError as exc:
        raise ServeError(f"cannot serve metrics on {config.metrics_host}:{config.metrics_port}: {exc}; "
                         "pick a free --metrics-port (0 = any free port)") from exc


def _finite(rate: float) -> float | None:
    return round(rate, 6) if math.isfinite(rate) else None


def _validate(config: GuardConfig) -> None:
    from agent_under_test.errors import ServeError

    if config.period_s <= 0 or config.p99_threshold_ms <= 0:
        raise ServeError("--period-s and --p99-threshold-ms must be positive")
    if config.alert_periods < 1 or config.resolve_periods < 1:
        raise ServeError("--alert-periods and --resolve-periods must be at least 1")
    if not 0 < config.min_rate <= config.max_rate:
        raise ServeError("need 0 < --min-rate <= --max-rate")
    if not (math.isfinite(config.dependency_threshold_ms) and config.dependency_threshold_ms > 0):
        raise ServeError(f"--dependency-threshold-ms {config.dependency_threshold_ms:g}: must be a positive number")


def build_guard(config: GuardConfig, clock: Clock | None = None) -> Guard:
    """The Guard for `config`: `ProtectionGuard` (also with limiter `off`: alerts, tiers and metrics
    still work). Raises ServeError for a bad configuration or an unknown limiter."""
    from agent_under_test.errors import ServeError

    try:
        return ProtectionGuard(config, clock)
    except ValueError as exc:
        raise ServeError(f"bad protection settings: {exc}") from exc


__all__ = ["ProtectionGuard", "build_guard", "NullGuard", "P99_ALERT"]
