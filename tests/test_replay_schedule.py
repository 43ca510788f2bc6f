"""The pure schedule: exact due times at several speeds, window, loop, filters, rate scaling, shards."""

from __future__ import annotations

import random

import pytest

from capture.recording import Call, Message
from replay.errors import PlanError
from replay.schedule import PlannedCall, ScheduleOptions, build_plan

BASE = 5_000_000_000


def _calls(times_ms: list[int], flows: int = 1, method: str = "/s.S/A") -> list[Call]:
    return [Call(protocol="grpc", method=method if i % 3 else "/s.S/B", request_ts_ns=BASE + t * 1_000_000,
                 flow_id=1 + i % flows, id=i + 1,
                 requests=[Message("c2s", 0, BASE + t * 1_000_000, b"%d" % i)])
            for i, t in enumerate(times_ms)]


def _plan(calls: list[Call], **kw: object) -> list[PlannedCall]:
    return list(build_plan(lambda: iter(calls), ScheduleOptions(**kw)))  # type: ignore[arg-type]


@pytest.mark.parametrize("speed, expected_ms", [(1.0, [0, 10, 25, 100]), (2.0, [0, 5, 12.5, 50]),
                                                (0.5, [0, 20, 50, 200])])
def test_due_times_scale_exactly_with_speed(speed: float, expected_ms: list[float]) -> None:
    plan = _plan(_calls([0, 10, 25, 100]), speed=speed)
    assert [p.due_ns for p in plan] == [int(e * 1_000_000) for e in expected_ms]
    assert [p.index for p in plan] == [0, 1, 2, 3]


def test_window_selects_and_rebases() -> None:
    plan = _plan(_calls([0, 10, 25, 100, 150]), window=(0.010, 0.1))
    assert [p.due_ns for p in plan] == [0, 15_000_000]  # the calls at 10 ms and 25 ms


def test_loop_repeats_with_mean_gap_at_the_seam() -> None:
    plan = _plan(_calls([0, 10, 20]), loop=3, speed=2.0)
    # period = span 20 ms + mean gap 10 ms = 30 ms, at speed 2: 15 ms
    assert [p.due_ns // 1000 for p in plan] == [0, 5000, 10000, 15000, 20000, 25000, 30000, 35000, 40000]
    assert [p.loop for p in plan] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len({p.index for p in plan}) == 9


def test_method_and_flow_filters() -> None:
    calls = _calls([0, 1, 2, 3, 4, 5], flows=2)
    assert [p.method for p in _plan(calls, methods=frozenset({"A"}))] == ["/s.S/A"] * 4
    assert [p.flow_id for p in _plan(calls, flows=frozenset({2}))] == [2, 2, 2]


def test_stream_messages_keep_their_own_offsets() -> None:
    call = Call(protocol="grpc", method="/s.S/Bidi", kind="bidi", request_ts_ns=BASE, flow_id=1,
                requests=[Message("c2s", i, BASE + o, b"m") for i, o in enumerate([0, 4_000_000, 9_000_000])])
    (p,) = _plan([call], speed=2.0)
    assert [m.offset_ns for m in p.messages] == [0, 2_000_000, 4_500_000]


def test_rate_scaling_duplicates_or_thins_flows_deterministically() -> None:
    calls = _calls(list(range(0, 400, 4)), flows=50)
    doubled = _plan(calls, rate=2.0)
    assert len(doubled) == 200 and {p.connection for p in doubled} >= {"f1", "f1#1"}
    thin_a = _plan(calls, rate=0.5, seed=3)
    thin_b = _plan(calls, rate=0.5, seed=3)
    assert [p.index for p in thin_a] == [p.index for p in thin_b]
    kept = {p.flow_id for p in thin_a}
    rng = random.Random(3)
    expected = {f for f in range(1, 51) if rng.random() < 0.5}  # one draw per flow, first-seen order
    assert 10 < len(kept) < 40 and kept == expected
    # every call of a kept flow is kept: the per-connection sequence stays whole
    assert len(thin_a) == 2 * len(kept)


def test_shards_by_connection_partition_connections_and_preserve_order() -> None:
    calls = _calls(list(range(0, 60, 2)), flows=5)
    whole = _plan(calls)
    shards = [_plan(calls, shard=(w, 2), shard_by="connection") for w in range(2)]
    assert sorted(p.index for s in shards for p in s) == [p.index for p in whole]
    conns = [{p.connection for p in s} for s in shards]
    assert not conns[0] & conns[1] and conns[0] and conns[1]
    for s in shards:
        assert [p.due_ns for p in s] == sorted(p.due_ns for p in s)


@pytest.mark.parametrize("workers", [2, 3])
def test_shards_by_call_split_one_connection_evenly(workers: int) -> None:
    calls = _calls(list(range(0, 100, 1)), flows=1)          # one recorded connection, 100 calls
    whole = _plan(calls)
    shards = [_plan(calls, shard=(w, workers)) for w in range(workers)]   # by call is the default
    assert sorted(p.index for s in shards for p in s) == [p.index for p in whole]
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 100
    for w, s in enumerate(shards):
        assert {p.connection for p in s} == {"f1"}            # each worker opens its own "f1"
        assert [p.due_ns for p in s] == sorted(p.due_ns for p in s)
        assert all(p.index % workers == w for p in s)
        # a call is never split: same due time and bytes as in the whole plan
        assert [(p.due_ns, p.messages) for p in s] == [(whole[p.index].due_ns, whole[p.index].messages) for p in s]


def test_shards_by_call_keep_a_streams_messages_on_one_worker() -> None:
    calls = [Call(protocol="grpc", method="/s.S/Bidi", kind="bidi", request_ts_ns=BASE + i * 10_000_000, flow_id=1,
                  id=i + 1, requests=[Message("c2s", j, BASE + i * 10_000_000 + j * 1_000_000, b"%d.%d" % (i, j))
                                      for j in range(3)])
             for i in range(6)]
    shards = [_plan(calls, shard=(w, 2)) for w in range(2)]
    assert [len(s) for s in shards] == [3, 3]
    for s in shards:
        for p in s:
            assert [m.data for m in p.messages] == [b"%d.%d" % (p.index, j) for j in range(3)]
            assert [m.offset_ns for m in p.messages] == [0, 1_000_000, 2_000_000]


@pytest.mark.parametrize("kw", [{"speed": 0.05}, {"speed": 101.0}, {"window": (2.0, 1.0)}, {"loop": 0},
                                {"shard": (2, 2)}, {"shard_by": "flow"}])
def test_bad_options_are_plan_errors(kw: dict[str, object]) -> None:
    with pytest.raises(PlanError):
        _plan(_calls([0]), **kw)
