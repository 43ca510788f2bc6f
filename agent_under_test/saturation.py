"""Saturation of the serving thread: the share of wall time it was running or waiting to run.

    /proc/self/task/<tid>/schedstat: "<ns on a CPU> <ns runnable but waiting for one> <timeslices>"
    saturation over an interval = (d on-CPU + d waiting) / d wall

The fourth golden signal, next to latency, traffic and errors. On CPU the agent's event loop thread
does all the work (HTTP/2, the pipeline and, with --workers 0, the forward pass), so this is how close
it is to its capacity: it rises smoothly with load (0.3 at 1,000 calls/s, 0.68 at 5,000/s, 0.82 at
6,500/s here) and reaches 1 where the queue starts, while P99 stays flat until that cliff. Time stolen
by other processes on the same core and CPU-quota throttling count as waiting (measured: a spinning
thread under a 20 % cgroup quota reads 0.20 on CPU + 0.80 waiting), so the signal also sees contention.
It does not see time a request spends elsewhere (a GPU, another thread's pool).

Linux only; elsewhere, or when the file cannot be read, `sample()` returns None and the limiter falls
back to latency alone.
"""

from __future__ import annotations

import threading
import time


def read_schedstat(tid: int, pid: int | str = "self") -> tuple[int, int] | None:
    """(ns on a CPU, ns waiting for one) of thread `tid` of process `pid` (default: this one), or None
    where unavailable."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            fields = f.read().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


class ThreadSaturation:
    """Samples one thread's saturation; each `sample()` covers the time since the previous one."""

    def __init__(self, tid: int | None = None) -> None:
        self.tid = threading.get_native_id() if tid is None else tid
        self._last = self._read()

    def _read(self) -> tuple[int, int] | None:
        stat = read_schedstat(self.tid)
        return None if stat is None else (stat[0] + stat[1], time.monotonic_ns())

    def sample(self) -> float | None:
        """Busy share of wall time since the last sample (0..1, a little above 1 from rounding), or
        None when the thread's stats cannot be read or no time has passed."""
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None or now[1] <= last[1]:
            return None
        return max(0.0, (now[0] - last[0]) / (now[1] - last[1]))
