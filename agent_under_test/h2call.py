"""One gRPC call on the lean server: its stream state, the ServicerContext its handler sees, and the
async iterator over a client-streaming call's messages.

`Context` implements the part of `grpc.aio.ServicerContext` that servicers use (abort, codes and details,
metadata both ways, write/read, deadline, cancellation), so generated `add_*_to_server()` servicers,
grpc's health and reflection servicers included, run on it unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

from wire.messages import MessageReader
from wire.status import Metadata

if TYPE_CHECKING:
    from agent_under_test.h2server import Connection


class Abort(aio.AbortError):
    """Raised by Context.abort(); the server ends the call with the code and details set there."""


class Call:
    """Stream state of one call. `inbox` holds decoded request messages not yet read by the handler."""

    __slots__ = ("sid", "conn", "handler", "ctx", "task", "reader", "encoding", "inbox", "waiter", "remote_closed",
                 "local_closed", "headers_sent", "window", "recv_window", "held", "out", "trailers", "drained",
                 "timer", "unacked", "received_ns")

    def __init__(self, sid: int, conn: Connection, handler: grpc.RpcMethodHandler, metadata: Metadata,
                 window: int, timeout_s: float | None, recv_window: int, max_receive: int) -> None:
        self.sid, self.conn, self.handler = sid, conn, handler
        self.received_ns = time.perf_counter_ns()
        self.ctx = Context(self, metadata, timeout_s)
        self.task: asyncio.Task[None] | None = None
        self.reader = MessageReader(max_receive)    # request messages split over DATA frames
        self.encoding = ""                          # grpc-encoding of the request messages
        self.inbox: deque[Any] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.remote_closed = self.local_closed = self.headers_sent = False
        self.window = window                        # what the client lets us send on this stream
        self.recv_window = recv_window              # what the client may still send us on it
        self.held = 0                               # request bytes buffered for this call (the connection caps the sum)
        self.out = bytearray()                      # DATA payload held back by flow control
        self.trailers: bytes | None = None          # the end of the call, sent once `out` has drained
        self.drained: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.unacked = 0                            # request bytes consumed but not yet given back

    def serialize(self, response: Any) -> bytes:
        serializer = self.handler.response_serializer
        return serializer(response) if serializer is not None else response  # None: the handler gives bytes

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class Requests:
    """The request messages of a client-streaming call, as handlers iterate them."""

    def __init__(self, call: Call) -> None:
        self._call = call

    def __aiter__(self) -> Requests:
        return self

    async def __anext__(self) -> Any:
        call = self._call
        while not call.inbox:
            if call.remote_closed or call.local_closed:
                raise StopAsyncIteration
            call.waiter = asyncio.get_running_loop().create_future()
            await call.waiter
        message, size = call.inbox.popleft()
        call.conn.consumed(call, size)
        return message


class Context:
    """The handler's view of its call (a subset of grpc.aio.ServicerContext)."""

    def __init__(self, call: Call, metadata: Metadata, timeout_s: float | None) -> None:
        self._call = call
        self._metadata = metadata
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: Metadata = ()
        self._cancelled = False
        self._callbacks: list[Callable[[Context], None]] = []

    # -- what the call carries
    def invocation_metadata(self) -> Metadata:
        """The request's metadata; `-bin` values as bytes, as grpc gives them."""
        return self._metadata

    def peer(self) -> str:
        return self._call.conn.peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    @property
    def received_ns(self) -> int:
        """perf_counter_ns when the call's headers were read off the socket (before the handler ran)."""
        return self._call.received_ns

    # -- status
    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Metadata = ()) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() needs a non-OK status code")
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise Abort()

    # -- streaming
    async def send_initial_metadata(self, metadata: Metadata) -> None:
        self._call.conn.send_headers(self._call, tuple(metadata))

    async def write(self, message: Any) -> None:
        await self._call.conn.send_message(self._call, self._call.serialize(message))

    async def read(self) -> Any:
        try:
            return await Requests(self._call).__anext__()
        except StopAsyncIteration:
            return aio.EOF

    # -- lifecycle
    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._call.local_closed

    def add_done_callback(self, callback: Callable[[Context], None]) -> None:
        self._callbacks.append(callback)

    def set_compression(self, compression: object) -> None:
        """Responses are never compressed; accepted for compatibility."""

    def disable_next_message_compression(self) -> None:
        """Responses are never compressed; accepted for compatibility."""

    def finished(self, cancelled: bool) -> None:
        self._cancelled = cancelled
        for callback in self._callbacks:
            callback(self)
        self._callbacks.clear()
