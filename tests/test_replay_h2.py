"""The lean h2 sender against real grpc.aio servers (and the real agent): same outcomes as the grpc sender."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from replay.engine import ReplayRun
from replay.options import ReplayOptions
from replay.schedule import PlannedCall, PlannedMessage
from replay.senders import SendOutcome, get_sender
from replay.testing import DECIDE, DECIDE_STREAM, SERVICE, EchoServer, snapshot_bytes, write_unary_recording

MS = 1_000_000


def _planned(method: str, messages: list[bytes], kind: str = "unary", index: int = 0,
             offsets_ns: list[int] | None = None) -> PlannedCall:
    offsets = offsets_ns or [0] * len(messages)
    return PlannedCall(index, 0, "c0", "grpc", method, kind, [PlannedMessage(o, m) for o, m in zip(offsets, messages, strict=True)],
                       metadata=[("x-replay-test", str(index))])


async def _requests(planned: PlannedCall):  # noqa: ANN202 - an async generator of the call's messages
    start = time.monotonic_ns()
    for m in planned.messages:
        await asyncio.sleep(max(0.0, (m.offset_ns - (time.monotonic_ns() - start)) / 1e9))
        yield m


def _call(sender_name: str, address: str, calls: list[PlannedCall], timeout_s: float = 5.0) -> list[SendOutcome]:
    """Run `calls` concurrently through a fresh sender (one connection) and return their outcomes."""
    async def go() -> list[SendOutcome]:
        sender = get_sender(sender_name, address)
        try:
            return list(await asyncio.gather(*(sender.call(p, _requests(p), timeout_s) for p in calls)))
        finally:
            await sender.close()
    return asyncio.run(go())


def _same(address: str, calls: list[PlannedCall], timeout_s: float = 5.0) -> list[SendOutcome]:
    """Both senders' outcomes; asserts they agree field by field and returns the h2 ones."""
    grpc_out, h2_out = _call("grpc", address, calls, timeout_s), _call("h2", address, calls, timeout_s)
    for g, h in zip(grpc_out, h2_out, strict=True):
        assert (h.outcome, h.code, h.status, h.responses) == (g.outcome, g.code, g.status, g.responses)
        if g.outcome != "timeout":  # who noticed the deadline first (client or server) shows in grpc's detail
            assert h.detail == g.detail
    return h2_out


def test_unary_ok_returns_identical_response_bytes() -> None:
    with EchoServer(fast=True) as server:  # echoes the request bytes untouched
        out = _same(server.address, [_planned(DECIDE, [snapshot_bytes(i)], index=i) for i in range(5)])
    assert [(o.outcome, o.code, o.status) for o in out] == [("ok", "OK", 0)] * 5
    assert [o.responses for o in out] == [[snapshot_bytes(i)] for i in range(5)]


def test_non_ok_status_and_rejection_map_like_grpc() -> None:
    with EchoServer(reject_every=1) as server:
        unknown = _planned(f"/{SERVICE}/NoSuchMethod", [b"x"])
        shed = _planned(DECIDE, [snapshot_bytes(1)])
        missing, rejected = _same(server.address, [unknown, shed])
    assert (missing.outcome, missing.code, missing.status) == ("error", "UNIMPLEMENTED", 12)
    assert missing.detail  # the server's grpc-message, percent-decoded
    assert (rejected.outcome, rejected.code, rejected.detail) == ("rejected", "RESOURCE_EXHAUSTED", "shed")


def test_deadline_exceeded_is_a_timeout_and_cancels_the_stream() -> None:
    with EchoServer(delay_s=0.6) as server:
        started = time.monotonic()
        (out,) = _same(server.address, [_planned(DECIDE, [snapshot_bytes(1)])], timeout_s=0.1)
        elapsed = time.monotonic() - started
    assert (out.outcome, out.code, out.status) == ("timeout", "DEADLINE_EXCEEDED", 4)
    assert elapsed < 2 * 0.6  # both senders gave up at the deadline, not at the reply (tolerance: 2 x the delay)


def test_all_streaming_kinds_match_grpc() -> None:
    calls = [_planned(f"/{SERVICE}/Collect", [snapshot_bytes(i) for i in range(3)], "client_stream", 0,
                      [0, 20 * MS, 40 * MS]),
             _planned(f"/{SERVICE}/Fanout", [snapshot_bytes(7)], "server_stream", 1),
             _planned(DECIDE_STREAM, [snapshot_bytes(i) for i in range(3)], "bidi", 2, [0, 30 * MS, 60 * MS])]
    with EchoServer() as server:
        out = _call("h2", server.address, calls)
        got = sorted((m, s) for _, m, s in server.received)
    assert [(o.outcome, len(o.responses)) for o in out] == [("ok", 1), ("ok", 3), ("ok", 3)]
    assert out[0].responses == [b"3"]
    assert got == sorted([("Collect", i) for i in range(3)] + [("Fanout", 7)] + [("DecideStream", i) for i in range(3)])


def test_many_large_concurrent_calls_on_one_connection_need_flow_control() -> None:
    """90 calls of ~100 KB each way at once: ~9 MB per direction, far beyond HTTP/2's 64 KiB default
    windows and past half of our 16 MiB receive window (so we must send WINDOW_UPDATEs too)."""
    from agent_under_test.proto import agent_pb2

    calls = [_planned(DECIDE, [snapshot_bytes(i, f"S{i}" + "x" * 100_000)], index=i) for i in range(90)]
    with EchoServer(delay_s=0.05) as server:
        out = _call("h2", server.address, calls, timeout_s=20.0)
        peers = len(server.peers)
    assert [o.outcome for o in out] == ["ok"] * 90
    decoded = [agent_pb2.Decision.FromString(o.responses[0]) for o in out]
    assert [(d.sequence_id, d.symbol) for d in decoded] == [(i, f"S{i}" + "x" * 100_000) for i in range(90)]
    assert peers == 1  # all on one connection


def test_against_the_real_agent_both_senders_account_for_every_call(tmp_path: Path) -> None:
    from agent_under_test.launch import AgentProcess

    n = write_unary_recording(tmp_path / "r.rec", [i * 8 * MS for i in range(60)], flows=2)
    with AgentProcess(tier="light", device="cpu", metrics_port=-1) as agent:
        reps = {s: ReplayRun(tmp_path / "r.rec", agent.grpc_address, ReplayOptions(sender=s)).run()
                for s in ("grpc", "h2")}
    for rep in reps.values():
        assert rep.invariant_ok and rep.scheduled == n
        assert rep.ok + rep.rejected == n, rep  # the agent answers or sheds; nothing else
    assert reps["h2"].ok >= n // 2


def test_server_max_concurrent_streams_is_honoured() -> None:
    """A server that allows 2 streams at a time: 8 concurrent calls wait for a slot instead of being refused."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    lock, active, peak = threading.Lock(), [0], [0]

    def slow_echo(request: bytes, context: object) -> bytes:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return request

    server = grpc.server(ThreadPoolExecutor(8), options=[("grpc.max_concurrent_streams", 2)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {"Decide": grpc.unary_unary_rpc_method_handler(slow_echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        out = _call("h2", f"127.0.0.1:{port}", [_planned(DECIDE, [snapshot_bytes(i)], index=i) for i in range(8)])
    finally:
        server.stop(None)
    assert [(o.outcome, o.responses) for o in out] == [("ok", [snapshot_bytes(i)]) for i in range(8)], [o.detail for o in out]
    assert peak[0] <= 2


def _started(address: str, calls: list[PlannedCall], timeout_s: float = 5.0) -> tuple[list[bool], list[SendOutcome]]:
    """Each call through H2Sender.start (the engine's synchronous fast path) once the connection is
    ready; returns whether start() took it, and the outcomes (call() for those it declined)."""
    async def go() -> tuple[list[bool], list[SendOutcome]]:
        loop = asyncio.get_running_loop()
        sender = get_sender("h2", address)
        try:
            assert sender.start(calls[0], timeout_s, print) is None  # type: ignore[attr-defined]  # not connected yet
            await asyncio.wait_for(asyncio.shield(sender._conn(calls[0].connection).ready), 5)  # type: ignore[attr-defined]
            futs: list[asyncio.Future[SendOutcome] | None] = []
            for p in calls:
                fut = loop.create_future()
                futs.append(fut if sender.start(p, timeout_s, fut.set_result) is not None else None)  # type: ignore[attr-defined]
            outs = [await (f if f is not None else sender.call(p, _requests(p), timeout_s))
                    for f, p in zip(futs, calls, strict=True)]
            return [f is not None for f in futs], outs
        finally:
            await sender.close()
    return asyncio.run(go())


def test_start_sends_synchronously_with_the_same_outcomes_as_call() -> None:
    calls = [_planned(DECIDE, [snapshot_bytes(i)], index=i) for i in range(6)]
    calls += [_planned(f"/{SERVICE}/NoSuchMethod", [b"x"], index=6),
              _planned(f"/{SERVICE}/Fanout", [snapshot_bytes(7)], "server_stream", 7),
              _planned(DECIDE_STREAM, [snapshot_bytes(8)], "bidi", 8)]
    with EchoServer() as server:
        taken, outs = _started(server.address, calls)
        reference = _call("grpc", server.address, calls)
    with EchoServer(reject_every=1) as server:
        _, shed = _started(server.address, calls[:2])
    assert taken == [True] * 8 + [False]  # a bidi call needs its request stream: call() handles it
    for got, want in zip(outs, reference, strict=True):
        # the echo server stamps its own latency into each decision: compare shape, not bytes
        assert (got.outcome, got.code, got.status, len(got.responses)) == (want.outcome, want.code, want.status,
                                                                            len(want.responses))
    assert [o.code for o in outs] == ["OK"] * 6 + ["UNIMPLEMENTED", "OK", "OK"]
    assert [(o.outcome, o.code, o.detail) for o in shed] == [("rejected", "RESOURCE_EXHAUSTED", "shed")] * 2


def test_engine_fast_path_times_out_and_stops_cleanly(tmp_path: Path) -> None:
    """Calls the engine sent through start() still time out at their deadline, and a stop() while
    they are in flight counts them as CANCELLED within the grace (none are lost)."""
    n = write_unary_recording(tmp_path / "r.rec", [i * 20 * MS for i in range(20)])  # 0.4 s of calls
    with EchoServer(delay_s=3.0) as server:
        rep = ReplayRun(tmp_path / "r.rec", server.address, ReplayOptions(sender="h2", timeout_s=0.2)).run()
        assert rep.invariant_ok and rep.scheduled == n
        assert rep.timeouts == n, rep  # every call: DEADLINE_EXCEEDED at 0.2 s, not the 3 s reply
        run = ReplayRun(tmp_path / "r.rec", server.address, ReplayOptions(sender="h2", timeout_s=10.0,
                                                                         stop_grace_s=0.2))
        threading.Timer(0.6, run.stop).start()
        started = time.monotonic()
        rep = run.run()
        elapsed = time.monotonic() - started
    assert rep.invariant_ok and rep.scheduled == n
    assert rep.errors.get("CANCELLED", 0) == n, rep  # all were in flight (the server takes 3 s)
    assert elapsed < 0.6 + 0.2 + 1.5  # tolerance: stop at 0.6 s + grace 0.2 s + 1.5 s for a noisy host


def test_lean_sender_runs_on_uvloop_and_grpc_stays_on_asyncio(tmp_path: Path) -> None:
    import uvloop

    write_unary_recording(tmp_path / "r.rec", [i * MS for i in range(5)])
    loops: dict[str, set[type]] = {}
    with EchoServer() as server:
        for sender, choice in (("h2", "auto"), ("grpc", "auto"), ("h2", "asyncio")):
            seen = loops.setdefault(f"{sender}/{choice}", set())
            rep = ReplayRun(tmp_path / "r.rec", server.address, ReplayOptions(sender=sender, event_loop=choice),
                            on_result=lambda _r, seen=seen: seen.add(type(asyncio.get_running_loop()))).run()
            assert rep.ok == 5
    assert loops == {"h2/auto": {uvloop.Loop}, "grpc/auto": {asyncio.new_event_loop().__class__},
                     "h2/asyncio": {asyncio.new_event_loop().__class__}}
    with pytest.raises(ValueError, match="event_loop"):
        ReplayRun(tmp_path / "r.rec", "127.0.0.1:1", ReplayOptions(event_loop="trio")).run()
