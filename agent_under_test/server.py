"""The gRPC server: TradingAgent (Decide, DecideStream), health checking and reflection.

    call --Guard.admit()--> refused: RESOURCE_EXHAUSTED + retry-after-ms (never queued; the lean
      |                     server asks on the call's headers, before any per-call work)
      | admitted
      v
    Pipeline.decide() --> Decision --Guard.finish(method, latency, ok|invalid|error)

A stream is admitted once when it opens; its messages run concurrently (so they batch with everyone
else) and are answered strictly in arrival order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc
from grpc import aio

from agent_under_test.errors import InvalidSnapshotError
from agent_under_test.h2server import Admit, Refusal
from agent_under_test.hooks import Guard
from agent_under_test.pipeline import Pipeline
from agent_under_test.proto import agent_pb2, agent_pb2_grpc

SERVICE = "shadowtest.agent.v1.TradingAgent"
DECIDE = f"/{SERVICE}/Decide"
DECIDE_STREAM = f"/{SERVICE}/DecideStream"
STREAM_WINDOW = 64  # messages of one stream in flight at once; the reader waits beyond that


def refusal(retry_s: float) -> Refusal:
    """RESOURCE_EXHAUSTED, its message and the retry hint in trailing metadata, for a refused call."""
    ms = str(max(0, int(retry_s * 1000)))
    return (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], f"agent overloaded: retry after {ms} ms",
            (("retry-after-ms", ms), ("grpc-retry-pushback-ms", ms)))


def admission(guard: Guard) -> Admit:
    """The guard's admission as the lean server runs it, on a call's headers (see h2server.LeanServer)."""
    def admit(path: str) -> Refusal | None:
        if path != DECIDE and path != DECIDE_STREAM:
            return None  # health and reflection are never refused
        retry = guard.admit(path)
        return None if retry is None else refusal(retry)
    return admit


async def _abort(context: aio.ServicerContext, code: grpc.StatusCode, detail: str) -> NoReturn:
    """End the call with `code`: grpc.aio's abort() always raises (grpc ships no types to say so)."""
    await context.abort(code, detail)
    raise AssertionError("ServicerContext.abort() returned")


async def _refuse(context: aio.ServicerContext, retry_s: float) -> NoReturn:
    _, message, metadata = refusal(retry_s)
    context.set_trailing_metadata(metadata)
    await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def _received_ns(context: aio.ServicerContext) -> int:
    """When the call arrived: the lean server stamps it as the headers come off the socket, so the wait
    for the event loop counts in the latency the guard sees; grpc.aio only lets us stamp it here."""
    return getattr(context, "received_ns", None) or time.perf_counter_ns()


class TradingAgentServicer(agent_pb2_grpc.TradingAgentServicer):
    def __init__(self, pipeline: Pipeline, guard: Guard, admits: bool = True) -> None:
        """admits=False: the server already ran the guard's admission (the lean server does, on headers)."""
        self._pipeline, self._guard, self._admits = pipeline, guard, admits

    async def _one(self, method: str, request: agent_pb2.MarketSnapshot,
                   received_ns: int) -> agent_pb2.Decision | InvalidSnapshotError:
        """Run one message and report it to the guard exactly once; bad input is returned, not raised."""
        outcome = "error"
        try:
            decision = await self._pipeline.decide(request, received_ns)
            outcome = "ok"
            return decision
        except InvalidSnapshotError as exc:
            outcome = "invalid"
            return exc
        finally:
            self._guard.finish(method, (time.perf_counter_ns() - received_ns) / 1e9, outcome)

    async def Decide(self, request: agent_pb2.MarketSnapshot,  # noqa: N802 - gRPC method name
                     context: aio.ServicerContext) -> agent_pb2.Decision:
        received = _received_ns(context)
        if self._admits and (retry := self._guard.admit(DECIDE)) is not None:
            await _refuse(context, retry)
        try:
            result = await self._one(DECIDE, request, received)
        except Exception as exc:  # noqa: BLE001 - a failed forward pass must not look like UNKNOWN
            await _abort(context, grpc.StatusCode.INTERNAL, f"agent failed: {type(exc).__name__}: {exc}")
        if isinstance(result, InvalidSnapshotError):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(result))
        return result

    async def DecideStream(self, request_iterator: AsyncIterator[agent_pb2.MarketSnapshot],  # noqa: N802
                           context: aio.ServicerContext) -> AsyncIterator[agent_pb2.Decision]:
        if self._admits and (retry := self._guard.admit(DECIDE_STREAM)) is not None:
            await _refuse(context, retry)
        await context.send_initial_metadata(())  # tells the client the stream was admitted
        pending: asyncio.Queue[asyncio.Task | None] = asyncio.Queue(STREAM_WINDOW)
        reader = asyncio.get_running_loop().create_task(self._read_stream(request_iterator, pending))
        try:
            while (task := await pending.get()) is not None:
                result = await task
                if isinstance(result, InvalidSnapshotError):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stream message: {result}")
                yield result
            await reader  # surface a reader failure
        finally:
            reader.cancel()
            while not pending.empty():
                if (task := pending.get_nowait()) is not None:
                    task.cancel()

    async def _read_stream(self, requests: AsyncIterator[agent_pb2.MarketSnapshot],
                           pending: asyncio.Queue[asyncio.Task | None]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for request in requests:
                received = time.perf_counter_ns()
                await pending.put(loop.create_task(self._one(DECIDE_STREAM, request, received)))
        except grpc.RpcError:
            pass  # the client broke the stream: answer what was read, then end
        # Not in `finally`: when the writer cancels us it has stopped reading, and a full queue would block.
        await pending.put(None)
