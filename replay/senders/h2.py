"""The lean gRPC sender ("h2"): gRPC over HTTP/2 on a plain asyncio Protocol, without grpcio.

The replayer already holds each call's raw request bytes, so it needs none of grpcio's machinery
(channels, call objects, serializers, the C-core completion queue): a unary call here is one cached
header block plus one DATA frame written straight to the socket, and one parsed response. Outcomes
and codes map exactly as the grpc sender's do (ok, RESOURCE_EXHAUSTED -> rejected, DEADLINE_EXCEEDED
-> timeout, UNAVAILABLE/connection loss -> connection_error, other codes -> error by name). All four
call kinds are supported; each streamed request message goes out when the engine releases it.

Limits: cleartext (h2c prior knowledge) only, no TLS; no request compression (a compressed recorded
message is sent decompressed, as the grpc sender does); no retries; one FIFO for flow-control-blocked
data per connection (a stream waiting for its own window holds back later DATA on that connection).
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Awaitable

from replay.schedule import PlannedCall, PlannedMessage
from replay.senders.base import ERROR, SendOutcome, replayable_metadata
from replay.senders.h2conn import REFUSED, H2Connection, Stream
from replay.senders.h2frames import DEADLINE_EXCEEDED, connection_failed, outcome, request_block

_REFUSED_RETRIES = 3


def _wire(m: PlannedMessage) -> bytes:
    data = m.data
    if m.compressed:
        try:
            data = gzip.decompress(data)
        except OSError:
            pass
    return b"\x00" + len(data).to_bytes(4, "big") + data  # the gRPC length prefix, uncompressed


class H2Sender:
    """Replays gRPC calls to `target` ("host:port") over its own HTTP/2 connections.

    Args:
        target: "host:port" (IPv6 as "[::1]:port").
        share_connection: one connection for all recorded connections (default: one each).
    A connection that is lost, refused or told GOAWAY is replaced by a new one for later calls.
    """

    def __init__(self, target: str, *, share_connection: bool = False, **_: object) -> None:
        host, port = target.rsplit(":", 1)
        self.target, self.host, self.port = target, host.strip("[]"), int(port)
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
            conn = self._conns[key] = H2Connection(loop)
            self._all = {c for c in self._all if not c.closed}
            self._all.add(conn)
            task = loop.create_task(self._connect(conn))  # held: the loop keeps only weak references
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)
        return conn

    async def _connect(self, conn: H2Connection) -> None:
        try:
            await conn.loop.create_connection(lambda: conn, self.host, self.port)
        except OSError as exc:
            conn.connect_failed(exc)

    def prepare(self, connection: str) -> None:
        """Start connecting now (non-blocking), ahead of the first call."""
        self._conn(connection)

    def _block(self, planned: PlannedCall, timeout: float) -> bytes:
        key = (planned.method or "", tuple(planned.metadata), timeout)
        block = self._blocks.get(key)
        if block is None:
            if len(self._blocks) >= 4096:  # bounded: recordings may carry unique metadata per call
                self._blocks.clear()
            md = tuple(replayable_metadata(planned.metadata))
            block = self._blocks[key] = request_block(key[0], self.target, md, timeout)
        return block

    async def call(self, planned: PlannedCall, requests: AsyncIterator[PlannedMessage], timeout_s: float) -> SendOutcome:
        conn = self._conn(planned.connection)
        timeout = timeout_s + planned.last_offset_ns / 1e9
        deadline = conn.loop.time() + timeout
        if not conn.ready.done() and not await self._within(deadline, asyncio.shield(conn.ready)):
            return outcome(DEADLINE_EXCEEDED, "Deadline Exceeded")
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
            return outcome(DEADLINE_EXCEEDED, "Deadline Exceeded")
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
            if st.fut.done():
                return
            conn.send(st, _wire(m), False)
        conn.send(st, b"", True)

    @staticmethod
    async def _wait(conn: H2Connection, st: Stream) -> SendOutcome:
        try:
            return await st.fut
        except asyncio.CancelledError:  # the engine stopped us: tell the server too
            conn.cancel(st, outcome(1, "cancelled"))
            raise

    async def close(self) -> None:
        for task in list(self._connecting):  # a connect still in flight must not leave a socket behind
            task.cancel()
        conns, self._conns, self._all = self._all, {}, set()
        for conn in conns:
            conn.close()
