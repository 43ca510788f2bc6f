"""Join the TLS program's plaintext to the eBPF recorder's TCP flows, with every loss made a gap.

    tls.bpf.c records: PLAIN (tgid, fd, position, bytes) / CLOSE (tgid, fd, final positions)
        | TlsProgram.consume(), in ring order
        v
    TlsJoiner --(tgid, fd)--> the recorder's flow of that socket --plaintext + gaps--> FlowSink
        ^                                                            (same decoders, same redaction)
    EbpfBackend --open_flow / data / not_captured (NC_TLS: ciphertext length) / close_flow--'

What a flow is, decided from the recorder's records of it:

* **tls** (plaintext): the recorder sent its bytes as a length only (`TLS_CIPHERTEXT`), because the TLS
  program saw its ciphertext move inside an SSL call (the kernel's `tls_socks`). Its ciphertext is
  counted, never stored; its plaintext goes to the sink under the flow's key.
* **encrypted**: its first bytes are a TLS record the recorder copied (no SSL call of the system
  libssl moved them): stored as raw TCP, listed with the reason. A flow never changes from ciphertext
  to plaintext: plaintext that comes for it later is dropped, counted and said (the bytes before it
  were stored encrypted, and mixing the two would store plaintext no masker has seen whole).
* **hold**: its first bytes are a TLS handshake the recorder copied (a server with memory BIOs, Node or
  asyncio, reads the client's hello before any SSL call): held, at most _HOLD_MAX_BYTES in one
  direction, until the socket is marked (then tls: the hello is ciphertext, counted, not stored) or an
  answer is copied too (then encrypted: stored as it came).
* **plain**: its first bytes are not TLS; if TLS starts later on it (STARTTLS), the plaintext goes on
  through the same sink flow, its masker and decoder.

**No silent loss.** Each PLAIN record carries the position of its first byte in its direction's
plaintext stream, counted in the kernel whether or not the ring had room. A record whose position is
past what the flow has received means records were lost: the sink gets a gap of exactly that many
bytes there, so the decoders resynchronise (an HTTP/1 body of known length is stepped over; the calls
it touched are marked) and never pair a response with the wrong request. The CLOSE record carries
the final positions, so bytes lost at a connection's end are a gap too; if that record itself was
lost while the ring was losing records, both directions end with a gap of unknown size (the flow may
be affected, so it says so). At stop, open flows are checked against the kernel's positions.

Ordering: records are handed on once the recorder's own records have caught up with their time
(`_watermark`: the latest timestamp the backend passed in, or the progress mark it sends when it has
handed on everything written before a time, `caught_up`), so a connection's plaintext never reaches
the flow of an earlier connection on the same fd, however far behind the recorder's decoding is.
Plaintext that arrives before the recorder's OPEN is handled waits (bounded) for it, and is dropped
if none comes (its position makes it a gap if the flow opens).

**Closes race calls.** A Go service writes a connection's last answer from one goroutine and closes the
connection from another (net/http's HTTP/2 server does so when the client goes): the close(2) can run
while that Write is still returning, even inside it at the socket's last unref. The call's record then
comes after the connection's CLOSE, marked late, with the birth of the stream it started on (tls.bpf.c,
emit_plain). So a plaintext flow's close is held for _CLOSE_GRACE_NS (its sink flow moved to a key of
its own, the fd's next connection may open meanwhile): a late call that comes in time goes on at the
end of its own connection, told from the fd's next one by that birth; its final positions are applied
when the flow is let go. A late call that comes after it (or finds no connection) is dropped and
counted (`late_call_bytes_dropped`), never given to another connection.
"""

from __future__ import annotations

import collections
import struct
import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, cast

from capture.ebpf.loader import TLS_CIPHERTEXT
from capture.recording import Direction, Flow, RecordingWriter
from capture.sink import FlowSink

if TYPE_CHECKING:
    from capture.ebpf.tls import TlsProgram

EV_PLAIN, EV_CLOSE = 1, 3
F_LATE = 1                  # a PLAIN record of a call whose socket closed while it was in flight
_HDR = struct.Struct("<QQQIIIIIBBBB")   # struct tls_hdr in tls.bpf.c
HDR_SIZE = _HDR.size
_CLOSE = -1                 # the "is_write" of a CLOSE record in the ready queue
_ORPHAN_S = 3.0             # plaintext with no recorded flow waits this long for the flow's OPEN
_ORPHAN_MAX_BYTES = 8 << 20  # and at most this much in all
_STALE_NS = 2_000_000_000   # a call still missing records after this long lost them in the ring
# Records drained from the ring and waiting for the recorder (the watermark) hold at most this much
# plaintext: beyond it the ring keeps them (and, if the recorder stays behind, loses them: a gap
# each, never memory without bound).
_READY_MAX_BYTES = 64 << 20
# A flow whose first bytes are a TLS handshake the recorder copied (a client's hello, read by a server
# whose TLS works on memory buffers before any SSL call: Node, asyncio) waits for its answer: the socket
# marked by then makes it plaintext (the handshake bytes held are dropped), a copied answer makes it
# ciphertext (stored as it came). At most this much is held per flow, in one direction.
_HOLD_MAX_BYTES = 64 << 10
_HANDSHAKE = 0x16
# A plaintext flow's close waits this long for the late record of a call that was in flight when the
# connection closed (see the module docstring), and at most this many flows wait at once (the oldest
# is let go first).
_CLOSE_GRACE_NS = 500_000_000
# The TLS program's CLOSE record is written in the same close(2) as the recorder's, microseconds later:
# a CLOSE later than this after a held flow's close is a later connection's on the fd
_CLOSE_SLACK_NS = 200_000
_CLOSING_MAX = 8192


_Rec = tuple[int, tuple[int, int], int, bytes, int, int, int, int, bool]   # a record in the ready queue


def looks_like_tls(data: bytes) -> bool:
    """A TLS record header: content type 20-23, version 3.0-3.4 (SSLv3 .. TLS 1.3's legacy 3.3)."""
    return len(data) >= 3 and 0x14 <= data[0] <= 0x17 and data[1] == 3 and data[2] <= 4


class _Conn:
    """A flow the recorder opened, as the joiner sees it."""

    __slots__ = ("key", "flow_id", "file_index", "pid", "opened_ns", "mode", "reason", "cipher_bytes",
                 "plain_bytes", "expect", "lost_bytes", "unknown_losses", "final", "lost_mark", "late_dropped",
                 "held", "held_bytes", "late_start", "closed_ns")

    def __init__(self, key: Hashable, flow_id: int, flow: Flow, lost_mark: int, file_index: int | None = None) -> None:
        self.key = key
        self.flow_id = flow_id
        self.file_index = file_index     # a rotated set: the file whose flow `flow_id` is
        self.pid = flow.pid or 0
        self.opened_ns = flow.opened_ns or 0
        # ? (no bytes yet) | hold | plain | tls (plaintext from the probes) | encrypted | dropped (not recorded)
        self.mode = "?"
        self.reason = ""
        self.cipher_bytes = 0
        self.plain_bytes = 0
        self.expect: dict[str, int] = {"c2s": 0, "s2c": 0}   # next plaintext position per direction
        self.lost_bytes = 0        # plaintext known lost (gaps of known size)
        self.unknown_losses = 0    # gaps of unknown size
        self.final: tuple[int, int] | None = None   # the CLOSE record's final positions (read, written)
        # a late call (F_LATE) in a direction: where it starts in the stream (the flow's end when it came)
        self.late_start: dict[str, int] = {}
        self.closed_ns: int | None = None   # held after its close (TlsJoiner._hold_close): the close's time
        self.lost_mark = lost_mark  # the program's lost-record count when the flow opened
        self.late_dropped = 0      # plaintext of an encrypted flow, dropped
        self.held: list[tuple[Direction, int, bytes]] = []   # "hold": the copied handshake bytes, undecided
        self.held_bytes = 0


class TlsJoiner:
    """Between the eBPF backend and the FlowSink: see the module docstring. Thread-safe."""

    def __init__(self, sink: FlowSink, server_side: bool, max_bytes: int,
                 why_unreadable: Callable[[int, TlsProgram | None], str],
                 on_open: Callable[[int], None] | None = None) -> None:
        self.sink = sink
        self._on_open = on_open                 # told each new flow's process (the TLS libraries' discovery)
        self.program: TlsProgram | None = None
        self._why_unreadable = why_unreadable   # (pid, program or None) -> reason of an encrypted flow
        self._server_side = server_side
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._conns: dict[Hashable, _Conn] = {}
        self._by_fd: dict[tuple[int, int], Hashable] = {}
        self._watermark = 0
        self._lost = 0                                             # the program's lost records, last read
        # (ts, fdkey, is_write (_CLOSE: a CLOSE), payload, span, position, x, born, late) waiting for the
        # watermark: plaintext `payload` at stream `position`, standing for `span` bytes of which x were
        # cut by --max-bytes, of the stream born at `born` (0: unknown); a late call: position within
        # the call; a CLOSE: position = bytes read in all, x = bytes written in all
        self._ready: collections.deque[_Rec] = collections.deque()
        self._ready_bytes = 0
        self._waiting = False             # records in the ready queue wait for the recorder's marks
        self._partial: dict[tuple[int, int, int], list[Any]] = {}  # one call's records, reassembled
        self._orphans: dict[tuple[int, int], list[tuple[int, int, bytes, int, int, int]]] = {}   # no flow yet
        self._orphan_bytes = 0
        self._first: dict[tuple[int, int], float] = {}             # when its first orphan came
        # flows closed, held for late calls: sink key -> (conn, its fd, let go at (monotonic ns))
        self._closing: dict[Hashable, tuple[_Conn, tuple[int, int], int]] = {}
        self._closing_fd: dict[tuple[int, int], list[_Conn]] = {}     # the same, by fd
        self.flows: list[list[object]] = []                        # [flow, tls, reason, ciphertext bytes]
        self.counts = {"plaintext_flows": 0, "encrypted_flows": 0, "ciphertext_bytes_not_stored": 0,
                       "plaintext_bytes": 0, "orphan_bytes_dropped": 0, "late_plaintext_flows": 0,
                       "late_plaintext_bytes_dropped": 0, "lost_plaintext_bytes": 0,
                       "flows_with_lost_plaintext": 0, "unknown_size_gaps": 0, "late_calls": 0,
                       "late_call_bytes_dropped": 0}

    @property
    def writer(self) -> RecordingWriter:
        return self.sink.writer

    def __getattr__(self, name: str) -> Any:   # stats, add_loss, tick, ...: the sink's own
        return getattr(self.sink, name)

    # ---- what the backend calls ----

    def open_flow(self, key: Hashable, flow: Flow) -> int:
        with self._lock:
            fdkey = _fdkey(key)
            if self.program is not None:
                self._advance(flow.opened_ns or 0)   # what came before it goes to the fd's previous flow
            old = self._by_fd.get(fdkey) if fdkey else None
            if old is not None and old in self._conns:
                gone = self._conns.pop(old)      # closed unseen (its CLOSE lost): the sink replaces it too
                self._settle(gone)
                self._finish(gone)
            flow_id = self.sink.open_flow(key, flow)
            c = self._conns[key] = _Conn(key, flow_id, flow, self._lost,
                                         self.sink.first_file(key) if flow_id else None)
            if not flow_id:
                c.mode = "dropped"      # not recorded (--sample, --max-file-mb): its plaintext too
            if fdkey is not None:
                self._by_fd[fdkey] = key
                self._adopt(fdkey, c)
        if fdkey is not None and self._on_open is not None:
            self._on_open(fdkey[0])
        return flow_id

    def data(self, key: Hashable, direction: Direction, ts_ns: int, data: bytes) -> None:
        with self._lock:
            if ts_ns > self._watermark:
                self._watermark = ts_ns
            c = self._conns.get(key)
            if self._ready and self._ready[0][0] <= self._watermark:
                self._advance(ts_ns, drain=False)
            if c is not None and c.mode == "dropped":
                return
            if c is not None and c.mode != "plain":
                if c.mode == "?":
                    self._classify(c, data)
                if c.mode == "hold":
                    if not c.held or (direction == c.held[0][0] and c.held_bytes + len(data) <= _HOLD_MAX_BYTES):
                        c.held.append((direction, ts_ns, data))
                        c.held_bytes += len(data)
                        return
                    self._release(c, tls=False)    # an answer copied too: no probe moved this TLS
                if c.mode == "tls":      # ciphertext the recorder copied before the socket was marked
                    self._ciphertext(c, len(data))
                    return
            self.sink.data(key, direction, ts_ns, data)

    def not_captured(self, key: Hashable, direction: Direction, ts_ns: int, nbytes: int, how: str) -> None:
        with self._lock:
            if how != TLS_CIPHERTEXT:
                self.sink.not_captured(key, direction, ts_ns, nbytes, how)
                return
            if ts_ns > self._watermark:
                self._watermark = ts_ns
            c = self._conns.get(key)
            if c is None or c.mode == "dropped":
                return
            if c.mode == "hold":
                self._release(c, tls=True)
            if c.mode in ("?", "plain"):
                c.mode = "tls"            # plain first: STARTTLS, the plaintext goes on in the same flow
            self._ciphertext(c, nbytes)

    @property
    def needs_marks(self) -> bool:
        """Whether plaintext waits for the backend's progress marks (loader._poll sends none otherwise):
        records in the ready queue, or drained and not taken yet."""
        program = self.program
        return self._waiting or (program is not None and program.pending())

    def caught_up(self, ts_ns: int) -> None:
        """The backend has handed on every record it wrote before `ts_ns` (a progress mark): hand on
        what that allows, with what has been drained meanwhile (in the backend's thread, which is
        awake anyway: the TLS threads then need not wake for ordinary traffic)."""
        with self._lock:
            self._advance(ts_ns, drain=True)

    def gap(self, key: Hashable, direction: Direction, nbytes: int) -> None:
        with self._lock:
            c = self._conns.get(key)
            if c is not None and c.mode == "hold":
                self._release(c, tls=False)
            if c is None or c.mode != "tls":    # a hole in ciphertext is no hole in the plaintext
                self.sink.gap(key, direction, nbytes)

    def discarded(self, key: Hashable, direction: Direction, nbytes: int) -> None:
        with self._lock:
            c = self._conns.get(key)
            if c is not None and c.mode == "hold":
                self._release(c, tls=False)
            if c is None or c.mode != "tls":
                self.sink.discarded(key, direction, nbytes)

    def close_flow(self, key: Hashable, ts_ns: int | None) -> None:
        with self._lock:
            fdkey = _fdkey(key)
            if self.program is not None:
                # its last plaintext was written before its close() ran (no time: what is due only)
                self._advance(ts_ns or 0)
                if fdkey is not None:
                    self._take_close(fdkey)
            c = self._conns.pop(key, None)
            if c is not None:
                if fdkey is not None and self._by_fd.get(fdkey) == key:
                    del self._by_fd[fdkey]
                if fdkey is not None and self.program is not None and c.mode in ("tls", "?", "hold"):
                    self._hold_close(c, fdkey, ts_ns)
                    return
                self._settle(c)
                self._finish(c)
            self.sink.close_flow(key, ts_ns)

    def _hold_close(self, c: _Conn, fdkey: tuple[int, int], ts_ns: int | None) -> None:
        """Let a closed flow wait for a late call: under a key of its own, so that the fd's next
        connection opens beside it."""
        held_key = ("closing", *fdkey, c.flow_id, c.opened_ns)
        self.sink.rekey(c.key, held_key)
        c.key = held_key
        c.closed_ns = ts_ns
        self._closing[held_key] = (c, fdkey, time.monotonic_ns() + _CLOSE_GRACE_NS)
        self._closing_fd.setdefault(fdkey, []).append(c)
        if len(self._closing) > _CLOSING_MAX:
            self._let_go([next(iter(self._closing))])

    def _let_go(self, held_keys: list[Hashable]) -> None:
        """Held flows whose wait is over: their records still queued, their final positions, their close."""
        due = [self._closing.pop(k) for k in held_keys]
        fds = {fdkey for _c, fdkey, _deadline in due}
        if self._ready:
            ours = {id(c) for c, _fd, _deadline in due}
            mine = [rec for rec in self._ready
                    if rec[1] in fds and id(self._owner(rec[1], rec[0], rec[7], rec[8], rec[2] == _CLOSE)) in ours]
            if mine:
                taken = {id(rec) for rec in mine}
                self._ready = collections.deque(rec for rec in self._ready if id(rec) not in taken)
                for rec in mine:
                    self._ready_bytes -= len(rec[3])
                    self._hand_on(*rec)
        for c, fdkey, _deadline in due:
            held = self._closing_fd[fdkey]
            held.remove(c)
            if not held:
                del self._closing_fd[fdkey]
            self._settle(c)
            self._finish(c)
            self.sink.close_flow(c.key, c.closed_ns)

    def _let_go_due(self, force: bool = False) -> None:
        now = time.monotonic_ns()
        due = []
        for held_key, (_c, _fd, deadline) in self._closing.items():
            if not force and deadline > now:
                break           # held in the order they closed: the rest wait longer
            due.append(held_key)
        if due:
            self._let_go(due)

    # ---- the TLS program's records ----

    def poll(self) -> int:
        """Drain the ring, hand on what is due, expire plaintext no recorded flow claimed (the poll
        thread). Returns how many records the ring held."""
        with self._lock:
            n = self._drain()
            stale = time.monotonic_ns() - _STALE_NS
            for pk in [k for k, p in self._partial.items() if p[0] < stale]:
                self._flush_partial(pk)    # a call whose last records were lost: what came, then a gap
            self._advance(0)
            self._let_go_due()
            now = time.monotonic()
            for fdkey, first in list(self._first.items()):
                if now - first >= _ORPHAN_S:
                    self._drop_orphan(fdkey)
            if self.program is not None:
                self._lost = self.program.counters()[0]
            return n

    def _advance(self, ts_ns: int, drain: bool = True) -> None:
        """Hand on every record the backend's records have caught up with, draining the ring (as far
        as _READY_MAX_BYTES allows) for more."""
        if ts_ns > self._watermark:
            self._watermark = ts_ns
        self._hand_due()
        while drain and self._drain():
            self._hand_due()

    def _hand_due(self) -> None:
        ready, mark = self._ready, self._watermark
        while ready and ready[0][0] <= mark:
            rec = ready.popleft()
            self._ready_bytes -= len(rec[3])
            self._hand_on(*rec)
        self._waiting = bool(ready)

    def _hand_on(self, ts: int, fdkey: tuple[int, int], is_write: int, payload: bytes, span: int,
                 pos: int, x: int, born: int, late: bool) -> None:
        if is_write == _CLOSE:
            c = self._owner(fdkey, ts, 0, close=True)
            if c is not None:
                c.final = (pos, x)     # applied when the flow is let go (a late call may come first)
        else:
            self._plain(fdkey, is_write, ts, payload, span, pos, x, born, late)

    def _take_close(self, fdkey: tuple[int, int]) -> None:
        """The CLOSE record of the connection closing on `fdkey`, if it waits behind the watermark
        (written in the same close() as the recorder's CLOSE, a moment after it). It is this
        connection's: a later one on the fd would have had plaintext records before its CLOSE."""
        for i, rec in enumerate(self._ready):
            if rec[1] == fdkey:
                if rec[2] == _CLOSE:
                    del self._ready[i]
                    self._hand_on(*rec)
                return

    def _queue(self, rec: _Rec) -> None:
        self._ready.append(rec)
        self._ready_bytes += len(rec[3])

    def _drain(self) -> int:
        """Move the ring's records into the ready queue (none while it holds _READY_MAX_BYTES)."""
        if self.program is None or self._ready_bytes >= _READY_MAX_BYTES:
            return 0
        raws = self.program.consume()
        for raw in raws:
            ts, pos, pos2, tgid, fd, length, total, offset, etype, is_write, _trunc, flags = _HDR.unpack_from(raw)
            if etype == EV_PLAIN:
                self._on_record(ts, tgid, fd, is_write, offset, total, pos, raw[HDR_SIZE:HDR_SIZE + length], pos2,
                                bool(flags & F_LATE))
            elif etype == EV_CLOSE:
                for pk in [k for k in self._partial if k[:2] == (tgid, fd)]:
                    self._flush_partial(pk)   # its calls are over: what came of them goes first
                self._queue((ts, (tgid, fd), _CLOSE, b"", 0, pos, pos2, 0, False))
        return len(raws)

    def _on_record(self, ts: int, tgid: int, fd: int, is_write: int, offset: int, total: int, pos: int,
                   payload: bytes, born: int = 0, late: bool = False) -> None:
        """One record of an SSL call (a call over CHUNK bytes comes as several, all with the call's
        time and position). Whole calls go to the ready queue; pieces are joined, and a record lost
        inside a call splits it into pieces at their own positions, so the hole becomes a gap."""
        pk = (tgid, fd, is_write)
        if offset == 0 and len(payload) >= min(total, self._max_bytes) and pk not in self._partial:
            self._queue((ts, (tgid, fd), is_write, payload, total, pos, total - len(payload), born, late))
            return
        p = self._partial.get(pk)
        if p is not None and p[0] == ts and offset >= p[4] + len(p[1]):
            if offset > p[4] + len(p[1]):       # records lost inside the call
                self._piece(pk, p, final=False)
                p[1], p[4] = bytearray(), offset
        else:
            if p is not None:
                self._flush_partial(pk)
            # [time, bytes, the call's position, the call's length, offset of bytes[0] in the call, born, late]
            p = self._partial[pk] = [ts, bytearray(), pos, total, offset, born, late]
        p[1] += payload
        if p[4] + len(p[1]) >= min(total, self._max_bytes):
            self._flush_partial(pk)

    def _flush_partial(self, pk: tuple[int, int, int]) -> None:
        self._piece(pk, self._partial.pop(pk), final=True)

    def _piece(self, pk: tuple[int, int, int], p: list[Any], final: bool) -> None:
        """Queue what `p` holds at its stream position; the call's last piece accounts for the
        rest of the call (what did not come of it is a gap after it)."""
        ts, buf, call_pos, call_total, off, born, late = p
        span = call_total - off if final else len(buf)
        truncated = max(0, call_total - self._max_bytes) if final else 0
        self._queue((ts, pk[:2], pk[2], bytes(buf), span, call_pos + off, truncated, born, late))

    def _owner(self, fdkey: tuple[int, int], ts: int, born: int, late: bool = False,
               close: bool = False) -> _Conn | None:
        """The connection on `fdkey` a record belongs to: the latest one opened before it (its time; a
        late call's: the birth of its stream), the fd's open flow or one held closed; a held one only
        if the record's stream was born before it closed, or a CLOSE came with its close (the fd's
        next connection may not have opened yet: its bytes wait as orphans and its final positions
        are dropped, never given to the connection before it)."""
        start = born if late else ts
        key = self._by_fd.get(fdkey)
        c = self._conns.get(key) if key is not None else None
        best = c if c is not None and start >= c.opened_ns else None
        for held in self._closing_fd.get(fdkey, ()):
            if start < held.opened_ns:
                continue
            if held.closed_ns is not None and (ts > held.closed_ns + _CLOSE_SLACK_NS if close
                                               else (born or ts) > held.closed_ns):
                continue
            if best is None or held.opened_ns > best.opened_ns:
                best = held
        return best

    def _plain(self, fdkey: tuple[int, int], is_write: int, ts: int, payload: bytes, span: int,
               pos: int, truncated: int, born: int = 0, late: bool = False) -> None:
        c = self._owner(fdkey, ts, born, late)
        if c is None:
            if late:     # its connection was let go (or never recorded): never another's
                self.counts["late_call_bytes_dropped"] += len(payload)
                return
            self._orphan(fdkey, ts, is_write, payload, span, pos, truncated)
            return
        if c.mode == "dropped":
            return
        if c.mode == "encrypted":
            self._late(c, len(payload))
            return
        if c.mode == "hold":
            self._release(c, tls=True)
        if c.mode != "tls":
            if c.mode == "plain":
                self.counts["late_plaintext_flows"] += 1   # STARTTLS: bytes before it stay as they were
            c.mode = "tls"
        direction: Direction = "s2c" if bool(is_write) == self._server_side else "c2s"
        if late:
            # a late call: its bytes come after all the connection's others in this direction (one call
            # at a time moves a direction of a connection); `pos` is within the call
            if direction not in c.late_start:
                c.late_start[direction] = c.expect[direction]
                self.counts["late_calls"] += 1
            pos += c.late_start[direction]
        self._catch_up(c, direction, pos)
        c.expect[direction] = pos + span
        c.plain_bytes += len(payload)
        self.counts["plaintext_bytes"] += len(payload)
        self.sink.data(c.key, direction, ts, payload)
        if len(payload) < span:
            # what the call returned beyond --max-bytes (the program counts it as truncated) and
            # its records that the ring lost: one gap after it, of the known size
            if span - len(payload) > truncated:
                self._lose(c, direction, span - len(payload) - truncated, emit=False)
            self.sink.gap(c.key, direction, span - len(payload))

    def _catch_up(self, c: _Conn, direction: Direction, pos: int) -> None:
        """Bytes at stream position `pos` come next: a gap before them for the bytes whose records
        were lost since the flow's stream got to where it is."""
        expect = c.expect[direction]
        if pos > expect:
            self._lose(c, direction, pos - expect)
        elif pos < expect:
            # behind the stream: the kernel's position entry started again (evicted under 65,536
            # recorded sockets); what was lost meanwhile cannot be told
            self._lose(c, direction, None)

    def _lose(self, c: _Conn, direction: Direction, nbytes: int | None, emit: bool = True) -> None:
        """Plaintext of `c` whose records the ring lost (None: how much is unknown): counted, and a
        gap for the decoders there unless the caller makes it."""
        if not c.lost_bytes and not c.unknown_losses:
            self.counts["flows_with_lost_plaintext"] += 1
        if nbytes is None:
            c.unknown_losses += 1
            self.counts["unknown_size_gaps"] += 1
        else:
            c.lost_bytes += nbytes
            self.counts["lost_plaintext_bytes"] += nbytes
        if emit:
            self.sink.gap(c.key, direction, nbytes)

    def _final(self, c: _Conn, read: int, written: int) -> None:
        """The connection's final positions: bytes after the last record that came were lost."""
        if c.mode != "tls":
            return
        ends = {"c2s": read, "s2c": written} if self._server_side else {"c2s": written, "s2c": read}
        for direction, end in ends.items():
            if end > c.expect[direction]:
                self._lose(c, cast(Direction, direction), end - c.expect[direction])
                c.expect[direction] = end

    def _settle(self, c: _Conn) -> None:
        """A plaintext flow ends: bytes short of its final positions were lost; without them, while
        the ring lost records, its end may be missing, so both directions end with a gap of unknown size."""
        if c.final is not None:
            self._final(c, *c.final)
            return
        if c.mode != "tls" or self.program is None:
            return
        self._lost = self.program.counters()[0]
        if self._lost > c.lost_mark:
            for direction in ("c2s", "s2c"):
                self._lose(c, direction, None)

    def _ciphertext(self, c: _Conn, nbytes: int) -> None:
        c.cipher_bytes += nbytes
        self.counts["ciphertext_bytes_not_stored"] += nbytes

    def _late(self, c: _Conn, nbytes: int) -> None:
        """Plaintext of a flow stored as ciphertext: dropped (see the module docstring), and said."""
        if not c.late_dropped:
            self.counts["late_plaintext_flows"] += 1
            c.reason += "; its plaintext came later and was dropped (a flow is stored one way only)"
        c.late_dropped += nbytes
        self.counts["late_plaintext_bytes_dropped"] += nbytes

    def _orphan(self, fdkey: tuple[int, int], ts: int, is_write: int, payload: bytes, span: int,
                pos: int, truncated: int) -> None:
        """A record of a recorded socket whose OPEN the backend has not handed on yet (bounded wait)."""
        if self._orphan_bytes + len(payload) > _ORPHAN_MAX_BYTES:
            self.counts["orphan_bytes_dropped"] += len(payload)   # its flow, if it opens, gets a gap
            return
        self._orphans.setdefault(fdkey, []).append((ts, is_write, payload, span, pos, truncated))
        self._orphan_bytes += len(payload)
        self._first.setdefault(fdkey, time.monotonic())

    def _adopt(self, fdkey: tuple[int, int], c: _Conn) -> None:
        """A flow just opened: the plaintext its socket's records brought before."""
        self._first.pop(fdkey, None)
        for ts, is_write, payload, span, pos, truncated in self._orphans.pop(fdkey, []):
            self._orphan_bytes -= len(payload)
            if ts < c.opened_ns:
                self.counts["orphan_bytes_dropped"] += len(payload)
            else:
                self._plain(fdkey, is_write, ts, payload, span, pos, truncated)

    def _drop_orphan(self, fdkey: tuple[int, int]) -> None:
        self._first.pop(fdkey, None)
        for _ts, _w, payload, _span, _pos, _trunc in self._orphans.pop(fdkey, []):
            self._orphan_bytes -= len(payload)
            self.counts["orphan_bytes_dropped"] += len(payload)

    # ---- classification and the per-flow report ----

    def _classify(self, c: _Conn, first: bytes) -> None:
        if not looks_like_tls(first):
            c.mode = "plain"
            return
        if first[0] == _HANDSHAKE and self.program is not None:
            c.mode = "hold"    # a ClientHello read before any SSL call (memory BIOs): wait for the answer
            return
        c.mode = "encrypted"
        c.reason = self._why_unreadable(c.pid, self.program)

    def _release(self, c: _Conn, tls: bool) -> None:
        """A held flow decided: plaintext (its socket was marked, or its plaintext came: the handshake
        bytes held are ciphertext, counted and not stored) or encrypted (stored as they came)."""
        held, c.held, c.held_bytes = c.held, [], 0
        if tls:
            c.mode = "tls"
            for _d, _ts, data in held:
                self._ciphertext(c, len(data))
            return
        c.mode = "encrypted"
        c.reason = self._why_unreadable(c.pid, self.program)
        for direction, ts, data in held:
            self.sink.data(c.key, direction, ts, data)

    def _finish(self, c: _Conn) -> None:
        if c.mode == "dropped":
            return
        if c.mode == "hold":
            self._release(c, tls=False)
        if c.mode == "tls":
            self.counts["plaintext_flows"] += 1
            lost = None
            if c.lost_bytes or c.unknown_losses:
                lost = (f"plaintext with gaps: {c.lost_bytes} bytes lost"
                        + (f" and {c.unknown_losses} gap(s) of unknown size" if c.unknown_losses else "")
                        + " (the TLS ring buffer was full); the calls they touched are marked")
            self.flows.append(self._row(c, "plaintext", lost, c.cipher_bytes))
        elif c.mode == "encrypted":
            self.counts["encrypted_flows"] += 1
            self.flows.append(self._row(c, "encrypted", c.reason, 0))

    @staticmethod
    def _row(c: _Conn, mode: str, reason: str | None, cipher_bytes: int) -> list[object]:
        """[flow, plaintext|encrypted, reason, ciphertext bytes], and in a rotated set the index of the file
        that flow id belongs to (capture/merge.py maps it to the merged flow)."""
        return [c.flow_id, mode, reason, cipher_bytes] + ([c.file_index] if c.file_index is not None else [])

    def finish_all(self, positions: Any = None) -> None:
        """At stop: the last records, then every flow still open goes into the report, checked
        against `positions((tgid, fd))` -> (read, written) or None, the kernel's final positions."""
        with self._lock:
            self._drain()
            for pk in list(self._partial):
                self._flush_partial(pk)
            self._watermark = 1 << 63       # the backend has stopped: everything is due
            self._advance(0)
            self._let_go_due(force=True)
            for c in list(self._conns.values()):
                fdkey = _fdkey(c.key)
                final = positions(fdkey) if positions is not None and fdkey is not None else None
                if final is not None:
                    c.final = final
                if c.final is not None:
                    self._final(c, *c.final)
                self._finish(c)
            self._conns.clear()
            self._by_fd.clear()
            for fdkey in list(self._first):
                self._drop_orphan(fdkey)

    def meta(self, status: dict[str, object]) -> dict[str, object]:
        return {"tls": status | self.counts, "tls_flows": sorted(self.flows, key=lambda r: cast(int, r[0]))}


def _fdkey(key: Hashable) -> tuple[int, int] | None:
    if isinstance(key, tuple) and len(key) >= 2 and isinstance(key[0], int) and isinstance(key[1], int):
        return (key[0], key[1])
    return None
