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


class StreamLane:
    """One DecideStream held open for the whole run; sends in order, matches answers by sequence_id."""

    def __init__(self, channel: aio.Channel, index: int, timeout_s: float) -> None:
        self.index, self._timeout_s = index, timeout_s
        self._channel = channel
        self._call: aio.StreamStreamCall | None = None
        self._pending: dict[int, CallResult] = {}
        self._outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def send(self, payload: bytes, res: CallResult) -> None:
        if self._call is None:  # opened on first use so an unused lane costs nothing
            self._call = self._channel.stream_stream(DECIDE_STREAM, response_deserializer=agent_pb2.Decision.FromString)()
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._write()), loop.create_task(self._read())]
        self._pending[res.sequence_id] = res
        self._outbox.put_nowait(payload)

    async def _write(self) -> None:
        assert self._call is not None
        try:
            while (payload := await self._outbox.get()) is not None:
                await self._call.write(payload)
            await self._call.done_writing()
        except (aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the reader sees the stream's status and fails what is pending

    async def _read(self) -> None:
        assert self._call is not None
        code = "OK"
        try:
            async for decision in self._call:
                res = self._pending.pop(decision.sequence_id, None)
                if res is not None:
                    _finish(res, "OK")
        except aio.AioRpcError as exc:
            code = exc.code().name
        if code == "OK":
            code = (await self._call.code()).name
        for res in self._pending.values():  # answered never: count them under the stream's status
            _finish(res, code if code != "OK" else grpc.StatusCode.UNKNOWN.name)
        self._pending.clear()

    async def close(self) -> None:
        """Finish writing, wait for the answers (bounded by the call timeout), then cancel."""
        if self._call is None:
            return
        self._outbox.put_nowait(None)
        done, pending = await asyncio.wait(self._tasks, timeout=self._timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            self._call.cancel()
            for res in self._pending.values():
                _finish(res, grpc.StatusCode.DEADLINE_EXCEEDED.name)
