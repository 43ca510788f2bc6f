"""Apply redaction rules to a recording after the fact (`shadowtest redact`).

Copies the recording into a new file: calls go through the rules; raw chunks get the same
in-place, same-length masks as at record time, on each flow's reassembled stream
(capture/decode/streammask.py); meta lists every rule ever applied (record time + now).

A damaged source (capture.integrity) is refused unless `salvage`; a salvaged copy says so in its meta
(`salvaged`: from, calls_lost, problems), so `inspect` and `replay` see the loss in the copy too. The
copy appears whole or not at all (capture.output).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from capture.decode.streammask import FlowMasker
from capture.integrity import Integrity, open_for
from capture.output import atomic_output
from capture.recording import Chunk, Recording, RecordingWriter
from capture.redact import Redactor, rules_from_specs


class RedactCounts(TypedDict):
    """What a redaction did: the copy's flows, chunks and calls, the calls changed, what the source lost."""

    flows: int
    chunks: int
    calls: int
    calls_changed: int
    problems: list[str]
    calls_lost: int | None   # 0 for an intact source; None when unknown


def redact_recording(src: str, dst: str, redactor: Redactor, *, overwrite: bool = False,
                     salvage: bool = False, progress: Callable[[int, int], None] | None = None) -> RedactCounts:
    """Write a redacted copy of `src` to `dst`; returns counts (flows, chunks, calls, calls_changed),
    `problems` (what the source lost, one line each) and `calls_lost` (0 for an intact source, None
    when unknown).

    Raises RecordingError / CorruptRecordingError for `src` (a damaged one without `salvage`),
    RecordingError for `dst`. `progress(chunks read, chunks)` is called every 1,024 chunks."""
    rec, found = open_for(src, "redact", salvage=salvage)
    with rec, atomic_output(dst, overwrite=overwrite) as tmp:
        meta = dict(rec.meta)
        before = list(meta.get("redaction_rules", []) or [])
        # the file's own rules again (chunks an older version masked chunk by chunk), then the new ones
        redactor = Redactor(rules_from_specs(before) + [r for r in redactor.rules if r.spec not in before])
        meta["redaction_rules"] = before + [s for s in redactor.specs if s not in before]
        with RecordingWriter(tmp, meta=meta) as out:
            ids, protos = _copy_flows(rec, out)
            chunks = _copy_chunks(rec, out, ids, protos, redactor, progress)
            calls, changed = _copy_calls(rec, out, ids, redactor)
            for fid, direction, at, nbytes, how in rec.gaps():
                out.add_gap(ids.get(fid, fid), direction, at, nbytes, how)
            problems = list(dict.fromkeys(found.problems + rec.problems))
            lost = 0 if found.intact else _salvaged(rec, found, src, calls, problems, out)
    return {"flows": len(ids), "chunks": chunks, "calls": calls, "calls_changed": changed, "problems": problems,
            "calls_lost": lost}


def _salvaged(rec: Recording, found: Integrity, src: str, calls: int, problems: list[str],
              out: RecordingWriter) -> int | None:
    """The calls a salvaged copy lost (those the source's writer committed minus those copied, plus what
    an earlier salvage lost; None when unknown), stated in the copy's meta."""
    written = (rec.meta.get("rows_written") or {}).get("calls")
    earlier = (rec.meta.get("salvaged") or {}).get("calls_lost", 0)
    lost = None if found.loss_unknown or not isinstance(written, int) or earlier is None \
        else max(0, written - calls) + int(earlier)
    out.set_meta({"salvaged": {"from": str(src), "calls_lost": lost, "problems": problems[:10]}})
    return lost


def _copy_flows(rec: Recording, out: RecordingWriter) -> tuple[dict[int, int], dict[int, tuple[str, bool]]]:
    ids, protos = {}, {}
    for f in rec.flows():
        assert f.id is not None
        ids[f.id] = out.add_flow(f)
        protos[f.id] = (f.protocol, f.joined_midstream)
    return ids, protos


def _copy_chunks(rec: Recording, out: RecordingWriter, ids: dict[int, int],
                 protos: dict[int, tuple[str, bool]], redactor: Redactor,
                 progress: Callable[[int, int], None] | None = None) -> int:
    """Each flow's chunks through a FlowMasker: the rules apply to the reassembled stream, so a
    credential split over chunks (stored by an older version that masked chunk by chunk) is found."""
    maskers: dict[int, FlowMasker] = {}
    n = 0
    total = rec.count("chunks") if progress is not None else 0
    for read, c in enumerate(rec.chunks(), 1):
        if progress is not None and not read & 1023:
            progress(read, total)
        proto, joined = protos.get(c.flow_id, ("tcp", False))
        m = maskers.get(c.flow_id)
        if m is None:
            m = maskers[c.flow_id] = FlowMasker(redactor, joined)
        for direction, ts, data in m.feed(c.direction, c.ts_ns, c.data, proto):
            out.add_chunk(Chunk(ids.get(c.flow_id, c.flow_id), direction, ts, data))
            n += 1
    for fid, m in maskers.items():
        for direction, ts, data in m.flush():
            out.add_chunk(Chunk(ids.get(fid, fid), direction, ts, data))
            n += 1
    return n


def _copy_calls(rec: Recording, out: RecordingWriter, ids: dict[int, int], redactor: Redactor) -> tuple[int, int]:
    """(calls copied, calls the redactor changed)."""
    calls = changed = 0
    for call in rec.calls():
        changed += int(redactor.call(call))
        if call.flow_id is not None:
            call.flow_id = ids.get(call.flow_id, call.flow_id)
        out.add_call(call)
        calls += 1
    return calls, changed


def redact_in_place(path: str, redactor: Redactor, progress: Callable[[int, int], None] | None = None) -> RedactCounts:
    """Redact `path` itself: write a copy beside it, then atomically replace the original. A damaged
    file is refused (never salvaged in place: the damaged original would be gone)."""
    tmp = str(Path(path).with_name(Path(path).name + ".redacting"))
    counts = redact_recording(path, tmp, redactor, overwrite=True, progress=progress)
    for suffix in ("-wal", "-shm"):
        Path(path + suffix).unlink(missing_ok=True)
    os.replace(tmp, path)
    return counts
