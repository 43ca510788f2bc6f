"""Many recordings, one file (`shadowtest merge A.rec B.rec ... -o all.rec`): the traffic of a fleet, replayed
as one.

A rotated set (capture/rotate.py) is merged the same way: a flow a file `continues` is joined to the
flow of the previous file it continues (one flow, its chunks in order, its gaps where they were).

Each recorder stamps its records with its own host's CLOCK_MONOTONIC, whose zero is the host's boot: two
hosts' stamps cannot be compared as they are. Every recording also holds the wall clock and the monotonic
clock read together when it started (meta `started_wall_ns`, `started_mono_ns`), so its stamps map to the
wall clock by one offset. The merge takes the earliest-starting recording as the reference and shifts
every other file's stamps (flows, chunks, calls, messages) by the difference of the offsets: the merged
file is on the reference's monotonic clock, aligned by wall clock. How well depends on the hosts' wall
clocks (NTP keeps them within milliseconds); the merge states the alignment it used and each shift.

Refused, with one line naming the file: a recording without the two clock readings (nothing to align
by), one whose calls are not decoded yet (`record --decode later`: `record --finish` first), a damaged one
(unless --salvage: its intact part, the loss stated), and recordings whose time ranges do not overlap
(a set that follows one another in time needs --allow-disjoint: then they are placed on the wall clock
as they are). Every flow keeps its host (meta `merged.from[i]`: file, host, its flow ids, the shift),
every call its messages and its redaction marks; meta `redaction_rules` is the union. The output appears
whole or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from capture.errors import RecordingError
from capture.integrity import Integrity, open_for
from capture.output import atomic_output
from capture.recording import Call, Chunk, Message, Recording, RecordingWriter


@dataclass
class _Source:
    path: str
    rec: Recording
    found: Integrity
    host: str
    offset_ns: int           # wall - monotonic, as the recorder read them at its start
    span: tuple[int, int] | None   # first, last stamp (its own clock)
    place: tuple[str, int] | None  # (set id, index) of a file of a rotated set (capture/rotate.py)


def _shift(v: int | None, by: int) -> int | None:
    return None if v is None else v + by


def _source(path: str, salvage: bool) -> _Source:
    rec, found = open_for(path, "merge", salvage=salvage)
    meta = rec.meta
    wall, mono = meta.get("started_wall_ns"), meta.get("started_mono_ns")
    if not isinstance(wall, int) or not isinstance(mono, int):
        rec.close()
        raise RecordingError(f"{path}: no clock readings to align it by (meta started_wall_ns/started_mono_ns: "
                             "recorded by `shadowtest record`, not imported): cannot merge")
    if meta.get("calls_decoded") is False:
        rec.close()
        raise RecordingError(f"{path}: its calls are not decoded yet (--decode later): run "
                             f"`shadowtest record --finish -o {path}` first")
    spans = [s for s in (rec.chunk_time_range_ns(), rec.time_range_ns()) if s is not None]
    span = (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None
    rot = meta.get("rotation")
    place = (rot["set"], rot["index"]) if isinstance(rot, dict) and isinstance(rot.get("set"), str) \
        and isinstance(rot.get("index"), int) else None
    return _Source(path, rec, found, str(meta.get("host") or "?"), wall - mono, span, place)


def merge_recordings(paths: list[str], dst: str, *, overwrite: bool = False, allow_disjoint: bool = False,
                     salvage: bool = False, meta: dict[str, Any] | None = None,
                     single_ok: bool = False) -> dict[str, Any]:
    """Merge `paths` into `dst` (see the module docstring). Returns counts and the alignment used.
    `meta`: added to the output's meta; `single_ok`: one file is a copy (a flight recorder's dump)."""
    if len(paths) < (1 if single_ok else 2):
        raise RecordingError("merge needs at least two recordings")
    if len(set(map(str, map(Path, paths)))) != len(paths):
        raise RecordingError("the same recording is named twice")
    sources: list[_Source] = []
    try:
        for p in paths:
            sources.append(_source(p, salvage))
        ref = min(sources, key=lambda s: s.offset_ns + (s.span[0] if s.span else 0))
        shifts = {s.path: s.offset_ns - ref.offset_ns for s in sources}
        _check_overlap(sources, shifts, allow_disjoint)
        return _write(sources, ref, shifts, dst, overwrite, meta or {})
    finally:
        for s in sources:
            s.rec.close()


def _check_overlap(sources: list[_Source], shifts: dict[str, int], allow_disjoint: bool) -> None:
    spans = sorted((s.span[0] + shifts[s.path], s.span[1] + shifts[s.path], s.path) for s in sources if s.span)
    if allow_disjoint:
        return
    end = None
    for start, stop, path in spans:
        if end is not None and start > end:
            raise RecordingError(f"{path} starts {(start - end) / 1e9:.3f} s after every earlier recording has "
                                 "ended (by wall clock): their time ranges do not overlap; pass --allow-disjoint to "
                                 "merge them one after another")
        end = stop if end is None else max(end, stop)


def _write(sources: list[_Source], ref: _Source, shifts: dict[str, int], dst: str, overwrite: bool,
           extra: dict[str, Any]) -> dict[str, Any]:
    rules: list[str] = []
    for s in sources:
        rules += [r for r in s.rec.meta.get("redaction_rules", []) or [] if r not in rules]
    hosts = {s.host for s in sources}
    meta = dict(ref.rec.meta) | {"host": hosts.pop() if len(hosts) == 1 else "merged", "redaction_rules": rules} | extra
    for key in ("rows_written", "salvaged", "capped", "sampling", "tls", "tls_flows", "method_map", "rotation",
                "continues", "rotated"):
        meta.pop(key, None)
    merged: list[dict[str, Any]] = []
    counts = {"flows": 0, "chunks": 0, "calls": 0, "messages": 0}
    problems: list[str] = []
    with atomic_output(dst, overwrite=overwrite) as tmp:
        with RecordingWriter(tmp, meta=meta) as out:
            files = {s.place: s.path for s in sources if s.place is not None}
            merged_ids: dict[str, dict[int, int]] = {}          # file -> its flow id -> merged flow id
            stored: dict[tuple[int, str], int] = {}               # (merged flow, direction) -> chunks so far
            for s in sorted(sources, key=lambda s: (shifts[s.path], s.place or ("", 0))):
                by = shifts[s.path]
                ids = merged_ids[s.path] = {}
                before = files.get((s.place[0], s.place[1] - 1)) if s.place is not None else None
                continues = s.rec.meta.get("continues") or {} if before is not None else {}
                new_ids: list[int] = []
                for f in s.rec.flows():
                    assert f.id is not None
                    prev = continues.get(str(f.id)) if isinstance(continues, dict) else None
                    if before is not None and isinstance(prev, int) and prev in merged_ids.get(before, {}):
                        ids[f.id] = merged_ids[before][prev]        # a connection the previous file had open
                        if f.closed_ns is not None:
                            out.update_flow(ids[f.id], closed_ns=f.closed_ns + by)
                        continue
                    ids[f.id] = out.add_flow(replace(f, opened_ns=_shift(f.opened_ns, by),
                                                     closed_ns=_shift(f.closed_ns, by)))
                    new_ids.append(ids[f.id])
                base = dict(stored)                                  # chunks of continued flows in earlier files
                for c in s.rec.chunks():
                    fid = ids.get(c.flow_id, c.flow_id)
                    out.add_chunk(Chunk(fid, c.direction, c.ts_ns + by, c.data))
                    stored[(fid, c.direction)] = stored.get((fid, c.direction), 0) + 1
                    counts["chunks"] += 1
                for fid, direction, at, nbytes, how in s.rec.gaps():
                    mid = ids.get(fid, fid)
                    out.add_gap(mid, direction, at + base.get((mid, direction), 0), nbytes, how)
                for call in s.rec.calls():
                    counts["messages"] += len(call.requests) + len(call.responses)
                    out.add_call(_shifted(call, ids, by))
                    counts["calls"] += 1
                counts["flows"] += len(new_ids)
                problems += [f"{s.path}: {p}" for p in dict.fromkeys(s.found.problems + s.rec.problems)]
                merged.append({"file": s.path, "host": s.host, "flows": [min(new_ids), max(new_ids)]
                               if new_ids else [], "shift_ns": by, "started_wall_ns": s.rec.meta.get("started_wall_ns"),
                               "sampling": s.rec.meta.get("sampling"), "salvaged": not s.found.intact})
            out.set_meta({"merged": {"alignment": "wall clock: each file's started_wall_ns - started_mono_ns, "
                                                  f"against the earliest, {ref.path} ({ref.host})",
                                     "from": merged}} | _tls_report(sources, files, merged_ids))
    return counts | {"from": merged, "problems": problems, "output": dst}


def _tls_report(sources: list[_Source], files: dict[tuple[str, int], str],
                merged_ids: dict[str, dict[int, int]]) -> dict[str, Any]:
    """The inputs' TLS report (meta `tls`, `tls_flows`) on the merged flow ids: a row names its flow in its
    own file, or, in a rotated set, in the file of the set it carries as its fifth field (the file the
    connection was opened in). The `tls` counts of several inputs are summed."""
    rows: list[list[Any]] = []
    statuses: list[dict[str, Any]] = []
    for s in sources:
        status = s.rec.meta.get("tls")
        if isinstance(status, dict):
            statuses.append(status)
        for r in s.rec.meta.get("tls_flows") or []:
            if not (isinstance(r, list) and len(r) >= 4 and isinstance(r[0], int)):
                continue
            path = files.get((s.place[0], r[4])) if len(r) > 4 and s.place is not None else s.path
            merged = merged_ids.get(path or "", {}).get(r[0])
            if merged is not None:
                rows.append([merged, *r[1:4]])
    if not statuses:
        return {}
    status = dict(statuses[0])
    for other in statuses[1:]:
        for k, v in other.items():
            if isinstance(v, int) and not isinstance(v, bool) and isinstance(status.get(k), int):
                status[k] += v
    return {"tls": status, "tls_flows": sorted(rows, key=lambda r: int(r[0]))}


def _shifted(call: Call, ids: dict[int, int], by: int) -> Call:
    msgs = [Message(m.direction, m.seq, m.ts_ns + by, m.data, m.compressed) for m in (*call.requests, *call.responses)]
    return replace(call, flow_id=ids.get(call.flow_id, call.flow_id) if call.flow_id is not None else None,
                   request_ts_ns=call.request_ts_ns + by, response_ts_ns=_shift(call.response_ts_ns, by),
                   end_ts_ns=_shift(call.end_ts_ns, by), requests=[m for m in msgs if m.direction == "c2s"],
                   responses=[m for m in msgs if m.direction == "s2c"], id=None)

