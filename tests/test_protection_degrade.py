"""Degradation in virtual time: alert-driven light tier with hysteresis, queue-driven light tier."""

from __future__ import annotations

import pytest

from agent_under_test.degrade import TierSelector


def moves(changes):
    return [(c.from_tier, c.to_tier, c.reason) for c in changes if c is not None]


def test_queue_above_five_goes_light_until_it_drains_to_two():
    t = TierSelector(light_depth=5, drain_depth=2, hold_s=0.0)
    got = [t.on_queue(d, 0.0) for d in (1, 5, 6, 7, 4, 3, 6, 2, 5)]
    assert moves(got) == [("full", "light", "queue"), ("light", "full", "recovered")]
    assert [c is not None for c in got] == [False, False, True, False, False, False, False, True, False]


def test_queue_light_holds_at_least_hold_s_even_if_drained_sooner():
    t = TierSelector(light_depth=5, drain_depth=2, hold_s=0.5)
    assert moves([t.on_queue(9, 10.0)]) == [("full", "light", "queue")]
    assert t.on_queue(0, 10.2) is None and t.on_queue(0, 10.49) is None      # drained, but held
    assert moves([t.on_queue(0, 10.5)]) == [("light", "full", "recovered")]


def test_alert_light_returns_to_full_only_after_the_hold():
    t = TierSelector(hold_periods=2)
    assert t.on_period(False, "breaching") is None           # pending: still full
    assert moves([t.on_period(True, "breaching")]) == [("full", "light", "alert")]
    assert t.on_period(True, "healthy") is None              # still firing (healing)
    assert t.on_period(False, "healthy") is None             # resolving period: 1st of 2 calm periods
    assert t.on_period(False, "insufficient") is None        # neither counts nor resets
    assert t.on_period(False, "breaching") is None           # resets the hold
    assert t.on_period(False, "healthy") is None
    assert moves([t.on_period(False, "healthy")]) == [("light", "full", "recovered")]


def test_queue_and_alert_overlap_without_flapping():
    t = TierSelector()
    assert moves([t.on_period(True, "breaching")]) == [("full", "light", "alert")]
    assert t.on_queue(9, 0.0) is None and t.on_queue(0, 1.0) is None   # already light: no event either way
    for verdict in ("healthy", "healthy"):
        last = t.on_period(False, verdict)
    assert moves([last]) == [("light", "full", "recovered")]


def test_light_base_tier_never_changes_and_bad_levels_are_refused():
    t = TierSelector(base_tier="light")
    assert t.on_queue(50, 0.0) is None and t.on_period(True, "breaching") is None and t.tier == "light"
    with pytest.raises(ValueError):
        TierSelector(light_depth=5, drain_depth=5)
