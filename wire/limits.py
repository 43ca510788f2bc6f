"""Flood budgets: a token bucket per kind of frame that costs us work without moving a call forward.

A peer may send PING, SETTINGS, RST_STREAM or empty frames, but a peer that sends millions of them is
attacking (CVE-2019-9512/9515/9518, CVE-2023-44487 "rapid reset"). Each kind has a burst and a refill
rate; a peer that empties a bucket gets GOAWAY ENHANCE_YOUR_CALM. The clock is an argument so the
rules run in virtual time in tests.
"""

from __future__ import annotations

from wire.clock import SYSTEM, Clock


class Budget:
    """`burst` tokens, refilled at `per_s` a second; `spend()` is False once the bucket is empty."""

    __slots__ = ("burst", "per_s", "tokens", "last", "clock")

    def __init__(self, burst: float, per_s: float, clock: Clock = SYSTEM) -> None:
        self.burst, self.per_s, self.clock = burst, per_s, clock
        self.tokens = burst
        self.last = clock.now()

    def spend(self, n: float = 1.0) -> bool:
        if self.tokens < n:                 # refill lazily: the clock is read only when running low
            now = self.clock.now()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.per_s)
            self.last = now
            if self.tokens < n:
                return False
        elif self.tokens >= self.burst:     # leaving full: refill counts from now, not from when it filled
            self.last = self.clock.now()    # (else a bucket that sat full gives twice its burst once drained)
        self.tokens -= n
        return True

    def available(self) -> float:
        """What the bucket holds now, refill included, without spending."""
        return min(self.burst, self.tokens + (self.clock.now() - self.last) * self.per_s)

    def refund(self, n: float = 1.0) -> None:
        """Give `n` tokens back (up to the burst): for work that shows the peer is doing real things."""
        self.tokens = min(self.burst, self.tokens + n)
