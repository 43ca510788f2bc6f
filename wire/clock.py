"""One clock for every package: a Protocol, the real clock and one fake, so time logic runs in virtual
time in tests with exact trajectories.

    clock.now_ns() / clock.now()     monotonic (CLOCK_MONOTONIC: the same base as bpf_ktime_get_ns() and
                                     as every other process on the host, so workers can start together)
    clock.wall_ns() / clock.wall()   wall-clock time since the epoch, for timestamps people read
    clock.sleep(s)                   block a thread
    clock.wait(event, s)             block until the event is set or s pass; True when it was set
    await clock.sleep_until(ns)      an event loop's wait for an absolute monotonic time

The agent's limiter, monitor and alerts, the recorder, the fault runner, the replay engine and the
HTTP/2 flood budgets all take a Clock instead of reading `time` themselves. The replay engine's
precise clocks (sleep then spin; timerfd) build on MonotonicClock in replay/clock.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Protocol

_NS = 1_000_000_000


class Clock(Protocol):
    def now_ns(self) -> int:
        """Monotonic nanoseconds (only differences mean anything)."""

    def now(self) -> float:
        """Monotonic seconds, on the same base as now_ns."""

    def wall_ns(self) -> int:
        """Wall-clock nanoseconds since the epoch."""

    def wall(self) -> float:
        """Wall-clock seconds since the epoch."""

    def sleep(self, seconds: float) -> None:
        """Block this thread for `seconds` (at once when not positive)."""

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Block until `event` is set or `seconds` pass on this clock; True when the event was set."""

    async def sleep_until(self, deadline_ns: int) -> None:
        """Return at or soon after monotonic `deadline_ns` (at once when it is already past)."""


class MonotonicClock:
    """The real clock: CLOCK_MONOTONIC for decisions, the system clock for timestamps.

    spin_ns: `sleep_until` sleeps until this long before the deadline, then spins yielding to the
    event loop (asyncio.sleep overshoots by the loop's granularity, often ~1 ms under load)."""

    def __init__(self, spin_ns: int = 300_000) -> None:
        self.spin_ns = spin_ns

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def now(self) -> float:
        return time.monotonic()

    def wall_ns(self) -> int:
        return time.time_ns()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(max(0.0, seconds))

    async def sleep_until(self, deadline_ns: int) -> None:
        remaining = deadline_ns - time.monotonic_ns()
        if remaining > self.spin_ns:
            await asyncio.sleep((remaining - self.spin_ns) / 1e9)
        while time.monotonic_ns() < deadline_ns:   # spin, yielding so in-flight calls still progress
            await asyncio.sleep(0)

    def sleep_until_blocking(self, deadline_ns: int) -> None:
        """`sleep_until` for a plain thread (no event loop): sleep, then spin."""
        remaining = deadline_ns - time.monotonic_ns()
        if remaining > self.spin_ns:
            time.sleep((remaining - self.spin_ns) / 1e9)
        while time.monotonic_ns() < deadline_ns:
            pass


SYSTEM = MonotonicClock()   # the default wherever a clock is optional


class FakeClock:
    """Virtual time: it moves only by `advance`, `sleep`, an unset `wait` (by its timeout, at once) and
    `sleep_until` (straight to the deadline, `lag_ns` late). Kept in integer nanoseconds, so a
    trajectory of additions has no floating-point drift.

    sleep_until first yields `settle_yields` times so every task that is ready runs at the current
    virtual time before it jumps; `sleeps` lists the deadlines asked for."""

    def __init__(self, start_ns: int = _NS, wall_offset_ns: int = 1_700_000_000 * _NS, lag_ns: int = 0) -> None:
        self._now = start_ns
        self._wall_offset = wall_offset_ns
        self.lag_ns = lag_ns
        self.settle_yields = 20
        self.sleeps: list[int] = []

    @classmethod
    def at(cls, seconds: float, **kwargs: int) -> FakeClock:
        """A fake clock reading `seconds` now."""
        return cls(start_ns=round(seconds * _NS), **kwargs)

    def now_ns(self) -> int:
        return self._now

    def now(self) -> float:
        return self._now / _NS

    def wall_ns(self) -> int:
        return self._wall_offset + self._now

    def wall(self) -> float:
        return self.wall_ns() / _NS

    def advance(self, seconds: float) -> float:
        """Move virtual time forward by `seconds` (never backwards); returns the new `now()`."""
        return self.advance_ns(round(seconds * _NS)) / _NS

    def advance_ns(self, ns: int) -> int:
        if ns < 0:
            raise ValueError("a clock never goes backwards")
        self._now += ns
        return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def wait(self, event: threading.Event, seconds: float) -> bool:
        if event.is_set():
            return True
        self.sleep(seconds)   # time does not pass on its own: the timeout is reported at once
        return False

    async def sleep_until(self, deadline_ns: int) -> None:
        self.sleeps.append(deadline_ns)
        for _ in range(self.settle_yields):
            await asyncio.sleep(0)
        if deadline_ns > self._now:
            self._now = deadline_ns + self.lag_ns
