"""One cleartext HTTP/2 connection (prior knowledge, as gRPC uses it) as an asyncio Protocol.

Only what a gRPC client needs, written for low CPU per call: a unary call is one `transport.write`
(HEADERS from a cached block + DATA with END_STREAM); the response path parses frames straight out of
the receive buffer. Flow control: we advertise a 16 MiB window for the connection and every stream and
send WINDOW_UPDATEs once half of it is consumed; our sends respect the peer's windows (data that does
not fit waits in one FIFO until a WINDOW_UPDATE or SETTINGS frees room). MAX_CONCURRENT_STREAMS and
MAX_FRAME_SIZE from the peer are honoured. Every header block goes through the one hpack Decoder in
arrival order, also for streams we have already finished, so its dynamic table stays in step.
"""

from __future__ import annotations

import asyncio
import gzip
import struct
from collections import deque
from collections.abc import Callable
from typing import cast

import hpack

from replay.senders.base import OK, SendOutcome
from replay.senders.h2frames import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    DEADLINE_EXCEEDED,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    FRAME_HEAD,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    INTERNAL,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    RST_STREAM,
    RST_TO_GRPC,
    SETTINGS,
    WINDOW_UPDATE,
    connection_failed,
    frame,
    headers_frames,
    outcome,
    rst_stream,
    settings_frame,
    status_from_headers,
    window_update,
)

REFUSED_STREAM = 0x7
REFUSED = "stream refused by the server (REFUSED_STREAM): not processed"  # the detail that allows a retry
WINDOW = 1 << 24  # what we let the server send before a WINDOW_UPDATE (connection and each stream)
_U32 = struct.Struct(">L")
_PAIR = struct.Struct(">HL")


class Stream:
    """One call's state on a connection; its SendOutcome goes to `on_end` if given, else to `fut`."""

    __slots__ = ("sid", "fut", "on_end", "responses", "buf", "http_status", "got_headers", "window", "unacked",
                 "half_closed", "timer")

    def __init__(self, sid: int, fut: asyncio.Future[SendOutcome] | None, window: int,
                 on_end: Callable[[SendOutcome], None] | None = None) -> None:
        self.sid, self.fut, self.window, self.on_end = sid, fut, window, on_end
        self.responses: list[bytes] = []
        self.buf: bytearray | None = None  # a gRPC message split over DATA frames
        self.http_status: int | None = None
        self.got_headers = self.half_closed = False
        self.unacked = 0
        self.timer: asyncio.TimerHandle | None = None

    def take(self, payload: bytes) -> None:
        """Append DATA payload and cut out the complete length-prefixed gRPC messages."""
        if self.buf is None and len(payload) >= 5 and len(payload) == 5 + int.from_bytes(payload[1:5], "big"):
            self.responses.append(_message(payload[0], payload[5:]))  # the usual case: one whole message
            return
        buf = self.buf = (self.buf or bytearray()) + payload
        while len(buf) >= 5:
            n = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + n:
                break
            self.responses.append(_message(buf[0], bytes(buf[5:5 + n])))
            del buf[:5 + n]
        if not buf:
            self.buf = None


def _message(flag: int, data: bytes) -> bytes:
    return gzip.decompress(data) if flag else data  # we advertise no encoding; gzip is the only one seen


class H2Connection(asyncio.Protocol):
    """A client HTTP/2 connection; the sender opens streams on it while it is `usable`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[bool] = loop.create_future()  # True with the server's SETTINGS, False: failed
        self.error = ""
        self.closed = self.going_away = False
        self.streams: dict[int, Stream] = {}
        self.next_sid = 1
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = 1 << 20
        self._decoded: dict[bytes, tuple[tuple[int, int], list[tuple[str, str]]]] = {}  # see _decode
        self._adds = 0
        self._count_adds()
        self.buf = b""
        self.peer_max_frame, self.peer_max_streams, self.peer_window = 16384, 1 << 31, 65535
        self.send_window = 65535
        self.recv_unacked = 0
        self.blocked: deque[list] = deque()  # [stream, memoryview, end_stream] waiting for window
        self.slot_waiters: deque[asyncio.Future[None]] = deque()
        self._partial: tuple[int, int, list[bytes]] | None = None  # a header block awaiting CONTINUATION

    @property
    def usable(self) -> bool:
        return not self.closed and not self.going_away and self.next_sid < (1 << 31) - 2

    # ---- asyncio Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(PREFACE + settings_frame({ENABLE_PUSH: 0, INITIAL_WINDOW_SIZE: WINDOW})  # type: ignore[attr-defined]
                        + window_update(0, WINDOW - 65535))
        # Ready only with the server's first SETTINGS (as grpc-core does): before it we would not know
        # its MAX_CONCURRENT_STREAMS, and streams beyond it would be refused.

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail_all(f"connection lost: {exc or 'closed by the peer'}")

    def connect_failed(self, exc: Exception) -> None:
        self.error = f"cannot connect: {exc}"
        self.fail_all(self.error)

    def fail_all(self, detail: str) -> None:
        """Close: every open stream ends as a connection error, waiters are woken."""
        self.closed = True
        self.error = self.error or detail
        if not self.ready.done():
            self.ready.set_result(False)
        for st in list(self.streams.values()):
            self._end(st, connection_failed(detail))
        self._wake_waiters(all_of_them=True)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.fail_all("sender closed")

    # ---- opening streams and sending ------------------------------------------------------------
    async def slot(self) -> None:
        """Wait until MAX_CONCURRENT_STREAMS lets one more stream open (raises nothing; check `usable`)."""
        while self.usable and len(self.streams) >= self.peer_max_streams:
            waiter = self.loop.create_future()
            self.slot_waiters.append(waiter)
            await waiter

    def open(self, block: bytes, payload: bytes | None, deadline: float,
             on_end: Callable[[SendOutcome], None] | None = None) -> Stream:
        """Start a stream: HEADERS, then (if given) one DATA payload with END_STREAM; arm the deadline.
        Its outcome is passed to `on_end` (called once, from this connection's callbacks) or, without
        one, set on the stream's `fut`."""
        sid, self.next_sid = self.next_sid, self.next_sid + 2
        fut = self.loop.create_future() if on_end is None else None
        st = self.streams[sid] = Stream(sid, fut, self.peer_window, on_end)
        st.timer = self.loop.call_at(deadline, self._deadline, st)
        head = headers_frames(sid, block, self.peer_max_frame)
        if payload is None:
            self.transport.write(head)  # type: ignore[union-attr]
            return st
        n = len(payload)
        st.half_closed = True
        if not self.blocked and n <= self.send_window and n <= st.window and n <= self.peer_max_frame:
            self.send_window -= n
            st.window -= n
            self.transport.write(b"".join((head, FRAME_HEAD.pack(n >> 16, n & 0xFFFF, DATA, END_STREAM, sid),  # type: ignore[union-attr]
                                           payload)))
        else:
            self.transport.write(head)  # type: ignore[union-attr]
            self.blocked.append([st, memoryview(payload), True])
            self._flush()
        return st

    def send(self, st: Stream, payload: bytes, end: bool) -> None:
        """One more request message (or just END_STREAM with an empty payload) on an open stream."""
        if st.sid not in self.streams or st.half_closed or self.closed:
            return
        st.half_closed = end
        self.blocked.append([st, memoryview(payload), end])
        self._flush()

    def cancel(self, st: Stream, out: SendOutcome) -> None:
        """End a stream locally (RST_STREAM CANCEL) with `out`."""
        if st.sid in self.streams:
            self._end(st, out, reset=CANCEL)

    def _flush(self) -> None:
        """Send queued DATA in FIFO order as far as the connection and stream windows allow."""
        write = self.transport.write  # type: ignore[union-attr]
        while self.blocked and not self.closed:
            item = self.blocked[0]
            st, data, end = item
            if st.sid not in self.streams:
                self.blocked.popleft()
                continue
            n = min(len(data), self.send_window, st.window, self.peer_max_frame)
            if n <= 0 and len(data):
                return  # wait for a WINDOW_UPDATE (head of line: simple, and fair to call order)
            rest = data[n:]
            flags = END_STREAM if end and not rest else 0
            write(FRAME_HEAD.pack(n >> 16, n & 0xFFFF, DATA, flags, st.sid) + bytes(data[:n]))
            self.send_window -= n
            st.window -= n
            if rest:
                item[1] = rest
            else:
                self.blocked.popleft()

    def _deadline(self, st: Stream) -> None:
        st.timer = None
        self.cancel(st, outcome(DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _end(self, st: Stream, out: SendOutcome, reset: int | None = None) -> None:
        self.streams.pop(st.sid, None)
        if st.timer is not None:
            st.timer.cancel()
        if reset is not None and not self.closed:
            self.transport.write(rst_stream(st.sid, reset))  # type: ignore[union-attr]
        if st.on_end is not None:
            on_end, st.on_end = st.on_end, None
            on_end(out)
        elif st.fut is not None and not st.fut.done():
            st.fut.set_result(out)
        if self.slot_waiters:
            self._wake_waiters()

    def _wake_waiters(self, all_of_them: bool = False) -> None:
        while self.slot_waiters and (all_of_them or len(self.streams) < self.peer_max_streams):
            w = self.slot_waiters.popleft()
            if not w.done():
                w.set_result(None)
                if not all_of_them:
                    return

    # ---- receiving ----------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, size = 0, len(buf)
        while size - pos >= 9:
            hi, lo, ftype, flags, sid = FRAME_HEAD.unpack_from(buf, pos)
            end = pos + 9 + (hi << 16 | lo)
            if end > size:
                break
            payload = buf[pos + 9:end]
            pos = end
            if ftype == DATA:
                self._on_data(sid & 0x7FFFFFFF, flags, payload)
            elif ftype == HEADERS or ftype == CONTINUATION:
                self._on_headers(ftype, sid & 0x7FFFFFFF, flags, payload)
            else:
                self._on_control(ftype, sid & 0x7FFFFFFF, flags, payload)
            if self.closed:
                return
        self.buf = buf[pos:]

    def _on_data(self, sid: int, flags: int, payload: bytes) -> None:
        n = len(payload)
        self.recv_unacked += n
        if self.recv_unacked >= WINDOW // 2:
            self.transport.write(window_update(0, self.recv_unacked))  # type: ignore[union-attr]
            self.recv_unacked = 0
        st = self.streams.get(sid)
        if st is None:
            return  # a stream we already ended: counted for the connection window, then dropped
        if flags & PADDED:
            payload = payload[1:n - payload[0]]
        st.take(payload)
        if flags & END_STREAM:
            self._remote_end(st, [])
            return
        st.unacked += n
        if st.unacked >= WINDOW // 2:
            self.transport.write(window_update(sid, st.unacked))  # type: ignore[union-attr]
            st.unacked = 0

    def _on_headers(self, ftype: int, sid: int, flags: int, payload: bytes) -> None:
        if ftype == HEADERS:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            self._partial = (sid, flags, [payload])
        elif self._partial is None or self._partial[0] != sid:
            return self._protocol_error("CONTINUATION without HEADERS")
        else:
            self._partial[2].append(payload)
        if not flags & END_HEADERS:
            return None
        sid, first_flags, parts = self._partial
        self._partial = None
        try:
            headers = self._decode(b"".join(parts))
        except hpack.HPACKError as exc:
            return self._protocol_error(f"cannot decode response headers: {exc}")
        st = self.streams.get(sid)
        if st is None:
            return None
        if not st.got_headers:
            st.got_headers = True
            st.http_status = next((int(v) for k, v in headers if k == ":status" and v.isdigit()), None)
            if not first_flags & END_STREAM:
                return None  # response headers; the trailers come later
        self._remote_end(st, headers)  # trailers, or the headers of a trailers-only response
        return None

    def _decode(self, block: bytes) -> list[tuple[str, str]]:
        """Decode one header block through the connection's decoder, memoised when that is exact.

        A block's meaning depends only on the block and the decoder's dynamic table. `_adds` counts
        every change of that table, so a block whose decoding changed nothing is cached under the
        current count (what a server sends once its headers sit in the table: the same few bytes per
        response); a block that changes the table is always decoded."""
        table = self.decoder.header_table
        state = (self._adds, table.maxsize)
        hit = self._decoded.get(block)
        if hit is not None and hit[0] == state:
            return hit[1]
        headers = cast(list[tuple[str, str]], self.decoder.decode(block))  # a list of str pairs (raw=False)
        if (self._adds, table.maxsize) == state:
            if len(self._decoded) >= 256:
                self._decoded.clear()
            self._decoded[block] = (state, headers)
        return headers

    def _count_adds(self) -> None:
        table, add = self.decoder.header_table, self.decoder.header_table.add

        def counted_add(name: bytes, value: bytes) -> None:
            self._adds += 1
            add(name, value)
        table.add = counted_add  # type: ignore[method-assign]

    def _remote_end(self, st: Stream, trailers: list[tuple[str, str]]) -> None:
        status = status_from_headers(trailers, st.http_status)
        if status is None:
            out = outcome(INTERNAL, "the server ended the stream without grpc-status")
        elif status[0] == 0:
            out = SendOutcome(OK, "OK", 0, st.responses)
        else:
            out = outcome(*status)
        self._end(st, out, reset=None if st.half_closed else CANCEL)

    def _on_control(self, ftype: int, sid: int, flags: int, payload: bytes) -> None:
        write = self.transport.write  # type: ignore[union-attr]
        if ftype == SETTINGS and not flags & ACK:
            self._apply_settings(payload)
            write(frame(SETTINGS, ACK, 0))
        elif ftype == WINDOW_UPDATE:
            inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
            st = self.streams.get(sid) if sid else None
            if sid == 0:
                self.send_window += inc
            elif st is not None:
                st.window += inc
            self._flush()
        elif ftype == PING and not flags & ACK:
            write(frame(PING, ACK, 0, payload))
        elif ftype == RST_STREAM:
            st = self.streams.get(sid)
            if st is not None:
                err = _U32.unpack(payload)[0]
                why = REFUSED if err == REFUSED_STREAM else f"stream reset by the server (HTTP/2 error {err})"
                self._end(st, outcome(RST_TO_GRPC.get(err, INTERNAL), why))
        elif ftype == GOAWAY:
            last, err = struct.unpack(">LL", payload[:8])
            self.going_away = True
            for st in [s for s in self.streams.values() if s.sid > last & 0x7FFFFFFF]:
                self._end(st, connection_failed(f"GOAWAY (error {err}): not processed, retryable"))
            self._wake_waiters(all_of_them=True)

    def _apply_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            key, value = _PAIR.unpack_from(payload, i)
            if key == INITIAL_WINDOW_SIZE:
                for st in self.streams.values():
                    st.window += value - self.peer_window
                self.peer_window = value
            elif key == MAX_FRAME_SIZE:
                self.peer_max_frame = value
            elif key == MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
        if not self.ready.done():
            self.ready.set_result(True)
        self._flush()
        self._wake_waiters()

    def _protocol_error(self, why: str) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(frame(GOAWAY, 0, 0, struct.pack(">LL", 0, PROTOCOL_ERROR)))
            self.transport.close()
        self.fail_all(why)
