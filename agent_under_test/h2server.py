"""A lean gRPC server: HTTP/2 cleartext (prior knowledge, as gRPC speaks it) on the running asyncio loop.

Why it exists: grpcio's Python server spends ~400 us of CPU on every unary call on this 2-core machine
(an echo servicer), more than the agent's whole pipeline, so the agent could neither reach its target
rate nor refuse calls cheaply under overload. This server parses frames straight out of the receive
buffer, answers a unary call with one write (cached HEADERS block + DATA + cached trailers) and keeps
no per-call objects beyond the call itself. `--server grpcio` keeps grpc.aio for comparison.

    socket --data_received--> wire.h2.split --HEADERS--> Call (handler by :path; unknown: UNIMPLEMENTED)
                                             --DATA-----> MessageReader --unary: task(handler(request, ctx))
                                                                       --client stream: Call.inbox -> Requests
    handler result --> respond(): HEADERS + DATA + trailers, within the client's flow-control windows

It hosts ordinary grpc.aio servicers: generated `add_*_to_server()` functions register through
add_generic_rpc_handlers / add_registered_method_handlers, and each handler gets an h2call.Context.

The peer is hostile until it proves otherwise (the limits are grpc-go's and nghttp2's ideas):
- frames over our MAX_FRAME_SIZE, malformed frames and SETTINGS, frames inside a header block: GOAWAY
  with the RFC 9113 error code, one log line, the connection closed; a malformed request: RST_STREAM;
- header blocks capped while they are assembled (max_header_list_size), before END_HEADERS;
- flow control enforced both ways: a peer that overruns a window gets FLOW_CONTROL_ERROR; a stream's
  window is given back as its messages are consumed, so a slow streaming handler holds its client
  back; request bytes held per connection are capped (MAX_HELD);
- messages limited by their declared size and again after decompression (bounded inflater);
- PING, SETTINGS and empty-frame floods: GOAWAY ENHANCE_YOUR_CALM once a per-connection token bucket is
  empty; streams reset before we answered them ("rapid reset") draw on a bucket per peer host, so an
  attacker that reconnects finds it as empty as it left it (and is refused at once while below half);
- a peer that does not read stops being read (write backpressure), handshake and idle timeouts.
Shutdown: GOAWAY(2^31-1) + PING, then GOAWAY(last stream seen) once the PING returns; in-flight calls
finish within the grace period, then are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import grpc

from agent_under_test.h2call import Abort, Call, Requests
from agent_under_test.stall import LoopStall, last_arrival, spread
from wire import h2
from wire.h2 import ErrorCode, Flag, FrameType, H2Error, Setting
from wire.headers import CachedDecoder, encode_block
from wire.limits import Budget
from wire.messages import SUPPORTED_ENCODINGS, decompress
from wire.status import (
    RESPONSE_HEADERS,
    TRAILERS_OK,
    GrpcError,
    Metadata,
    Status,
    metadata_in,
    metadata_out,
    parse_timeout,
    status_block,
)

log = logging.getLogger(__name__)

WINDOW = 1 << 24          # connection receive window we advertise
STREAM_WINDOW = 1 << 20   # per-stream receive window (a streaming handler's unread backlog is bounded by it)
MAX_STREAMS = 4096        # concurrent calls per connection; beyond: REFUSED_STREAM (retryable)
HIGH_WATER = 1 << 16      # a streaming writer waits while more than this is held back by flow control
MAX_HELD = 32 << 20       # request bytes held per connection (partial messages, unread inboxes): 8 max-size calls
# Flood budgets per connection (burst, refill per second). A legitimate client stays far below:
# grpc-js keepalive pings about once a second, a replayer cancels what it abandons, not 1,000/s.
PING_BUDGET = (1000, 100)       # each call opened gives one PING back (a busy client's BDP pings: grpc-go)
SETTINGS_BUDGET = (100, 10)
# Resets of streams we had not answered yet ("rapid reset", CVE-2023-44487: its requests are complete, so
# the request's state alone cannot tell it from a client's cancel); each call we answer gives one back.
# Per peer host, shared by its connections: reconnecting does not refill it. A burst of 1,000 (nghttp2's):
# 2,000 reset streams took ~40 ms of CPU in one burst and a normal call beside them waited ~35 ms.
RESET_BUDGET = (1000, 1000)
MAX_PEERS = 10_000              # peer hosts whose reset budgets are remembered (full ones are forgotten first)
EMPTY_BUDGET = (1000, 100)      # empty DATA/CONTINUATION, PRIORITY, unknown frame types
# After our side closes, the client's input is read and dropped for this long / this much, as nginx's
# lingering close does: closing a socket with unread input sends a reset, and a reset that overtakes our
# last frames (under load, loopback packets can be delivered out of order across CPUs) loses the GOAWAY
# that says why. Our FIN goes after the GOAWAY, so the client reads both before it sees the end.
LINGER_S, LINGER_BYTES = 1.0, 1 << 20
_SHUTDOWN_PING = b"shutdown"
# A connection from a host whose reset budget is below half gets this and nothing else (no log line either).
_REFUSE_FLOODER = h2.settings({}) + h2.goaway(0, ErrorCode.ENHANCE_YOUR_CALM, b"too many streams reset by this host")
_DATA, _HEADERS, _SETTINGS = FrameType.DATA, FrameType.HEADERS, FrameType.SETTINGS
_END_STREAM, _END_HEADERS, _ACK, _PADDED = Flag.END_STREAM, Flag.END_HEADERS, Flag.ACK, Flag.PADDED
# Not metadata for the handler; user-agent is (grpc.aio's invocation_metadata() has it too).
_RESERVED = frozenset({"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding",
                       "grpc-message-type"})


# A request's header block as the server needs it: path, gRPC content type?, timeout (s), grpc-encoding,
# metadata (-bin decoded), and why the metadata is unusable. Computed once per distinct block.
Request = tuple[str, bool, float | None, str, Metadata, str]
_UNSUPPORTED_MEDIA_TYPE = encode_block([(":status", "415")])


def _request(fields: list[tuple[str, str]]) -> Request:
    path = ctype = encoding = ""
    timeout: float | None = None
    extra = []
    for k, v in fields:
        if k[0] == ":":
            if k == ":path":
                path = v
        elif k == "content-type":
            ctype = v
        elif k == "grpc-timeout":
            timeout = parse_timeout(v)
        elif k == "grpc-encoding":
            encoding = v
        elif k not in _RESERVED:
            extra.append((k, v))
    try:
        metadata, problem = tuple(metadata_in(extra)), ""
    except ValueError as exc:
        metadata, problem = (), str(exc)
    return path, ctype.startswith("application/grpc"), timeout, encoding, metadata, problem


class Connection(asyncio.Protocol, h2.FrameLoop):
    """One client connection: its frames, calls and flow control."""

    def __init__(self, server: LeanServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer = "unknown"
        self.calls: dict[int, Call] = {}
        self.last_sid = 0
        self.buf = b""
        self.preface = self.handshaken = False
        self.closed = False
        self.going_away: int | None = None      # the last stream id we still serve, once GOAWAY is final
        self.decoder = CachedDecoder(server.header_table_size, server.max_header_list_size, validate=True)
        self.blocks = h2.BlockAssembler(server.max_header_list_size)
        self.peer_window, self.peer_max_frame = h2.DEFAULT_WINDOW, h2.DEFAULT_MAX_FRAME
        self.send_window = h2.DEFAULT_WINDOW
        self.recv_window = WINDOW                # what the client may still send before our next update
        self.recv_unacked = 0
        self.held = 0                            # request bytes buffered on this connection's calls
        self.blocked: deque[Call] = deque()      # calls with DATA held back by flow control
        self.age_timer: asyncio.TimerHandle | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.linger_timer: asyncio.TimerHandle | None = None
        self.linger_left = LINGER_BYTES
        self.pings, self.settings = Budget(*PING_BUDGET), Budget(*SETTINGS_BUDGET)
        self.resets, self.empties = Budget(*RESET_BUDGET), Budget(*EMPTY_BUDGET)
        self._out: list[bytes] = []             # frames written in this loop iteration, sent together
        self.last_read = time.perf_counter_ns()  # when this connection was last read (its data came after)
        self._fresh: list[Call] = []            # calls opened by the chunk being read (stall.py back-dates them)
        self._stall_held = False

    # ---- asyncio Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = f"ipv6:[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"ipv4:{peer[0]}:{peer[1]}"
            self.resets = self.server.reset_budget(peer[0])
            if self.resets.available() < RESET_BUDGET[0] / 2:  # a host mid-flood: reconnecting buys no new round
                self._send(_REFUSE_FLOODER)               # (measured: ~10,000 reconnects per 100,000 streams)
                return self.close()
        s = self.server
        self._send(h2.settings({Setting.MAX_CONCURRENT_STREAMS: MAX_STREAMS, Setting.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                                Setting.HEADER_TABLE_SIZE: s.header_table_size, Setting.ENABLE_PUSH: 0,
                                Setting.MAX_HEADER_LIST_SIZE: s.max_header_list_size})
                   + h2.window_update(0, WINDOW - h2.DEFAULT_WINDOW))
        s.connections.add(self)
        s.stall.acquire()
        self._stall_held = True
        if s.max_connection_age_s is not None:
            self.age_timer = self.loop.call_later(s.max_connection_age_s, self.go_away)
        if s.handshake_timeout_s is not None:
            self.idle_timer = self.loop.call_later(s.handshake_timeout_s, self._timed_out, "handshake")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.linger_timer is not None:
            self.linger_timer.cancel()
        self._forget()

    def _forget(self) -> None:
        """Forget the connection's calls and timers (once closed by either side; idempotent)."""
        self.server.connections.discard(self)
        if self._stall_held:
            self._stall_held = False
            self.server.stall.release()
        for timer in (self.age_timer, self.idle_timer):
            if timer is not None:
                timer.cancel()
        self.age_timer = self.idle_timer = None
        for call in list(self.calls.values()):
            self._drop(call, cancelled=True)
        self.server.call_ended()

    def eof_received(self) -> bool | None:
        return None  # the client is done sending: close (our side too, if it is not closed already)

    def pause_writing(self) -> None:
        """The peer is not reading what we write: stop reading what it sends (PINGs, calls) meanwhile."""
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def _send(self, data: bytes) -> None:
        """Queue bytes for the socket; everything queued in one loop iteration leaves in one write.

        On loopback a send syscall also runs the receiver's TCP path, so one write per response cost
        more than the rest of a refusal (measured: half of the loop's time at 2,700 refusals/s)."""
        if not self._out:
            self.loop.call_soon(self._write_out)
        self._out.append(data)

    def _write_out(self) -> None:
        if self._out and self.transport is not None and not self.closed and not self.transport.is_closing():
            self.transport.write(b"".join(self._out))
        self._out.clear()

    # ---- receiving -----------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closed:  # lingering after our close: drop the input, within bounds
            self.linger_left -= len(data)
            if self.linger_left < 0 and self.transport is not None:
                self.transport.close()
            return
        try:
            self._receive(data)
        except H2Error as exc:
            self._connection_error(exc)
        except Exception as exc:  # noqa: BLE001 - a bug of ours must cost one connection, not the server
            log.warning("h2 %s: internal error, closing the connection: %s: %s", self.peer, type(exc).__name__, exc)
            self._connection_error(H2Error(ErrorCode.INTERNAL_ERROR, "internal error"), logged=True)
        now = time.perf_counter_ns()
        if fresh := self._fresh:  # requests that waited out a stall of the loop are timed from their arrival
            if (window := self.server.stall.window(self.last_read, now)) is not None and self.transport is not None:
                lo, hi = window
                last = last_arrival(self.transport.get_extra_info("socket"), now)
                for call, at in zip(fresh, spread(lo, hi if last is None else min(max(last, lo), now), len(fresh)), strict=True):
                    call.received_ns = min(call.received_ns, at)
            fresh.clear()
        self.last_read = now

    def _receive(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos = 0
        if not self.preface:
            if len(buf) < 24:
                self.buf = buf
                return
            if buf[:24] != h2.PREFACE:  # an HTTP/1 client or garbage: nothing gRPC can answer
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "expected the HTTP/2 preface")
            self.preface, pos = True, 24
        frames, pos, error = h2.split(buf, pos, h2.DEFAULT_MAX_FRAME)
        if not self.handshaken and frames and (frames[0][0] != _SETTINGS or frames[0][1] & _ACK):
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "the client's first frame is not its SETTINGS")
        self.run_frames(frames)
        if self.closed:
            return
        if error is not None:
            raise error
        self.buf = buf[pos:]

    def on_empty_frame(self, what: str) -> None:
        self._spend(self.empties, what)

    def on_block(self, sid: int, flags: int, block: bytes) -> None:
        call = self.calls.get(sid)
        new = call is None and sid > self.last_sid
        if new:
            if not sid & 1:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, f"a client opened even stream {sid}")
            self.last_sid = sid
        request = self.decoder.view(block, sid, _request)   # malformed: RST_STREAM, table in step
        if call is not None:  # trailers from the client: only END_STREAM matters
            if not flags & _END_STREAM:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "trailers without END_STREAM", sid)
            self._remote_end(call)
        elif new:
            self._open(sid, request, bool(flags & _END_STREAM))
        # else: a stream we already ended; decoded only to keep the HPACK table in step

    def _open(self, sid: int, request: Request, ended: bool) -> None:
        if (self.going_away is not None and sid > self.going_away) or len(self.calls) >= MAX_STREAMS:
            self._send(h2.rst_stream(sid, ErrorCode.REFUSED_STREAM))
            return
        path, grpc_type, timeout, encoding, metadata, problem = request
        if not path:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "a request without :path", sid)
        if not grpc_type:
            self._send(h2.headers(sid, _UNSUPPORTED_MEDIA_TYPE, self.peer_max_frame, True))
            return
        if problem:
            return self._trailers_only(sid, Status.INTERNAL, problem, ended=ended)
        handler = self.server.lookup(path, metadata)
        if handler is None:
            return self._trailers_only(sid, Status.UNIMPLEMENTED, f"Method not found: {path}", ended=ended)
        if self.server.admit is not None and (refusal := self.server.admit(path)) is not None:
            return self._trailers_only(sid, *refusal, ended=ended)  # refused before any per-call object exists
        if encoding and encoding not in SUPPORTED_ENCODINGS:
            return self._trailers_only(sid, Status.UNIMPLEMENTED, f"grpc-encoding {encoding} is not supported",
                                       ended=ended)
        self._start(sid, handler, metadata, timeout, encoding, ended)

    def _start(self, sid: int, handler: grpc.RpcMethodHandler, metadata: Metadata, timeout: float | None,
               encoding: str, ended: bool) -> None:
        call = Call(sid, self, handler, metadata, self.peer_window, timeout, STREAM_WINDOW, self.server.max_receive)
        self.pings.refund()
        call.encoding = encoding
        self.calls[sid] = call
        self._fresh.append(call)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if timeout is not None:
            call.timer = self.loop.call_later(timeout, self._expire, call)
        if handler.request_streaming:
            call.task = self.loop.create_task(self.server.run(call, Requests(call)))
        if ended:
            self._remote_end(call)

    def on_data(self, sid: int, flags: int, payload: bytes) -> None:
        if not sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        n = len(payload)
        self.recv_window -= n
        if self.recv_window < 0:
            raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self.recv_unacked += n
        if self.recv_unacked >= WINDOW // 2:   # the connection window comes back as data arrives (grpc-go)
            self._send(h2.window_update(0, self.recv_unacked))
            self.recv_window += self.recv_unacked
            self.recv_unacked = 0
        if not n and not flags & _END_STREAM:
            self.on_empty_frame("empty DATA frames")
        call = self.calls.get(sid)
        if call is None:
            if sid > self.last_sid:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a call we already ended: counted for the connection window, then dropped
        if call.remote_closed:
            raise H2Error(ErrorCode.STREAM_CLOSED, "DATA after END_STREAM", sid)
        call.recv_window -= n
        if call.recv_window < 0:
            raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the stream window", sid)
        data = h2.strip(_DATA, flags, payload) if flags & _PADDED else payload
        if not call.handler.request_streaming:
            self.consumed(call, n)  # a unary request is buffered whole anyway (bounded by the size limit)
        elif len(data) < n:
            self.consumed(call, n - len(data))  # padding is never read by anyone: give it back now
        self._take(call, data)
        if flags & _END_STREAM and not call.local_closed:
            self._remote_end(call)

    def _take(self, call: Call, payload: bytes) -> None:
        """Cut complete length-prefixed messages out of the call's DATA."""
        call.held += len(payload)
        self.held += len(payload)
        if self.held > MAX_HELD:
            return self.end(call, Status.RESOURCE_EXHAUSTED, f"over {MAX_HELD} request bytes held on the connection")
        try:
            messages = call.reader.feed(payload)
        except GrpcError as exc:
            return self.end(call, exc.status, exc.message)
        for flag, data in messages:
            self._message(call, flag, data)
            if call.local_closed:
                return None
        return None

    def _message(self, call: Call, flag: int, data: bytes) -> None:
        size = len(data)
        try:
            raw = decompress(data, call.encoding, self.server.max_receive) if flag else data
            deserialize = call.handler.request_deserializer
            message = deserialize(raw) if deserialize is not None else raw  # None: the handler takes bytes
        except GrpcError as exc:
            return self.end(call, exc.status, exc.message)
        except Exception as exc:  # noqa: BLE001 - the client sent bytes that are not the request type
            return self.end(call, Status.INTERNAL, f"cannot parse the request message: {type(exc).__name__}: {exc}")
        if call.handler.request_streaming:
            call.inbox.append((message, size + 5))
            call.wake()
        elif call.inbox:
            self.end(call, Status.UNIMPLEMENTED, "a unary call received a second request message")
        else:
            call.inbox.append((message, size + 5))
        return None

    def _remote_end(self, call: Call) -> None:
        call.remote_closed = True
        if call.handler.request_streaming:
            call.wake()
        elif not call.inbox:
            self.end(call, Status.UNIMPLEMENTED, "a unary call ended without a request message")
        else:
            self._release(call, call.held)  # the handler owns its request from here
            call.task = self.loop.create_task(self.server.run(call, call.inbox.popleft()[0]))

    def consumed(self, call: Call, n: int) -> None:
        """Give `n` bytes of the stream's window back once they have been taken."""
        call.recv_window += n
        call.unacked += n
        if call.handler.request_streaming:
            self._release(call, n)
        if call.unacked >= STREAM_WINDOW // 2 and not call.remote_closed and not self.closed:
            self._send(h2.window_update(call.sid, call.unacked))
            call.unacked = 0

    def _release(self, call: Call, n: int) -> None:
        n = min(n, call.held)
        call.held -= n
        self.held -= n

    def on_control(self, ftype: int, sid: int, flags: int, payload: bytes) -> None:
        if ftype == FrameType.SETTINGS:
            return self._on_settings(sid, flags, payload)
        if ftype > FrameType.CONTINUATION or ftype == FrameType.PRIORITY:
            h2.check_control(ftype, flags, sid, payload)
            return self.on_empty_frame("PRIORITY or unknown frames")
        h2.check_control(ftype, flags, sid, payload)
        if ftype == FrameType.WINDOW_UPDATE:
            self._on_window_update(sid, h2.U32.unpack(payload)[0] & h2.MAX_WINDOW)
        elif ftype == FrameType.PING:
            if not flags & Flag.ACK:
                self._spend(self.pings, "PING frames")
                self._send(h2.ping(payload, ack=True))
            elif payload == _SHUTDOWN_PING and self.going_away is None:
                self._final_goaway()
        elif ftype == FrameType.RST_STREAM:
            self._on_reset(sid)
        elif ftype == FrameType.GOAWAY:
            if not self.calls:
                self.close()
        elif ftype == FrameType.PUSH_PROMISE:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
        return None

    def _on_settings(self, sid: int, flags: int, payload: bytes) -> None:
        pairs = h2.parse_settings(flags, sid, payload)
        if flags & Flag.ACK:
            return
        if self.handshaken:
            self._spend(self.settings, "SETTINGS frames")
        else:
            self.handshaken = True
            self._arm_idle()
        for key, value in pairs:
            if key == Setting.INITIAL_WINDOW_SIZE:
                for call in self.calls.values():
                    call.window = h2.grow_window(call.window, value - self.peer_window, 0)
                self.peer_window = value
            elif key == Setting.MAX_FRAME_SIZE:
                self.peer_max_frame = value
        self._send(h2.SETTINGS_ACK)
        self._flush()

    def _on_window_update(self, sid: int, inc: int) -> None:
        if sid == 0:
            self.send_window = h2.grow_window(self.send_window, inc, 0)
        elif (call := self.calls.get(sid)) is not None:
            call.window = h2.grow_window(call.window, inc, sid)
        elif sid > self.last_sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
        self._flush()

    def _on_reset(self, sid: int) -> None:
        if sid > self.last_sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        call = self.calls.get(sid)
        if call is None:
            return
        # Still ours to answer: its work (a task queued for the model, maybe) is thrown away. bench/rapid_reset.py:
        # counting only resets of incomplete requests let HEADERS+DATA+RST floods through, 100,000 streams
        # for 2.9 s of CPU and 3.0 s p99 for the agent's other calls, never a GOAWAY (median of 3 runs).
        self._spend(self.resets, "streams reset before we answered them")
        self._drop(call, cancelled=True)

    def _spend(self, budget: Budget, what: str) -> None:
        if not budget.spend():
            raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, f"too many {what}")

    def on_stream_error(self, exc: H2Error) -> None:
        log.info("h2 %s: stream error: %s", self.peer, exc)
        self._send(h2.rst_stream(exc.stream, exc.code))
        call = self.calls.get(exc.stream)
        if call is not None:
            call.local_closed = True
            self._drop(call, cancelled=True)

    def _connection_error(self, exc: H2Error, logged: bool = False) -> None:
        if not logged:
            log.warning("h2 %s: closing the connection: %s", self.peer, exc)
        if not self.closed:
            self._send(h2.goaway(self.last_sid, exc.code, exc.why.encode()[:200]))
            self.close()

    # ---- sending -------------------------------------------------------------------------------------
    def respond(self, call: Call, payload: bytes, trailers: bytes = TRAILERS_OK) -> None:
        """A unary response and the call's end, in one write when the windows allow (they nearly always do)."""
        if call.local_closed:
            return
        n = len(payload) + 5
        if (call.headers_sent or self.blocked or n > self.send_window or n > call.window
                or n > self.peer_max_frame):
            self.send_message_nowait(call, payload)
            return self._close_local(call, trailers)
        self.send_window -= n
        call.window -= n
        call.headers_sent = True
        self._send(
            h2.frame(_HEADERS, _END_HEADERS, call.sid, RESPONSE_HEADERS)
            + h2.HEAD.pack(n >> 16, n & 0xFFFF, _DATA, 0, call.sid) + (n - 5).to_bytes(5, "big") + payload
            + h2.frame(_HEADERS, _END_HEADERS | _END_STREAM, call.sid, trailers))
        self._finished(call)

    def send_headers(self, call: Call, metadata: Metadata = ()) -> None:
        if call.headers_sent or call.local_closed or self.closed:
            return
        call.headers_sent = True
        block = RESPONSE_HEADERS + encode_block(metadata_out(metadata)) if metadata else RESPONSE_HEADERS
        self._send(h2.headers(call.sid, block, self.peer_max_frame, False))

    def send_message_nowait(self, call: Call, payload: bytes) -> None:
        self.send_headers(call)
        call.out += len(payload).to_bytes(5, "big") + payload  # flag 0 + 4-byte length
        if call not in self.blocked:
            self.blocked.append(call)
        self._flush()

    async def send_message(self, call: Call, payload: bytes) -> None:
        """Queue one response message; waits while the client's windows hold too much of it back."""
        if call.local_closed:
            raise asyncio.CancelledError()
        self.send_message_nowait(call, payload)
        while len(call.out) > HIGH_WATER and not call.local_closed:
            call.drained = self.loop.create_future()
            await call.drained

    def _flush(self) -> None:
        """Send held-back DATA in call order as far as the windows allow, then any trailers behind it."""
        if self.closed:
            return
        for _ in range(len(self.blocked)):
            call = self.blocked.popleft()
            n = min(len(call.out), self.send_window, call.window)
            if n > 0:
                self._send(h2.data_frames(call.sid, bytes(call.out[:n]), self.peer_max_frame))
                del call.out[:n]
                self.send_window -= n
                call.window -= n
            if call.out:
                self.blocked.append(call)
                continue
            if call.drained is not None and not call.drained.done():
                call.drained.set_result(None)
            if call.trailers is not None:
                self._send(h2.headers(call.sid, call.trailers, self.peer_max_frame, True))
                self._finished(call)

    def end(self, call: Call, code: int, message: str = "", metadata: Metadata = ()) -> None:
        """End the call with a status (after whatever it has already sent)."""
        if call.local_closed:
            return
        if not call.headers_sent and not call.out:
            call.headers_sent = True
            self._close_local(call, status_block(code, message, metadata, trailers_only=True))
        else:
            self._close_local(call, status_block(code, message, metadata))
        if call.task is not None and not call.task.done() and call.task is not asyncio.current_task():
            call.task.cancel()

    def _close_local(self, call: Call, trailers: bytes) -> None:
        call.local_closed = True
        call.wake()
        if call.out:
            call.trailers = trailers  # sent by _flush after the data
            return
        self._send(h2.headers(call.sid, trailers, self.peer_max_frame, True))
        self._finished(call)

    def _trailers_only(self, sid: int, code: int, message: str, metadata: Metadata = (), *, ended: bool) -> None:
        self._send(h2.headers(sid, status_block(code, message, metadata, trailers_only=True), self.peer_max_frame, True)
                   + (b"" if ended else h2.rst_stream(sid, ErrorCode.NO_ERROR)))

    def _finished(self, call: Call) -> None:
        """Our side is done: forget the call (telling the client to stop sending if it still is)."""
        call.local_closed = True
        if not call.remote_closed and not self.closed:
            self._send(h2.rst_stream(call.sid, ErrorCode.NO_ERROR))
        self.resets.refund()  # a call answered: a busy client's cancels (deadlines under overload) stay in budget
        self._drop(call, cancelled=False)

    def _drop(self, call: Call, cancelled: bool) -> None:
        if self.calls.pop(call.sid, None) is None:
            return
        call.local_closed = True
        self._release(call, call.held)
        if call.timer is not None:
            call.timer.cancel()
        if cancelled and call.task is not None and not call.task.done():
            call.task.cancel()
        if call.drained is not None and not call.drained.done():
            call.drained.set_result(None)
        call.wake()
        call.ctx.finished(cancelled)
        if not self.calls:
            if self.going_away is not None:
                self.close()
            self._arm_idle()
            self.server.call_ended()

    def _expire(self, call: Call) -> None:
        call.timer = None
        if not call.local_closed:
            self.end(call, Status.DEADLINE_EXCEEDED, "Deadline Exceeded")

    # ---- connection lifecycle -------------------------------------------------------------------------
    def _arm_idle(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        after = self.server.idle_timeout_s
        self.idle_timer = None if after is None or self.closed else self.loop.call_later(after, self._timed_out, "idle")

    def _timed_out(self, what: str) -> None:
        self.idle_timer = None
        if self.closed or self.calls:
            return
        if what == "handshake" and not self.handshaken:
            log.info("h2 %s: no HTTP/2 handshake within %ss, closing", self.peer, self.server.handshake_timeout_s)
            return self.close()
        if what == "idle":
            self._send(h2.goaway(self.last_sid, ErrorCode.NO_ERROR, b"idle"))
            self.close()

    def go_away(self) -> None:
        """Start a graceful close: no new calls once the client has seen GOAWAY; current ones finish."""
        if self.closed or self.going_away is not None:
            return
        self._send(h2.goaway(h2.MAX_STREAM_ID, ErrorCode.NO_ERROR) + h2.ping(_SHUTDOWN_PING))
        self.age_timer = self.loop.call_later(self.server.grace_s, self.close)  # a client that never answers

    def _final_goaway(self) -> None:
        self.going_away = self.last_sid
        self._send(h2.goaway(self.last_sid, ErrorCode.NO_ERROR))
        if not self.calls:
            self.close()

    def close(self) -> None:
        """Send what is queued, then FIN; linger (LINGER_S, LINGER_BYTES) on the client's input, then close."""
        transport = self.transport
        if self.closed or transport is None:
            return
        self._write_out()
        self.closed = True
        if transport.is_closing() or not transport.can_write_eof():
            transport.close()
        else:
            try:
                transport.write_eof()
            except OSError:  # the client is gone already (reset, not connected): nothing to linger for
                transport.close()
            else:
                transport.resume_reading()
                self.linger_timer = self.loop.call_later(LINGER_S, transport.close)
        self._forget()

    def cancel_all(self) -> None:
        for call in list(self.calls.values()):
            self.end(call, Status.UNAVAILABLE, "the server is shutting down")
        self.close()


Refusal = tuple[int, str, Metadata]  # gRPC code, message, trailing metadata
Admit = Callable[[str], Refusal | None]


class LeanServer:
    """The subset of grpc.aio.Server the agent uses: register servicers, bind, start, stop(grace).

    `admit(path)`, when given, runs as a call's headers arrive, before anything is allocated for it:
    a Refusal ends the call there (trailers only), which is what keeps refusing cheap under overload.
    `handshake_timeout_s`: a connection that has not sent the preface and SETTINGS by then is closed;
    `idle_timeout_s`: one with no call for that long gets GOAWAY(NO_ERROR) and is closed (None: never)."""

    def __init__(self, *, max_receive_message_length: int = 4 << 20, header_table_size: int = 4096,
                 max_connection_age_s: float | None = None, grace_s: float = 5.0, admit: Admit | None = None,
                 handshake_timeout_s: float | None = 10.0, idle_timeout_s: float | None = 600.0,
                 max_header_list_size: int = 1 << 16) -> None:
        self.admit = admit
        self.max_receive = max_receive_message_length
        self.header_table_size = header_table_size
        self.max_connection_age_s = max_connection_age_s
        self.grace_s = grace_s
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_header_list_size = max_header_list_size
        self.connections: set[Connection] = set()
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        self._generic: list[grpc.GenericRpcHandler] = []
        self._sockets: list[socket.socket] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._idle: asyncio.Event | None = None   # while a stop waits for the calls in flight
        self._resets: dict[str, Budget] = {}
        self.stall = LoopStall()  # the loop's stalls: the wait of requests not yet read (stall.py)

    # -- registration (what generated add_*_to_server() calls)
    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        for name, handler in handlers.items():
            self._handlers[f"/{service}/{name}"] = handler

    def lookup(self, path: str, metadata: Metadata) -> grpc.RpcMethodHandler | None:
        handler = self._handlers.get(path)
        if handler is None:
            details = _CallDetails(path, metadata)
            for generic in self._generic:
                if (handler := generic.service(details)) is not None:
                    break
        return handler

    # -- lifecycle
    def add_insecure_port(self, address: str) -> int:
        """Bind now (like grpc) and return the port; raises RuntimeError when it cannot."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port)))
            sock.listen(1024)
        except (OSError, ValueError) as exc:
            sock.close()
            raise RuntimeError(f"Failed to bind to address {address}: {exc}") from exc
        sock.setblocking(False)
        self._sockets.append(sock)
        return int(sock.getsockname()[1])

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self._sockets:
            self._servers.append(await loop.create_server(lambda: Connection(self), sock=sock))

    async def run(self, call: Call, request: Any) -> None:
        """Run one call's handler and end the call with its result or status."""
        handler, ctx, conn = call.handler, call.ctx, call.conn
        try:
            unary = handler.unary_unary or handler.stream_unary  # one response: answered in one write
            if unary is not None:
                response = await unary(request, ctx)
                if ctx.code() in (None, grpc.StatusCode.OK):
                    trailing = ctx.trailing_metadata()
                    return conn.respond(call, call.serialize(response),
                                        status_block(0, ctx.details(), trailing) if trailing else TRAILERS_OK)
            else:
                behavior = handler.unary_stream or handler.stream_stream
                result = behavior(request, ctx)
                if hasattr(result, "__anext__"):
                    async for response in result:
                        await conn.send_message(call, call.serialize(response))
                else:
                    await result
        except Abort:
            pass
        except asyncio.CancelledError:
            if call.local_closed:
                return  # ended on purpose (deadline, client reset, shutdown): the status is out already
            raise
        except Exception as exc:  # noqa: BLE001 - a handler bug becomes UNKNOWN, as grpc does
            if ctx.code() in (None, grpc.StatusCode.OK):
                ctx.set_code(grpc.StatusCode.UNKNOWN)
                ctx.set_details(f"Unexpected error in RPC handling: {exc!r}")
        code = ctx.code()
        conn.end(call, code.value[0] if code is not None else 0, ctx.details(), ctx.trailing_metadata())

    def call_ended(self) -> None:
        """A connection has no call left. Only a stop waits for that: a scan of every connection after each
        rapid-reset stream was 8% of the agent's time under bench/rapid_reset.py (cProfile)."""
        if self._idle is not None and not any(c.calls for c in self.connections):
            self._idle.set()

    def reset_budget(self, host: str) -> Budget:
        """The budget for streams reset before we answered them, of every connection from `host`: an attacker
        cut off with ENHANCE_YOUR_CALM that reconnects finds it as empty as it left it."""
        budget = self._resets.get(host)
        if budget is None:
            if len(self._resets) >= MAX_PEERS:  # forget the peers whose buckets have refilled: nothing to recall
                kept = {h: b for h, b in self._resets.items() if b.available() < b.burst}
                self._resets = kept if len(kept) < MAX_PEERS // 2 else {}  # amortised: never a scan per connection
            budget = self._resets[host] = Budget(*RESET_BUDGET)
        return budget

    async def stop(self, grace: float | None) -> None:
        """Stop accepting; let calls finish within `grace` seconds (None: at once), then cancel the rest."""
        for srv in self._servers:
            srv.close()
        for conn in list(self.connections):
            conn.go_away()
        if grace and self._servers:
            self._idle = asyncio.Event()
            self.call_ended()
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except TimeoutError:
                pass
        for conn in list(self.connections):
            conn.cancel_all()
        for srv in self._servers:
            await srv.wait_closed()
        self._servers.clear()
        self._sockets.clear()


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, metadata: Metadata) -> None:
        self.method, self.invocation_metadata = method, metadata
