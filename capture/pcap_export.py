"""`shadowtest export`: a recording -> pcapng that Wireshark/tshark dissect as the same calls.

Each chunk becomes TCP segments with synthesized IPv4/IPv6 + TCP headers (LINKTYPE_RAW), sequence
numbers continuous per direction, a three-way handshake before a flow's first chunk and FINs at its
close, all stamped with the original times at nanosecond resolution (if_tsresol = 9).

    chunks (time order) --> the file's redaction rules again (per flow, on the reassembled stream)
        --> seq state per flow/direction --> IP/TCP frames --> EPB blocks (pcapng)

Gaps (bytes not captured, the recording's `gaps` table) are shown, not hidden: the sequence number
jumps by the missing bytes (1 when their number is unknown) before the next segment of that
direction, so Wireshark/tshark say "previous segment not captured", and that packet carries a pcapng
comment "shadowtest: N bytes not captured here (...)" (`frame.comment`). The chunks are run through
the rules the file lists in `meta.redaction_rules` once more, so a file stored by an older version
(which masked chunk by chunk) exports without a credential split over chunks.
"""

from __future__ import annotations

import heapq
import ipaddress
import os
import struct
from collections.abc import Callable
from typing import Any, BinaryIO

from capture.decode.streammask import FlowMasker
from capture.errors import PcapError
from capture.integrity import calls_lost, open_for
from capture.output import atomic_output
from capture.recording import Flow, Recording
from capture.redact import Redactor, rules_from_specs

_LINKTYPE_RAW = 101
_SEG = 16000          # payload bytes per synthesized segment (well under the IPv4 64 KiB limit)
_SYN, _ACK, _PSH, _FIN = 0x02, 0x10, 0x08, 0x01


def _block(btype: int, body: bytes) -> bytes:
    body += b"\0" * (-len(body) % 4)
    n = len(body) + 12
    return struct.pack("<II", btype, n) + body + struct.pack("<I", n)


def _headers() -> bytes:
    shb = _block(0x0A0D0D0A, struct.pack("<IHHq", 0x1A2B3C4D, 1, 0, -1))
    opt_tsresol = struct.pack("<HHB3x", 9, 1, 9)     # if_tsresol: 10^-9 s
    idb = _block(1, struct.pack("<HHI", _LINKTYPE_RAW, 0, 0) + opt_tsresol + struct.pack("<HH", 0, 0))
    return shb + idb


def _epb(ts_ns: int, frame: bytes, comment: str | None = None) -> bytes:
    body = struct.pack("<IIIII", 0, ts_ns >> 32, ts_ns & 0xFFFFFFFF, len(frame), len(frame)) + frame
    if comment:
        text = comment.encode()[:1000]
        body += b"\0" * (-len(body) % 4) + struct.pack("<HH", 1, len(text)) + text + b"\0" * (-len(text) % 4)
        body += struct.pack("<HH", 0, 0)                 # opt_endofopt
    return _block(6, body)


def _ip_tcp(src: tuple[str, int], dst: tuple[str, int], seq: int, ack: int, flags: int, payload: bytes) -> bytes:
    tcp = struct.pack(">HHIIBBHHH", src[1], dst[1], seq & 0xFFFFFFFF, ack & 0xFFFFFFFF, 5 << 4, flags,
                      65535, 0, 0)
    s, d = ipaddress.ip_address(src[0]), ipaddress.ip_address(dst[0])
    if s.version == 4 and d.version == 4:
        total = 20 + len(tcp) + len(payload)
        ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, total, 0, 0x4000, 64, 6, 0, s.packed, d.packed)
        ip = ip[:10] + struct.pack(">H", _checksum(ip)) + ip[12:]
    else:
        s6 = s if s.version == 6 else ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + s.packed)
        d6 = d if d.version == 6 else ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + d.packed)
        ip = struct.pack(">IHBB16s16s", 6 << 28, len(tcp) + len(payload), 6, 64, s6.packed, d6.packed)
    return ip + tcp + payload


def _checksum(data: bytes) -> int:
    total: int = sum(struct.unpack(f">{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


class _FlowState:
    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        # A client address we could not learn (client-side eBPF) still needs a plausible one.
        src = flow.src if flow.src[1] else ("127.0.0.2", 40000 + (flow.id or 0) % 20000)
        self.ends = {"c2s": (src, flow.dst), "s2c": (flow.dst, src)}
        self.seq = {"c2s": 1000, "s2c": 5000}
        self.started = False
        self.sent = {"c2s": 0, "s2c": 0}                  # chunks written per direction
        self.marked = 0                                   # gaps shown (sequence jump + comment)
        # chunks_before -> [(bytes missing or None, how)] per direction
        self.gaps: dict[str, dict[int, list[tuple[int | None, str | None]]]] = {"c2s": {}, "s2c": {}}

    def gap_before(self, direction: str) -> str | None:
        """Advance the sequence over a gap before this direction's next chunk; the comment saying so."""
        return self._skip(direction, self.gaps[direction].pop(self.sent[direction], []))

    def gaps_left(self, direction: str) -> str | None:
        """Gaps after the last chunk of `direction` (before its FIN)."""
        left = [g for k in sorted(self.gaps[direction]) for g in self.gaps[direction][k]]
        self.gaps[direction].clear()
        return self._skip(direction, left)

    def _skip(self, direction: str, gaps: list[tuple[int | None, str | None]]) -> str | None:
        if not gaps:
            return None
        self.marked += len(gaps)
        known = sum(n for n, _ in gaps if n)
        unknown = sum(1 for n, _ in gaps if not n)
        self.seq[direction] += known + unknown
        hows = sorted({h for _, h in gaps if h})
        size = f"{known} bytes" if not unknown else (f"{known} + an unknown number of bytes" if known
                                                    else "an unknown number of bytes")
        return (f"shadowtest: {size} not captured here ({direction}{', ' + ', '.join(hows) if hows else ''}; "
                "a gap in the recording)")


def export_pcapng(recording: Recording, out: BinaryIO, progress: Callable[[int, int], None] | None = None) -> dict[str, int]:
    """Write `recording` as pcapng to `out`; returns counts (flows, chunks, packets). `progress(chunks
    read, chunks)` is called every 1,024 chunks."""
    offset = _wall_offset(recording.meta)
    flows = {f.id: _FlowState(f) for f in recording.flows()}
    for fid, direction, before, nbytes, how in recording.gaps():
        if fid in flows:
            flows[fid].gaps[direction].setdefault(before, []).append((nbytes, how))
    redactor = Redactor(rules_from_specs(list(recording.meta.get("redaction_rules", []) or [])))
    maskers: dict[int, FlowMasker] = {}
    fins: list[tuple[int, int]] = [(s.flow.closed_ns, fid) for fid, s in flows.items()
                                   if s.flow.closed_ns is not None and fid is not None]
    heapq.heapify(fins)
    out.write(_headers())
    counts = {"flows": len(flows), "chunks": 0, "packets": 0, "gaps_marked": 0}

    def flushed(fid: int) -> None:
        """Write what the flow's masker still holds (before its FIN, or at the end)."""
        m, st = maskers.pop(fid, None), flows[fid]
        for direction, ts, data in m.flush() if m is not None else []:
            if not st.started:
                counts["packets"] += _handshake(out, st, ts + offset)
            counts["packets"] += _data(out, st, direction, ts + offset, data)
            counts["chunks"] += 1

    total = recording.count("chunks") if progress is not None else 0
    for n, chunk in enumerate(recording.chunks(), 1):
        if progress is not None and not n & 1023:
            progress(n, total)
        while fins and fins[0][0] <= chunk.ts_ns:
            ts, fid = heapq.heappop(fins)
            flushed(fid)
            counts["packets"] += _fin(out, flows[fid], ts + offset)
        st = flows.get(chunk.flow_id)
        if st is None:
            continue
        m = maskers.get(chunk.flow_id)
        if m is None:
            m = maskers[chunk.flow_id] = FlowMasker(redactor, st.flow.joined_midstream)
        for direction, ts, data in m.feed(chunk.direction, chunk.ts_ns, chunk.data, st.flow.protocol):
            if not st.started:
                counts["packets"] += _handshake(out, st, ts + offset)
            counts["packets"] += _data(out, st, direction, ts + offset, data)
            counts["chunks"] += 1
    while fins:
        ts, fid = heapq.heappop(fins)
        flushed(fid)
        counts["packets"] += _fin(out, flows[fid], ts + offset)
    for fid in list(maskers):
        flushed(fid)
    counts["gaps_marked"] = sum(st.marked for st in flows.values())
    return counts


def _wall_offset(meta: dict[str, object]) -> int:
    """What to add to recorded ts_ns to get wall-clock ns (0 for captures already in wall time)."""
    if meta.get("clock") == "capture-wall":
        return 0
    wall, mono = meta.get("started_wall_ns"), meta.get("started_mono_ns")
    return int(wall) - int(mono) if isinstance(wall, int) and isinstance(mono, int) else 0


def _handshake(out: BinaryIO, st: _FlowState, ts: int) -> int:
    st.started = True
    (c, s), seq = st.ends["c2s"], st.seq
    t0 = max(0, ts - 3000)
    out.write(_epb(t0, _ip_tcp(c, s, seq["c2s"] - 1, 0, _SYN, b"")))
    out.write(_epb(t0 + 1000, _ip_tcp(s, c, seq["s2c"] - 1, seq["c2s"], _SYN | _ACK, b"")))
    out.write(_epb(t0 + 2000, _ip_tcp(c, s, seq["c2s"], seq["s2c"], _ACK, b"")))
    return 3


def _data(out: BinaryIO, st: _FlowState, direction: str, ts: int, data: bytes) -> int:
    src, dst = st.ends[direction]
    other = "s2c" if direction == "c2s" else "c2s"
    comment = st.gap_before(direction)
    st.sent[direction] += 1
    n = 0
    for i in range(0, len(data), _SEG):
        part = data[i:i + _SEG]
        out.write(_epb(ts, _ip_tcp(src, dst, st.seq[direction], st.seq[other], _ACK | _PSH, part), comment))
        comment = None
        st.seq[direction] += len(part)
        n += 1
    return n


def _fin(out: BinaryIO, st: _FlowState, ts: int) -> int:
    if not st.started:
        return 0
    (c, s) = st.ends["c2s"]
    c_note, s_note = st.gaps_left("c2s"), st.gaps_left("s2c")
    out.write(_epb(ts, _ip_tcp(c, s, st.seq["c2s"], st.seq["s2c"], _FIN | _ACK, b""), c_note))
    out.write(_epb(ts + 1000, _ip_tcp(s, c, st.seq["s2c"], st.seq["c2s"] + 1, _FIN | _ACK, b""), s_note))
    return 2


def export_file(recording_path: str, output: str, *, overwrite: bool = False, salvage: bool = False,
                progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Export the recording at `recording_path` to the pcapng file `output` (mode 0600).

    A damaged recording (capture.integrity) is refused unless `salvage`: then its intact part is
    exported and the result says what was lost (`problems`, `calls_lost`: None when unknown). The
    file appears whole or not at all (capture.output). Raises RecordingError for an unreadable or
    refused recording, PcapError when `output` cannot be written."""
    rec, found = open_for(recording_path, "export", salvage=salvage)
    with rec, atomic_output(output, overwrite=overwrite, error=PcapError) as tmp:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)   # holds production data: owner-only
        except OSError as exc:
            raise PcapError(f"cannot write {output}: {exc.strerror}") from exc
        with os.fdopen(fd, "wb") as out:
            counts = export_pcapng(rec, out, progress)
        lost = 0 if found.intact else calls_lost(rec, found)
        problems = list(dict.fromkeys(found.problems + rec.problems))
    return {**counts, "problems": problems, "calls_lost": lost}
