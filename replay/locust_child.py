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
from typing import Any

_BATCH_S = 0.1
_PROGRESS_S = 0.5


def _options(cfg: dict[str, Any]) -> Any:
    from replay.engine import ReplayOptions
    from replay.schedule import ScheduleOptions
    from replay.shadow import ShadowValues

    w, s = cfg.get("window"), cfg["shard"]
    window = (float(w[0]), float(w[1])) if w else None
    shadow = cfg.get("shadow") or {}
    sched = ScheduleOptions(speed=float(cfg.get("speed", 1.0)), loop=int(cfg.get("loop", 1)), window=window,
                            methods=frozenset(cfg.get("methods") or ()), shard=(int(s[0]), int(s[1])),
                            shard_by=str(cfg.get("shard_by", "call")),
                            shadow=ShadowValues(tuple((str(k), str(v)) for k, v in shadow.get("query", ())),
                                                tuple((str(k), str(v)) for k, v in shadow.get("field", ()))))
    lead_ns = int((float(cfg["start_wall"]) - time.time()) * 1e9)
    tls, headers = None, None
    if cfg.get("tls"):
        from replay.senders.tls import TlsConfig
        tls = TlsConfig(**cfg["tls"])
        tls.check()  # a file missing on this worker: one line to the master
    if cfg.get("headers"):
        from replay.senders.headers import HeaderPolicy
        h = cfg["headers"]
        headers = HeaderPolicy(tuple((str(k), str(v)) for k, v in h.get("set", ())), tuple(h.get("drop", ())),
                               bool(h.get("marker", True)), bool(h.get("keep_trace_context", False)))
    return ReplayOptions(tls=tls, headers=headers, schedule=sched, sender=str(cfg.get("sender", "auto")),
                         timeout_s=float(cfg.get("timeout_s", 10.0)),
                         max_in_flight=int(cfg.get("max_in_flight", 256)),
                         allow_targets=tuple(cfg.get("allow_targets") or ()),
                         start_at_ns=time.monotonic_ns() + max(0, lead_ns))


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
