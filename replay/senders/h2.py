"""The lean h2 sender ("h2"): gRPC, and plain HTTP/2, on a plain asyncio Protocol, without grpcio.

The replayer already holds each call's raw request bytes, so it needs none of grpcio's machinery
(channels, call objects, serializers, the C-core completion queue): a unary call here is one cached
header block plus one DATA frame written straight to the socket, and one parsed response. Outcomes
and codes map exactly as the grpc sender's do (ok, RESOURCE_EXHAUSTED -> rejected, DEADLINE_EXCEEDED
-> timeout, UNAVAILABLE/connection loss -> connection_error, other codes -> error by name). All four
call kinds are supported; each streamed request message goes out when the engine releases it.

Plain HTTP/2 calls (protocol "http2": recorded requests that were not gRPC) go out as recorded: HEADERS
with :method and :path from the recorded "VERB /path" (a method map's bare path takes the recorded
:method), :scheme, :authority the target's (or --server-name's, as the http1 sender's Host), the recorded
end-to-end headers through the same header policy as HTTP/1 (`replayable_metadata(..., "http2")`) and
content-length; then the recorded body raw (no gRPC prefix) with END_STREAM, or END_STREAM on the HEADERS
when there is none. The outcome is the HTTP status's, exactly as the http1 sender reports it
(`senders.base.http_outcome`): 2xx/3xx ok, 429 rejected, others error "HTTP_<status>"; `responses` is
the body. Its transport failures are in the http1 sender's words too: TIMEOUT, CONNECTION, no status.

Cleartext (h2c, prior knowledge) by default; with `tls` over TLS with ALPN h2 (a server that does not
choose h2 fails every call with a one-line reason, as does a failed handshake: "TLS: ...").

Limits: no request compression (a compressed recorded
message is sent decompressed, as the grpc sender does); no retries; one FIFO for flow-control-blocked
data per connection (a stream waiting for its own window holds back later DATA on that connection).
"""

from __future__ import annotations

import asyncio
import gzip
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

from replay.schedule import PlannedCall, PlannedMessage
from replay.senders.base import ERROR, SendOutcome, replayable_metadata
from replay.senders.h2conn import MAX_RECEIVE_MESSAGE, REFUSED, WINDOW, H2Connection, Stream
from replay.senders.h2frames import connection_failed, http_request_block, outcome, request_block
from replay.senders.headers import HeaderPolicy
from replay.senders.tls import TlsConfig, describe
from wire.status import Status

_REFUSED_RETRIES = 3
_PLAIN = "http2"  # a call's protocol when it is plain HTTP/2, not gRPC
_MAX_BLOCKS = 4096  # cached header blocks, per kind: recordings may carry unique metadata per call


def _wire(m: PlannedMessage) -> bytes:
    data = m.data
    if m.compressed:
        try:
            data = gzip.decompress(data)
        except OSError:
            pass
    return b"\x00" + len(data).to_bytes(4, "big") + data  # the gRPC length prefix, uncompressed


def _body(messages: list[PlannedMessage]) -> bytes:
    """A plain HTTP/2 request's body: recorded whole as one message (none without a body)."""
    return messages[0].data if len(messages) == 1 else b"".join(m.data for m in messages)


# A plain call's transport failures as the http1 sender names them (no gRPC status number: not an HTTP one).
_HTTP_CODES = {"DEADLINE_EXCEEDED": "TIMEOUT", "UNAVAILABLE": "CONNECTION"}


def _as_http(out: SendOutcome) -> SendOutcome:
    """`out` of a plain HTTP/2 call: an HTTP status stays; a failure the connection reported in gRPC's
    terms (deadline, connection lost or refused, cancelled) is said as the http1 sender says it."""
    if out.code is None or out.code == "OK" or out.code.startswith("HTTP_") or out.status is None:
        return out
    return SendOutcome(out.outcome, _HTTP_CODES.get(out.code, out.code), None, out.responses, out.detail)


def _request_line(planned: PlannedCall, body: bytes) -> tuple[str, str]:
    """(verb, path) of a plain call: its recorded "VERB /path", or for a bare path (named by a method
    map) the recorded :method, else what a client would use for such a body."""
    verb, _, path = (planned.method or "/").partition(" ")
    if path:
        return verb, path
    recorded = next((v for k, v in planned.metadata if k == ":method"), None)
    return recorded or ("POST" if body else "GET"), verb


class _Started:
    """A call sent by `H2Sender.start`: its stream, or the retry task after the server refused it."""

    __slots__ = ("sender", "conn", "planned", "payload", "deadline", "done", "st", "retry")

    def __init__(self, sender: H2Sender, conn: H2Connection, planned: PlannedCall, payload: bytes,
                 deadline: float, done: Callable[[SendOutcome], None]) -> None:
        self.sender, self.conn, self.planned, self.payload = sender, conn, planned, payload
        self.deadline = deadline
        self.done: Callable[[SendOutcome], None] | None = done  # None once reported
        self.st: Stream | None = None
        self.retry: asyncio.Task[SendOutcome] | None = None

    def end(self, out: SendOutcome) -> None:
        """The stream's outcome. Refused (rare): retry on the task path within the deadline."""
        loop = self.conn.loop
        if out.detail == REFUSED and self.done is not None and loop.time() < self.deadline:
            block = self.sender._block(self.planned, self.deadline - loop.time(), self.payload)
            http = self.planned.protocol == _PLAIN
            self.retry = loop.create_task(self.sender._unary(self.conn, block, self.payload, self.deadline, http))
            self.retry.add_done_callback(self._retried)
            return
        self._report(out)

    def _retried(self, task: asyncio.Task[SendOutcome]) -> None:
        if task.cancelled():
            return  # cancel() reported it
        exc = task.exception()
        self._report(task.result() if exc is None else SendOutcome(ERROR, type(exc).__name__, detail=str(exc)))

    def _report(self, out: SendOutcome) -> None:
        done, self.done = self.done, None
        if done is not None:
            done(_as_http(out) if self.planned.protocol == _PLAIN else out)

    def cancel(self) -> None:
        """Abandon the call: reset its stream (or stop its retry); `done` gets a CANCELLED outcome."""
        if self.retry is not None:
            self.retry.cancel()
        elif self.st is not None:
            self.conn.cancel(self.st, outcome(Status.CANCELLED, "cancelled"))
        self._report(outcome(Status.CANCELLED, "cancelled"))  # no-op when the stream's end already reported


class H2Sender:
    """Replays gRPC and plain HTTP/2 calls to `target` ("host:port") over its own HTTP/2 connections.

    Args:
        target: "host:port" (IPv6 as "[::1]:port").
        share_connection: one connection for all recorded connections (default: one each).
        max_receive_message_length: the largest response message accepted, after decompression, and
            the most one call's responses may hold in all (default 64 MiB, as the grpc sender); over
            it the call ends RESOURCE_EXHAUSTED and its stream is reset.
        window: the HTTP/2 receive window advertised for each stream and the connection (16 MiB).
        tls: a TlsConfig to speak TLS (ALPN h2), None for cleartext. headers: the HeaderPolicy.
    A connection that is lost, refused or told GOAWAY is replaced by a new one for later calls.
    """

    def __init__(self, target: str, *, share_connection: bool = False,
                 max_receive_message_length: int = MAX_RECEIVE_MESSAGE, window: int = WINDOW,
                 tls: TlsConfig | None = None, headers: HeaderPolicy | None = None, **_: object) -> None:
        host, port = target.rsplit(":", 1)
        self.max_receive_message_length, self.window = max_receive_message_length, window
        self.target, self.host, self.port = target, host.strip("[]"), int(port)
        self.policy = headers
        self.ssl: ssl.SSLContext | None = tls.context(alpn=("h2",)) if tls else None
        self.server_name = tls.name_for(self.host) if tls else self.host
        self.authority = f"{tls.server_name}:{self.port}" if tls and tls.server_name else target
        self.scheme = "https" if tls else "http"
        self.tls_hint = "; does it require a client certificate (--cert, --key)?" if tls and not tls.cert else ""
        self.share = share_connection
        self._conns: dict[str, H2Connection] = {}
        self._all: set[H2Connection] = set()
        self._connecting: set[asyncio.Task[None]] = set()
        self._blocks: dict[tuple[str, tuple[tuple[str, str], ...], float], bytes] = {}
        self._http_blocks: dict[tuple[str, tuple[tuple[str, str], ...], int], bytes] = {}

    def _conn(self, connection: str) -> H2Connection:
        key = "shared" if self.share else connection
        conn = self._conns.get(key)
        if conn is None or not conn.usable:
            loop = asyncio.get_running_loop()
            conn = self._conns[key] = H2Connection(loop, max_receive_message_length=self.max_receive_message_length,
                                                   window=self.window)
            conn.server_name, conn.tls_hint = self.server_name, self.tls_hint
            self._all = {c for c in self._all if not c.closed}
            self._all.add(conn)
            task = loop.create_task(self._connect(conn))  # held: the loop keeps only weak references
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)
        return conn

    async def _connect(self, conn: H2Connection) -> None:
        try:
            if self.ssl is None:
                await conn.loop.create_connection(lambda: conn, self.host, self.port)
            else:
                await conn.loop.create_connection(lambda: conn, self.host, self.port, ssl=self.ssl,
                                                  server_hostname=self.server_name)
        except ssl.SSLError as exc:  # an OSError too: say it was TLS, and for which name
            conn.connect_failed(exc, describe(exc, self.server_name, "h2"))
        except OSError as exc:
            conn.connect_failed(exc)

    def prepare(self, connection: str) -> asyncio.Future[bool]:
        """Start connecting now (non-blocking), ahead of the first call; the future resolves when
        the connection is ready (True) or has failed (False)."""
        return self._conn(connection).ready

    def _block(self, planned: PlannedCall, timeout: float, body: bytes = b"") -> bytes:
        """The call's request header block (cached): gRPC's, or a plain call's for `body`."""
        if planned.protocol == _PLAIN:
            return self._http_block(planned, body)
        key = (planned.method or "", tuple(planned.metadata), timeout)
        block = self._blocks.get(key)
        if block is None:
            if len(self._blocks) >= _MAX_BLOCKS:
                self._blocks.clear()
            md = tuple(replayable_metadata(planned.metadata, self.policy))
            block = self._blocks[key] = request_block(key[0], self.authority, md, timeout, self.scheme)
        return block

    def _http_block(self, planned: PlannedCall, body: bytes) -> bytes:
        key = (planned.method or "", tuple(planned.metadata), len(body))
        block = self._http_blocks.get(key)
        if block is None:
            if len(self._http_blocks) >= _MAX_BLOCKS:
                self._http_blocks.clear()
            verb, path = _request_line(planned, body)
            md = tuple(replayable_metadata(planned.metadata, self.policy, _PLAIN))
            block = self._http_blocks[key] = http_request_block(verb, path, self.authority, md, len(body), self.scheme)
        return block

    def start(self, planned: PlannedCall, timeout_s: float,
              done: Callable[[SendOutcome], None]) -> Callable[[], None] | None:
        """Send a call now, synchronously; `done(outcome)` follows once, from the connection's
        callbacks (the engine's `senders.base.Starter` fast path). Returns the call's cancel
        function, or None when the call must take `call()` instead.

        Taken by a unary or server-streaming call with its one request message due at its start (or
        a plain HTTP/2 request with its body due at its start), on a connection that is ready with a
        stream slot free: HEADERS and DATA are written before this
        returns, and no future, task, generator or timeout context is made per call. Cancelling
        resets the stream (RST_STREAM CANCEL); a stream the server refuses is retried as `call()`
        retries it."""
        http = planned.protocol == _PLAIN
        if planned.last_offset_ns or (not http and (planned.kind in ("client_stream", "bidi")
                                                    or len(planned.messages) != 1)):
            return None
        conn = self._conn(planned.connection)
        ready = conn.ready
        if not ready.done() or not ready.result() or not conn.usable or len(conn.streams) >= conn.peer_max_streams:
            return None
        payload = _body(planned.messages) if http else _wire(planned.messages[0])
        started = _Started(self, conn, planned, payload, conn.loop.time() + timeout_s, done)
        started.st = conn.open(self._block(planned, timeout_s, payload), payload, started.deadline, started.end, http)
        return started.cancel

    async def call(self, planned: PlannedCall, requests: AsyncIterator[PlannedMessage], timeout_s: float) -> SendOutcome:
        if planned.protocol == _PLAIN:
            return _as_http(await self._call(planned, requests, timeout_s))
        return await self._call(planned, requests, timeout_s)

    async def _call(self, planned: PlannedCall, requests: AsyncIterator[PlannedMessage], timeout_s: float) -> SendOutcome:
        conn = self._conn(planned.connection)
        timeout = timeout_s + planned.last_offset_ns / 1e9
        deadline = conn.loop.time() + timeout
        if not conn.ready.done() and not await self._within(deadline, asyncio.shield(conn.ready)):
            return outcome(Status.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if planned.protocol == _PLAIN:  # one request, its body whole: sent as the engine releases it
            body = b"".join([m.data async for m in requests])
            return await self._unary(conn, self._block(planned, timeout, body), body, deadline, True)
        block = self._block(planned, timeout)
        if planned.kind in ("client_stream", "bidi"):
            refused = await self._refused(conn, deadline)
            return refused or await self._streaming(conn, block, requests, deadline)
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return SendOutcome(ERROR, "NO_REQUEST", detail="the recorded call has no request message")
        return await self._unary(conn, block, _wire(first), deadline)

    async def _unary(self, conn: H2Connection, block: bytes, payload: bytes, deadline: float,
                     http: bool = False) -> SendOutcome:
        """Unary and server-streaming calls, and plain HTTP/2 requests (`http`). A stream the server refused (REFUSED_STREAM: not processed,
        e.g. its stream count lagging behind ours under MAX_CONCURRENT_STREAMS) is retried transparently
        within the deadline, as grpc-core does; streaming calls are not (their messages are gone)."""
        for attempt in range(_REFUSED_RETRIES + 1):
            if not conn.usable or len(conn.streams) >= conn.peer_max_streams:
                refused = await self._refused(conn, deadline)
                if refused is not None:
                    return refused
            # From the check above to open() nothing awaits, so MAX_CONCURRENT_STREAMS holds exactly.
            out = await self._wait(conn, conn.open(block, payload, deadline, None, http))
            if out.detail != REFUSED or attempt == _REFUSED_RETRIES or conn.loop.time() >= deadline:
                return out
            await asyncio.sleep(0.001 * (attempt + 1))  # let the server finish closing its streams
        raise AssertionError("unreachable: the last attempt returns")

    async def _refused(self, conn: H2Connection, deadline: float) -> SendOutcome | None:
        """Why a stream cannot open on `conn` now (after waiting for a slot), or None when it can."""
        if len(conn.streams) >= conn.peer_max_streams and not await self._within(deadline, conn.slot()):
            return outcome(Status.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if not conn.ready.result() or not conn.usable:
            return connection_failed(conn.error or "the connection is going away")
        return None

    @staticmethod
    async def _within(deadline: float, waiting: Awaitable[object]) -> bool:
        """Wait for `waiting` until the call's deadline; False if the deadline came first."""
        try:
            async with asyncio.timeout_at(deadline):
                await waiting
        except TimeoutError:
            return False
        return True

    async def _streaming(self, conn: H2Connection, block: bytes, requests: AsyncIterator[PlannedMessage],
                         deadline: float) -> SendOutcome:
        st = conn.open(block, None, deadline)
        pump = asyncio.ensure_future(self._pump(conn, st, requests))
        try:
            return await self._wait(conn, st)
        finally:
            pump.cancel()

    @staticmethod
    async def _pump(conn: H2Connection, st: Stream, requests: AsyncIterator[PlannedMessage]) -> None:
        async for m in requests:  # each message when the engine releases it (its own offset)
            if st.fut is None or st.fut.done():
                return
            conn.send(st, _wire(m), False)
        conn.send(st, b"", True)

    @staticmethod
    async def _wait(conn: H2Connection, st: Stream) -> SendOutcome:
        try:
            assert st.fut is not None  # opened without on_end
            return await st.fut
        except asyncio.CancelledError:  # the engine stopped us: tell the server too
            conn.cancel(st, outcome(Status.CANCELLED, "cancelled"))
            raise

    async def close(self) -> None:
        for task in list(self._connecting):  # a connect still in flight must not leave a socket behind
            task.cancel()
        conns, self._conns, self._all = self._all, {}, set()
        for conn in conns:
            conn.close()
