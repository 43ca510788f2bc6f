"""`--workers N`: N processes each replay a shard of the calls, start together, merge HDRs.

Sharding is by call (ScheduleOptions.shard_by, default "call"): the plan's calls go round-robin to
the workers, so one recorded connection's calls are spread over all of them (each opens its own
connections); a call and all its stream messages stay on one worker. Histograms merge bucket by
bucket (exact percentiles of the whole run, never an average of percentiles); the report lists
each worker's share (`ReplayReport.workers`).

    parent --spawn--> worker i: open recording, plan shard (i, N), report "ready"
           <-ready--  ...
           --go(t0)-> all start at the same CLOCK_MONOTONIC t0 (shared by every process on a host)
           <-progress (stats every 0.25 s) / results (batched, when asked) / done (HDR-encoded stats)

Processes are spawned (not forked): grpc's C core must not be inherited across fork. A worker that
dies is reported in `problems`; its calls are then missing from the counts and the invariant says so.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from replay.engine import ReplayRun
from replay.options import ReplayOptions
from replay.report import ReplayReport, build, worker_share
from replay.stats import CallResult, RunStats

_START_DELAY_NS = 50_000_000  # after the last "ready": time for every worker to see "go"


def _worker_main(i: int, n: int, path: str, target: str, opts: ReplayOptions, out: Any, go: Any,
                 start_at: Any, stop: Any, forward: bool) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us cleanly
    opts = dataclasses.replace(opts, schedule=dataclasses.replace(opts.schedule, shard=(i, n)))
    pending: deque[CallResult] = deque()
    run = ReplayRun(path, target, opts, on_result=pending.append if forward else None)
    out.put(("ready", i, None))
    go.wait()
    run.options.start_at_ns = start_at.value
    done = threading.Event()

    def report_progress() -> None:
        while not done.wait(0.25):
            if stop.is_set():
                run.stop()
            batch = [pending.popleft() for _ in range(len(pending))]  # appends race only at the end
            try:
                snapshot = run.stats.to_wire()
            except Exception:  # read while the run writes: skip this snapshot, never the results
                snapshot = None
            out.put(("progress", i, {"stats": snapshot, "results": batch}))
    reporter = threading.Thread(target=report_progress, daemon=True)
    reporter.start()
    try:
        run.run()
    finally:
        done.set()
        # A batch it popped must reach the queue before "done": the parent stops reading at "done".
        reporter.join()
    cmp = run.comparer
    out.put(("done", i, {"stats": run.stats.to_wire(), "results": list(pending), "end_ns": run.end_ns,
                         "problems": run.problems, "mismatches": cmp.summary() if cmp is not None else None}))


class WorkerPool:
    """Run one replay as `workers` processes. `run()` blocks and returns the merged ReplayReport.

    on_progress(merged RunStats) is called about every 0.25 s; on_result(CallResult) for each call
    (forwarded in batches, only when given). `stop()` ends every worker early (any thread).
    """

    def __init__(self, path: str | Path, target: str, options: ReplayOptions, workers: int, *,
                 on_result: Callable[[CallResult], None] | None = None,
                 on_progress: Callable[[RunStats], None] | None = None, ready_timeout_s: float = 60.0) -> None:
        from replay.compare import Comparer
        from replay.errors import ReplayError
        from replay.target import check_target
        if isinstance(options.compare, Comparer):
            raise ReplayError("with workers, pass compare=CompareSpec(...): each process builds its own Comparer")
        self.path, self.target = str(path), check_target(target, options.allow_targets)
        self.options, self.workers = options, workers
        self.on_result, self.on_progress = on_result, on_progress
        self.ready_timeout_s = ready_timeout_s
        self._ctx = mp.get_context("spawn")
        self._stop = self._ctx.Event()
        self.pids: list[int] = []  # the worker processes, once started
        self._died: set[int] = set()  # workers that died before their final counts

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> ReplayReport:
        ctx = self._ctx
        out, go, start_at = ctx.Queue(), ctx.Event(), ctx.Value("q", 0)
        procs = [ctx.Process(target=_worker_main, daemon=True,
                             args=(i, self.workers, self.path, self.target, self.options, out, go, start_at,
                                   self._stop, self.on_result is not None))
                 for i in range(self.workers)]
        for p in procs:
            p.start()
        self.pids = [p.pid for p in procs if p.pid is not None]
        try:
            self._await_ready(out, procs)
            start_at.value = time.monotonic_ns() + _START_DELAY_NS
            go.set()
            return self._collect(out, procs, start_at.value)
        finally:
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()

    def _await_ready(self, out: Any, procs: Sequence[BaseProcess]) -> None:
        from replay.errors import ReplayError
        ready, deadline = 0, time.monotonic() + self.ready_timeout_s
        while ready < len(procs):
            try:
                kind, i, _ = out.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise ReplayError("replay workers failed to start; run without --workers to see why") from None
                continue
            ready += kind == "ready"

    def _collect(self, out: Any, procs: Sequence[BaseProcess], t0: int) -> ReplayReport:
        finals: dict[int, dict[str, Any]] = {}
        latest: dict[int, RunStats] = {}
        problems: list[str] = []
        exited: set[int] = set()
        while len(finals) < len(procs):
            try:
                kind, i, payload = out.get(timeout=0.5)
            except queue.Empty:
                for w, p in enumerate(procs):
                    if w in finals or p.exitcode is None:
                        continue
                    if w not in exited:  # its last message may still be in the pipe: poll once more
                        exited.add(w)
                    else:
                        problems.append(f"worker {w} died (exit {p.exitcode}); its calls are missing")
                        self._died.add(w)
                        finals[w] = {"stats": RunStats().to_wire(), "results": [], "end_ns": 0,
                                     "problems": [], "mismatches": None}
                continue
            if self.on_result is not None:
                for r in payload["results"]:
                    self.on_result(r)
            if payload["stats"] is not None:
                latest[i] = RunStats.from_wire(payload["stats"])
            if kind == "done":
                finals[i] = payload
            if self.on_progress:
                self.on_progress(_merge(latest.values()))
        return self._report(finals, t0, problems)

    def _report(self, finals: dict[int, dict[str, Any]], t0: int, problems: list[str]) -> ReplayReport:
        from replay.compare import Comparer
        parts = {w: RunStats.from_wire(f["stats"]) for w, f in sorted(finals.items())}
        stats = _merge(parts.values())
        shares = [worker_share(w, s, complete=w not in self._died) for w, s in parts.items()]
        for f in finals.values():
            problems += [p for p in f["problems"] if p not in problems]
        summaries = [f["mismatches"] for f in finals.values() if f["mismatches"] is not None]
        merged = _Summary(Comparer.merge_summaries(summaries)) if summaries else None
        end = max((f["end_ns"] for f in finals.values()), default=t0)
        report = build(stats, t0, end, target=self.target, options=self.options, problems=problems,
                       comparer=merged, workers=shares)
        # A dead worker's shard was never counted, so the sums cannot prove nothing was lost.
        report.invariant_ok = report.invariant_ok and not any("died" in p for p in problems)
        return report


class _Summary:
    def __init__(self, summary: dict[str, Any]) -> None:
        self._s = summary

    def summary(self) -> dict[str, Any]:
        return self._s


def _merge(parts: Iterable[RunStats]) -> RunStats:
    total = RunStats()
    for s in parts:
        total.merge(s)
    return total
