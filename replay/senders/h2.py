"""The lean gRPC sender ("h2"): gRPC over HTTP/2 on a plain asyncio Protocol, without grpcio.

The replayer already holds each call's raw request bytes, so it needs none of grpcio's machinery
(channels, call objects, serializers, the C-core completion queue): a unary call here is one cached
header block plus one DATA frame written straight to the socket, and one parsed response. Outcomes
and codes map exactly as the grpc sender's do (ok, RESOURCE_EXHAUSTED -> rejected, DEADLINE_EXCEEDED
-> timeout, UNAVAILABLE/connection loss -> connection_error, other codes -> error by name). All four
call kinds are supported; each streamed request message goes out when the engine releases it.

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
from replay.senders.h2frames import connection_failed, outcome, request_block
from replay.senders.headers import HeaderPolicy
from replay.senders.tls import TlsConfig, describe
from wire.status import Status

_REFUSED_RETRIES = 3


def _wire(m: PlannedMessage) -> bytes:
    data = m.data
    if m.compressed:
        try:
            data = gzip.decompress(data)
        except OSError:
            pass
    return b"\x00" + len(data).to_bytes(4, "big") + data  # the gRPC length prefix, uncompressed


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
            block = self.sender._block(self.planned, self.deadline - loop.time())
            self.retry = loop.create_task(self.sender._unary(self.conn, block, self.payload, self.deadline))
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
            done(out)

    def cancel(self) -> None:
        """Abandon the call: reset its stream (or stop its retry); `done` gets a CANCELLED outcome."""
        if self.retry is not None:
            self.retry.cancel()
        elif self.st is not None:
            self.conn.cancel(self.st, outcome(Status.CANCELLED, "cancelled"))
        self._report(outcome(Status.CANCELLED, "cancelled"))  # no-op when the stream's end already reported


class H2Sender:
    """Replays gRPC calls to `target` ("host:port") over its own HTTP/2 connections.

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

    def _block(self, planned: PlannedCall, timeout: float) -> bytes:
        key = (planned.method or "", tuple(planned.metadata), timeout)
        block = self._blocks.get(key)
        if block is None:
            if len(self._blocks) >= 4096:  # bounded: recordings may carry unique metadata per call
                self._blocks.clear()
            md = tuple(replayable_metadata(planned.metadata, self.policy))
            block = self._blocks[key] = request_block(key[0], self.authority, md, timeout, self.scheme)
        return block

    def start(self, planned: PlannedCall, timeout_s: float,
              done: Callable[[SendOutcome], None]) -> Callable[[], None] | None:
        """Send a call now, synchronously; `done(outcome)` follows once, from the connection's
        callbacks (the engine's `senders.base.Starter` fast path). Returns the call's cancel
        function, or None when the call must take `call()` instead.

        Taken by a unary or server-streaming call with its one request message due at its start, on a
        connection that is ready with a stream slot free: HEADERS and DATA are written before this
        returns, and no future, task, generator or timeout context is made per call. Cancelling
        resets the stream (RST_STREAM CANCEL); a stream the server refuses is retried as `call()`
        retries it."""
        if planned.kind in ("client_stream", "bidi") or len(planned.messages) != 1 or planned.last_offset_ns:
            return None
        conn = self._conn(planned.connection)
        ready = conn.ready
        if not ready.done() or not ready.result() or not conn.usable or len(conn.streams) >= conn.peer_max_streams:
            return None
        started = _Started(self, conn, planned, _wire(planned.messages[0]), conn.loop.time() + timeout_s, done)
        started.st = conn.open(self._block(planned, timeout_s), started.payload, started.deadline, started.end)
        return started.cancel

    async def call(self, planned: PlannedCall, requests: AsyncIterator[PlannedMessage], timeout_s: float) -> SendOutcome:
        conn = self._conn(planned.connection)
        timeout = timeout_s + planned.last_offset_ns / 1e9
        deadline = conn.loop.time() + timeout
        if not conn.ready.done() and not await self._within(deadline, asyncio.shield(conn.ready)):
            return outcome(Status.DEADLINE_EXCEEDED, "Deadline Exceeded")
        block = self._block(planned, timeout)
        if planned.kind in ("client_stream", "bidi"):
            refused = await self._refused(conn, deadline)
            return refused or await self._streaming(conn, block, requests, deadline)
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return SendOutcome(ERROR, "NO_REQUEST", detail="the recorded call has no request message")
        return await self._unary(conn, block, _wire(first), deadline)

    async def _unary(self, conn: H2Connection, block: bytes, payload: bytes, deadline: float) -> SendOutcome:
        """Unary and server-streaming calls. A stream the server refused (REFUSED_STREAM: not processed,
        e.g. its stream count lagging behind ours under MAX_CONCURRENT_STREAMS) is retried transparently
        within the deadline, as grpc-core does; streaming calls are not (their messages are gone)."""
        for attempt in range(_REFUSED_RETRIES + 1):
            if not conn.usable or len(conn.streams) >= conn.peer_max_streams:
                refused = await self._refused(conn, deadline)
                if refused is not None:
                    return refused
            # From the check above to open() nothing awaits, so MAX_CONCURRENT_STREAMS holds exactly.
            out = await self._wait(conn, conn.open(block, payload, deadline))
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
