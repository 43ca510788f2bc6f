"""Traffic planning for a run: the seeded generator and the per-phase time warp (pure, no clock)."""

from __future__ import annotations

from harness.scenario import GeneratorTraffic
from harness.traffic import DECIDE, base_duration, generator_plan, warp
from replay.schedule import PlannedCall, PlannedMessage


def _call(i: int, due_s: float, offsets_ms: tuple[int, ...] = (0,)) -> PlannedCall:
    return PlannedCall(index=i, due_ns=int(due_s * 1e9), connection="c", protocol="grpc", method=DECIDE,
                       kind="unary", messages=[PlannedMessage(o * 1_000_000, b"x") for o in offsets_ms])


def test_warp_runs_each_phase_at_its_load() -> None:
    profile = [(0.0, 2.0, 1.0), (2.0, 4.0, 2.0), (4.0, 5.0, 1.0)]
    assert base_duration(profile) == 7.0          # 2 + 2*2 + 1 seconds of load-1 traffic
    calls = [_call(i, t) for i, t in enumerate([0.5, 1.9, 2.0, 3.0, 5.9, 6.0, 6.5, 7.0, 8.0])]
    out = [c.due_ns / 1e9 for c in warp(iter(calls), profile)]
    # base 2.0 -> run 2.0; base 3.0 -> 2.5; base 5.9 -> 3.95; base 6.0 -> 4.0; 6.5 -> 4.5; 7.0 is past the end
    assert out == [0.5, 1.9, 2.0, 2.5, 3.95, 4.0, 4.5]


def test_warp_shrinks_stream_offsets_in_a_fast_phase() -> None:
    out = list(warp(iter([_call(0, 1.0, (0, 20, 40))]), [(0.0, 10.0, 2.0)]))
    assert out[0].due_ns == 500_000_000 and [m.offset_ns for m in out[0].messages] == [0, 10_000_000, 20_000_000]


def test_generator_is_seeded_open_loop_and_doubles_in_an_overload_phase() -> None:
    traffic = GeneratorTraffic(rate=200.0, pattern="poisson", seed=None, stream_share=0.25)
    a = list(generator_plan(traffic, 4.0, seed=5))
    b = list(generator_plan(traffic, 4.0, seed=5))
    # Same seed, same schedule and call mix (snapshot timestamps are the wall clock, so bytes differ).
    assert [(c.due_ns, c.method) for c in a] == [(c.due_ns, c.method) for c in b]
    assert 650 < len(a) < 950                                   # 800 expected; poisson spread
    streams = [c for c in a if c.kind == "bidi"]
    assert 0.15 < len(streams) / len(a) < 0.35 and all(len(c.messages) == 3 for c in streams)
    profile = [(0.0, 2.0, 1.0), (2.0, 3.0, 2.0)]
    warped = [c.due_ns / 1e9 for c in warp(iter(generator_plan(traffic, base_duration(profile), 5)), profile)]
    first, second = sum(t < 2.0 for t in warped) / 2.0, sum(t >= 2.0 for t in warped) / 1.0
    assert 1.6 < second / first < 2.5                            # twice the rate in the load-2 phase
    constant = list(generator_plan(GeneratorTraffic(rate=10.0, pattern="constant"), 1.0, seed=1))
    assert [c.due_ns for c in constant] == [i * 100_000_000 for i in range(10)]
