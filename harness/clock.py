"""The harness's clock: real monotonic time for runs, a fake one for tests (time is an argument)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards (same base as `time.monotonic`)."""

    def sleep(self, seconds: float) -> None:
        """Wait `seconds` (a fake clock just advances)."""


class MonotonicClock:
    """The real clock: `time.monotonic`, the base the agent's events use for their `mono` field."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class FakeClock:
    """A clock that moves only when told to: `sleep` advances it instantly."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def advance(self, seconds: float) -> None:
        self.now += seconds
