"""The engine in virtual time: exact send times, stream offsets, stop, caps and the invariant."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from replay.engine import ReplayRun
from replay.errors import TargetNotAllowedError
from replay.options import ReplayOptions
from replay.schedule import PlannedCall, PlannedMessage, ScheduleOptions
from replay.senders import SENDERS, SendOutcome
from replay.stats import CallResult
from replay.testing import FakeSender, write_stream_recording, write_unary_recording
from wire.clock import FakeClock

MS = 1_000_000



@pytest.fixture(autouse=True)
def _fake_sender_removed() -> Iterator[None]:
    """Tests here add a "fake" sender; no other module sees it afterwards."""
    yield
    SENDERS.discard("fake")

def _run(path: Path, clock: FakeClock, sender: object, **kw: object) -> tuple[ReplayRun, list[CallResult]]:
    SENDERS.add("fake", lambda target, **_: sender)  # type: ignore[arg-type,return-value]
    results: list[CallResult] = []
    sched = ScheduleOptions(**{k: v for k, v in kw.items() if k in ScheduleOptions.__dataclass_fields__})
    rest = {k: v for k, v in kw.items() if k not in ScheduleOptions.__dataclass_fields__}
    opts = ReplayOptions(schedule=sched, sender="fake", **rest)  # type: ignore[arg-type]
    run = ReplayRun(path, "127.0.0.1:1", opts, on_result=results.append, clock=clock)
    run.run()
    return run, results


@pytest.mark.parametrize("speed", [1.0, 2.0, 0.5])
def test_sends_at_exact_virtual_times(tmp_path: Path, speed: float) -> None:
    offsets = [0, 3 * MS, 3 * MS, 10 * MS, 250 * MS, 1200 * MS]
    write_unary_recording(tmp_path / "r.rec", offsets, flows=2)
    clock = FakeClock(start_ns=0)
    fake = FakeSender(clock)
    run, results = _run(tmp_path / "r.rec", clock, fake, speed=speed)
    assert [t for t, _, _ in fake.sends] == [int(o / speed) for o in offsets]
    rep = run.report()
    assert rep.scheduled == rep.ok == 6 and rep.invariant_ok and rep.lag_us["max"] == 0
    assert sorted(r.index for r in results) == list(range(6))


def test_loop_and_window_in_virtual_time(tmp_path: Path) -> None:
    write_unary_recording(tmp_path / "r.rec", [0, 10 * MS, 20 * MS, 30 * MS])
    clock = FakeClock(start_ns=0)
    fake = FakeSender(clock)
    _run(tmp_path / "r.rec", clock, fake, window=(0.010, 0.030), loop=2)
    assert [t for t, _, _ in fake.sends] == [0, 10 * MS, 20 * MS, 30 * MS]


def test_stream_messages_released_at_their_offsets(tmp_path: Path) -> None:
    write_stream_recording(tmp_path / "s.rec", [0, 5 * MS, 7 * MS, 40 * MS], start_ns=2 * MS)
    clock = FakeClock(start_ns=0)
    fake = FakeSender(clock)
    run, _ = _run(tmp_path / "s.rec", clock, fake, speed=2.0)
    assert [t for t, _, _ in fake.sends] == [0, 2_500_000, 3_500_000, 20 * MS]
    assert run.report().ok == 1


def test_late_wakeups_send_every_overdue_call_and_measure_lag(tmp_path: Path) -> None:
    write_unary_recording(tmp_path / "r.rec", [i * MS for i in range(10)])
    clock = FakeClock(start_ns=0, lag_ns=int(2.5 * MS))  # every wake-up 2.5 ms late
    fake = FakeSender(clock)
    run, results = _run(tmp_path / "r.rec", clock, fake)
    times = [t for t, _, _ in fake.sends]
    assert times[0] == 0 and all(t >= i * MS for i, t in enumerate(times))
    assert len(set(times)) < len(times)  # several overdue calls went out on one wake-up
    assert max(r.sent_ns - r.intended_ns for r in results) <= int(2.5 * MS)
    assert run.report().lag_us["max"] > 0


class _Hanging:
    """A transport whose calls never finish until cancelled."""

    def __init__(self) -> None:
        self.started = 0

    async def call(self, planned: PlannedCall, requests: object, timeout_s: float) -> SendOutcome:
        self.started += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def close(self) -> None:
        pass


def test_in_flight_cap_sheds_and_counts(tmp_path: Path) -> None:
    write_unary_recording(tmp_path / "r.rec", [i * MS for i in range(6)])
    clock = FakeClock(start_ns=0)
    hanging = _Hanging()
    run, results = _run(tmp_path / "r.rec", clock, hanging, max_in_flight=2, timeout_s=0.05)
    rep = run.report()
    assert hanging.started == 2 and rep.not_sent_reasons == {"in_flight_cap": 4}
    assert rep.timeouts == 2 and rep.invariant_ok


def test_stop_from_another_thread_counts_the_rest_as_not_sent(tmp_path: Path) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 20 * MS for i in range(200)])
    seen = threading.Event()
    results: list[CallResult] = []

    def on_result(r: CallResult) -> None:
        results.append(r)
        if len(results) == 5:
            seen.set()
    SENDERS.add("fake", lambda target, **_: FakeSender(clock))  # type: ignore[arg-type,return-value]
    from wire.clock import MonotonicClock
    clock = MonotonicClock()
    run = ReplayRun(tmp_path / "r.rec", "127.0.0.1:1", ReplayOptions(sender="fake"), on_result=on_result)
    t = threading.Thread(target=run.run)
    t.start()
    assert seen.wait(10)
    run.stop()
    t.join(5)
    assert not t.is_alive()
    rep = run.report()
    assert rep.scheduled == n and rep.invariant_ok and rep.ok >= 5
    assert rep.not_sent_reasons["stopped"] == n - rep.ok  # tolerance: none; the fake never fails
    assert len(results) == n


def test_non_loopback_target_is_refused(tmp_path: Path) -> None:
    write_unary_recording(tmp_path / "r.rec", [0])
    with pytest.raises(TargetNotAllowedError, match="--allow-target"):
        ReplayRun(tmp_path / "r.rec", "192.0.2.10:50051")
    # explicitly allowed: accepted (nothing is sent here)
    ReplayRun(tmp_path / "r.rec", "192.0.2.10:50051", ReplayOptions(allow_targets=("192.0.2.0/24",)))


def test_timerfd_clock_wakes_at_or_after_each_deadline() -> None:
    from replay.clock import TimerfdClock

    clock = TimerfdClock(spin_ns=0)

    async def wakes() -> list[int]:
        out = []
        start = clock.now_ns() + 2 * MS
        for i in range(20):
            await clock.sleep_until(start + i * MS)
            out.append(clock.now_ns() - (start + i * MS))
        return out
    try:
        lateness = asyncio.run(wakes())
    finally:
        clock.close()
    assert all(x >= 0 for x in lateness)  # never early; how late is measured in bench/, not here


def test_plan_is_read_lazily_within_the_lookahead() -> None:
    """Bounded memory: a call is read from the plan no earlier than lookahead before it is due."""
    clock = FakeClock(start_ns=0)
    fake = FakeSender(clock)
    SENDERS.add("fake", lambda target, **_: fake)  # type: ignore[arg-type,return-value]
    pulled: list[tuple[int, int]] = []

    def plan() -> object:
        for i in range(2000):
            pulled.append((clock.now_ns(), i * MS))
            yield PlannedCall(index=i, due_ns=i * MS, connection="c", protocol="grpc", method="/m",
                              kind="unary", messages=[PlannedMessage(0, b"x")])
    run = ReplayRun(plan(), "127.0.0.1:1", ReplayOptions(sender="fake", lookahead_s=0.05), clock=clock)
    rep = run.run()
    assert rep.ok == 2000 and rep.invariant_ok
    # one item beyond the horizon may be held (the next pending one), never more
    assert all(due - now <= 50 * MS + MS for now, due in pulled)


def test_slow_plan_reads_never_delay_a_due_send() -> None:
    """Reading the plan costs time (SQLite batches): in virtual time each read here advances the
    clock 0.3 ms. Calls due now are read and sent first; the lookahead fills only while the next
    send is more than the read margin (0.2 ms) away, so no send is ever late by more than one read.
    (Filling the whole 50 ms lookahead before sending would make the first send ~15 ms late.)"""
    clock = FakeClock(start_ns=0)
    fake = FakeSender(clock)
    SENDERS.add("fake", lambda target, **_: fake)  # type: ignore[arg-type,return-value]

    def plan() -> object:
        for i in range(400):
            clock.advance_ns(300_000)
            yield PlannedCall(index=i, due_ns=20 * MS + i * MS, connection="c", protocol="grpc", method="/m",
                              kind="unary", messages=[PlannedMessage(0, b"x")])
    run = ReplayRun(plan(), "127.0.0.1:1", ReplayOptions(sender="fake", lookahead_s=0.05), clock=clock)
    rep = run.run()
    assert rep.ok == 400 and rep.invariant_ok
    lags = [t - run.t0_ns - (20 * MS + i * MS) for t, i, _ in fake.sends]
    assert [i for _, i, _ in fake.sends] == list(range(400))
    assert max(lags) <= 300_000, max(lags)


def test_connections_of_the_first_lookahead_open_before_the_clock_starts(tmp_path: Path) -> None:
    """Connecting is not lag: t0 is taken once the first lookahead's connections are ready (here
    each takes 5 ms of virtual time), and a connection that never becomes ready delays the start by
    at most the warm-up bound (1 s) and is then left to fail on its own calls."""
    write_unary_recording(tmp_path / "r.rec", [0, MS, 2 * MS], flows=3)
    clock = FakeClock(start_ns=0)

    class Connecting(FakeSender):
        prepared: list[tuple[str, int]] = []
        hang = False

        def prepare(self, connection: str) -> object:
            async def ready() -> None:
                await asyncio.sleep(0)
                if self.hang:
                    await asyncio.Event().wait()
                clock.advance_ns(5 * MS)
                self.prepared.append((connection, clock.now_ns()))
            return ready()

    fake = Connecting(clock)
    run, _ = _run(tmp_path / "r.rec", clock, fake)
    assert len(fake.prepared) == 3 and max(t for _, t in fake.prepared) <= run.t0_ns
    assert [(t - run.t0_ns, i) for t, i, _ in fake.sends] == [(0, 0), (MS, 1), (2 * MS, 2)]  # no lag at all
    Connecting.hang = True
    started = time.monotonic()
    run, _ = _run(tmp_path / "r.rec", FakeClock(start_ns=0), Connecting(FakeClock()))
    assert run.stats.outcomes["ok"] == 3 and 1.0 <= time.monotonic() - started < 1.0 + 3.0  # tolerance: noisy host


def test_a_protocol_without_sender_is_counted_not_sent() -> None:
    clock = FakeClock(start_ns=0)
    plan = [PlannedCall(index=0, due_ns=0, connection="c", protocol="mqtt", method="CONNECT", kind="request",
                        messages=[PlannedMessage(0, b"")])]
    rep = ReplayRun(plan, "127.0.0.1:1", clock=clock).run()
    assert rep.not_sent_reasons == {"no_sender:mqtt": 1}
    assert rep.invariant_ok


def test_allowlist_from_environment_and_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from replay.target import check_target, configured_allowlist

    monkeypatch.delenv("SHADOWTEST_ALLOW_TARGETS", raising=False)
    with pytest.raises(TargetNotAllowedError):
        check_target("192.0.2.7:80", use_config=False)
    monkeypatch.setenv("SHADOWTEST_ALLOW_TARGETS", "198.51.100.0/24, 192.0.2.7")
    assert check_target("192.0.2.7:80") == "192.0.2.7:80"
    conf = tmp_path / "allow-targets"
    conf.write_text("# shadow cluster\n203.0.113.0/28\n")
    assert "203.0.113.0/28" in configured_allowlist(conf)
    assert check_target("[::1]:50051") == "[::1]:50051"  # loopback v6 needs no entry


def test_replay_to_takes_every_replay_option_but_schedule_as_a_typed_keyword() -> None:
    import dataclasses

    from replay.engine import ReplayOptionFields

    fields = {f.name: f.type for f in dataclasses.fields(ReplayOptions) if f.name != "schedule"}
    typed = {name: getattr(t, "__forward_arg__", t) for name, t in ReplayOptionFields.__annotations__.items()}
    assert typed == fields   # the same names with the same annotations
