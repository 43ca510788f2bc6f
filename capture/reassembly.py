"""TCP reassembly: segments in capture order -> each direction's byte stream, in order, once.

    segment --(seq vs next expected)--> in order: deliver, then drain held segments
                                        old/overlapping: trim (retransmission), deliver the new part
                                        ahead: hold (out of order) until the hole fills
    FIN / end of capture / too much held --> skip the hole: a gap, reported, never silent

Deliveries go to a `FlowSink` with the timestamp of the segment that carried the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from capture.packets import FIN, RST, SYN, Segment
from capture.recording import Direction, Flow
from capture.sink import FlowSink

_MAX_HELD = 4 << 20      # bytes held out of order per direction before declaring a gap
_MOD = 1 << 32

_Addr = tuple[str, int]
_Key = tuple[_Addr, _Addr]        # (client, server)


@dataclass
class ReassemblyStats:
    tcp_segments: int = 0
    retransmitted: int = 0
    out_of_order: int = 0
    gaps: int = 0
    gap_bytes: int = 0
    problems: list[str] = field(default_factory=list)


class _Dir:
    def __init__(self) -> None:
        self.next: int | None = None
        self.held: dict[int, tuple[int, bytes]] = {}
        self.held_bytes = 0
        self.fin = False


def _diff(a: int, b: int) -> int:
    """a - b in sequence space (signed, wraps at 2**32)."""
    d = (a - b) % _MOD
    return d - _MOD if d >= _MOD // 2 else d


class Reassembler:
    """Feed TCP segments (any flows, capture order); flows and bytes go to `sink`."""

    def __init__(self, sink: FlowSink, server_ports: set[int] | None = None,
                 accept: Callable[[Segment], bool] | None = None) -> None:
        self.sink = sink
        self.server_ports = server_ports or set()
        self.accept = accept
        self.stats = ReassemblyStats()
        self._flows: dict[_Key, dict[Direction, _Dir]] = {}

    def _flow(self, seg: Segment, ts_ns: int) -> tuple[_Key, Direction] | None:
        key = (seg.src, seg.dst) if (seg.src, seg.dst) in self._flows else (seg.dst, seg.src)
        if key in self._flows:
            return key, ("c2s" if seg.src == key[0] else "s2c")
        if not seg.payload and not seg.flags & SYN:
            return None                               # ACK/FIN/RST tail of a connection we never saw
        syn_only = seg.flags & SYN and not seg.flags & 0x10
        if syn_only or (seg.flags & SYN) == 0 and self._client_is_src(seg):
            key = (seg.src, seg.dst)
        else:
            key = (seg.dst, seg.src)                  # SYN-ACK or data from the server
        joined = not seg.flags & SYN
        self._flows[key] = {"c2s": _Dir(), "s2c": _Dir()}
        self.sink.open_flow(key, Flow(src=key[0], dst=key[1], opened_ns=ts_ns, joined_midstream=joined))
        return key, ("c2s" if seg.src == key[0] else "s2c")

    def _client_is_src(self, seg: Segment) -> bool:
        if seg.dst[1] in self.server_ports:
            return True
        if seg.src[1] in self.server_ports:
            return False
        return seg.dst[1] < seg.src[1]                # no SYN seen: the lower port is the service

    def feed(self, seg: Segment, ts_ns: int) -> None:
        self.stats.tcp_segments += 1
        if self.accept and not self.accept(seg):
            return
        found = self._flow(seg, ts_ns)
        if found is None:
            return
        key, direction = found
        d = self._flows[key][direction]
        seq = seg.seq
        if seg.flags & SYN:
            d.next, seq = (seq + 1) % _MOD, (seq + 1) % _MOD
        if d.next is None:
            d.next = seq                          # joined mid-stream: start where we are
        if seg.payload:
            self._data(key, direction, d, seq, seg.payload, ts_ns)
        if seg.flags & (FIN | RST):
            d.fin = True
            self._skip_gaps(key, direction, d)
            if all(x.fin for x in self._flows[key].values()) or seg.flags & RST:
                self._close(key, ts_ns)

    def _data(self, key: _Key, direction: Direction, d: _Dir, seq: int, data: bytes, ts_ns: int) -> None:
        assert d.next is not None
        ahead = _diff(seq, d.next)
        if ahead < 0:
            if -ahead >= len(data):
                self.stats.retransmitted += 1
                return
            data, seq = data[-ahead:], d.next     # partly new: keep the new part
            ahead = 0
        if ahead > 0:
            self.stats.out_of_order += 1
            if seq not in d.held or len(d.held[seq][1]) < len(data):
                d.held[seq] = (ts_ns, data)
                d.held_bytes += len(data)
            if d.held_bytes > _MAX_HELD:
                self._skip_gaps(key, direction, d)
            return
        self._deliver(key, direction, d, data, ts_ns)
        self._drain(key, direction, d)

    def _deliver(self, key: _Key, direction: Direction, d: _Dir, data: bytes, ts_ns: int) -> None:
        assert d.next is not None
        self.sink.data(key, direction, ts_ns, data)
        d.next = (d.next + len(data)) % _MOD

    def _drain(self, key: _Key, direction: Direction, d: _Dir) -> None:
        while d.held:
            nxt = d.next
            assert nxt is not None
            seq = min(d.held, key=lambda s: _diff(s, nxt))
            ahead = _diff(seq, nxt)
            if ahead > 0:
                return
            ts, data = d.held.pop(seq)
            d.held_bytes -= len(data)
            if -ahead < len(data):
                self._deliver(key, direction, d, data[-ahead:], ts)

    def _skip_gaps(self, key: _Key, direction: Direction, d: _Dir) -> None:
        """Bytes that never arrived: jump over each hole, report it, deliver what follows."""
        while d.held:
            nxt = d.next
            assert nxt is not None
            seq = min(d.held, key=lambda s: _diff(s, nxt))
            hole = _diff(seq, nxt)
            if hole > 0:
                self.stats.gaps += 1
                self.stats.gap_bytes += hole
                self.stats.problems.append(f"gap of {hole} bytes in {direction} of {key[0]}->{key[1]}")
                self.sink.gap(key, direction, hole)
                d.next = seq
            self._drain(key, direction, d)

    def _close(self, key: _Key, ts_ns: int) -> None:
        self.sink.close_flow(key, ts_ns)
        del self._flows[key]

    def finish(self) -> ReassemblyStats:
        """End of capture: report holes still open; flows left open stay open (closed_ns NULL)."""
        for key, dirs in list(self._flows.items()):
            for direction, d in dirs.items():
                self._skip_gaps(key, direction, d)
        return self.stats
