"""The lean h2 replay client's cheap paths keep the old behaviour: the plan read by position and in
bursts, the header policy's per-name decisions, stream deadlines in one heap per connection, answers
derived once per block."""

from __future__ import annotations

import asyncio
import pickle
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from capture.errors import CorruptRecordingError
from capture.recording import Call, Flow, Message, Recording, RecordingWriter
from replay.engine import ReplayRun
from replay.options import ReplayOptions
from replay.plan import plan_from_recording
from replay.schedule import PlannedCall, PlannedMessage, ScheduleOptions
from replay.senders import SENDERS, SendOutcome
from replay.senders.h2 import H2Sender
from replay.senders.headers import MARKER, HeaderPolicy
from replay.testing import DECIDE, EchoServer, FakeSender, snapshot_bytes
from wire.clock import FakeClock


def _calls(flow: int) -> list[Call]:
    """Calls whose rows vary in every way the reader checks: NULLs, statuses, metadata, messages, flags."""
    base = 5_000_000_000
    return [
        Call(protocol="grpc", method=DECIDE, request_ts_ns=base, flow_id=flow, stream_id=1,
             request_metadata=[("x-id", "1"), ("authorization", "[REDACTED]")], status=0,
             response_ts_ns=base + 10, end_ts_ns=base + 20,
             requests=[Message("c2s", 0, base, b"req-1")], responses=[Message("s2c", 0, base + 10, b"resp-1")]),
        Call(protocol="grpc", method=None, request_ts_ns=base + 100, flow_id=flow, kind="bidi", method_unknown=True,
             status=None, status_message="status hidden",
             requests=[Message("c2s", 0, base + 100, b"a"), Message("c2s", 1, base + 150, b"\x1f\x8b", True)]),
        Call(protocol="http1", method="GET /x?y=1", request_ts_ns=base + 200, flow_id=None, kind="request", status=404,
             request_metadata=[("Host", "h"), ("Accept", "*/*")], response_metadata=[("Server", "s")],
             responses=[Message("s2c", 0, base + 300, b"not found")]),
        Call(protocol="grpc", method=DECIDE, request_ts_ns=base + 300, flow_id=flow, status=8, status_message="shed",
             requests=[Message("c2s", 0, base + 300, b"req-4")]),
    ]


def _write(path: Path) -> list[Call]:
    with RecordingWriter(path, meta={"host": "test"}) as w:
        flow = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 50051), protocol="grpc"))
        calls = _calls(flow)
        for c in calls:
            c.id = w.add_call(c)
    return calls


def test_the_plan_read_returns_every_column_of_every_call_as_written(tmp_path: Path) -> None:
    written = _write(tmp_path / "r.rec")
    with Recording(tmp_path / "r.rec") as rec:
        read = list(rec.calls(batch_size=3))  # a batch boundary inside the file
        assert rec.problems == []
    assert read == written


def _damage(path: Path, *statements: str) -> None:
    db = sqlite3.connect(path)
    for sql in statements:
        db.execute(sql)
    db.commit()
    db.close()


def test_damaged_rows_are_left_out_and_said_exactly_as_before(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    written = _write(path)
    _damage(path, "UPDATE calls SET status_message = 'flipped' WHERE id = 3",      # a call row's bytes
            "UPDATE messages SET data = X'00' WHERE call_id = 4")                  # one of a call's messages
    rec, plan = plan_from_recording(path, ScheduleOptions())
    try:
        planned = list(plan)
        problems = list(rec.problems)
        left_out = rec.left_out
    finally:
        rec.close()
    assert [p.call_id for p in planned] == [written[0].id, written[1].id]
    assert problems == ["1 call(s) left out: their row failed its checksum (bytes damaged on disk)",
                        "1 call(s) left out: a message of theirs failed its checksum (bytes damaged on disk)"]
    assert left_out == {"calls": 1, "messages": 1}


def test_a_row_whose_column_is_not_its_type_is_named_as_before(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    _write(path)
    # crc NULL: unchecked, as rows from before checksums; the type check must still catch the damage
    _damage(path, "UPDATE calls SET crc = NULL, end_ts_ns = 'soon' WHERE id = 2")
    with Recording(path) as rec, pytest.raises(CorruptRecordingError, match="row 2 of calls is unreadable "
                                                                             r"\(end_ts_ns is 'soon', not an integer\)"):
        list(rec.calls())


def test_unchecked_rows_of_an_older_file_still_read(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    written = _write(path)
    _damage(path, "UPDATE calls SET crc = NULL", "UPDATE messages SET crc = NULL")
    with Recording(path) as rec:
        assert list(rec.calls()) == written


def test_the_header_policy_decides_names_once_but_values_every_call() -> None:
    policy = HeaderPolicy.from_options(("authorization=Bearer shadow",), ("x-debug-*",))
    first = [("X-Token", "[REDACTED]"), ("X-Debug-Id", "7"), ("traceparent", "00-1"), ("Accept", "a")]
    second = [("X-Token", "kept now"), ("X-Debug-Id", "8"), ("Accept", "b"), ("Authorization", "Bearer prod")]
    expected_first = [("accept", "a"), ("authorization", "Bearer shadow"), MARKER]
    expected_second = [("x-token", "kept now"), ("accept", "b"), ("authorization", "Bearer shadow"), MARKER]
    assert policy.apply(first) == expected_first
    assert policy.apply(second) == expected_second  # the same names, decided by value where values matter
    assert pickle.loads(pickle.dumps(policy)).apply(second) == expected_second  # as --workers get it
    # a recorded Connection header makes the headers it names hop-by-hop, for that call only
    named = [("Connection", "x-hop, keep-alive"), ("X-Hop", "1"), ("Accept", "c")]
    assert policy.apply(named, "http1") == [("accept", "c"), ("authorization", "Bearer shadow"), MARKER]
    assert policy.apply([("X-Hop", "1")], "http1") == [("x-hop", "1"), ("authorization", "Bearer shadow"), MARKER]
    assert HeaderPolicy() == HeaderPolicy()  # what it learns is no part of its value


def _unary(index: int) -> PlannedCall:
    return PlannedCall(index, 0, "c0", "grpc", DECIDE, "unary", [PlannedMessage(0, snapshot_bytes(index))],
                       metadata=[("x-replay-test", str(index))])


def test_deadlines_share_one_timer_per_connection_and_leave_nothing_behind() -> None:
    """Calls started on one connection (the engine's fast path) with short and long deadlines against a
    server that answers after 0.3 s: the short ones time out at their deadline, the long ones finish
    ok, and once closed the connection holds no deadline entry and no armed timer."""
    async def go(address: str) -> tuple[list[SendOutcome], list[float], int, tuple[int, bool]]:
        sender = H2Sender(address)
        await sender.prepare("c0")
        conn = sender._conns["c0"]
        outs: dict[int, SendOutcome] = {}
        ends: dict[int, float] = {}
        t0 = time.monotonic()

        def done(i: int) -> Callable[[SendOutcome], None]:
            def end(out: SendOutcome) -> None:
                outs[i], ends[i] = out, time.monotonic() - t0
            return end
        for i, timeout in enumerate([0.1, 5.0, 0.05, 5.0, 0.15]):
            assert sender.start(_unary(i), timeout, done(i)) is not None
        while len(outs) < 5:
            await asyncio.sleep(0.01)
        held = len(conn.deadlines)  # the two answered calls' entries wait for their turn at the top
        await sender.close()
        return [outs[i] for i in range(5)], [ends[i] for i in range(5)], held, \
            (len(conn.deadlines), conn.deadline_timer is None)
    with EchoServer(delay_s=0.3) as server:
        outs, ends, held, (entries, disarmed) = asyncio.run(go(server.address))
    assert [(o.outcome, o.code) for o in outs] == [("timeout", "DEADLINE_EXCEEDED"), ("ok", "OK"),
                                                   ("timeout", "DEADLINE_EXCEEDED"), ("ok", "OK"),
                                                   ("timeout", "DEADLINE_EXCEEDED")]
    # each timed out at its own deadline (tolerance: +0.1 s for a loaded host), before the answers came
    for i, deadline in ((0, 0.1), (2, 0.05), (4, 0.15)):
        assert deadline - 0.002 <= ends[i] < deadline + 0.1
    assert held == 2
    assert (entries, disarmed) == (0, True)


def test_deadline_entries_of_ended_streams_do_not_pile_up() -> None:
    """1,000 calls answered at once with a 30 s deadline each: the heap keeps about what is in flight."""
    async def go(address: str) -> tuple[int, int]:
        sender = H2Sender(address)
        try:
            await sender.prepare("c0")
            outs: list[SendOutcome] = []
            most = 0
            for i in range(1000):
                sender.start(_unary(i), 30.0, outs.append)
                conn = sender._conns["c0"]
                most = max(most, len(conn.deadlines) - len(conn.streams))
                if i % 50 == 49:
                    while len(outs) < i + 1:
                        await asyncio.sleep(0.005)
            return most, sum(o.outcome == "ok" for o in outs)
        finally:
            await sender.close()
    with EchoServer(fast=True) as server:
        stale_most, ok = asyncio.run(go(server.address))
    assert ok == 1000
    assert stale_most <= 64 + 50 + 1  # compaction keeps ended entries to about the calls in flight


def test_a_repeated_answer_block_gives_each_call_its_own_outcome() -> None:
    """Rejections and successes from one server: the same trailer blocks repeat on the connection (their
    meaning is derived once), and every call still gets the outcome of the block it received."""
    async def go(address: str) -> list[SendOutcome]:
        sender = H2Sender(address)
        try:
            await sender.prepare("c0")
            outs: dict[int, SendOutcome] = {}
            def done(i: int) -> Callable[[SendOutcome], None]:
                def end(out: SendOutcome) -> None:
                    outs[i] = out
                return end
            for i in range(12):
                sender.start(_unary(i), 5.0, done(i))
                while len(outs) < i + 1:
                    await asyncio.sleep(0.002)
            return [outs[i] for i in range(12)]
        finally:
            await sender.close()
    with EchoServer(reject_every=3) as server:
        outs = asyncio.run(go(server.address))
    assert [(o.outcome, o.code, o.detail) for o in outs] == \
        [("ok", "OK", ""), ("ok", "OK", ""), ("rejected", "RESOURCE_EXHAUSTED", "shed")] * 4
    assert all(len(o.responses) == 1 for o in outs if o.outcome == "ok")


def test_the_lookahead_is_refilled_in_bursts_and_each_call_still_enters_it_early() -> None:
    """In virtual time, 1,000 calls 1 ms apart with a 200 ms lookahead: the plan is read in bursts (a
    refill once a quarter of the lookahead is used, not a call or two per wake-up), and every call is
    read at least 150 ms and at most 200 ms (+ the one pending) before it is due, so its connection is
    prepared as early as before within 50 ms."""
    ms = 1_000_000
    clock = FakeClock(start_ns=0)
    fake = FakeSender(clock)
    SENDERS.add("fake", lambda target, **_: fake)
    pulled: list[tuple[int, int]] = []

    def plan() -> Iterator[PlannedCall]:
        for i in range(1000):
            pulled.append((clock.now_ns(), i * ms))
            yield PlannedCall(index=i, due_ns=i * ms, connection="c", protocol="grpc", method="/m", kind="unary",
                              messages=[PlannedMessage(0, b"x")])
    try:
        rep = ReplayRun(plan(), "127.0.0.1:1", ReplayOptions(sender="fake", lookahead_s=0.2), clock=clock).run()
    finally:
        SENDERS.discard("fake")
    assert rep.ok == 1000 and rep.invariant_ok and rep.lag_us["max"] == 0
    ahead = [due - now for now, due in pulled if due >= 200 * ms]  # after the first lookahead
    assert min(ahead) >= 150 * ms - ms and max(ahead) <= 200 * ms + ms
    bursts = len({now for now, _ in pulled})
    assert bursts <= 1000 // 40, bursts  # ~50 calls a burst here, not one per wake-up


def test_refill_bursts_keep_slow_batch_reads_away_from_the_next_send() -> None:
    """Virtual time, 2,000 calls/s: reading a call costs 13 us and every 16th read also a 300 us batch
    (SQLite under load), longer than the 200 us margin. Read a call or two per wake-up, right after a
    send, such a batch ends before the next send; a refill burst must keep it there too (read up to the
    margin alone, 409 of 8,000 sends went out late here)."""
    clock = FakeClock(start_ns=0)
    fake = FakeSender(clock)
    SENDERS.add("fake", lambda target, **_: fake)
    gap = 500_000

    def plan() -> Iterator[PlannedCall]:
        for i in range(8000):
            clock.advance_ns(13_000 + (300_000 if i % 16 == 0 else 0))
            yield PlannedCall(index=i, due_ns=i * gap, connection="c", protocol="grpc", method="/m", kind="unary",
                              messages=[PlannedMessage(0, b"x")])
    try:
        run = ReplayRun(plan(), "127.0.0.1:1", ReplayOptions(sender="fake"), clock=clock)
        rep = run.run()
    finally:
        SENDERS.discard("fake")
    assert rep.ok == 8000 and rep.invariant_ok
    assert max(t - run.t0_ns - i * gap for t, i, _ in fake.sends) == 0
