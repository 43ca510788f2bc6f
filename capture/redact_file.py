"""Apply redaction rules to a recording after the fact (`shadowtest redact`).

Copies the recording into a new file: calls go through the rules; raw chunks of HTTP/1.1 and
HTTP/2 flows get the same in-place, same-length header masks as at record time; meta lists every
rule ever applied (record time + now).
"""

from __future__ import annotations

import os
from pathlib import Path

from capture.decode.h2mask import H2ChunkMasker
from capture.recording import Chunk, Direction, Recording, RecordingWriter
from capture.redact import Redactor, mask_http1_headers
from capture.salvage import open_salvaged


def redact_recording(src: str, dst: str, redactor: Redactor, *, overwrite: bool = False) -> dict[str, int]:
    """Write a redacted copy of `src` to `dst`; returns counts (flows, chunks, calls, calls_changed).

    Raises RecordingError / CorruptRecordingError for `src`, RecordingError for `dst`. A damaged
    source is copied up to the damage; `problems` in the result says what was cut off."""
    with open_salvaged(src) as rec:
        meta = dict(rec.meta)
        meta["redaction_rules"] = list(meta.get("redaction_rules", [])) + redactor.specs
        with RecordingWriter(dst, meta=meta, overwrite=overwrite) as out:
            ids, protos = _copy_flows(rec, out)
            counts = {"flows": len(ids), "chunks": _copy_chunks(rec, out, ids, protos, redactor)}
            counts |= _copy_calls(rec, out, ids, redactor)
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
    rule = redactor.header_rule()
    maskers: dict[tuple[int, Direction], H2ChunkMasker] = {}
    n = 0
    for c in rec.chunks():
        proto, joined = protos.get(c.flow_id, ("tcp", False))
        pieces = [(c.ts_ns, c.data)]
        if proto == "http1":
            pieces = [(c.ts_ns, redactor.body(mask_http1_headers(c.data, rule) if rule else c.data))]
        elif proto in ("grpc", "http2"):
            key = (c.flow_id, c.direction)
            if key not in maskers:
                maskers[key] = H2ChunkMasker(rule.matches if rule else (lambda _n: False), redactor.body,
                                             c.direction == "c2s", joined)
            pieces = maskers[key].feed(c.ts_ns, c.data)
        for ts, data in pieces:
            out.add_chunk(Chunk(ids.get(c.flow_id, c.flow_id), c.direction, ts, data))
            n += 1
    for (fid, direction), m in maskers.items():
        for ts, data in m.flush():
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
