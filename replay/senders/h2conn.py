"""One HTTP/2 connection as an asyncio Protocol: cleartext with prior knowledge (h2c, as gRPC uses it) or,
over a TLS transport, only when the server's ALPN chose h2 (else it fails with a one-line reason).

Only what a gRPC client (and a plain HTTP/2 one: `HttpStream`) needs, written for low CPU per call: a unary call is one `transport.write`
(HEADERS from a cached block + DATA with END_STREAM); the response path splits frames straight out of
the receive buffer into tuples (`wire.h2.split`). Flow control: we advertise a 16 MiB window for the
connection and every stream and send WINDOW_UPDATEs once half of it is consumed; our sends respect
the peer's windows (data that does not fit waits in one FIFO until a WINDOW_UPDATE or SETTINGS frees
room). MAX_CONCURRENT_STREAMS and MAX_FRAME_SIZE from the peer are honoured. Every header block goes
through the connection's one HPACK decoder in arrival order, also for streams we have already
finished, so its dynamic table stays in step.

The server is a target we do not control, so it is held to the protocol as grpc-go's client holds it:

- connection errors (GOAWAY with the error code, close, every open call fails UNAVAILABLE with a
  detail naming what the server did): a frame over 16384 bytes (we advertise no MAX_FRAME_SIZE), a
  first frame that is not SETTINGS, invalid SETTINGS or control frames, a window pushed over 2^31-1,
  DATA/HEADERS on stream 0 or on a stream we never opened, PUSH_PROMISE (push is off), any frame but
  CONTINUATION inside a header block, a header block over 1 MiB or 64 frames (ENHANCE_YOUR_CALM),
  undecodable HPACK (COMPRESSION_ERROR), DATA beyond the connection's receive window
  (FLOW_CONTROL_ERROR), PING or SETTINGS floods (ENHANCE_YOUR_CALM);
- stream errors (RST_STREAM with the code, that call fails INTERNAL): DATA beyond the stream's receive
  window, DATA before the response headers, trailers without END_STREAM, a malformed header list;
- message errors (RST_STREAM CANCEL): a response message over the max receive size, also after
  decompression, or a call's responses over it in all -> RESOURCE_EXHAUSTED; a compressed message
  without a usable grpc-encoding -> INTERNAL (UNIMPLEMENTED for an encoding we cannot decode).

Plain HTTP/2 streams (`open(..., http=True)`): a request without a body ends on its HEADERS; the response
body is kept as it comes (up to the max receive size, else the call fails BODY_TOO_LARGE and its stream is
reset), interim 1xx responses are skipped, and the outcome is the HTTP status's (`senders.base.http_outcome`,
as the http1 sender reports it).

No exception escapes `data_received`: an unexpected one is a bug of ours, answered with GOAWAY
INTERNAL_ERROR and one log line.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple, cast

from replay.senders.base import ERROR, OK, SendOutcome, http_outcome
from replay.senders.h2frames import connection_failed, outcome
from wire.h2 import (
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    HEAD,
    MAX_STREAM_ID,
    MAX_WINDOW,
    PREFACE,
    SETTINGS_ACK,
    U32,
    BlockAssembler,
    ErrorCode,
    Flag,
    FrameLoop,
    FrameType,
    H2Error,
    Setting,
    check_control,
    error_name,
    frame_name,
    goaway,
    grow_window,
    headers,
    parse_settings,
    ping,
    rst_stream,
    settings,
    split,
    strip,
    window_update,
)
from wire.headers import CachedDecoder
from wire.limits import Budget
from wire.messages import PREFIX_LEN, MessageReader, decompress
from wire.status import RST_TO_STATUS, GrpcError, Status, status_from_headers

log = logging.getLogger(__name__)

REFUSED = "stream refused by the server (REFUSED_STREAM): not processed"  # the detail that allows a retry
WINDOW = 1 << 24  # what we let the server send before a WINDOW_UPDATE (connection and each stream)
MAX_RECEIVE_MESSAGE = 64 << 20  # as the grpc sender sets it: both senders accept what the recording held
MAX_HEADER_BLOCK = 1 << 20  # an encoded response header block (and its decoded list): gRPC sends ~100 bytes
# Floods (CVE-2019-9512 PING, -9515 SETTINGS): each costs us a frame back; a real server sends a few.
PING_BURST, PING_PER_S = 1000, 100.0
SETTINGS_BURST, SETTINGS_PER_S = 1000, 100.0
SERVER_ERROR = "server protocol error"  # how every detail about a misbehaving server starts

# plain ints for the per-frame dispatch (an IntEnum member lookup per frame is measurable)
_DATA, _HEADERS, _CONTINUATION = int(FrameType.DATA), int(FrameType.HEADERS), int(FrameType.CONTINUATION)
_SETTINGS, _PING, _WINDOW_UPDATE = int(FrameType.SETTINGS), int(FrameType.PING), int(FrameType.WINDOW_UPDATE)
_RST_STREAM, _GOAWAY, _PRIORITY = int(FrameType.RST_STREAM), int(FrameType.GOAWAY), int(FrameType.PRIORITY)
_PUSH_PROMISE = int(FrameType.PUSH_PROMISE)
_END_STREAM, _END_HEADERS, _ACK = int(Flag.END_STREAM), int(Flag.END_HEADERS), int(Flag.ACK)
# A deadline fires when the loop's time is within this of it: asyncio timers (uvloop's in whole
# milliseconds) may wake up to that much early, and a per-stream timer cancelled its call then too.
_DEADLINE_SLACK_S = 0.001


class _Answer(NamedTuple):
    """What a response header block says, derived once per distinct block (CachedDecoder.view)."""

    http_status: int | None
    encoding: str | None
    status: tuple[int, str] | None  # (grpc-status, grpc-message) when the block carries grpc-status


def _answer(fields: list[tuple[str, str]]) -> _Answer:
    http_status = encoding = None
    for k, v in fields:
        if k == ":status":
            http_status = int(v) if v.isdigit() else None
        elif k == "grpc-encoding":
            encoding = v
    return _Answer(http_status, encoding, status_from_headers(fields, None))


class Stream:
    """One call's state on a connection; its SendOutcome goes to `on_end` if given, else to `fut`."""

    __slots__ = ("sid", "fut", "on_end", "responses", "reader", "size", "encoding", "http_status", "got_headers",
                 "window", "recv_window", "unacked", "half_closed")
    plain = False  # a gRPC call's stream; HttpStream is a plain HTTP/2 request's

    def __init__(self, sid: int, fut: asyncio.Future[SendOutcome] | None, window: int,
                 on_end: Callable[[SendOutcome], None] | None = None, recv_window: int = WINDOW,
                 max_message: int = MAX_RECEIVE_MESSAGE) -> None:
        self.sid, self.fut, self.window, self.on_end = sid, fut, window, on_end
        self.responses: list[bytes] = []
        self.reader = MessageReader(max_message)  # gRPC messages, also those split over DATA frames
        self.size = 0  # the responses' bytes so far (prefixes included): bounded by the max message size
        self.encoding = ""  # the response's grpc-encoding
        self.http_status: int | None = None
        self.got_headers = self.half_closed = False
        self.recv_window = recv_window  # what the server may still send on this stream
        self.unacked = 0

    def take(self, payload: bytes) -> None:
        """Add DATA payload: the complete messages, decompressed, go to `responses`.
        Raises GrpcError for a message over the limit, a bad flag or encoding."""
        limit = self.reader.limit
        for flag, message in self.reader.feed(payload):
            if flag:
                if flag != 1:
                    raise GrpcError(Status.INTERNAL, f"message with compressed flag {flag} (not 0 or 1)")
                message = decompress(message, self.encoding, limit)
            self.size += PREFIX_LEN + len(message)
            if self.size > PREFIX_LEN + limit:  # room for one message of the limit, prefix included
                raise GrpcError(Status.RESOURCE_EXHAUSTED,
                                f"responses to one call over the max receive message size ({limit} bytes)")
            self.responses.append(message)

    def refused(self, exc: GrpcError) -> SendOutcome:
        """The outcome of a response this stream would not take (`take` raised)."""
        return outcome(exc.status, exc.message)


class HttpStream(Stream):
    """A plain HTTP/2 request's stream: the response body is kept whole, not read as gRPC messages."""

    __slots__ = ("body",)
    plain = True

    def __init__(self, sid: int, fut: asyncio.Future[SendOutcome] | None, window: int,
                 on_end: Callable[[SendOutcome], None] | None = None, recv_window: int = WINDOW,
                 max_message: int = MAX_RECEIVE_MESSAGE) -> None:
        super().__init__(sid, fut, window, on_end, recv_window, max_message)
        self.body = bytearray()

    def take(self, payload: bytes) -> None:
        """Add DATA payload to the body. Raises GrpcError past the max receive size."""
        if len(self.body) + len(payload) > self.reader.limit:
            raise GrpcError(Status.RESOURCE_EXHAUSTED, f"response body over the max receive size "
                                                      f"({self.reader.limit} bytes)")
        self.body += payload

    def refused(self, exc: GrpcError) -> SendOutcome:
        return SendOutcome(ERROR, "BODY_TOO_LARGE", detail=exc.message)  # an HTTP call: not gRPC's rejected

    def http_end(self) -> SendOutcome:
        """The outcome once the response ended: its status's, the body its one response."""
        if self.http_status is None:
            return SendOutcome(ERROR, "BAD_RESPONSE", detail="the response had no :status")
        return http_outcome(self.http_status, bytes(self.body))


class H2Connection(asyncio.Protocol, FrameLoop):
    """A client HTTP/2 connection; the sender opens streams on it while it is `usable`.

    `max_receive_message_length` bounds each response message (after decompression) and all of one
    call's responses together; `window` is the receive window advertised for the connection and each
    stream (the connection's is never below HTTP/2's 65535)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, max_receive_message_length: int = MAX_RECEIVE_MESSAGE,
                 window: int = WINDOW) -> None:
        if not 0 < window <= MAX_WINDOW:
            raise ValueError(f"window {window} outside 1..2^31-1")
        self.loop = loop
        self.server_name = ""  # the name TLS verified (for error details), set by the sender
        self.tls_hint = ""  # what a TLS connection closed before SETTINGS may mean, set by the sender
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[bool] = loop.create_future()  # True with the server's SETTINGS, False: failed
        self.error = ""
        self.closed = self.going_away = False
        self.streams: dict[int, Stream] = {}
        self.next_sid = 1
        self.max_message = max_receive_message_length
        self.decoder = CachedDecoder(max_header_list_size=MAX_HEADER_BLOCK, validate=True)
        self.blocks = BlockAssembler(MAX_HEADER_BLOCK)
        self.buf = b""
        self.peer_max_frame, self.peer_max_streams, self.peer_window = DEFAULT_MAX_FRAME, 1 << 31, DEFAULT_WINDOW
        self.send_window = DEFAULT_WINDOW
        # our receive side: the stream window we advertise, the connection's, what is left of it
        self.window = window
        self.conn_window = max(window, DEFAULT_WINDOW)
        self.recv_window = self.conn_window
        self.recv_unacked = 0
        # Until the server ACKs our SETTINGS it may still assume 65535 per stream: a smaller advertised
        # window is enforced only from then on.
        self.recv_floor = min(0, window - DEFAULT_WINDOW)
        self.got_preface = False  # the server's first frame (which must be SETTINGS) arrived
        self.ping_budget = Budget(PING_BURST, PING_PER_S)
        self.settings_budget = Budget(SETTINGS_BURST, SETTINGS_PER_S)
        self.blocked: deque[list[Any]] = deque()  # [stream, memoryview, end_stream] waiting for window
        self.slot_waiters: deque[asyncio.Future[None]] = deque()
        # Stream deadlines: one heap of (deadline, stream id) and one timer armed at its earliest entry,
        # not a timer per stream (uvloop's call_at and cancel cost ~3 us a call). An entry whose stream
        # already ended is dropped when it reaches the top, or when such entries are most of the heap.
        self.deadlines: list[tuple[float, int]] = []
        self.deadline_timer: asyncio.TimerHandle | None = None
        self.deadline_at = 0.0

    @property
    def usable(self) -> bool:
        return not self.closed and not self.going_away and self.next_sid < MAX_STREAM_ID - 2

    # ---- asyncio Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream connection's transport (loop.create_connection): asyncio types the argument as the base
        self.transport = t = cast(asyncio.Transport, transport)
        tls = t.get_extra_info("ssl_object")
        if tls is not None and tls.selected_alpn_protocol() != "h2":  # it would answer our preface as HTTP/1
            from replay.senders.tls import ALPN_NOT_H2
            self.fail_all(ALPN_NOT_H2.format(name=self.server_name, got=tls.selected_alpn_protocol() or "none"))
            t.close()
            return
        preface = PREFACE + settings({Setting.ENABLE_PUSH: 0, Setting.INITIAL_WINDOW_SIZE: self.window})
        if self.conn_window > DEFAULT_WINDOW:
            preface += window_update(0, self.conn_window - DEFAULT_WINDOW)
        t.write(preface)
        # Ready only with the server's first SETTINGS (as grpc-core does): before it we would not know
        # its MAX_CONCURRENT_STREAMS, and streams beyond it would be refused.

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, ssl.SSLError):  # e.g. the server refused our (missing) client certificate
            from replay.senders.tls import describe
            self.fail_all(f"connection lost: {describe(exc, self.server_name)}")
            return
        if not self.got_preface and self.transport is not None and self.transport.get_extra_info("ssl_object"):
            self.fail_all(f"connection lost: TLS: {self.server_name} closed the connection right after the "
                          f"handshake, before its HTTP/2 SETTINGS{self.tls_hint}")
            return
        self.fail_all(f"connection lost: {exc or 'closed by the peer'}")

    def connect_failed(self, exc: Exception, detail: str | None = None) -> None:
        """The connection could not be made; `detail` (e.g. a TLS failure in words) replaces the default."""
        self.error = detail or f"cannot connect: {exc}"
        self.fail_all(self.error)

    def fail_all(self, detail: str) -> None:
        """Close: every open stream ends as a connection error, waiters are woken."""
        self.closed = True
        self.error = self.error or detail
        if not self.ready.done():
            self.ready.set_result(False)
        for st in list(self.streams.values()):
            self._end(st, connection_failed(detail))
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()
            self.deadline_timer = None
        self.deadlines = []
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
             on_end: Callable[[SendOutcome], None] | None = None, http: bool = False) -> Stream:
        """Start a stream: HEADERS, then (if given) one DATA payload with END_STREAM; arm the deadline.
        An empty payload (a plain request without a body) ends the stream on its HEADERS. Its outcome
        is passed to `on_end` (called once, from this connection's callbacks) or, without one, set on
        the stream's `fut`. `http`: a plain HTTP/2 request (HttpStream), not a gRPC call."""
        sid, self.next_sid = self.next_sid, self.next_sid + 2
        fut = self.loop.create_future() if on_end is None else None
        st = self.streams[sid] = (HttpStream if http else Stream)(sid, fut, self.peer_window, on_end, self.window,
                                                                  self.max_message)
        self._add_deadline(deadline, sid)
        transport = self.transport
        assert transport is not None, "open() before the connection is made"
        if payload is not None and not payload:  # never a gRPC call's: its message has a 5-byte prefix
            st.half_closed = True
            transport.write(headers(sid, block, self.peer_max_frame, end_stream=True))
            return st
        n = len(block)
        head = (HEAD.pack(n >> 16, n & 0xFFFF, _HEADERS, _END_HEADERS, sid) + block if n <= self.peer_max_frame
                else headers(sid, block, self.peer_max_frame))  # the usual case, packed inline
        if payload is None:
            transport.write(head)
            return st
        n = len(payload)
        st.half_closed = True
        if not self.blocked and n <= self.send_window and n <= st.window and n <= self.peer_max_frame:
            self.send_window -= n
            st.window -= n
            transport.write(b"".join((head, HEAD.pack(n >> 16, n & 0xFFFF, _DATA, _END_STREAM, sid), payload)))
        else:
            transport.write(head)
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
            self._end(st, out, reset=ErrorCode.CANCEL)

    def _flush(self) -> None:
        """Send queued DATA in FIFO order as far as the connection and stream windows allow."""
        assert self.transport is not None
        write = self.transport.write
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
            flags = _END_STREAM if end and not rest else 0
            write(HEAD.pack(n >> 16, n & 0xFFFF, _DATA, flags, st.sid) + bytes(data[:n]))
            self.send_window -= n
            st.window -= n
            if rest:
                item[1] = rest
            else:
                self.blocked.popleft()

    def _add_deadline(self, deadline: float, sid: int) -> None:
        heap = self.deadlines
        if len(heap) > 2 * len(self.streams) + 64:  # mostly ended streams: keep memory to those in flight
            streams = self.streams
            heap[:] = [e for e in heap if e[1] in streams]
            heapq.heapify(heap)
        heapq.heappush(heap, (deadline, sid))
        if self.deadline_timer is None or deadline < self.deadline_at:
            self._arm_deadline(deadline)

    def _arm_deadline(self, when: float) -> None:
        if self.deadline_timer is not None:
            self.deadline_timer.cancel()
        self.deadline_at = when
        self.deadline_timer = self.loop.call_at(when, self._deadlines)

    def _deadlines(self) -> None:
        """The deadline timer: every stream past its deadline ends DEADLINE_EXCEEDED (RST_STREAM CANCEL)."""
        self.deadline_timer = None
        heap, streams = self.deadlines, self.streams
        now = self.loop.time() + _DEADLINE_SLACK_S
        while heap and (heap[0][0] <= now or heap[0][1] not in streams):
            sid = heapq.heappop(heap)[1]
            st = streams.get(sid)
            if st is not None:
                self.cancel(st, outcome(Status.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        if heap and not self.closed and self.deadline_timer is None:
            self._arm_deadline(heap[0][0])

    def _end(self, st: Stream, out: SendOutcome, reset: int | None = None) -> None:
        self.streams.pop(st.sid, None)
        if reset is not None and not self.closed:
            assert self.transport is not None
            self.transport.write(rst_stream(st.sid, reset))
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
        if self.closed:
            return
        try:
            self._receive(data)
        except H2Error as exc:
            self._connection_error(exc.code, f"{SERVER_ERROR}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a bug of ours must not leave the connection half-parsed
            log.error("h2 sender: unexpected %s while handling the server's frames: %s", type(exc).__name__, exc)
            self._connection_error(ErrorCode.INTERNAL_ERROR, f"h2 sender internal error: {type(exc).__name__}: {exc}")

    def _receive(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        if not self.got_preface and buf[:5] == b"HTTP/":
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "the server answered in HTTP/1.x, not HTTP/2")
        frames, pos, err = split(buf, 0, DEFAULT_MAX_FRAME)  # we advertise no larger MAX_FRAME_SIZE
        if not self.got_preface and frames:
            ftype, flags = frames[0][0], frames[0][1]
            if ftype != _SETTINGS or flags & _ACK:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, f"the server's first frame is {frame_name(ftype)}, not SETTINGS")
            self.got_preface = True
        self.run_frames(frames)
        if self.closed:
            return
        if err is not None:
            raise err
        self.buf = buf[pos:]

    def _idle(self, sid: int) -> bool:
        """A stream we never opened (the server cannot open streams: push is off)."""
        return not sid & 1 or sid >= self.next_sid

    def on_data(self, sid: int, flags: int, payload: bytes) -> None:
        if not sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        n = len(payload)  # padding included: flow control counts the whole payload
        if n > self.recv_window:
            raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, f"{n}-byte DATA beyond the connection's receive window "
                                                        f"({self.recv_window} bytes left)")
        self.recv_window -= n
        self.recv_unacked += n
        if self.recv_unacked >= self.conn_window // 2:
            assert self.transport is not None
            self.transport.write(window_update(0, self.recv_unacked))
            self.recv_window += self.recv_unacked
            self.recv_unacked = 0
        st = self.streams.get(sid)
        if st is None:
            if self._idle(sid):
                raise H2Error(ErrorCode.PROTOCOL_ERROR, f"DATA on stream {sid}, which we never opened")
            return  # a stream we already ended: counted for the connection window, then dropped
        if n > st.recv_window - self.recv_floor:
            raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, f"{n}-byte DATA beyond the stream's receive window "
                                                        f"({max(0, st.recv_window)} bytes left)", sid)
        st.recv_window -= n
        if not st.got_headers:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "DATA before the response HEADERS", sid)
        try:
            st.take(strip(_DATA, flags, payload))
        except GrpcError as exc:
            self._end(st, st.refused(exc), reset=ErrorCode.CANCEL)
            return
        if flags & _END_STREAM:
            self._remote_end(st, None)
            return
        st.unacked += n
        if st.unacked >= self.window // 2:
            assert self.transport is not None
            self.transport.write(window_update(sid, st.unacked))
            st.recv_window += st.unacked
            st.unacked = 0

    def on_block(self, sid: int, flags: int, block: bytes) -> None:
        """A complete header block: decoded whatever its stream (the HPACK table must stay in step)."""
        answer = self.decoder.view(block, sid, _answer)  # what a repeated block says is derived once
        st = self.streams.get(sid)
        if st is None:
            if self._idle(sid):
                raise H2Error(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {sid}, which we never opened")
            return
        if not st.got_headers:
            st.got_headers = True
            st.http_status = answer.http_status
            if answer.encoding is not None:
                st.encoding = answer.encoding
            if not flags & _END_STREAM:
                if st.plain and st.http_status is not None and st.http_status < 200:
                    st.got_headers = False  # an interim response (1xx): the final one follows
                return  # response headers; the trailers come later
        elif not flags & _END_STREAM:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "trailers without END_STREAM", sid)
        self._remote_end(st, answer.status)  # trailers, or the headers of a trailers-only response

    def _remote_end(self, st: Stream, grpc_status: tuple[int, str] | None) -> None:
        """The server ended the stream; `grpc_status` is its trailers' (None: they had no grpc-status)."""
        if st.plain:
            self._end(st, cast(HttpStream, st).http_end(), reset=None if st.half_closed else ErrorCode.CANCEL)
            return
        status = grpc_status if grpc_status is not None else status_from_headers([], st.http_status)
        if status is None:
            out = outcome(Status.INTERNAL, "the server ended the stream without grpc-status")
        elif status[0] == 0:
            pending = st.reader.pending
            out = (SendOutcome(OK, "OK", 0, st.responses) if not pending else
                   outcome(Status.INTERNAL, f"the stream ended inside a message ({pending} bytes of it received)"))
        else:
            out = outcome(*status)
        self._end(st, out, reset=None if st.half_closed else ErrorCode.CANCEL)

    def on_control(self, ftype: int, sid: int, flags: int, payload: bytes) -> None:
        assert self.transport is not None
        write = self.transport.write
        if ftype == _SETTINGS:
            if not self.settings_budget.spend():
                raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, f"SETTINGS flood (over {SETTINGS_BURST} at "
                                                           f"{SETTINGS_PER_S:g}/s)")
            pairs = parse_settings(flags, sid, payload)
            if flags & _ACK:
                self.recv_floor = 0  # our (possibly smaller) initial window is in force now
            else:
                self._apply_settings(pairs)
                write(SETTINGS_ACK)
        elif ftype == _PING:
            if not self.ping_budget.spend():
                raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, f"PING flood (over {PING_BURST} at {PING_PER_S:g}/s)")
            check_control(ftype, flags, sid, payload)
            if not flags & _ACK:
                write(ping(payload, ack=True))
        elif ftype == _WINDOW_UPDATE:
            check_control(ftype, flags, sid, payload)
            inc = U32.unpack(payload)[0] & MAX_WINDOW
            if sid == 0:
                self.send_window = grow_window(self.send_window, inc, 0)
            else:
                st = self.streams.get(sid)
                if st is None:
                    if self._idle(sid):
                        raise H2Error(ErrorCode.PROTOCOL_ERROR, f"WINDOW_UPDATE on stream {sid}, which we never opened")
                    return
                st.window = grow_window(st.window, inc, sid)
            self._flush()
        elif ftype == _RST_STREAM:
            check_control(ftype, flags, sid, payload)
            st = self.streams.get(sid)
            if st is not None:
                err = U32.unpack(payload)[0]
                why = (REFUSED if err == ErrorCode.REFUSED_STREAM else
                       f"stream reset by the server (HTTP/2 error {err})")
                self._end(st, outcome(RST_TO_STATUS.get(err, Status.INTERNAL), why))
            elif self._idle(sid):
                raise H2Error(ErrorCode.PROTOCOL_ERROR, f"RST_STREAM on stream {sid}, which we never opened")
        elif ftype == _GOAWAY:
            check_control(ftype, flags, sid, payload)
            last, err = U32.unpack_from(payload, 0)[0] & MAX_STREAM_ID, U32.unpack_from(payload, 4)[0]
            self.going_away = True
            for st in [s for s in self.streams.values() if s.sid > last]:
                self._end(st, connection_failed(f"GOAWAY (error {err}): not processed, retryable"))
            self._wake_waiters(all_of_them=True)
        elif ftype == _PRIORITY:
            check_control(ftype, flags, sid, payload)  # valid on any stream; we do not prioritise
        elif ftype == _PUSH_PROMISE:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE, though we disabled push")
        # other frame types: extensions we do not speak, ignored as RFC 9113 asks

    def _apply_settings(self, pairs: list[tuple[int, int]]) -> None:
        for key, value in pairs:
            if key == Setting.INITIAL_WINDOW_SIZE:
                delta = value - self.peer_window
                for st in self.streams.values():
                    st.window += delta
                    if st.window > MAX_WINDOW:
                        raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, f"SETTINGS_INITIAL_WINDOW_SIZE {value} took "
                                                                    f"stream {st.sid}'s window over 2^31-1")
                self.peer_window = value
            elif key == Setting.MAX_FRAME_SIZE:
                self.peer_max_frame = value
            elif key == Setting.MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
        if not self.ready.done():
            self.ready.set_result(True)
        self._flush()
        self._wake_waiters()

    def on_stream_error(self, exc: H2Error) -> None:
        """RST_STREAM with the error's code; the call fails INTERNAL (as grpc-go fails it)."""
        st = self.streams.get(exc.stream)
        if st is not None:
            self._end(st, outcome(Status.INTERNAL, f"{SERVER_ERROR}: {exc}"), reset=exc.code)

    def _connection_error(self, code: ErrorCode, detail: str) -> None:
        """GOAWAY with `code`, close, and fail every open call with `detail`."""
        if self.transport is not None and not self.closed:
            self.transport.write(goaway(0, code, detail.encode()[:256]))  # we accept no server streams: last 0
            self.transport.close()
        log.debug("h2 sender: GOAWAY %s to %s: %s", error_name(code), self.transport, detail)
        self.fail_all(detail)
