"""The agent with deliberate defects, for proving that each chaos check catches what it is for.

    python tests/broken_agent.py DEFECT[,DEFECT...] serve --port 0 ...   (the agent's own `serve` options)

Each defect is a subclass of one of the agent's parts (its guard, limiter, alert set, tier selector or
period recorder), swapped in when the guard is built; the rest is the real agent, started as a real
process by `BrokenAgent` (an AgentProcess whose command runs this file). The defects:

    alert_late         P99High fires on the (N+1)-th consecutive breach instead of the N-th
    alert_early        P99High fires on the first breaching period (a rule that forgets "consecutive")
    alert_false        P99High judges the P99 against 0 ms (pages on any latency, however healthy)
    p99_is_p95         every period's "P99" is its P95
    limiter_flat       the limiter never changes its rate
    limiter_leaky      the limiter reports its rate but admits every call
    limiter_stuck_low  the limiter cuts but never grows back
    limiter_grows      each healthy period doubles the rate (x2 where the policy says x1.1)
    leak               every finished call keeps 64 KB for good
    deadlines_ignored  calls whose deadline passed while they queued are computed all the same
    constant_light     the light tier answers every call with the same decision (status OK, wrong answer)
    degrade_never      the tier never changes
    degrade_stuck      once light, the tier never returns to full
    flapping           the tier flips at forward passes, up to 5 times a second
    lose_counts        every 25th finished call is missing from agent_requests_total
    errors             every 8th batch fails (INTERNAL) instead of running
    slow               the event loop stalls for 60 ms every 200 ms (at a call's admission): 30 % of the loop
                       whatever the host's speed or the call rate
    cache_blocks       Redis lookups wait without any timeout: a call blocks on a slow or stopped Redis
    circuit_stuck      once open, the Redis circuit never half-opens, so it never closes again
    dependency_alert_never  DependencySlow never fires (the Redis P99 and circuit are judged, never acted on)
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from agent_under_test import protection
from agent_under_test.alerts import AlertSet, Transition
from agent_under_test.degrade import FULL, LIGHT, TierChange, TierSelector
from agent_under_test.hooks import GuardConfig
from agent_under_test.launch import AgentProcess, serve_args
from agent_under_test.limiter import Adjustment, Limiter
from agent_under_test.monitor import PeriodRecorder, PeriodSummary, classify

DEFECTS = ("alert_late", "alert_early", "alert_false", "p99_is_p95", "limiter_flat", "limiter_leaky", "limiter_stuck_low",
           "limiter_grows", "leak", "deadlines_ignored", "constant_light",
           "degrade_never", "degrade_stuck", "flapping", "lose_counts", "errors", "slow",
           "cache_blocks", "circuit_stuck", "dependency_alert_never")


class BrokenAgent(AgentProcess):
    """AgentProcess running this file with `defects` (set the class attribute in a subclass)."""

    defects: tuple[str, ...] = ()

    def command(self) -> list[str]:
        opts = {**self.options, "ready_file": str(self._ready_path)}
        return [sys.executable, str(Path(__file__).resolve()), ",".join(self.defects) or "none", "serve",
                *serve_args(opts)]


def broken(*defects: str) -> type[BrokenAgent]:
    """An AgentProcess class whose agent has `defects`."""
    unknown = set(defects) - set(DEFECTS)
    if unknown:
        raise ValueError(f"unknown defects {sorted(unknown)}")
    return type("Broken_" + "_".join(defects), (BrokenAgent,), {"defects": tuple(defects)})


# --- the defects ---------------------------------------------------------------------------------------

class _LimiterDefect:
    """Wraps the real limiter; each defect changes one thing."""

    def __init__(self, inner: Limiter, defect: str) -> None:
        self.inner, self.defect, self.policy = inner, defect, inner.policy

    @property
    def rate(self) -> float:
        return self.inner.rate

    def try_acquire(self, now: float) -> float | None:
        retry = self.inner.try_acquire(now)
        return None if self.defect == "limiter_leaky" else retry

    def on_period(self, summary: PeriodSummary) -> Adjustment | None:
        if self.defect == "limiter_flat":
            return None
        before = self.inner.rate
        adjustment = self.inner.on_period(summary)
        if self.defect == "limiter_stuck_low" and adjustment is not None and adjustment.new_rate > before:
            self.inner.bucket.set_rate(before)    # (the seed and gradient limiters sit on a token bucket)
            return None
        if self.defect == "limiter_grows" and adjustment is not None and adjustment.new_rate > before:
            doubled = min(before * 2, self.inner.s.max_rate)
            self.inner.bucket.set_rate(doubled)
            return dataclasses.replace(adjustment, new_rate=doubled, reason=f"{adjustment.reason} (doubled)")
        return adjustment

    def set_threshold(self, threshold_ms: float) -> None:
        self.inner.set_threshold(threshold_ms)


class _LateAlerts(AlertSet):
    def __init__(self, config: GuardConfig) -> None:
        super().__init__(config.alert_periods + 1, config.resolve_periods, config.error_ratio_threshold,
                         config.rejected_ratio_threshold, config.min_samples)


class _EarlyAlerts(AlertSet):
    def __init__(self, config: GuardConfig) -> None:
        super().__init__(1, config.resolve_periods, config.error_ratio_threshold,
                         config.rejected_ratio_threshold, config.min_samples)


class _FalseAlerts(AlertSet):
    def __init__(self, config: GuardConfig) -> None:
        super().__init__(config.alert_periods, config.resolve_periods, config.error_ratio_threshold,
                         config.rejected_ratio_threshold, config.min_samples)
        # any latency breaches: a twentieth of the threshold (2.5 ms of 50) let a fast host's healthy P99 pass
        self.threshold_ms = 0.0

    def observe(self, summary: PeriodSummary) -> list[Transition]:
        state = classify(summary.count, summary.p99_ms, self.threshold_ms, self.min_samples)
        return super().observe(dataclasses.replace(summary, state=state))


class _QuietDependencyAlerts(AlertSet):
    def __init__(self, config: GuardConfig) -> None:
        super().__init__(config.alert_periods, config.resolve_periods, config.error_ratio_threshold,
                         config.rejected_ratio_threshold, config.min_samples)

    def observe_dependency(self, verdict: str, period: int) -> Transition | None:
        return None


def _break_cache(defects: frozenset[str]) -> None:
    """The cache defects: patched into the real cache module's Redis tier and circuit."""
    from agent_under_test import cache

    if "cache_blocks" in defects:
        init = cache.RedisTier.__init__

        def blocking_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.backstop = None      # not even the backstop

        async def unbounded(self: Any, op: str, call: Any) -> Any:
            start = time.perf_counter()
            result = await call()      # no budget: as long as Redis takes
            self.hooks.on_dependency(cache.DEPENDENCY, op, time.perf_counter() - start, None)
            return result

        cache.RedisTier.__init__ = blocking_init  # type: ignore[method-assign]
        cache.RedisTier._bounded = unbounded      # type: ignore[method-assign]
    if "circuit_stuck" in defects:
        cache.Circuit._half_open_due = lambda self, now: False  # type: ignore[method-assign]


class _Tiers(TierSelector):
    def __init__(self, defect: str, config: GuardConfig) -> None:
        super().__init__(config.tier, config.queue_light_depth, config.queue_drain_depth,
                         hold_periods=config.tier_hold_periods, sustain_s=config.queue_sustain_s,
                         period_s=config.period_s)
        self.defect = defect

    def on_queue(self, depth: int, now: float) -> TierChange | None:
        if self.defect == "flapping":      # flips at forward passes, at most every 0.2 s
            if self.changed_at is not None and now - self.changed_at < 0.2:
                return None
            old, self.tier, self.changed_at = self.tier, LIGHT if self.tier == FULL else FULL, now
            return TierChange(old, self.tier, "queue")
        if self.defect == "degrade_never":
            return None
        if self.defect == "degrade_stuck" and self.tier == LIGHT:
            return None
        return super().on_queue(depth, now)

    def on_period(self, firing: bool, verdict: str, now: float) -> TierChange | None:
        if self.defect == "degrade_never":
            return None
        if self.defect == "flapping":
            return None
        if self.defect == "degrade_stuck" and self.tier == LIGHT:
            return None
        return super().on_period(firing, verdict, now)


class _P95Recorder(PeriodRecorder):
    def summarize(self, period: int, end: float, threshold_ms: float, min_samples: int,
                  saturation: float | None = None) -> PeriodSummary:
        s = super().summarize(period, end, threshold_ms, min_samples, saturation)
        return dataclasses.replace(s, p99_ms=s.p95_ms, state=classify(s.count, s.p95_ms, threshold_ms, min_samples))


class BrokenGuard(protection.ProtectionGuard):
    """The real guard with the parts the defects name swapped for broken subclasses."""

    defects: frozenset[str] = frozenset()

    def __init__(self, config: GuardConfig, clock: Any = None) -> None:
        super().__init__(config, clock)
        d = self.defects
        for defect in ("limiter_flat", "limiter_leaky", "limiter_stuck_low", "limiter_grows"):
            if defect in d:
                self.limiter = _LimiterDefect(self.limiter, defect)
        if "alert_late" in d:
            self.alerts = _LateAlerts(config)
        if "alert_false" in d:
            self.alerts = _FalseAlerts(config)
        if "alert_early" in d:
            self.alerts = _EarlyAlerts(config)
        if "dependency_alert_never" in d:
            self.alerts = _QuietDependencyAlerts(config)
        for defect in ("degrade_never", "degrade_stuck", "flapping"):
            if defect in d:
                self.tiers = _Tiers(defect, config)
        self._finished = 0
        self._kept: list[bytes] = []
        self._batches = 0
        self._stalled_at = 0.0

    # The recorder is replaced at every tick; a P95-for-P99 recorder replaces it each time.
    @property
    def _recorder(self) -> PeriodRecorder:
        return self.__dict__["_rec"]

    @_recorder.setter
    def _recorder(self, value: PeriodRecorder) -> None:
        if "p99_is_p95" in self.defects and not isinstance(value, _P95Recorder):
            value = _P95Recorder(value.start)
        self.__dict__["_rec"] = value

    def drops_expired(self) -> bool:
        return "deadlines_ignored" not in self.defects

    def admit(self, method: str) -> float | None:
        if "slow" in self.defects:
            now = time.monotonic()
            if now - self._stalled_at >= 0.2:
                self._stalled_at = now
                time.sleep(0.06)           # on the event loop: every call behind it waits too
        return super().admit(method)

    def finish(self, method: str, latency_s: float, outcome: str) -> None:
        self._finished += 1
        if "leak" in self.defects:
            self._kept.append(b"\x01" * 65536)   # written, so resident: RSS grows 64 KB a call
        if "lose_counts" in self.defects and self._finished % 25 == 0:
            with self._lock:
                self._recorder.record(latency_s, outcome)
            self.metrics.latency.observe(latency_s)   # seen, but never counted in agent_requests_total
            return
        super().finish(method, latency_s, outcome)

    def choose_tier(self, queue_depth: int) -> str:
        tier = super().choose_tier(queue_depth)
        if "errors" in self.defects:
            self._batches += 1
            if self._batches % 8 == 0:
                return "no-such-tier"       # the engine fails the whole batch
        return tier


def main() -> None:
    defects = frozenset(d for d in sys.argv[1].split(",") if d and d != "none")
    unknown = defects - set(DEFECTS)
    if unknown:
        sys.exit(f"broken_agent: unknown defects {sorted(unknown)}; known: {', '.join(DEFECTS)}")
    BrokenGuard.defects = defects

    def build(config: GuardConfig, clock: Any = None) -> protection.ProtectionGuard:
        return BrokenGuard(config, clock)

    protection.build_guard = build   # the one swap: the app builds its guard through this
    _break_cache(defects)
    if "constant_light" in defects:  # ... and one in the pipeline: the light tier's answer is canned
        from agent_under_test import pipeline
        from agent_under_test.proto import agent_pb2

        real = pipeline.Pipeline.decide
        canned = agent_pb2.Decision(sequence_id=1, symbol="ACME", side=agent_pb2.HOLD, confidence=0.5, tier="light")

        async def decide(self: Any, msg: Any, received_ns: int) -> Any:
            out = await real(self, msg, received_ns)
            return canned if out.tier == "light" else out

        pipeline.Pipeline.decide = decide  # type: ignore[method-assign]
    from agent_under_test.__main__ import main as agent_main

    sys.argv = [sys.argv[0], *sys.argv[2:]]
    agent_main(prog_name="broken_agent")


if __name__ == "__main__":
    main()
