"""The replay clock: real (sleep, then spin the last few hundred microseconds) or fake (virtual time).

Open-loop accuracy depends on waking up on time. `asyncio.sleep` overshoots by the event loop's
granularity (often ~1 ms under load), so the real clock sleeps until `spin_ns` before the deadline
and then yields in a tight loop until it passes. Spinning yields to the loop (sleep(0)) so that
responses keep being processed while we wait.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic nanoseconds and an awaitable wait for an absolute time on the same scale."""

    def now_ns(self) -> int:
        """The current time in nanoseconds (monotonic; only differences mean anything)."""

    async def sleep_until(self, deadline_ns: int) -> None:
        """Return at or soon after `deadline_ns` (immediately when it is already past)."""


class MonotonicClock:
    """CLOCK_MONOTONIC, shared by every process on the host (so worker processes can start together).

    Args:
        spin_ns: how long before a deadline to stop sleeping and start spinning (default 300 us).
    """

    def __init__(self, spin_ns: int = 300_000) -> None:
        self.spin_ns = spin_ns

    def now_ns(self) -> int:
        return time.monotonic_ns()

    async def sleep_until(self, deadline_ns: int) -> None:
        remaining = deadline_ns - time.monotonic_ns()
        if remaining > self.spin_ns:
            await asyncio.sleep((remaining - self.spin_ns) / 1e9)
        # Spin, yielding to the loop so in-flight calls still progress while we wait.
        while time.monotonic_ns() < deadline_ns:
            await asyncio.sleep(0)

    def sleep_until_blocking(self, deadline_ns: int) -> None:
        """The same for a plain thread (no event loop): sleep, then spin."""
        remaining = deadline_ns - time.monotonic_ns()
        if remaining > self.spin_ns:
            time.sleep((remaining - self.spin_ns) / 1e9)
        while time.monotonic_ns() < deadline_ns:
            pass


class FakeClock:
    """Virtual time for tests: `sleep_until` jumps straight to the deadline.

    Only the engine's scheduling loop sleeps, so one jump per wake-up gives exact trajectories.
    `lag_ns` simulates a late wake-up (every sleep returns that much after its deadline).
    """

    def __init__(self, start_ns: int = 1_000_000_000, lag_ns: int = 0) -> None:
        self._now = start_ns
        self.lag_ns = lag_ns
        self.settle_yields = 20
        self.sleeps: list[int] = []

    def now_ns(self) -> int:
        return self._now

    def advance(self, ns: int) -> None:
        self._now += ns

    async def sleep_until(self, deadline_ns: int) -> None:
        self.sleeps.append(deadline_ns)
        # Let every task that is ready run at the current virtual time before time jumps.
        for _ in range(self.settle_yields):
            await asyncio.sleep(0)
        if deadline_ns > self._now:
            self._now = deadline_ns + self.lag_ns
