"""Adaptive limiters: one small interface, policies registered by name (`seed`, `gradient`, `off`).

    admit() --try_acquire(now)--> token bucket: a token -> None (admitted)
                                                no token -> retry-after seconds (rejected, never queued)
    tick()  --on_period(summary)--> policy sets the bucket's rate for the next period (an Adjustment)

Rates are floats in calls/s so a small rate still grows (1 x 1.1 = 1.1, never rounded back to 1).
The burst allowance is explicit: `burst_s` seconds of the current rate, at least one call.
The `gradient` formula, its defaults and why are in docs/protection.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from agent_under_test.monitor import INSUFFICIENT, PeriodSummary


@dataclass(frozen=True)
class LimiterSettings:
    threshold_ms: float = 20.0
    initial_rate: float = 2000.0
    min_rate: float = 10.0
    max_rate: float = 20000.0
    burst_s: float = 0.05


@dataclass(frozen=True)
class Adjustment:
    policy: str
    old_rate: float
    new_rate: float
    reason: str

    def event_fields(self) -> dict[str, object]:
        # Rounded for readers (x0.9 chains print as 258.11499999999995 otherwise); the limiter keeps full precision.
        return {"policy": self.policy, "old_rate": round(self.old_rate, 6), "new_rate": round(self.new_rate, 6),
                "reason": self.reason}


class Limiter(Protocol):
    policy: str

    @property
    def rate(self) -> float:
        """Admitted calls/s allowed now (`inf` when not limiting)."""

    def try_acquire(self, now: float) -> float | None:
        """None to admit one call at monotonic time `now`; else the retry-after hint in seconds."""

    def on_period(self, summary: PeriodSummary) -> Adjustment | None:
        """Adapt to the period just closed; the adjustment made, or None when the rate is unchanged."""


class TokenBucket:
    """Refills at `rate` tokens/s up to `burst` tokens; starts full."""

    def __init__(self, rate: float, burst_s: float, now: float | None = None) -> None:
        self.burst_s = burst_s
        self.rate = rate
        self.tokens = self.capacity
        self.last = now

    @property
    def capacity(self) -> float:
        return max(1.0, self.rate * self.burst_s)

    def take(self, now: float) -> float | None:
        """Take one token; None on success, else seconds until one is there."""
        if self.last is not None and now > self.last:
            self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now if self.last is None else max(self.last, now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return None
        return (1.0 - self.tokens) / self.rate

    def set_rate(self, rate: float) -> None:
        # Keep the tokens already earned, but never more than the new burst allows.
        self.rate = rate
        self.tokens = min(self.tokens, self.capacity)


class _BucketLimiter:
    """Shared plumbing: a token bucket whose rate a policy moves within [min_rate, max_rate]."""

    policy = "base"

    def __init__(self, settings: LimiterSettings) -> None:
        if not 0 < settings.min_rate <= settings.max_rate:
            raise ValueError(f"limiter: need 0 < min_rate <= max_rate, got {settings.min_rate}, "
                             f"{settings.max_rate}")
        self.s = settings
        start = float(min(settings.max_rate, max(settings.min_rate, settings.initial_rate)))
        self.bucket = TokenBucket(start, settings.burst_s)

    @property
    def rate(self) -> float:
        return self.bucket.rate

    def try_acquire(self, now: float) -> float | None:
        return self.bucket.take(now)

    def _move(self, new_rate: float, reason: str) -> Adjustment | None:
        new_rate = min(self.s.max_rate, max(self.s.min_rate, new_rate))
        old = self.bucket.rate
        if new_rate == old:
            return None
        self.bucket.set_rate(new_rate)
        return Adjustment(self.policy, old, new_rate, reason)


class SeedLimiter(_BucketLimiter):
    """The rule we start from: x0.9 when the period's P99 exceeds the threshold, else x1.1.

    A period with no finished calls holds the rate (no evidence either way). A period with fewer calls
    than the alert's minimum still counts: its P99 is then its slowest call, which errs towards backing off.
    """

    policy = "seed"

    def on_period(self, summary: PeriodSummary) -> Adjustment | None:
        if summary.count == 0 or summary.p99_ms is None:
            return None
        p99, limit = summary.p99_ms, self.s.threshold_ms
        if p99 > limit:
            return self._move(self.rate * 0.9, f"p99 {p99:.3f} ms > {limit:g} ms: x0.9")
        return self._move(self.rate * 1.1, f"p99 {p99:.3f} ms <= {limit:g} ms: x1.1")


@dataclass(frozen=True)
class GradientParams:
    min_cut: float = 0.5        # deepest single cut (x0.5), like Gradient2's gradient floor
    max_cut: float = 0.95       # mildest cut on a breach
    draining: float = 0.8       # a breach with p99 below this x the last period's is a queue draining: hold
    max_growth: float = 0.10    # most growth per period (as seed's x1.1), scaled by latency headroom
    probe: float = 0.01         # first probe step above the known-good rate; doubles each healthy period
    knee: float = 0.95          # approach knee x good by halving the gap
    headroom: float = 2.0       # when not limiting, stay within headroom x offered rate
    decay: float = 0.9          # the mild cut, and how fast a good rate that keeps breaching is forgotten
    queue_p50: float = 0.5      # P50 above this x T: the median call waits, so the breach is our queue


class GradientLimiter(_BucketLimiter):
    """Rate-based Gradient2/Vegas controller with a known-good rate (formula in docs/protection.md).

    T threshold, P period, done = completed calls/s, h = 1 - p99/T, good = highest rate seen healthy
    insufficient period (fewer than min_samples calls): calls refused -> rate*(1 + max_growth), else hold
    breach (p99 > T):
        p99 < draining x last p99:  hold (the queue from an earlier overload is draining; cutting more
                                    would only lose goodput)
        p50 <= queue_p50 x T, or rate <= good after a deep cut this episode:  rate = rate*decay
                                    (not our queue: a hiccup or outside contention; cut like seed)
        else (deep):  base = min(rate, done, good);  g = clamp(1 - (p99-T)/P, min_cut, max_cut)
               rate = base*g    (Little's law: done*(p99-T) calls wait beyond T; drain them in a period)
               if the limit was at or below good (capacity fell): good = max(good*decay, rate)
    healthy: good = max(good, done)
        limiting, rate < knee*good:  rate = max(rate*(1 + max_growth*h), rate + (knee*good - rate)/2)
        limiting, else (probe):      rate = rate*(1 + min(max_growth, probe*2^k)*h), k = probes so far
        not limiting:                rate = min(rate*(1 + max_growth*h), headroom*offered)
    """

    policy = "gradient"

    def __init__(self, settings: LimiterSettings, params: GradientParams | None = None) -> None:
        super().__init__(settings)
        self.p = params or GradientParams()
        self.good: float | None = None
        self.probes = 0
        self.last_p99: float | None = None
        self.deep_cut = False   # a deep cut at or below the good rate in this breach episode

    def on_period(self, summary: PeriodSummary) -> Adjustment | None:
        if summary.count == 0 or summary.p99_ms is None:
            return None
        if summary.state == INSUFFICIENT:
            # Too few calls to know a P99 (the slowest call stands in for it). Grow only when calls were
            # refused, never cut: cutting on no evidence is how a limiter starves itself at its floor.
            if summary.rejected == 0:
                return None
            return self._move(self.rate * (1 + self.p.max_growth), "too few calls to judge and calls refused: "
                                                                     f"x{1 + self.p.max_growth:g}")
        p99, last = summary.p99_ms, self.last_p99
        self.last_p99 = p99
        done = summary.count / summary.seconds
        if p99 > self.s.threshold_ms:
            self.probes = 0
            if last is not None and p99 < self.p.draining * last:
                return None
            queueing = summary.p50_ms is not None and summary.p50_ms > self.p.queue_p50 * self.s.threshold_ms
            return self._breach(p99, done, summary.seconds, queueing)
        self.deep_cut = False
        self.good = done if self.good is None else max(self.good, done)
        headroom = max(0.0, 1.0 - p99 / self.s.threshold_ms)
        if summary.rejected > 0:
            return self._grow_limited(headroom)
        self.probes = 0
        offered = (summary.count + summary.rejected) / summary.seconds
        cap = self.p.headroom * offered
        grown = self.rate * (1.0 + self.p.max_growth * headroom)
        if grown > cap:
            return self._move(cap, f"not limiting: {self.p.headroom:g}x offered {offered:.1f}/s")
        return self._move(grown, f"not limiting, headroom {headroom:.2f}: x{grown / self.rate:.3f}")

    def _breach(self, p99: float, done: float, seconds: float, queueing: bool) -> Adjustment | None:
        limit, good = self.rate, self.good
        above_good = good is None or limit > good
        # Deep cuts are for our own queue: the median call waits (Vegas' signal). At or below a rate
        # known to be good, only one per episode: if latency stays high after it, the rate is not
        # what drives it (outside contention), and cutting deep again would only starve the server.
        if not queueing or not (above_good or not self.deep_cut):
            return self._move(limit * self.p.decay, f"p99 {p99:.3f} ms > {self.s.threshold_ms:g} ms, "
                                                    f"not our queue: x{self.p.decay:g}")
        excess_s = (p99 - self.s.threshold_ms) / 1000.0
        g = min(self.p.max_cut, max(self.p.min_cut, 1.0 - excess_s / seconds))
        base = min(limit, done, good if good is not None else limit)
        adj = self._move(base * g, f"p99 {p99:.3f} ms > {self.s.threshold_ms:g} ms, queueing: "
                                   f"{base:.1f}/s x{g:.3f}")
        if good is not None and not above_good:
            # Our queue at a rate once good: capacity fell (e.g. CPU contention). Forget it slowly.
            self.good = max(good * self.p.decay, self.rate)
            self.deep_cut = True
        return adj

    def _grow_limited(self, headroom: float) -> Adjustment | None:
        knee = None if self.good is None else self.p.knee * self.good
        if knee is not None and self.rate < knee:
            self.probes = 0
            new = max(self.rate * (1 + self.p.max_growth * headroom), self.rate + (knee - self.rate) / 2)
            return self._move(new, f"limiting, below the {knee:.1f}/s knee: halve the gap")
        step = min(self.p.max_growth, self.p.probe * 2 ** self.probes) * headroom
        self.probes += 1
        return self._move(self.rate * (1 + step), f"limiting, headroom {headroom:.2f}: probe x{1 + step:.4f}")


class OffLimiter:
    """No limit: admits everything, never adjusts."""

    policy = "off"
    rate = math.inf

    def __init__(self, settings: LimiterSettings) -> None:
        self.s = settings

    def try_acquire(self, now: float) -> float | None:
        return None

    def on_period(self, summary: PeriodSummary) -> Adjustment | None:
        return None


LIMITERS: dict[str, Callable[[LimiterSettings], Limiter]] = {
    "seed": SeedLimiter,
    "gradient": GradientLimiter,
    "off": OffLimiter,
}


def make_limiter(name: str, settings: LimiterSettings) -> Limiter:
    """The limiter registered as `name`. Raises ValueError naming the known policies."""
    try:
        factory = LIMITERS[name]
    except KeyError:
        raise ValueError(f"unknown limiter {name!r}: choose one of {', '.join(sorted(LIMITERS))}") from None
    return factory(settings)
