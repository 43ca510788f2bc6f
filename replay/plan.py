"""Glue between a recording file and the pure schedule (kept out of schedule.py, which does no I/O)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from capture.recording import Recording
from replay.schedule import PlannedCall, ScheduleOptions, build_plan
from replay.source import recording_calls


def plan_from_recording(path: str | Path, opts: ScheduleOptions,
                        rng: random.Random | None = None) -> tuple[Recording, Iterator[PlannedCall]]:
    """Open `path` and return it with its lazy plan; the caller closes the recording when done.

    Raises capture's RecordingError/CorruptRecordingError when the file cannot be opened."""
    rec = Recording(path)
    return rec, build_plan(lambda: recording_calls(rec), opts, rng)


def estimate_total(path: str | Path, opts: ScheduleOptions) -> int:
    """The number of calls the plan will hold, counted without building messages (for progress bars)."""
    rec = Recording(path)
    try:
        plan = build_plan(lambda: recording_calls_light(rec), opts)
        return sum(1 for _ in plan)
    finally:
        rec.close()


def recording_calls_light(rec: Recording) -> Iterator:  # type: ignore[type-arg]
    """Calls without their messages (cheap); TCP flows still come from `recording_calls`."""
    import heapq

    from replay.source import _tcp_calls, _tcp_flow_starts
    starts = _tcp_flow_starts(rec)
    calls = (c for c in rec.calls(with_messages=False) if c.protocol != "tcp")
    return heapq.merge(calls, _tcp_calls(rec, starts), key=lambda c: c.request_ts_ns)
