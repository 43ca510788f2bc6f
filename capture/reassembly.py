"""TCP reassembly: segments in capture order -> each direction's byte stream, in order, once.

    segment --(seq vs next expected)--> in order: deliver, then drain held segments
                                        old/overlapping: trim (retransmission), deliver the new part
                                        ahead: hold (out of order) until the hole fills
    FIN / end of capture / too much held --> skip the hole: a gap, reported, never silent

Deliveries go to a `FlowSink` with the timestamp of the segment that carried the bytes.

Cost per segment is O(log held): held segments are keyed by their offset in the stream (not the
wrapping sequence number) in a heap, so a burst of small out-of-order segments does not make each
delivery scan all of them. At most `_MAX_HELD` bytes and `_MAX_HELD_SEGMENTS` segments are held per
direction. `feed` and `finish` may be called from different threads (the live backend does):
one lock serialises them.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from capture.packets import FIN, RST, SYN, Segment
from capture.recording import Direction, Flow
from capture.sink import FlowSink

_MAX_HELD = 4 << 20      # bytes held out of order per direction before declaring a gap
_MAX_HELD_SEGMENTS = 16384   # segments held per direction (tiny segments: bytes alone would allow millions)
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
        self.next: int | None = None     # sequence number of the next byte expected
        self.off = 0                     # its offset in the stream (no wrap): what `held` is keyed by
        self.held: dict[int, tuple[int, bytes]] = {}   # stream offset -> (ts, data)
        self.heap: list[int] = []        # the keys of `held`, smallest first
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
        self._lock = threading.Lock()

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
        with self._lock:
            self._feed(seg, ts_ns)

    def _feed(self, seg: Segment, ts_ns: int) -> None:
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
            off = d.off + ahead
            old = d.held.get(off)
            if old is None:
                heapq.heappush(d.heap, off)
            if old is None or len(old[1]) < len(data):
                d.held[off] = (ts_ns, data)
                d.held_bytes += len(data) - (len(old[1]) if old else 0)
            if d.held_bytes > _MAX_HELD or len(d.held) > _MAX_HELD_SEGMENTS:
                self._skip_gaps(key, direction, d)
            return
        self._deliver(key, direction, d, data, ts_ns)
        self._drain(key, direction, d)

    def _deliver(self, key: _Key, direction: Direction, d: _Dir, data: bytes, ts_ns: int) -> None:
        assert d.next is not None
        self.sink.data(key, direction, ts_ns, data)
        d.next = (d.next + len(data)) % _MOD
        d.off += len(data)

    def _drain(self, key: _Key, direction: Direction, d: _Dir) -> None:
        """Deliver the held segments that now start at or before the next expected byte."""
        while d.heap and d.heap[0] <= d.off:
            off = heapq.heappop(d.heap)
            ts, data = d.held.pop(off)
            d.held_bytes -= len(data)
            behind = d.off - off
            if behind < len(data):
                self._deliver(key, direction, d, data[behind:], ts)

    def _skip_gaps(self, key: _Key, direction: Direction, d: _Dir) -> None:
        """Bytes that never arrived: jump over each hole, report it, deliver what follows."""
        while d.heap:                     # each turn delivers or drops at least the first held segment
            hole = d.heap[0] - d.off
            if hole > 0:
                assert d.next is not None
                self.stats.gaps += 1
                self.stats.gap_bytes += hole
                self.stats.problems.append(f"gap of {hole} bytes in {direction} of {key[0]}->{key[1]}")
                self.sink.gap(key, direction, hole)
                d.next = (d.next + hole) % _MOD
                d.off += hole
            self._drain(key, direction, d)

    def _close(self, key: _Key, ts_ns: int) -> None:
        self.sink.close_flow(key, ts_ns)
        del self._flows[key]

    def finish(self) -> ReassemblyStats:
        """End of capture: report holes still open; flows left open stay open (closed_ns NULL)."""
        with self._lock:
            for key, dirs in list(self._flows.items()):
                for direction, d in dirs.items():
                    self._skip_gaps(key, direction, d)
        return self.stats
