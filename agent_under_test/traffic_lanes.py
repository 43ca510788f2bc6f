"""How the traffic generator sends: unary calls and long-lived DecideStream lanes (bytes in, bytes out)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
from grpc import aio

from agent_under_test.proto import agent_pb2

DECIDE = "/shadowtest.agent.v1.TradingAgent/Decide"
DECIDE_STREAM = "/shadowtest.agent.v1.TradingAgent/DecideStream"


@dataclass
class CallResult:
    """One call (or stream message): monotonic ns when it was due, sent and answered; gRPC code name."""

    intended_ns: int
    sent_ns: int
    done_ns: int
    method: str
    code: str            # "OK", "RESOURCE_EXHAUSTED", ... ("" while outstanding)
    sequence_id: int
    stream: int | None = None

    @property
    def latency_s(self) -> float:
        return (self.done_ns - self.intended_ns) / 1e9


def _finish(res: CallResult, code: str) -> None:
    res.done_ns, res.code = time.monotonic_ns(), code


async def unary_call(decide: aio.UnaryUnaryMultiCallable, payload: bytes, res: CallResult, timeout_s: float) -> None:
    try:
        await decide(payload, timeout=timeout_s)
        _finish(res, "OK")
    except aio.AioRpcError as exc:
        _finish(res, exc.code().name)


class _Stream:
    """One DecideStream call: a writer task, a reader task, and the messages still unanswered."""

    def __init__(self, channel: aio.Channel) -> None:
        self.call = channel.stream_stream(DECIDE_STREAM, response_deserializer=agent_pb2.Decision.FromString)()
        self.pending: dict[int, CallResult] = {}
        self.outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.reader = loop.create_task(self._read())
        self.tasks = [loop.create_task(self._write()), self.reader]

    async def _write(self) -> None:
        try:
            # Write only once the server has admitted the stream (it sends initial metadata then): a
            # write racing a refusal's status turns that status into INTERNAL on this side.
            await self.call.initial_metadata()
            while (payload := await self.outbox.get()) is not None:
                if self.call.done():
                    return
                await self.call.write(payload)
            await self.call.done_writing()
        except (aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the reader sees the stream's status and fails what is pending

    async def _read(self) -> None:
        code = "OK"
        try:
            async for decision in self.call:
                res = self.pending.pop(decision.sequence_id, None)
                if res is not None:
                    _finish(res, "OK")
        except aio.AioRpcError as exc:
            code = exc.code().name
        if code == "OK":
            code = (await self.call.code()).name
        self.tasks[0].cancel()  # the writer may be waiting for more to send into a finished call
        for res in self.pending.values():  # never answered: count them under the stream's status
            _finish(res, code if code != "OK" else grpc.StatusCode.UNKNOWN.name)
        self.pending.clear()


class StreamLane:
    """A long-lived DecideStream; sends in order, matches answers by sequence_id. When the server ends
    the stream (refused, error, connection age), the next message opens a new one, as a client would."""

    def __init__(self, channel: aio.Channel, index: int, timeout_s: float) -> None:
        self.index, self._timeout_s = index, timeout_s
        self._channel = channel
        self._stream: _Stream | None = None
        self.opened = 0

    def send(self, payload: bytes, res: CallResult) -> None:
        if self._stream is None or self._stream.reader.done():
            self._stream = _Stream(self._channel)  # opened on first use: an unused lane costs nothing
            self.opened += 1
        self._stream.pending[res.sequence_id] = res
        self._stream.outbox.put_nowait(payload)

    async def close(self) -> None:
        """Finish writing, wait for the answers (bounded by the call timeout), then cancel."""
        st = self._stream
        if st is None:
            return
        st.outbox.put_nowait(None)
        _, pending = await asyncio.wait(st.tasks, timeout=self._timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            st.call.cancel()
            for res in st.pending.values():
                _finish(res, grpc.StatusCode.DEADLINE_EXCEEDED.name)
