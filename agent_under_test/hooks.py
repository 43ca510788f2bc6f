"""The seam between the agent's request path and its self-protection.

The server and batcher call a `Guard` at four points; `protection.build_guard()` returns the real
one (limiter, P99 monitor, alerts, degradation, metrics), `NullGuard` admits everything.

    call arrives --admit()--> refused: RESOURCE_EXHAUSTED + retry hint (never queued)
         |                    admitted
         v
    batcher queue --choose_tier(depth)--> forward pass --on_batch()--> response --finish()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class GuardConfig:
    """What `shadowtest agent serve` passes to `protection.build_guard` (extend with defaults only)."""

    limiter: str = "off"                 # seed | gradient | off
    p99_threshold_ms: float = 20.0
    alert_periods: int = 3
    resolve_periods: int = 3
    period_s: float = 1.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None      # None: no HTTP endpoint; 0: any free port
    initial_rate: float = 2000.0         # calls/s the limiter starts at
    min_rate: float = 10.0
    max_rate: float = 20000.0
    tier: str = "full"                   # the tier served when healthy
    # Added by the protection work (issue 3); defaults are documented in docs/protection.md.
    burst_s: float = 0.05                # token-bucket burst: this many seconds of the rate (>= 1 call)
    min_samples: int = 20                # fewer finished calls in a period: "insufficient"
    error_ratio_threshold: float = 0.005     # ErrorRatioHigh: errors / (ok + errors) above this
    rejected_ratio_threshold: float = 0.05   # RejectedRatioHigh: rejected / offered above this
    queue_light_depth: int = 5           # queue depth above this (for queue_sustain_s) serves light ...
    queue_drain_depth: int = 2           # ... until it is at most this (for queue_sustain_s)
    queue_sustain_s: float = 0.25        # how long the queue must stay deep (or drained) to count
    alerts: bool = True                  # False: alerts never fire (a deliberately broken agent)
    tier_hold_periods: int = 2           # periods the tier holds after any change (the alert firing
                                         # excepted); healthy periods (from the resolving one) before full returns
    dependency_threshold_ms: float = 10.0    # DependencySlow: a dependency's (Redis) op P99 above this


class Guard(Protocol):
    def admit(self, method: str) -> float | None:
        """None when the call may proceed; else the retry-after hint in seconds (counted as rejected).

        Unary calls are admitted per call, streams once when they open."""

    def finish(self, method: str, latency_s: float, outcome: str) -> None:
        """Once per admitted unary call and once per stream message: outcome ok | invalid | error."""

    def choose_tier(self, queue_depth: int) -> str:
        """The tier ('full' or 'light') for the next forward pass, given the queue behind it."""

    def on_batch(self, size: int, queue_depth: int, tier: str) -> None:
        """After each forward pass."""

    def drops_expired(self) -> bool:
        """Whether calls whose deadline passed (their caller gone) before their forward pass are taken
        out of the batch rather than computed for nobody."""

    def on_expired(self, fate: str, n: int) -> None:
        """`n` calls of a batch were past their deadline (or their client gone) when it formed: `fate`
        'dropped' (taken out) or 'computed' (run all the same: wasted work)."""

    def on_stage(self, stage: str, seconds: float) -> None:
        """Per pipeline stage of each request (parse, features, strategy, risk, order)."""

    def start(self) -> None:
        """Start periodic work (period ticks, metrics endpoint)."""

    def stop(self) -> None:
        """Stop it; idempotent."""

    # The response cache's reports (cache.CacheHooks); a guard without them gets none.
    def on_cache(self, result: str) -> None:
        """Once per cache lookup: hit_local | hit_redis | stale | miss."""

    def on_dependency(self, dependency: str, op: str, seconds: float, error: str | None) -> None:
        """Once per operation on a dependency (Redis): its time, and None | timeout | error."""

    def on_circuit(self, dependency: str, old: str, new: str) -> None:
        """The dependency's circuit breaker moved (closed | half_open | open)."""


class NullGuard:
    """Admits everything and serves a fixed tier: the agent with no self-protection."""

    def __init__(self, tier: str = "full") -> None:
        self.tier = tier

    def admit(self, method: str) -> float | None:
        return None

    def finish(self, method: str, latency_s: float, outcome: str) -> None:
        pass

    def choose_tier(self, queue_depth: int) -> str:
        return self.tier

    def on_batch(self, size: int, queue_depth: int, tier: str) -> None:
        pass

    def drops_expired(self) -> bool:
        return True

    def on_expired(self, fate: str, n: int) -> None:
        pass

    def on_stage(self, stage: str, seconds: float) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def on_cache(self, result: str) -> None:
        pass

    def on_dependency(self, dependency: str, op: str, seconds: float, error: str | None) -> None:
        pass

    def on_circuit(self, dependency: str, old: str, new: str) -> None:
        pass
