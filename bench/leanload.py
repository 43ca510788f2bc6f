"""The benchmarks' load client: the replayer's lean HTTP/2 gRPC connection, pre-built snapshots.

At the rates these benchmarks need (10,000 calls/s and more) grpc.aio as a client costs more CPU per
call than the agent spends serving one, so it would measure itself. This client keeps no task or
future per call. Used by bench/limiter.py (open loop through an overload step) and
bench/agent_latency.py (closed-loop throughput).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_under_test.proto import agent_pb2  # noqa: E402
from replay.senders.base import SendOutcome  # noqa: E402
from replay.senders.h2conn import H2Connection  # noqa: E402
from replay.senders.h2frames import request_block  # noqa: E402
from wire.stats import percentile  # noqa: E402

DECIDE = "/shadowtest.agent.v1.TradingAgent/Decide"


def payloads(rng: random.Random, n: int = 64) -> list[bytes]:
    """Pre-built valid snapshots, so the client spends its CPU on sending, not on protobuf."""
    out = []
    for i in range(n):
        mid, now = 100.0 + rng.uniform(-5, 5), time.time_ns()
        levels = [agent_pb2.BookLevel(bid_price=round(mid - 0.01 * (k + 1), 4), bid_size=rng.uniform(50, 200),
                                      ask_price=round(mid + 0.01 * (k + 1), 4), ask_size=rng.uniform(50, 200))
                  for k in range(10)]
        ticks = [agent_pb2.Tick(ts_ns=now - (16 - k) * 20_000_000, price=mid + rng.gauss(0, 0.01), size=10.0)
                 for k in range(16)]
        out.append(agent_pb2.MarketSnapshot(sequence_id=i, symbol=f"S{i % 4}", levels=levels, ticks=ticks,
                                            ts_ns=now).SerializeToString())
    return out


class LeanClient:
    """The bench's load generator: one HTTP/2 connection of the replayer's lean gRPC client (no task or
    future per call), so that at 2C the client, not the agent, is the cheap side of a 2-core machine.
    grpc.aio cost ~300-400 us per call here, more than the lean agent spends serving one."""

    def __init__(self, conn: H2Connection, authority: str) -> None:
        self.conn = conn
        self.block = request_block(DECIDE, authority, (), 10.0)

    @classmethod
    async def connect(cls, address: str) -> LeanClient:
        host, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: H2Connection(loop), host, int(port))
        if not await conn.ready:
            raise RuntimeError(f"cannot talk HTTP/2 to {address}: {conn.error}")
        return cls(conn, address)

    @staticmethod
    def framed(bodies: list[bytes]) -> list[bytes]:
        """Request messages with gRPC's length prefix, built once (not per call)."""
        return [b"\x00" + len(body).to_bytes(4, "big") + body for body in bodies]

    def call(self, framed: bytes, on_end: Callable[[SendOutcome], None], timeout_s: float = 10.0) -> None:
        self.conn.open(self.block, framed, self.conn.loop.time() + timeout_s, on_end)

    def close(self) -> None:
        self.conn.close()


async def _saturate(address: str, seconds: float, workers: int, seed: int) -> float:
    """Closed loop: `workers` callers back to back for `seconds`; completed calls/s (throughput capacity)."""
    pool = LeanClient.framed(payloads(random.Random(seed)))
    done = 0
    client = await LeanClient.connect(address)
    end = time.monotonic() + seconds
    idle = asyncio.get_running_loop().create_future()
    running = workers

    def again(out: SendOutcome | None) -> None:
        nonlocal done, running
        if out is not None:
            done += 1
        if time.monotonic() < end:
            client.call(pool[done % len(pool)], again)
        else:
            running -= 1
            if running == 0 and not idle.done():
                idle.set_result(None)

    try:
        for _ in range(workers):
            again(None)
        await asyncio.wait_for(idle, seconds + 15.0)
    finally:
        client.close()
    return done / seconds



async def _open_loop(address: str, rate: float, seconds: float, seed: int, connections: int,
                     timeout_s: float) -> dict[str, object]:
    """Open loop: Poisson arrivals at `rate` for `seconds` over `connections` connections; latency of each
    call from its intended send time (coordinated omission counted), and how late the sends left."""
    rng = random.Random(seed)
    pool = LeanClient.framed(payloads(random.Random(seed)))
    clients = [await LeanClient.connect(address) for _ in range(max(1, connections))]
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    lags: list[float] = []
    codes: dict[str, int] = {}
    pending = 0
    drained = loop.create_future()
    sending = True

    def ended(intended: float, out: SendOutcome) -> None:
        nonlocal pending
        pending -= 1
        if out.outcome == "ok":
            latencies.append(loop.time() - intended)
        else:
            codes[out.code or out.outcome] = codes.get(out.code or out.outcome, 0) + 1
        if not sending and pending == 0 and not drained.done():
            drained.set_result(None)

    start = loop.time() + 0.05
    due, sent = start, 0
    end = start + seconds
    try:
        while due < end:
            now = loop.time()
            if due > now:
                await asyncio.sleep(min(due - now, 0.001))
                continue
            while due <= now and due < end:       # every call due by now, each stamped with its own time
                lags.append(now - due)
                pending += 1
                clients[sent % len(clients)].call(pool[sent % len(pool)],
                                                  lambda out, at=due: ended(at, out), timeout_s)
                sent += 1
                due += rng.expovariate(rate)
        sending = False
        if pending:
            await asyncio.wait_for(drained, timeout_s + 5.0)
    finally:
        for client in clients:
            client.close()
    ordered, lag_sorted = sorted(latencies), sorted(lags)
    return {"rate": rate, "achieved": round(sent / seconds, 1), "ok": len(latencies), "sent": sent,
            "p50_ms": _ms(ordered, 0.5), "p99_ms": _ms(ordered, 0.99), "errors": sum(codes.values()),
            "error_codes": codes, "send_lag_p99_ms": _ms(lag_sorted, 0.99)}


def _ms(ordered: list[float], q: float) -> float | None:
    return round(percentile(ordered, q) * 1e3, 3) if ordered else None


def open_loop(address: str, rate: float, seconds: float, seed: int = 11, connections: int = 4,
              timeout_s: float = 10.0) -> dict[str, object]:
    """Open loop with the lean client (Poisson, unary Decide): p50/p99 from the intended send time."""
    return asyncio.run(_open_loop(address, rate, seconds, seed, connections, timeout_s))


def saturate(address: str, seconds: float, callers: int, seed: int) -> float:
    """Closed loop: `callers` calls in flight back to back for `seconds`; completed calls/s."""
    return asyncio.run(_saturate(address, seconds, callers, seed))
