"""Time for the agent's self-protection: a Clock protocol, the real clock and a fake one for tests.

The limiter, period monitor and alerts never read the time themselves: the guard reads its clock and
passes `now` down, so tests drive every decision in virtual time with exact trajectories.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds (comparable with `time.monotonic()` of other processes on this host)."""

    def wall(self) -> float:
        """Wall-clock seconds since the epoch, for event timestamps."""

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Block until `event` is set or `seconds` pass on this clock; True when the event was set."""


class MonotonicClock:
    """The real clock: `time.monotonic()` for decisions, `time.time()` for timestamps."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(max(0.0, seconds))


class FakeClock:
    """Virtual time for tests: only `advance()` moves it; `wait()` returns at once without sleeping."""

    def __init__(self, start: float = 1000.0, wall_offset: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_offset

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._wall_offset + self._now

    def advance(self, seconds: float) -> float:
        """Move virtual time forward by `seconds` (never backwards) and return the new time."""
        if seconds < 0:
            raise ValueError("a clock never goes backwards")
        self._now += seconds
        return self._now

    def wait(self, event: threading.Event, seconds: float) -> bool:
        # Virtual time does not pass on its own: report the timeout at once, as if it had elapsed.
        if event.is_set():
            return True
        self._now += max(0.0, seconds)
        return False
