"""Glue between a recording file and the pure schedule (kept out of schedule.py, which does no I/O)."""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from pathlib import Path

from capture.deferred import calls_pending, pending_message
from capture.integrity import Integrity
from capture.recording import Call, Recording
from replay.errors import PlanError
from replay.method_map import MethodMapError, parse_method_map
from replay.schedule import PlannedCall, ScheduleOptions, build_plan
from replay.source import recording_calls, tcp_calls, tcp_flow_starts

# parse_method_map lives in replay/method_map.py; here too, beside the plan it feeds.
__all__ = ["MethodMapError", "estimate_total", "parse_method_map", "plan_from_recording"]


def plan_from_recording(path: str | Path, opts: ScheduleOptions, rng: random.Random | None = None, *,
                        salvage: Integrity | None = None) -> tuple[Recording, Iterator[PlannedCall]]:
    """Open `path` and return it with its lazy plan; the caller closes the recording when done.

    salvage: the file's `capture.integrity.check` (--salvage): a damaged file is read through
    `open_salvaged` (its intact part). Raises capture's RecordingError/CorruptRecordingError when the
    file cannot be opened, PlanError when its calls are not decoded yet (`--decode later`): it would
    replay nothing, silently."""
    rec = _open_decoded(path, opts, salvage)
    return rec, build_plan(lambda: recording_calls(rec), opts, rng)


def _open_decoded(path: str | Path, opts: ScheduleOptions | None = None, salvage: Integrity | None = None) -> Recording:
    """`Recording(path)`, refusing a file whose calls are not decoded yet (`--decode later`, or a killed
    at-stop recorder): replaying it would silently send nothing. Raises PlanError naming the fix.
    The options' `method_map` (`--method-map`) names groups of calls for this reader only."""
    if salvage is not None and not salvage.intact:
        from capture.salvage import open_salvaged
        rec = open_salvaged(path, wal_damaged=salvage.wal_damaged)
    else:
        rec = Recording(path)
    if calls_pending(rec.meta):
        rec.close()
        raise PlanError(f"cannot replay {path}: {pending_message(path, rec.meta)}")
    if opts is not None and opts.method_map:
        rec.map_methods({(flow, ref): method for flow, ref, method in opts.method_map}, how="--method-map")
    return rec


def estimate_total(path: str | Path, opts: ScheduleOptions, salvage: Integrity | None = None) -> int:
    """The number of calls the plan will hold, counted without reading messages (for progress bars).

    Raises PlanError for a file whose calls are not decoded yet (so `--workers` refuses it before
    starting any worker)."""
    rec = _open_decoded(path, opts, salvage)
    try:
        return sum(1 for _ in build_plan(lambda: _calls_light(rec), opts))
    finally:
        rec.close()


def _calls_light(rec: Recording) -> Iterator[Call]:
    """Calls without their messages (cheap); TCP flows still come as pseudo-calls."""
    calls = (c for c in rec.calls(with_messages=False) if c.protocol != "tcp")
    return heapq.merge(calls, tcp_calls(rec, tcp_flow_starts(rec)), key=lambda c: c.request_ts_ns)
