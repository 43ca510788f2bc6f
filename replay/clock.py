"""The replay clock: real (sleep, then spin the last few hundred microseconds) or fake (virtual time).

Open-loop accuracy depends on waking up on time. `asyncio.sleep` overshoots by the event loop's
granularity (often ~1 ms under load), so the real clock sleeps until `spin_ns` before the deadline
and then yields in a tight loop until it passes. Spinning yields to the loop (sleep(0)) so that
responses keep being processed while we wait.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
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


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_CLOCK_MONOTONIC, _TFD_NONBLOCK, _TFD_CLOEXEC, _TFD_TIMER_ABSTIME = 1, 0o4000, 0o2000000, 1


class TimerfdClock(MonotonicClock):
    """Linux: wake the event loop with a timerfd armed at the absolute deadline (ns precision).

    asyncio's own timers round the epoll timeout up to whole milliseconds, which is why
    MonotonicClock spins; a timerfd in the same epoll set wakes within the kernel's timer slack
    (~50 us) with no spinning, so the client CPU goes to sending, not waiting. `spin_ns` (default
    50 us) still covers the slack. Falls back to MonotonicClock when timerfd is unavailable.
    """

    def __init__(self, spin_ns: int = 50_000) -> None:
        super().__init__(spin_ns)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # One spec reused for every arm (this runs once per send): no ctypes objects built per call.
        self._spec = _Itimerspec()
        self._spec_ref = ctypes.byref(self._spec)
        self._settime = self._libc.timerfd_settime
        self._settime.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

    def _arm(self, deadline_ns: int) -> None:
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = divmod(deadline_ns, 1_000_000_000)
        if self._settime(self._fd, _TFD_TIMER_ABSTIME, self._spec_ref, None) < 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            return
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def sleep_until(self, deadline_ns: int) -> None:
        wake = deadline_ns - self.spin_ns
        if wake > time.monotonic_ns():
            loop = self._loop
            if loop is None or loop.is_closed():  # asking asyncio costs a getpid() per call: once per loop
                loop = asyncio.get_running_loop()
                loop.add_reader(self._fd, self._fired)
                self._loop = loop
            self._waiter = loop.create_future()
            self._arm(wake)
            await self._waiter
        while time.monotonic_ns() < deadline_ns:
            await asyncio.sleep(0)

    def close(self) -> None:
        """Unregister from the loop and close the timerfd (idempotent)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def real_clock(spin_ns: int | None = None) -> MonotonicClock:
    """The most precise real clock here: TimerfdClock on Linux, else MonotonicClock."""
    try:
        return TimerfdClock() if spin_ns is None else TimerfdClock(spin_ns)
    except (OSError, AttributeError):
        return MonotonicClock() if spin_ns is None else MonotonicClock(spin_ns)
