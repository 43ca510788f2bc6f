"""Apply redaction rules to a recording after the fact (`shadowtest redact`).

Copies the recording into a new file: calls go through the rules; raw chunks get the same
in-place, same-length masks as at record time, on each flow's reassembled stream
(capture/decode/streammask.py); meta lists every rule ever applied (record time + now).
"""

from __future__ import annotations

import os
from pathlib import Path

from capture.decode.streammask import FlowMasker
from capture.recording import Chunk, Recording, RecordingWriter
from capture.redact import Redactor, rules_from_specs
from capture.salvage import open_salvaged


def redact_recording(src: str, dst: str, redactor: Redactor, *, overwrite: bool = False) -> dict[str, int]:
    """Write a redacted copy of `src` to `dst`; returns counts (flows, chunks, calls, calls_changed).

    Raises RecordingError / CorruptRecordingError for `src`, RecordingError for `dst`. A damaged
    source is copied up to the damage; `problems` in the result says what was cut off."""
    with open_salvaged(src) as rec:
        meta = dict(rec.meta)
        before = list(meta.get("redaction_rules", []) or [])
        # the file's own rules again (chunks an older version masked chunk by chunk), then the new ones
        redactor = Redactor(rules_from_specs(before) + [r for r in redactor.rules if r.spec not in before])
        meta["redaction_rules"] = before + [s for s in redactor.specs if s not in before]
        with RecordingWriter(dst, meta=meta, overwrite=overwrite) as out:
            ids, protos = _copy_flows(rec, out)
            counts = {"flows": len(ids), "chunks": _copy_chunks(rec, out, ids, protos, redactor)}
            counts |= _copy_calls(rec, out, ids, redactor)
            for fid, direction, at, nbytes, how in rec.gaps():
                out.add_gap(ids.get(fid, fid), direction, at, nbytes, how)
        counts["problems"] = len(rec.problems)
    return counts


def _copy_flows(rec: Recording, out: RecordingWriter) -> tuple[dict[int, int], dict[int, tuple[str, bool]]]:
    ids, protos = {}, {}
    for f in rec.flows():
        assert f.id is not None
        ids[f.id] = out.add_flow(f)
        protos[f.id] = (f.protocol, f.joined_midstream)
    return ids, protos


def _copy_chunks(rec: Recording, out: RecordingWriter, ids: dict[int, int],
                 protos: dict[int, tuple[str, bool]], redactor: Redactor) -> int:
    """Each flow's chunks through a FlowMasker: the rules apply to the reassembled stream, so a
    credential split over chunks (stored by an older version that masked chunk by chunk) is found."""
    maskers: dict[int, FlowMasker] = {}
    n = 0
    for c in rec.chunks():
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


def _copy_calls(rec: Recording, out: RecordingWriter, ids: dict[int, int], redactor: Redactor) -> dict[str, int]:
    calls = changed = 0
    for call in rec.calls():
        changed += int(redactor.call(call))
        if call.flow_id is not None:
            call.flow_id = ids.get(call.flow_id, call.flow_id)
        out.add_call(call)
        calls += 1
    return {"calls": calls, "calls_changed": changed}


def redact_in_place(path: str, redactor: Redactor) -> dict[str, int]:
    """Redact `path` itself: write a copy beside it, then atomically replace the original."""
    tmp = str(Path(path).with_name(Path(path).name + ".redacting"))
    counts = redact_recording(path, tmp, redactor, overwrite=True)
    for suffix in ("-wal", "-shm"):
        Path(path + suffix).unlink(missing_ok=True)
    os.replace(tmp, path)
    return counts
