"""Degradation in virtual time: the alert and queue reasons, the sustain time and the tier hold."""

from __future__ import annotations

import pytest

from agent_under_test.degrade import TierSelector


def moves(changes):
    return [(c.from_tier, c.to_tier, c.reason) for c in changes if c is not None]


def drive(t: TierSelector, depth_at, seconds: float, step_ms: int = 50) -> list[tuple[float, str, str]]:
    """One forward pass every `step_ms` for `seconds`, the depth from `depth_at(k)`; the changes with
    their times (ms kept whole so the times are exact)."""
    out = []
    for k in range(int(seconds * 1000) // step_ms):
        now = k * step_ms / 1000
        change = t.on_queue(depth_at(k), now)
        if change is not None:
            out.append((round(now, 3), change.to_tier, change.reason))
    return out


def test_depth_levels_without_sustain_or_hold_go_light_above_five_and_back_at_two():
    t = TierSelector(light_depth=5, drain_depth=2, hold_periods=0, sustain_s=0.0)
    got = [t.on_queue(d, 0.0) for d in (1, 5, 6, 7, 4, 3, 6, 2, 5)]
    assert moves(got) == [("full", "light", "queue"), ("light", "full", "recovered")]
    assert [c is not None for c in got] == [False, False, True, False, False, False, False, True, False]


@pytest.mark.parametrize("high, low", [(6, 4), (9, 0), (50, 3)])
def test_a_queue_oscillating_around_the_depth_every_50ms_never_changes_the_tier(high, low):
    # Deep for one pass (50 ms), then not: never deep for the 0.25 s sustain time, so 0 changes in 10 s.
    assert drive(TierSelector(), lambda k: high if k % 2 == 0 else low, 10.0) == []
    # Without the sustain time and the hold the same queue flips the tier at every pass (9/0: 200 in 10 s).
    bare = drive(TierSelector(hold_periods=0, sustain_s=0.0), lambda k: high if k % 2 == 0 else low, 10.0)
    assert len(bare) == (200 if low <= 2 else 1)


def test_a_queue_deep_300ms_then_empty_300ms_changes_the_tier_once_per_two_periods():
    # The worst case for the queue reason: each deep and each empty stretch outlasts the sustain time.
    # Every change then waits for the 2 s hold, and comes at the first pass due after it.
    got = drive(TierSelector(), lambda k: 9 if k % 12 < 6 else 0, 10.0)
    assert got == [(0.25, "light", "queue"), (2.35, "full", "recovered"), (4.45, "light", "queue"),
                   (6.55, "full", "recovered"), (8.65, "light", "queue")]
    # 5 changes in 10 s (at most 3 in any 6 s); the same queue without hysteresis: 34 changes.
    assert len(drive(TierSelector(hold_periods=0, sustain_s=0.0), lambda k: 9 if k % 12 < 6 else 0, 10.0)) == 34


def test_a_sustained_deep_queue_switches_after_the_sustain_time_or_when_the_hold_ends():
    # Deep from 0 s to 0.3 s, empty until 2.3 s, deep again: light at 0.25 s (the sustain time), full
    # at 2.25 s (drained long enough, and 2 periods after the switch), light again at 4.25 s (deep since
    # 2.3 s, so due at 2.55 s, but held until 2 periods after the change at 2.25 s).
    got = drive(TierSelector(), lambda k: 9 if k < 6 or k >= 46 else 0, 6.0)
    assert got == [(0.25, "light", "queue"), (2.25, "full", "recovered"), (4.25, "light", "queue")]


def test_the_hold_is_counted_in_periods_of_the_agent():
    t = TierSelector(hold_periods=2, sustain_s=0.0, period_s=0.5)
    assert moves([t.on_queue(9, 10.0)]) == [("full", "light", "queue")]
    assert t.on_queue(0, 10.5) is None and t.on_queue(0, 10.99) is None       # drained, but held 1 s
    assert moves([t.on_queue(0, 11.0)]) == [("light", "full", "recovered")]


def test_alert_light_returns_to_full_only_after_the_hold():
    t = TierSelector(hold_periods=2)
    assert t.on_period(False, "breaching", 1.0) is None           # pending: still full
    assert moves([t.on_period(True, "breaching", 2.0)]) == [("full", "light", "alert")]
    assert t.on_period(True, "healthy", 3.0) is None              # still firing (healing)
    assert t.on_period(False, "healthy", 4.0) is None             # resolving period: 1st of 2 calm periods
    assert t.on_period(False, "insufficient", 5.0) is None        # neither counts nor resets
    assert t.on_period(False, "breaching", 6.0) is None           # resets the hold
    assert t.on_period(False, "healthy", 7.0) is None
    assert moves([t.on_period(False, "healthy", 8.0)]) == [("light", "full", "recovered")]


def test_the_alert_degrades_at_once_even_inside_the_hold():
    t = TierSelector()
    assert drive(t, lambda k: 9 if k < 6 else 0, 2.3) == [(0.25, "light", "queue"), (2.25, "full", "recovered")]
    # 0.75 s after the last change: the queue would wait, the alert does not.
    assert moves([t.on_period(True, "breaching", 3.0)]) == [("full", "light", "alert")]


def test_queue_and_alert_overlap_without_flapping():
    t = TierSelector()
    assert moves([t.on_period(True, "breaching", 1.0)]) == [("full", "light", "alert")]
    # Under the alert the queue reason comes and goes with no tier change (and no event) either way.
    assert [t.on_queue(9, 1.0 + k / 10) for k in range(5)] == [None] * 5 and t.queue_light
    assert [t.on_queue(0, 1.5 + k / 10) for k in range(5)] == [None] * 5 and not t.queue_light
    assert t.on_period(False, "healthy", 2.0) is None
    assert moves([t.on_period(False, "healthy", 3.0)]) == [("light", "full", "recovered")]


def test_light_base_tier_never_changes_and_bad_levels_are_refused():
    t = TierSelector(base_tier="light")
    assert t.on_queue(50, 0.0) is None and t.on_queue(50, 1.0) is None
    assert t.on_period(True, "breaching", 1.0) is None and t.tier == "light"
    with pytest.raises(ValueError):
        TierSelector(light_depth=5, drain_depth=5)
    with pytest.raises(ValueError):
        TierSelector(hold_periods=-1)
    with pytest.raises(ValueError):
        TierSelector(period_s=0.0)
