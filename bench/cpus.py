"""CPU pinning for benches that compare a server's CPU per call: the server on a core of its own, the load
and everything else on the others, so the two never share a core's caches or wait for each other's turn.
Unpinned on this 2-core host, the same build measured 10-20 % apart from one process to the next."""

from __future__ import annotations

import os

CPUS = sorted(os.sched_getaffinity(0))   # read at import, before pin() narrows this process


def pin(server_pid: int, *others: int) -> str:
    """Every thread of `server_pid` on the last CPU this process may use; this process (and so what it
    starts later) and `others` (a Redis, say) on the rest. Returns what it did, in one line."""
    if len(CPUS) < 2:
        return "pinned: nothing (one CPU only)"
    server, rest = {CPUS[-1]}, set(CPUS[:-1])
    for task in os.listdir(f"/proc/{server_pid}/task"):
        try:
            os.sched_setaffinity(int(task), server)
        except OSError:
            pass                                    # a thread that ended meanwhile
    for pid in (0, *others):
        os.sched_setaffinity(pid, rest)
    return f"pinned: server on CPU {CPUS[-1]}, load on CPU {','.join(map(str, sorted(rest)))}"
