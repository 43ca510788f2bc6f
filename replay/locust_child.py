"""One Locust worker's shard, replayed by shadowtest's own engine in a child process.

    Locust worker (gevent) --stdin: one JSON config line, then "stop" or EOF--> this process
                           <--stdout: JSON lines: {"r": [[...], ...]} results in batches,
                                      {"progress": stats}, then {"done": stats, ...} or {"error": "..."}

Locust monkey-patches the standard library for gevent; the engine runs on asyncio (uvloop with the
lean senders) on a timerfd clock. The two do not share a thread, so the worker starts this process
(unpatched) and reads what it reports: the calls go out through the same senders and scheduler as
`shadowtest replay`. EOF on stdin (the worker died or quit) stops the run; what was not sent is
counted as not sent, "stopped".

Config keys: path, target, shard [i, n], start_wall (time.time() of t0), speed, loop, timeout_s,
window [a, b] or null, methods [..], max_in_flight, sender, allow_targets [..], shard_by.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # the engine is imported only once the shard starts
    from replay.options import ReplayOptions

_BATCH_S = 0.1
_PROGRESS_S = 0.5


def _options(cfg: dict[str, Any]) -> ReplayOptions:
    """The ReplayOptions of the master's option values (replay/options.py), for shard `cfg["shard"]`,
    starting at the shared wall-clock `start_wall`; a bad value (a TLS file missing on this worker):
    ValueError, one line spelled as Locust's options are."""
    from dataclasses import replace

    from replay.options import LOCUST, OptionError, build, with_schedule

    try:
        opts = build(cfg["values"])
    except OptionError as exc:
        raise ValueError(exc.spelled(LOCUST)) from None
    s = cfg["shard"]
    lead_ns = int((float(cfg["start_wall"]) - time.time()) * 1e9)
    return replace(with_schedule(opts, shard=(int(s[0]), int(s[1]))), start_at_ns=time.monotonic_ns() + max(0, lead_ns))


def main() -> int:
    out_lock = threading.Lock()

    def emit(obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":"))
        with out_lock:
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):  # the Locust worker is gone: nobody to tell
                pass

    try:
        cfg = json.loads(sys.stdin.readline() or "{}")
        from replay.engine import ReplayRun
        from replay.stats import CallResult
        pending: deque[CallResult] = deque()
        run = ReplayRun(cfg["path"], cfg["target"], _options(cfg), on_result=pending.append)
    except Exception as exc:  # one line to the Locust worker, which tells the master
        emit({"error": " ".join(str(exc).split()) or type(exc).__name__})
        return 1

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        run.stop()  # "stop", or EOF: the worker is gone
    threading.Thread(target=watch_stdin, daemon=True).start()

    done = threading.Event()

    def flush() -> None:
        batch = [pending.popleft() for _ in range(len(pending))]
        if batch:
            emit({"r": [[r.method, r.outcome, r.code, r.intended_ns, r.sent_ns, r.done_ns, r.detail[:200]]
                        for r in batch]})

    def report() -> None:
        last = time.monotonic()
        while not done.wait(_BATCH_S):
            flush()
            if time.monotonic() - last >= _PROGRESS_S:
                last = time.monotonic()
                try:
                    emit({"progress": run.stats.to_wire()})
                except Exception:  # read while the run writes: skip this snapshot
                    pass
    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        run.run()
    except Exception as exc:
        done.set()
        reporter.join()
        flush()
        emit({"error": " ".join(str(exc).split()) or type(exc).__name__, "progress": run.stats.to_wire()})
        return 1
    done.set()
    reporter.join()
    flush()
    emit({"done": run.stats.to_wire(), "problems": run.problems})
    return 0


if __name__ == "__main__":
    sys.exit(main())
