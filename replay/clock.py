"""The replay engine's precise clock: wire.clock's MonotonicClock (sleep, then spin the last few hundred
microseconds), woken by a timerfd where Linux has one; tests use wire.clock.FakeClock (virtual time).

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
from collections.abc import Callable

from wire.clock import Clock, MonotonicClock


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_CLOCK_MONOTONIC, _TFD_NONBLOCK, _TFD_CLOEXEC, _TFD_TIMER_ABSTIME = 1, 0o4000, 0o2000000, 1
_PR_SET_TIMERSLACK = 29


class TimerfdClock(MonotonicClock):
    """Linux: wake the event loop with a timerfd armed at the absolute deadline (ns precision).

    asyncio's own timers round the epoll timeout up to whole milliseconds, which is why
    MonotonicClock spins; a timerfd in the same epoll set wakes within the kernel's timer slack.
    That slack (50 us by default, per thread) is set to 1 ns for the loop's thread
    (prctl PR_SET_TIMERSLACK) when the clock first sleeps there, so the timer fires on time and
    there is nothing to spin for: each spin step is a whole event-loop iteration (an epoll_wait),
    which costs more client CPU than the few microseconds of wake-up latency it hides. `spin_ns`
    (default 0) spins anyway; with the slack left at 50 us (prctl refused) it defaults to 50 us.
    Falls back to MonotonicClock when timerfd is unavailable.
    """

    def __init__(self, spin_ns: int | None = None) -> None:
        super().__init__(0 if spin_ns is None else spin_ns)
        self._default_spin = spin_ns is None
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self._waiter: asyncio.Future[None] | None = None
        self._on_fire: Callable[[], None] | None = None  # run_ticks' step, called from _fired
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
        fire, self._on_fire = self._on_fire, None
        if fire is not None:
            fire()  # a run_ticks step: it re-arms (which clears the expiry, no read needed) or ends
            if self._on_fire is not None:
                return
        try:
            os.read(self._fd, 8)  # clear the expiry so the fd stops being readable
        except BlockingIOError:
            return
        if fire is None and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def sleep_until(self, deadline_ns: int) -> None:
        wake = deadline_ns - self.spin_ns
        if wake > time.monotonic_ns():
            loop = self._attach()
            self._waiter = loop.create_future()
            self._arm(wake)
            await self._waiter
        while time.monotonic_ns() < deadline_ns:
            await asyncio.sleep(0)

    async def run_ticks(self, tick: Callable[[], int | None]) -> None:
        """Call `tick()` now and then at each absolute deadline (ns) it returns, until it returns
        None. At a deadline `tick` runs inside the timerfd's own reader callback: no future to
        resolve, no task to wake, so what it sends goes out one event-loop iteration earlier than
        after `await sleep_until(...)`, and each wake-up costs one iteration instead of two.
        With a spin configured, it falls back to sleep_until (which spins). `tick`'s exceptions
        propagate from here."""
        if self.spin_ns:
            await run_ticks(self, tick, fast=False)
            return
        loop = self._attach()
        done: asyncio.Future[None] = loop.create_future()

        def step() -> None:
            try:
                wake = tick()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                done.set_exception(exc)
                return
            if wake is None:
                done.set_result(None)
            elif wake > time.monotonic_ns():
                self._on_fire = step
                self._arm(wake)
            else:
                loop.call_soon(step)  # already due: run again after the I/O that is ready

        self._on_fire = None
        step()
        try:
            await done
        finally:
            self._on_fire = None

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None or loop.is_closed():  # asking asyncio costs a getpid() per call: once per loop
            loop = asyncio.get_running_loop()
            loop.add_reader(self._fd, self._fired)
            self._loop = loop
            self._tighten_slack()
        return loop

    def _tighten_slack(self) -> None:
        """1 ns timer slack for this (the loop's) thread; keep a 50 us spin where that is refused."""
        if self._libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0) != 0 and self._default_spin:
            self.spin_ns = 50_000

    def close(self) -> None:
        """Unregister from the loop and close the timerfd (idempotent)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


async def run_ticks(clock: Clock, tick: Callable[[], int | None], *, fast: bool = True) -> None:
    """Call `tick()` now and then at each absolute deadline (clock ns) it returns, until it returns
    None: through the clock's own `run_ticks` when it has one (TimerfdClock) and `fast`, else by
    awaiting `sleep_until` between ticks (any Clock, FakeClock included)."""
    own = getattr(clock, "run_ticks", None) if fast else None
    if own is not None:
        await own(tick)
        return
    while (wake := tick()) is not None:
        await clock.sleep_until(wake)


def real_clock(spin_ns: int | None = None) -> MonotonicClock:
    """The most precise real clock here: TimerfdClock on Linux, else MonotonicClock."""
    try:
        return TimerfdClock(spin_ns)
    except (OSError, AttributeError):
        return MonotonicClock() if spin_ns is None else MonotonicClock(spin_ns)
