"""How long the event loop could not read its sockets: the wait a request spends before the server sees it.

A server times a call from when it reads the call's headers. Whatever kept the loop from reading (a CPU
quota that throttled the whole process, other processes holding both cores, a stop signal, a long pass
that ran on the loop) is time the request spent in the kernel's socket buffer, which that clock never
sees. Under a 4 % quota the agent runs ~4 ms of every 100 ms: requests wait up to ~96 ms, and the few ms
it then takes to serve them is all the agent would measure. The kernel cannot say when each request
arrived (TCP merges the segments that queue up into one buffer, and a merged buffer keeps the newest
arrival time), and the scheduler's run-delay does not count a throttled cgroup's time on this kernel.

So the loop watches itself: a heartbeat is due every `interval_s`; when it runs late, or a read finds it
overdue, the loop was stalled from (about) when it was due until now. A connection read for the first
time after a stall holds requests that arrived during it, in order, between the stall's start (or the
connection's previous read) and when the kernel says the connection's last data came (TCP_INFO, to its 4 ms
tick here; a client's PING or WINDOW_UPDATE after its request makes that late, never early). Each request
is taken to have arrived at the middle of its even share of that window, and its call is timed from then. A read that
comes later than the stall's end by more than one heartbeat is not back-dated: its data arrived after.
The heartbeat runs only while connections are open; it costs ~1 us of CPU per beat.

This is an estimate of each request's arrival, bounded by the stall the loop measured; what it fixes is
the direction of the error: a stalled server no longer reports the stall as fast answers.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import Any

INTERVAL_S = 0.005      # heartbeat period: a stall's start is known to within this
MIN_STALL_S = 0.002     # lateness below this is the loop's ordinary jitter, not a stall
_LAST_DATA_RECV = 52    # struct tcp_info: ms since the last data segment arrived (u32)


class LoopStall:
    """The event loop's stalls, from a heartbeat on it. `now` is perf_counter_ns (what calls are timed by)."""

    def __init__(self, interval_s: float = INTERVAL_S, min_stall_s: float = MIN_STALL_S) -> None:
        self.interval_ns = int(interval_s * 1e9)
        self.min_ns = int(min_stall_s * 1e9)
        self.due = 0                      # when the next beat is due
        self.start = self.end = 0         # the last stall seen: the loop could not run from start to end
        self.stalls = 0                   # stalls seen, and their total length (for the metrics)
        self.stalled_ns = 0
        self._users = 0
        self._timer: asyncio.TimerHandle | None = None

    # -- the heartbeat, while anyone uses it
    def acquire(self) -> None:
        self._users += 1
        if self._users == 1:
            self.due = time.perf_counter_ns() + self.interval_ns
            self._timer = asyncio.get_running_loop().call_later(self.interval_ns / 1e9, self._beat)

    def release(self) -> None:
        self._users -= 1
        if self._users <= 0 and self._timer is not None:
            self._users = 0
            self._timer.cancel()
            self._timer = None

    def _beat(self) -> None:
        now = self.check(time.perf_counter_ns())
        self.due = now + self.interval_ns
        self._timer = asyncio.get_running_loop().call_later(self.interval_ns / 1e9, self._beat)

    def check(self, now: int) -> int:
        """Note a stall if the beat is overdue at `now` (the loop is only now running again); returns now."""
        if not self._users or now - self.due <= self.min_ns:
            return now
        if self.start != self.due:          # a new stall, from when the beat was due
            self.start, self.end = self.due, now
            self.stalls += 1
            self.stalled_ns += now - self.due
        elif now > self.end:                # the same one, seen again later: it lasted until now
            self.stalled_ns += now - self.end
            self.end = now
        return now

    def window(self, last_read: int, now: int) -> tuple[int, int] | None:
        """When the data of a chunk read at `now` arrived, if it waited out a stall: (from, to) in ns.

        `last_read`: when this connection was last read (its data arrived after that). None when the
        chunk did not wait: no stall since the last read, or the stall ended a beat or more before now."""
        self.check(now)
        lo, hi = max(self.start, last_read), self.end
        if hi <= lo or now - hi > self.interval_ns:
            return None
        return lo, hi


def spread(lo: int, hi: int, n: int) -> list[int]:
    """Arrival times of `n` requests that arrived in order between `lo` and `hi`: each at the middle of its
    even share (what is expected of arrivals spread evenly; a lone request, the middle of the window)."""
    span = max(0, hi - lo)
    return [lo + span * (2 * i + 1) // (2 * n) for i in range(n)]


def last_arrival(sock: Any, now: int) -> int | None:
    """When the socket's last data arrived (the kernel's TCP_INFO, to its 1-4 ms tick), or None."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        ms = struct.unpack_from("I", info, _LAST_DATA_RECV)[0]
    except (OSError, AttributeError, struct.error):
        return None
    return now - ms * 1_000_000
