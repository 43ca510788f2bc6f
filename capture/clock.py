"""The capture package's clock: one Protocol, the real monotonic clock, a fake for tests.

eBPF timestamps come from bpf_ktime_get_ns(), which is CLOCK_MONOTONIC; so does `MonotonicClock`,
so user-space and kernel timestamps in one recording share a time base.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ns(self) -> int:
        """Monotonic nanoseconds."""

    def wall_ns(self) -> int:
        """Wall-clock nanoseconds since the epoch."""


class MonotonicClock:
    def now_ns(self) -> int:
        return time.monotonic_ns()

    def wall_ns(self) -> int:
        return time.time_ns()


class FakeClock:
    """A clock that moves only when told to (`advance`)."""

    def __init__(self, start_ns: int = 1_000_000_000, wall_offset_ns: int = 1_700_000_000_000_000_000) -> None:
        self._now = start_ns
        self._offset = wall_offset_ns

    def now_ns(self) -> int:
        return self._now

    def wall_ns(self) -> int:
        return self._now + self._offset

    def advance(self, ns: int) -> None:
        self._now += ns
