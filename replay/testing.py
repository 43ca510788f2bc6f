"""Test and benchmark helpers (like trio.testing): a fake transport, recording builders, and a
real grpc.aio server of the agent's proto that echoes, stalls, rejects or dies on request.

Nothing here is used by the replay path itself.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from capture.recording import Call, Flow, Message, RecordingWriter
from replay.schedule import PlannedCall, PlannedMessage
from replay.senders import SendOutcome
from wire.clock import Clock

if TYPE_CHECKING:
    import grpc.aio

SERVICE = "shadowtest.agent.v1.TradingAgent"
DECIDE = f"/{SERVICE}/Decide"
DECIDE_STREAM = f"/{SERVICE}/DecideStream"


@dataclass
class FakeSender:
    """The mock transport: records (clock time, call index, message) for every message it is given.

    `latency_ns` of virtual time passes per call (by advancing a FakeClock if `advance` is set);
    `outcome` is returned for every call.
    """

    clock: Clock
    outcome: str = "ok"
    code: str = "OK"
    sends: list[tuple[int, int, bytes]] = field(default_factory=list)

    async def call(self, planned: PlannedCall, requests: AsyncIterator[PlannedMessage], timeout_s: float) -> SendOutcome:
        async for msg in requests:
            self.sends.append((self.clock.now_ns(), planned.index, msg.data))
        return SendOutcome(self.outcome, self.code, responses=[b"r%d" % planned.index])

    async def close(self) -> None:
        pass


def snapshot_bytes(seq: int, symbol: str = "ACME") -> bytes:
    """A serialized MarketSnapshot with `sequence_id` = seq (a small, realistic request)."""
    from agent_under_test.proto import agent_pb2
    snap = agent_pb2.MarketSnapshot(sequence_id=seq, symbol=symbol, ts_ns=seq * 1000, position=1.0)
    snap.levels.add(bid_price=100.0, bid_size=1.0, ask_price=100.5, ask_size=2.0)
    data: bytes = snap.SerializeToString()
    return data


def decision_bytes(seq: int, symbol: str = "ACME", latency_ns: int = 0) -> bytes:
    from agent_under_test.proto import agent_pb2
    data: bytes = agent_pb2.Decision(sequence_id=seq, symbol=symbol, side=agent_pb2.BUY, price=100.0, size=1.0,
                                     tier="full", server_latency_ns=latency_ns).SerializeToString()
    return data


def write_unary_recording(path: str | Path, times_ns: Iterable[int], *, flows: int = 1,
                          method: str = DECIDE, base_ns: int = 10_000_000_000) -> int:
    """A recording of unary calls at the given offsets, round-robin over `flows` connections.

    Request i carries sequence_id i; its recorded response is the echo server's answer. Returns the count."""
    n = 0
    with RecordingWriter(path, meta={"host": "test"}) as w:
        fids = [w.add_flow(Flow(("127.0.0.1", 40000 + i), ("127.0.0.1", 50051), protocol="grpc"))
                for i in range(flows)]
        for i, t in enumerate(times_ns):
            ts = base_ns + t
            w.add_call(Call(protocol="grpc", method=method, request_ts_ns=ts, flow_id=fids[i % flows],
                            request_metadata=[("x-replay-test", str(i)), ("user-agent", "grpc-c"),
                                              ("authorization", "[REDACTED]")], status=0,
                            requests=[Message("c2s", 0, ts, snapshot_bytes(i))],
                            responses=[Message("s2c", 0, ts + 500_000, decision_bytes(i))]))
            n += 1
    return n


def write_stream_recording(path: str | Path, offsets_ns: list[int], *, start_ns: int = 0,
                           base_ns: int = 10_000_000_000) -> None:
    """One bidi DecideStream call whose request messages are at `offsets_ns` from the call start."""
    with RecordingWriter(path, meta={"host": "test"}) as w:
        fid = w.add_flow(Flow(("127.0.0.1", 41000), ("127.0.0.1", 50051), protocol="grpc"))
        ts = base_ns + start_ns
        w.add_call(Call(protocol="grpc", method=DECIDE_STREAM, request_ts_ns=ts, flow_id=fid, kind="bidi",
                        status=0, requests=[Message("c2s", i, ts + o, snapshot_bytes(i))
                                            for i, o in enumerate(offsets_ns)],
                        responses=[Message("s2c", i, ts + o + 1000, decision_bytes(i))
                                   for i, o in enumerate(offsets_ns)]))


class EchoServer:
    """A real grpc.aio TradingAgent on 127.0.0.1 port 0, in its own thread and event loop.

    Decide answers a Decision with the request's sequence_id (server_latency_ns random: a noisy field).
    Knobs: `delay_s` per call, `reject_every` (every Nth call gets RESOURCE_EXHAUSTED). `received`
    lists (monotonic ns, method, sequence_id) in arrival order. Use as a context manager; `kill()`
    stops it at once mid-run (the target dying).
    """

    def __init__(self, delay_s: float = 0.0, reject_every: int = 0, port: int = 0,
                 reflection: bool = False, fast: bool = False) -> None:
        self.delay_s, self.reject_every, self.port = delay_s, reject_every, port
        self.fast = fast  # echo the request bytes untouched, keep no records (benchmarks)
        self.reflection = reflection
        self.received: list[tuple[int, str, int]] = []
        self.metadata: list[dict[str, str]] = []
        self.peers: set[str] = set()  # client addresses seen: one per TCP connection
        self._rng = random.Random(1)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> EchoServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("echo server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        self._thread.join(10)

    def kill(self) -> None:
        if self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop)

    async def _stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        import grpc
        import grpc.aio
        self._server = server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Decide": grpc.unary_unary_rpc_method_handler(self._decide),
            "DecideStream": grpc.stream_stream_rpc_method_handler(self._decide_stream),
            # Not in agent.proto: generic handlers for the two remaining call kinds.
            "Collect": grpc.stream_unary_rpc_method_handler(self._collect),
            "Fanout": grpc.unary_stream_rpc_method_handler(self._fanout)})
        server.add_generic_rpc_handlers((handler,))
        if self.reflection:
            from grpc_reflection.v1alpha import reflection

            from agent_under_test.proto import agent_pb2  # registers the service in the default pool
            reflection.enable_server_reflection(
                (agent_pb2.DESCRIPTOR.services_by_name["TradingAgent"].full_name, reflection.SERVICE_NAME), server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        await server.start()
        self._ready.set()
        await server.wait_for_termination()

    def _answer(self, method: str, request: bytes) -> bytes:
        from agent_under_test.proto import agent_pb2
        snap = agent_pb2.MarketSnapshot.FromString(request)
        self.received.append((time.monotonic_ns(), method, snap.sequence_id))
        return decision_bytes(snap.sequence_id, snap.symbol, self._rng.randrange(1, 10**6))

    async def _decide(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        import grpc
        if self.fast:
            return request
        n = len(self.received) + 1
        self.metadata.append(dict(context.invocation_metadata()))
        self.peers.add(context.peer())
        answer = self._answer("Decide", request)
        if self.reject_every and n % self.reject_every == 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return answer

    async def _collect(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        seqs = [self._answer("Collect", r) for r in [r async for r in requests]]
        return b"%d" % len(seqs)

    async def _fanout(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        answer = self._answer("Fanout", request)
        for _ in range(3):
            yield answer

    async def _decide_stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for request in requests:
            yield self._answer("DecideStream", request)


def main() -> None:
    """`python -m replay.testing [PORT] [--reflection] [--fast]`: run an echo server until killed (benchmarks, docs)."""
    import sys
    port = int(next((a for a in sys.argv[1:] if a.isdigit()), "0"))
    with EchoServer(port=port, reflection="--reflection" in sys.argv, fast="--fast" in sys.argv) as server:
        print(server.address, flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
