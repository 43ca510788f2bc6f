"""A lean gRPC server: HTTP/2 cleartext (prior knowledge, as gRPC speaks it) on the running asyncio loop.

Why it exists: grpcio's Python server spends ~400 us of CPU on every unary call on this 2-core machine
(an echo servicer), more than the agent's whole pipeline, so the agent could neither reach its target
rate nor refuse calls cheaply under overload. This server parses frames straight out of the receive
buffer, answers a unary call with one write (cached HEADERS block + DATA + cached trailers) and keeps
no per-call objects beyond the call itself. `--server grpcio` keeps grpc.aio for comparison.

    socket --data_received--> frames --HEADERS--> Call (handler by :path; unknown: UNIMPLEMENTED)
                                     --DATA-----> messages --unary: task(handler(request, ctx))
                                                          --client stream: Call.inbox -> Requests
    handler result --> respond(): HEADERS + DATA + trailers, within the client's flow-control windows

It hosts ordinary grpc.aio servicers: generated `add_*_to_server()` functions register through
add_generic_rpc_handlers / add_registered_method_handlers, and each handler gets an h2call.Context.
Flow control: the connection window is given back as data arrives; a stream's window as its messages are
consumed, so a slow streaming handler holds its client back instead of growing our memory.
Shutdown: GOAWAY(2^31-1) + PING, then GOAWAY(last stream seen) once the PING returns; in-flight calls
finish within the grace period, then are cancelled.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import grpc
import hpack

from agent_under_test import h2wire as w
from agent_under_test.h2call import Abort, Call, Requests

WINDOW = 1 << 24          # connection receive window we advertise
STREAM_WINDOW = 1 << 20   # per-stream receive window (a streaming handler's unread backlog is bounded by it)
MAX_STREAMS = 4096        # concurrent calls per connection; beyond: REFUSED_STREAM (retryable)
HIGH_WATER = 1 << 16      # a streaming writer waits while more than this is held back by flow control
_SHUTDOWN_PING = b"shutdown"
_UNAVAILABLE, _INTERNAL, _UNIMPLEMENTED, _UNKNOWN = 14, 13, 12, 2
_CANCELLED, _DEADLINE, _RESOURCE_EXHAUSTED = 1, 4, 8
_RESERVED = frozenset({"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding",
                       "user-agent", "grpc-message-type"})


class Connection(asyncio.Protocol):
    """One client connection: its frames, calls and flow control."""

    def __init__(self, server: LeanServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer = "unknown"
        self.calls: dict[int, Call] = {}
        self.last_sid = 0
        self.buf = b""
        self.preface = False
        self.closed = False
        self.going_away: int | None = None      # the last stream id we still serve, once GOAWAY is final
        self.decoder = hpack.Decoder()
        self.decoder.max_allowed_table_size = server.header_table_size
        self.decoder.max_header_list_size = 1 << 20
        self._decoded: dict[bytes, tuple[tuple[int, int], list[tuple[str, str]]]] = {}
        self._adds = 0
        self._count_adds()
        self._partial: tuple[int, int, list[bytes]] | None = None
        self.peer_window, self.peer_max_frame = 65535, 16384
        self.send_window = 65535
        self.recv_unacked = 0
        self.blocked: deque[Call] = deque()      # calls with DATA held back by flow control
        self.age_timer: asyncio.TimerHandle | None = None
        self._out: list[bytes] = []             # frames written in this loop iteration, sent together

    # ---- asyncio Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = f"ipv6:[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"ipv4:{peer[0]}:{peer[1]}"
        s = self.server
        self._send(w.settings({w.MAX_CONCURRENT_STREAMS: MAX_STREAMS, w.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                               w.HEADER_TABLE_SIZE: s.header_table_size, w.ENABLE_PUSH: 0,
                               w.MAX_HEADER_LIST_SIZE: 1 << 20})
                   + w.frame(w.WINDOW_UPDATE, 0, 0, w.U32.pack(WINDOW - 65535)))
        s.connections.add(self)
        if s.max_connection_age_s is not None:
            self.age_timer = self.loop.call_later(s.max_connection_age_s, self.go_away)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.age_timer is not None:
            self.age_timer.cancel()
        for call in list(self.calls.values()):
            self._drop(call, cancelled=True)
        self.server.call_ended()

    def _send(self, data: bytes) -> None:
        """Queue bytes for the socket; everything queued in one loop iteration leaves in one write.

        On loopback a send syscall also runs the receiver's TCP path, so one write per response cost
        more than the rest of a refusal (measured: half of the loop's time at 2,700 refusals/s)."""
        if not self._out:
            self.loop.call_soon(self._write_out)
        self._out.append(data)

    def _write_out(self) -> None:
        if self._out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self._out))
        self._out.clear()

    # ---- receiving -----------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, size = 0, len(buf)
        if not self.preface:
            if size < 24:
                self.buf = buf
                return
            if buf[:24] != w.PREFACE:  # an HTTP/1 client or garbage: nothing gRPC can answer
                self._send(w.goaway(0, w.PROTOCOL_ERROR, b"expected the HTTP/2 preface"))
                self.close()
                return
            self.preface, pos = True, 24
        while size - pos >= 9:
            hi, lo, ftype, flags, sid = w.HEAD.unpack_from(buf, pos)
            end = pos + 9 + (hi << 16 | lo)
            if end > size:
                break
            payload = buf[pos + 9:end]
            pos = end
            sid &= 0x7FFFFFFF
            if ftype == w.DATA:
                self._on_data(sid, flags, payload)
            elif ftype == w.HEADERS or ftype == w.CONTINUATION:
                self._on_headers(ftype, sid, flags, payload)
            else:
                self._on_control(ftype, sid, flags, payload)
            if self.closed:
                return
        self.buf = buf[pos:]

    def _on_headers(self, ftype: int, sid: int, flags: int, payload: bytes) -> None:
        if ftype == w.HEADERS:
            if flags & w.PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & w.PRIORITY_FLAG:
                payload = payload[5:]
            self._partial = (sid, flags, [payload])
        elif self._partial is None or self._partial[0] != sid:
            return self._protocol_error("CONTINUATION without HEADERS")
        else:
            self._partial[2].append(payload)
        if not flags & w.END_HEADERS:
            return None
        sid, first, parts = self._partial
        self._partial = None
        try:
            fields = self._decode(b"".join(parts))
        except hpack.HPACKError as exc:
            return self._protocol_error(f"cannot decode request headers: {exc}", error=0x9)
        call = self.calls.get(sid)
        if call is not None:  # trailers from the client: only END_STREAM matters
            if first & w.END_STREAM:
                self._remote_end(call)
            return None
        if sid <= self.last_sid or not sid & 1:
            return None if sid <= self.last_sid else self._protocol_error(f"bad stream id {sid}")
        self.last_sid = sid
        self._open(sid, fields, bool(first & w.END_STREAM))
        return None

    def _open(self, sid: int, fields: list[tuple[str, str]], ended: bool) -> None:
        if (self.going_away is not None and sid > self.going_away) or len(self.calls) >= MAX_STREAMS:
            self._send(w.frame(w.RST_STREAM, 0, sid, w.U32.pack(w.REFUSED_STREAM)))
            return
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
                timeout = w.parse_timeout(v)
            elif k == "grpc-encoding":
                encoding = v
            elif k not in _RESERVED:
                extra.append((k, v))
        metadata = tuple(extra)
        if not ctype.startswith("application/grpc"):
            self._send(w.headers(sid, w.block([(":status", "415")]), self.peer_max_frame, True))
            return
        handler = self.server.lookup(path, metadata)
        if handler is None:
            self._trailers_only(sid, _UNIMPLEMENTED, f"Method not found: {path}", ended=ended)
            return
        if self.server.admit is not None and (refusal := self.server.admit(path)) is not None:
            self._trailers_only(sid, *refusal, ended=ended)  # refused before any per-call object exists
            return
        if encoding not in ("", "identity", "gzip"):
            self._trailers_only(sid, _UNIMPLEMENTED, f"grpc-encoding {encoding} is not supported", ended=ended)
            return
        call = Call(sid, self, handler, metadata, self.peer_window, timeout)
        self.calls[sid] = call
        if timeout is not None:
            call.timer = self.loop.call_later(timeout, self._expire, call)
        if handler.request_streaming:
            call.task = self.loop.create_task(self.server.run(call, Requests(call)))
        if ended:
            self._remote_end(call)

    def _on_data(self, sid: int, flags: int, payload: bytes) -> None:
        n = len(payload)
        self.recv_unacked += n
        if self.recv_unacked >= WINDOW // 2:
            self._send(w.frame(w.WINDOW_UPDATE, 0, 0, w.U32.pack(self.recv_unacked)))
            self.recv_unacked = 0
        call = self.calls.get(sid)
        if call is None or call.remote_closed:
            return  # a call we already ended: counted for the connection window, then dropped
        if flags & w.PADDED:
            payload = payload[1:n - payload[0]]
        if not call.handler.request_streaming:
            self.consumed(call, n)  # a unary request is buffered whole anyway (bounded by the size limit)
        self._take(call, payload)
        if flags & w.END_STREAM and not call.local_closed:
            self._remote_end(call)

    def _take(self, call: Call, payload: bytes) -> None:
        """Cut complete length-prefixed messages out of the call's DATA."""
        if call.buf is None and len(payload) >= 5 and len(payload) == 5 + int.from_bytes(payload[1:5], "big"):
            self._message(call, payload[0], payload[5:])  # the usual case: one whole message in one frame
            return
        buf = call.buf = (call.buf or bytearray()) + payload
        while len(buf) >= 5 and not call.local_closed:
            size = int.from_bytes(buf[1:5], "big")
            if size > self.server.max_receive:
                self._message(call, buf[0], b"", size)  # refused before it is buffered whole
                return
            if len(buf) < 5 + size:
                break
            self._message(call, buf[0], bytes(buf[5:5 + size]))
            del buf[:5 + size]
        if not buf:
            call.buf = None

    def _message(self, call: Call, flag: int, data: bytes, size: int | None = None) -> None:
        size = len(data) if size is None else size
        if size > self.server.max_receive:
            return self.end(call, _RESOURCE_EXHAUSTED,
                            f"Received message larger than max ({size} vs. {self.server.max_receive})")
        try:
            raw = gzip.decompress(data) if flag else data
            deserialize = call.handler.request_deserializer
            message = deserialize(raw) if deserialize is not None else raw  # None: the handler takes bytes
        except Exception as exc:  # noqa: BLE001 - the client sent bytes that are not the request type
            return self.end(call, _INTERNAL, f"cannot parse the request message: {type(exc).__name__}: {exc}")
        if call.handler.request_streaming:
            call.inbox.append((message, size + 5))
            call.wake()
        elif call.inbox:
            self.end(call, _UNIMPLEMENTED, "a unary call received a second request message")
        else:
            call.inbox.append((message, size + 5))
        return None

    def _remote_end(self, call: Call) -> None:
        call.remote_closed = True
        if call.handler.request_streaming:
            call.wake()
        elif not call.inbox:
            self.end(call, _UNIMPLEMENTED, "a unary call ended without a request message")
        else:
            call.task = self.loop.create_task(self.server.run(call, call.inbox.popleft()[0]))

    def consumed(self, call: Call, n: int) -> None:
        """Give `n` bytes of the stream's window back once they have been taken."""
        call.unacked += n
        if call.unacked >= STREAM_WINDOW // 2 and not call.remote_closed and not self.closed:
            self._send(w.frame(w.WINDOW_UPDATE, 0, call.sid, w.U32.pack(call.unacked)))
            call.unacked = 0

    def _on_control(self, ftype: int, sid: int, flags: int, payload: bytes) -> None:
        if ftype == w.SETTINGS and not flags & w.ACK:
            self._apply_settings(payload)
            self._send(w.frame(w.SETTINGS, w.ACK, 0))
        elif ftype == w.WINDOW_UPDATE:
            inc = w.U32.unpack(payload)[0] & 0x7FFFFFFF
            if sid == 0:
                self.send_window += inc
            elif (call := self.calls.get(sid)) is not None:
                call.window += inc
            self._flush()
        elif ftype == w.PING:
            if not flags & w.ACK:
                self._send(w.frame(w.PING, w.ACK, 0, payload))
            elif payload == _SHUTDOWN_PING and self.going_away is None:
                self._final_goaway()
        elif ftype == w.RST_STREAM:
            if (call := self.calls.get(sid)) is not None:
                self._drop(call, cancelled=True)
        elif ftype == w.GOAWAY:
            if not self.calls:
                self.close()
        elif ftype == w.PUSH_PROMISE:
            self._protocol_error("a client sent PUSH_PROMISE")

    def _apply_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            key, value = w.SETTING.unpack_from(payload, i)
            if key == w.INITIAL_WINDOW_SIZE:
                for call in self.calls.values():
                    call.window += value - self.peer_window
                self.peer_window = value
            elif key == w.MAX_FRAME_SIZE:
                self.peer_max_frame = value
        self._flush()

    # ---- sending -------------------------------------------------------------------------------------
    def respond(self, call: Call, payload: bytes, trailers: bytes = w.TRAILERS_OK) -> None:
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
            w.frame(w.HEADERS, w.END_HEADERS, call.sid, w.RESPONSE_HEADERS)
            + w.HEAD.pack(n >> 16, n & 0xFFFF, w.DATA, 0, call.sid) + (n - 5).to_bytes(5, "big") + payload
            + w.frame(w.HEADERS, w.END_HEADERS | w.END_STREAM, call.sid, trailers))
        self._finished(call)

    def send_headers(self, call: Call, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        if call.headers_sent or call.local_closed or self.closed:
            return
        call.headers_sent = True
        block = w.RESPONSE_HEADERS + w.block(metadata) if metadata else w.RESPONSE_HEADERS
        self._send(w.headers(call.sid, block, self.peer_max_frame, False))

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
                self._send(w.data_frames(call.sid, bytes(call.out[:n]), self.peer_max_frame))
                del call.out[:n]
                self.send_window -= n
                call.window -= n
            if call.out:
                self.blocked.append(call)
                continue
            if call.drained is not None and not call.drained.done():
                call.drained.set_result(None)
            if call.trailers is not None:
                self._send(w.headers(call.sid, call.trailers, self.peer_max_frame, True))
                self._finished(call)

    def end(self, call: Call, code: int, message: str = "", metadata: tuple[tuple[str, str], ...] = ()) -> None:
        """End the call with a status (after whatever it has already sent)."""
        if call.local_closed:
            return
        if not call.headers_sent and not call.out:
            call.headers_sent = True
            self._close_local(call, w.status_block(code, message, metadata, trailers_only=True))
        else:
            self._close_local(call, w.status_block(code, message, metadata))
        if call.task is not None and not call.task.done() and call.task is not asyncio.current_task():
            call.task.cancel()

    def _close_local(self, call: Call, trailers: bytes) -> None:
        call.local_closed = True
        call.wake()
        if call.out:
            call.trailers = trailers  # sent by _flush after the data
            return
        self._send(w.headers(call.sid, trailers, self.peer_max_frame, True))
        self._finished(call)

    def _trailers_only(self, sid: int, code: int, message: str, metadata: tuple[tuple[str, str], ...] = (),
                       *, ended: bool) -> None:
        self._send(w.headers(sid, w.status_block(code, message, metadata, trailers_only=True), self.peer_max_frame, True)
                   + (b"" if ended else w.frame(w.RST_STREAM, 0, sid, w.U32.pack(w.NO_ERROR))))

    def _finished(self, call: Call) -> None:
        """Our side is done: forget the call (telling the client to stop sending if it still is)."""
        call.local_closed = True
        if not call.remote_closed and not self.closed:
            self._send(w.frame(w.RST_STREAM, 0, call.sid, w.U32.pack(w.NO_ERROR)))
        self._drop(call, cancelled=False)

    def _drop(self, call: Call, cancelled: bool) -> None:
        if self.calls.pop(call.sid, None) is None:
            return
        call.local_closed = True
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
            self.server.call_ended()

    def _expire(self, call: Call) -> None:
        call.timer = None
        if not call.local_closed:
            self.end(call, _DEADLINE, "Deadline Exceeded")

    # ---- connection lifecycle -------------------------------------------------------------------------
    def go_away(self) -> None:
        """Start a graceful close: no new calls once the client has seen GOAWAY; current ones finish."""
        if self.closed or self.going_away is not None:
            return
        self._send(w.goaway(0x7FFFFFFF, w.NO_ERROR) + w.frame(w.PING, 0, 0, _SHUTDOWN_PING))
        self.age_timer = self.loop.call_later(self.server.grace_s, self.close)  # a client that never answers

    def _final_goaway(self) -> None:
        self.going_away = self.last_sid
        self._send(w.goaway(self.last_sid, w.NO_ERROR))
        if not self.calls:
            self.close()

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self._write_out()
            self.closed = True
            self.transport.close()

    def cancel_all(self) -> None:
        for call in list(self.calls.values()):
            self.end(call, _UNAVAILABLE, "the server is shutting down")
        self.close()

    def _protocol_error(self, why: str, error: int = w.PROTOCOL_ERROR) -> None:
        if not self.closed:
            self._send(w.goaway(self.last_sid, error, why.encode()[:200]))
            self.close()

    def _decode(self, block: bytes) -> list[tuple[str, str]]:
        """Decode through the connection's decoder; memoised when the block changed nothing in its table
        (a client's repeated request headers, once they sit in the dynamic table)."""
        table = self.decoder.header_table
        state = (self._adds, table.maxsize)
        hit = self._decoded.get(block)
        if hit is not None and hit[0] == state:
            return hit[1]
        fields = cast(list[tuple[str, str]], self.decoder.decode(block))
        if (self._adds, table.maxsize) == state:
            if len(self._decoded) >= 256:
                self._decoded.clear()
            self._decoded[block] = (state, fields)
        return fields

    def _count_adds(self) -> None:
        table, add = self.decoder.header_table, self.decoder.header_table.add

        def counted_add(name: bytes, value: bytes) -> None:
            self._adds += 1
            add(name, value)
        table.add = counted_add  # type: ignore[method-assign]


Refusal = tuple[int, str, tuple[tuple[str, str], ...]]  # gRPC code, message, trailing metadata
Admit = Callable[[str], Refusal | None]


class LeanServer:
    """The subset of grpc.aio.Server the agent uses: register servicers, bind, start, stop(grace).

    `admit(path)`, when given, runs as a call's headers arrive, before anything is allocated for it:
    a Refusal ends the call there (trailers only), which is what keeps refusing cheap under overload."""

    def __init__(self, *, max_receive_message_length: int = 4 << 20, header_table_size: int = 4096,
                 max_connection_age_s: float | None = None, grace_s: float = 5.0, admit: Admit | None = None) -> None:
        self.admit = admit
        self.max_receive = max_receive_message_length
        self.header_table_size = header_table_size
        self.max_connection_age_s = max_connection_age_s
        self.grace_s = grace_s
        self.connections: set[Connection] = set()
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        self._generic: list[grpc.GenericRpcHandler] = []
        self._sockets: list[socket.socket] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._idle: asyncio.Event | None = None

    # -- registration (what generated add_*_to_server() calls)
    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        for name, handler in handlers.items():
            self._handlers[f"/{service}/{name}"] = handler

    def lookup(self, path: str, metadata: tuple[tuple[str, str], ...]) -> grpc.RpcMethodHandler | None:
        handler = self._handlers.get(path)
        if handler is None:
            details = _CallDetails(path, metadata)
            for generic in self._generic:
                if (handler := generic.service(details)) is not None:  # type: ignore[arg-type]
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
        self._idle = asyncio.Event()
        for sock in self._sockets:
            self._servers.append(await loop.create_server(lambda: Connection(self), sock=sock))

    async def run(self, call: Call, request: Any) -> None:
        """Run one call's handler and end the call with its result or status."""
        handler, ctx, conn = call.handler, call.ctx, call.conn
        try:
            unary = handler.unary_unary or handler.stream_unary  # one response: answered in one write
            if unary is not None:
                response = await unary(request, ctx)
                if ctx._code is None or ctx._code == grpc.StatusCode.OK:
                    return conn.respond(call, call.serialize(response),
                                        w.status_block(0, ctx._details, ctx._trailing) if ctx._trailing
                                        else w.TRAILERS_OK)
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
            if ctx._code is None or ctx._code == grpc.StatusCode.OK:
                ctx._code, ctx._details = grpc.StatusCode.UNKNOWN, f"Unexpected error in RPC handling: {exc!r}"
        code = ctx._code.value[0] if ctx._code is not None else 0
        conn.end(call, code, ctx._details, ctx._trailing)

    def call_ended(self) -> None:
        if self._idle is not None and not any(c.calls for c in self.connections):
            self._idle.set()

    async def stop(self, grace: float | None) -> None:
        """Stop accepting; let calls finish within `grace` seconds (None: at once), then cancel the rest."""
        for srv in self._servers:
            srv.close()
        for conn in list(self.connections):
            conn.go_away()
        if grace and self._idle is not None:
            self._idle.clear()
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
    def __init__(self, method: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method, self.invocation_metadata = method, metadata

