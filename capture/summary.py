"""What a recording holds, computed in one streamed pass (for `shadowtest inspect`).

Method groups (connections joined mid-stream, see capture/recording.py): `method_groups` lists each
(flow, ref) group with its calls, call kinds and method (mapped, or None) and how it was found. A
gRPC/HTTP/2 call whose method is still unknown after the map is a problem (`complete` is false, the
problem names the fix) when it belongs to a group (its request headers were seen, so naming the
group fixes it), to a connection recorded from its start, or to a file written before method
groups; calls of a joined connection whose request headers were never seen (in flight when the
recording began) are counted in `unknown_method_ungrouped` only. `replay` sends none of them (not_sent: unknown_method).

`duration_s` means the same for every backend: first to last timestamp of the traffic the file
holds (chunks: bytes seen; calls: request, response, end and each message). How long the recorder
ran is `capture_duration_s` (live backends' meta; None for imports and killed recorders).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from capture.decode.h2grpc import MAX_MESSAGE
from capture.decode.tls import client_hello_sni
from capture.deferred import calls_pending, pending_message
from capture.integrity import Integrity, loss_text
from capture.recording import (
    BODY_NOT_CAPTURED,
    CALL_DAMAGED,
    OUTCOME_UNKNOWN,
    STATUS_HIDDEN,
    MethodGroup,
    Recording,
)
from wire.stats import percentile

_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[int]) -> str:
    """Unicode bars scaled to the largest value."""
    top = max(values, default=0)
    if not top:
        return _SPARK[0] * len(values)
    return "".join(_SPARK[min(len(_SPARK) - 1, v * (len(_SPARK) - 1) // top)] for v in values)


def summarize(rec: Recording, buckets: int = 40, integrity: Integrity | None = None) -> dict[str, Any]:
    """Counts, methods, statuses, rate over time, payload sizes, loss and mid-stream joins.

    integrity: `capture.integrity.check` of the file; its damage is listed first among the problems.
    Payload sizes are kept as one int per message: fine for recordings of millions of calls."""
    methods: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    times: list[int] = []
    req_sizes: list[int] = []
    resp_sizes: list[int] = []
    unknown = 0
    flows = list(rec.flows())
    joined = {f.id for f in flows if f.joined_midstream}
    # flows with a gap in the client's bytes: request headers may have fallen in it (not a join)
    gapped = {g[0] for g in rec.gaps() if g[1] == "c2s" and g[4] is None}
    unresolved = ungrouped = 0      # gRPC/HTTP/2 calls whose method is unknown after the map
    unresolved_after_gap = 0        # of them, those whose HPACK entries a gap (not a join) hid
    hidden = 0                      # calls whose recorded trailers HPACK made unreadable (joined)
    body_gaps = unknown_outcome = 0  # HTTP/1 calls with a body lost in a gap / after one it could not resync
    damaged = no_status = 0         # calls open during a gap; calls that ended without a status
    last = 0                        # the latest timestamp of any call (request, response, end, message)
    for call in rec.calls():
        methods[call.method or "<unknown>"] += 1
        statuses[str(call.status)] += 1
        unknown += int(call.method_unknown)
        hidden += call.status is None and call.status_message == STATUS_HIDDEN
        body_gaps += bool(call.status_message and call.status_message.startswith(BODY_NOT_CAPTURED))
        unknown_outcome += call.status_message == OUTCOME_UNKNOWN
        damaged += bool(call.status_message and call.status_message.startswith(CALL_DAMAGED))
        no_status += call.status is None and call.status_message not in (OUTCOME_UNKNOWN, STATUS_HIDDEN) \
            and not (call.status_message or "").startswith((CALL_DAMAGED, BODY_NOT_CAPTURED))
        if call.method is None and call.protocol in ("grpc", "http2"):
            if call.method_ref is None and (call.flow_id in joined or call.flow_id in gapped) \
                    and rec.has_method_refs:
                ungrouped += 1      # its request headers were never seen: nothing can name it
            else:
                unresolved += 1
                unresolved_after_gap += bool(call.method_ref and call.method_ref.startswith("hpack@"))
        times.append(call.request_ts_ns)
        req_sizes += [len(m.data) for m in call.requests]
        resp_sizes += [len(m.data) for m in call.responses]
        last = max(last, call.request_ts_ns, call.response_ts_ns or 0, call.end_ts_ns or 0,
                   *(m.ts_ns for m in call.requests), *(m.ts_ns for m in call.responses))
    groups = rec.method_groups()
    span = _traffic_span(rec, min(times, default=None), last if times else None)
    meta = rec.meta
    out: dict[str, Any] = {
        "file": str(rec.path), "backend": meta.get("backend"), "host": meta.get("host"),
        "flows": len(flows), "joined_flows": sum(f.joined_midstream for f in flows),
        "protocols": dict(Counter(f.protocol for f in flows)), "calls": len(times),
        "methods": dict(methods.most_common()), "statuses": dict(statuses.most_common()),
        "chunks": rec.count("chunks"), "lost_events": int(meta.get("lost_events", 0) or 0),
        "truncated_events": int(meta.get("truncated_events", 0) or 0), "unknown_method_calls": unknown,
        "duration_s": span / 1e9, "capture_duration_s": _capture_duration(meta),
        "redaction_rules": meta.get("redaction_rules", []),
        "request_bytes": _sizes(req_sizes), "response_bytes": _sizes(resp_sizes),
        "rate_per_s": _rate(times, buckets),
        "complete": False,
        "calls_pending": calls_pending(meta),
        "method_groups": [{"flow": g.flow_id, "ref": g.ref, "protocol": g.protocol, "calls": g.calls,
                           "kinds": g.kinds, "method": g.method, "how": g.how} for g in groups],
        "unresolved_method_calls": unresolved, "unknown_method_ungrouped": ungrouped,
        "tls": meta.get("tls"),   # TLS plaintext capture (capture/ebpf/tls.py): on/off, counts
        "problems": (_file_damage(rec, integrity) + list(meta.get("import_problems", []) or []) + _salvaged(meta)
                     + _undecoded(rec)
                     + _unknown_peers(meta) + _oversized(meta) + _discarded(meta) + _hidden_statuses(hidden)
                     + _gapped_calls(body_gaps, unknown_outcome) + _encrypted(meta)
                     + _unresolved(rec, unresolved, groups, unresolved_after_gap)),
    }
    # What makes the recording incomplete without making it unusable: listed too, `complete` false,
    # exit 1 only with `inspect --strict`.
    out["blocking_problems"] = len(out["problems"])
    out["problems"] += (_loss(meta) + _gaps(rec) + _not_captured(meta) + _damaged_calls(damaged, no_status)
                        + _tls_flows(rec, flows, meta))
    out["gaps"] = len(rec.gaps())
    out["complete"] = ("stopped_wall_ns" in meta or meta.get("backend") == "import") and not out["problems"]
    return out


def _loss(meta: dict[str, Any]) -> list[str]:
    """Ring-buffer loss and syscalls cut at --max-bytes (eBPF): bytes the recording does not hold."""
    out = []
    lost = int(meta.get("lost_events", 0) or 0)
    truncated = int(meta.get("truncated_events", 0) or 0)
    if lost:
        out.append(f"{lost} event(s) lost (the recorder's ring buffer or queue was full): bytes of the flows "
                   "they belonged to are missing (gaps)")
    if truncated:
        out.append(f"{truncated} syscall(s) moved more than the recorder copies (--max-bytes): the rest of their "
                   "bytes are gaps")
    return out


def _gaps(rec: Recording) -> list[str]:
    """Positions where bytes were not captured (the gaps table; sendfile ones are said apart)."""
    gaps = [g for g in rec.gaps() if g[4] is None]
    if not gaps:
        return []
    known = sum(g[3] or 0 for g in gaps)
    unknown = sum(1 for g in gaps if g[3] is None)
    flows = len({g[0] for g in gaps})
    size = f"{known:,} bytes" + (f" and {unknown} gap(s) of unknown size" if unknown else "")
    return [f"{len(gaps)} gap(s) in {flows} flow(s): {size} not captured (lost, truncated or discarded); "
            "`export` marks them, calls open during one are marked damaged"]


def _not_captured(meta: dict[str, Any]) -> list[str]:
    """Bytes sent by a path the recorder cannot read (sendfile, splice): length and time only."""
    return [f"{n:,} bytes sent with {how} on flow {flow} ({direction}, {calls} syscall(s)): not captured "
            "(the bodies are stored as \"not captured\")"
            for flow, direction, how, n, calls in meta.get("not_captured_by_flow", []) or []]


def _damaged_calls(damaged: int, no_status: int) -> list[str]:
    out = []
    if damaged:
        out.append(f"{damaged} call(s) are damaged: bytes of their connection were lost (a gap) or a message "
                   "was too large to keep, so their messages or status may be incomplete; each says which "
                   "(replay --compare counts them as not comparable)")
    if no_status:
        out.append(f"{no_status} call(s) have no status: unanswered, reset, or cut off by the end of the "
                   "recording (replay --compare counts them as not comparable)")
    return out


def _tls_flows(rec: Recording, flows: list[Any], meta: dict[str, Any]) -> list[str]:
    """Flows detected as TLS by their ClientHello (protocol `tls`) that the TLS capture did not already
    list: payload encrypted, no calls; the server name (SNI) from the first 16 KiB when present."""
    listed = {r[0] for r in meta.get("tls_flows", []) or [] if r}
    tls = [f for f in flows if f.protocol == "tls" and f.id not in listed]
    if not tls:
        return []
    names: list[str] = []
    for f in tls[:20]:                 # bounded: the first bytes of the first 20 flows
        sni = client_hello_sni(rec.first_bytes(f.id, "c2s", 16384))
        if sni and sni not in names:
            names.append(sni)
    where = f" (server names: {', '.join(names)})" if names else ""
    return [f"{len(tls)} TLS flow(s){where}: payload is encrypted, no calls decoded (their bytes are kept)"]


def _encrypted(meta: dict[str, Any]) -> list[str]:
    """TLS flows recorded as ciphertext only (capture/ebpf/tls.py), each with the reason."""
    rows = [r for r in meta.get("tls_flows", []) or [] if len(r) > 2 and r[1] == "encrypted"]
    return [f"flow {r[0]} is TLS recorded as ciphertext (raw TCP, no calls): {r[2]}" for r in rows]


def _hidden_statuses(n: int) -> list[str]:
    """Trailers recorded whole whose status HPACK hid (a C-core server indexes grpc-status: 0)."""
    if not n:
        return []
    return [f"{n} call(s) have an unknown status: their trailers were recorded but refer to HPACK entries "
            "from before the capture joined the connection (replay does not compare their status)"]


def _gapped_calls(body_gaps: int, unknown_outcome: int) -> list[str]:
    """HTTP/1 calls a gap damaged: a body stepped over, or the pairing lost after the gap."""
    out = []
    if body_gaps:
        out.append(f"{body_gaps} HTTP call(s) have a body that was not captured (lost in a gap of known "
                   "size, sent with sendfile/splice, or over the decoder's size cap; the pairing was kept, the "
                   "body is not stored; replay does not send such requests)")
    if unknown_outcome:
        out.append(f"{unknown_outcome} HTTP/1 call(s) have an unknown outcome: bytes of their connection were "
                   "lost where the decoder could not resynchronise, so their responses are not paired")
    return out


def _unresolved(rec: Recording, n: int, groups: list[MethodGroup], after_gap: int = 0) -> list[str]:
    """Calls that replay will not send because nothing names their method, and how to name them."""
    if not n:
        return []
    open_groups = sum(g.method is None for g in groups)
    where = f" in {open_groups} method group(s)" if open_groups else ""
    path = rec.path
    if not rec.has_method_refs:
        return [f"{n} call(s) have an unknown method and replay will not send them; this file was written "
                "before method groups, so they cannot be named: record again (then `shadowtest infer`)"]
    why = "before the recording joined it" if not after_gap else (
        "before a gap in the recorded bytes" if after_gap == n else
        f"before the recording joined it, or for {after_gap} of them before a gap in the recorded bytes")
    return [f"{n} call(s){where} have an unknown method (their :path was in the connection's HPACK table "
            f"{why}); replay will not send them. Name them with "
            f"`shadowtest infer {path} --descriptors X.protoset`, or `shadowtest infer {path} --method-map "
            f"FLOW:REF=METHOD`, or record again with the server's reflection reachable"]


def _unknown_peers(meta: dict[str, Any]) -> list[str]:
    """Connections accepted without an address (libuv servers) whose client end could not be found."""
    n = int(meta.get("accepted_peer_unknown", 0) or 0)
    if not n:
        return []
    return [f"{n} accepted connection(s) kept with client 0.0.0.0:0: the server accepted without an address "
            "and the connection was gone before its peer could be read from /proc (their bytes are all here)"]


def _oversized(meta: dict[str, Any]) -> list[str]:
    """gRPC messages the decoder would not buffer (over its per-message cap)."""
    n = int(meta.get("truncated_messages", 0) or 0)
    if not n:
        return []
    return [f"{n} gRPC message(s) over the decoder's {MAX_MESSAGE >> 20} MiB cap were not stored as messages "
            "(their calls lack them; the bytes are in the chunks)"]


def _discarded(meta: dict[str, Any]) -> list[str]:
    """Bytes the application dropped unread (recv with MSG_TRUNC): a gap in the flow, not data."""
    return [f"{n} bytes discarded by the application with MSG_TRUNC on flow {flow} ({direction}, {reads} "
            "read(s)): not captured (a gap in the recording; the decoders resynchronised after it)"
            for flow, direction, n, reads in meta.get("discarded_by_flow", []) or []]


def _undecoded(rec: Recording) -> list[str]:
    """A `--decode later` recording, or an at-stop one whose recorder was killed, not finished yet."""
    return [pending_message(rec.path, rec.meta)] if calls_pending(rec.meta) else []


def _traffic_span(rec: Recording, first_call: int | None, last_call: int | None) -> int:
    """Nanoseconds from the first to the last timestamp of the traffic: chunks and calls alike, so an
    eBPF recording, a proxy one and a pcap import of the same traffic say the same duration."""
    ends = [t for t in (first_call, last_call) if t is not None]
    chunks = rec.chunk_time_range_ns()
    if chunks is not None:
        ends += list(chunks)
    return (max(ends) - min(ends)) if ends else 0


def _capture_duration(meta: dict[str, Any]) -> float | None:
    """How long the recorder ran (live backends, stopped cleanly); None for imports and killed recorders."""
    dur = meta.get("capture_duration_s")
    return float(dur) if isinstance(dur, (int, float)) and not isinstance(dur, bool) else None


def _file_damage(rec: Recording, integrity: Integrity | None) -> list[str]:
    """What `capture.integrity.check` found wrong with the file, then what the reader hit."""
    found = list(integrity.damage) if integrity is not None else []
    return found + [p for p in rec.problems if p not in found]


def _salvaged(meta: dict[str, Any]) -> list[str]:
    """A file written by `--salvage` from a damaged recording: the calls that copy lost."""
    salvaged = meta.get("salvaged")
    if not isinstance(salvaged, dict):
        return []
    return [f"written with --salvage from a damaged recording ({loss_text(salvaged.get('calls_lost'))})"]


def _sizes(vals: list[int]) -> dict[str, int]:
    vals.sort()
    return {"count": len(vals), "p50": percentile(vals, 0.5) if vals else 0, "p99": percentile(vals, 0.99) if vals else 0,
            "max": vals[-1] if vals else 0, "total": sum(vals)}


def _rate(times: list[int], buckets: int) -> list[float]:
    """Calls per second in `buckets` equal slices of the recording."""
    if not times:
        return []
    lo, hi = min(times), max(times)
    width = max(1, (hi - lo) // buckets + 1)
    counts = [0] * buckets
    for t in times:
        counts[min(buckets - 1, (t - lo) // width)] += 1
    return [c / (width / 1e9) for c in counts]
