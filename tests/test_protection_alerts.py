"""Alert state machines and the period verdict, in virtual time with exact period numbers."""

from __future__ import annotations

import pytest

from agent_under_test.alerts import AlertMachine, AlertSet, ratio_verdict
from agent_under_test.monitor import classify, summary_from_values

B, H, INSUF = "breaching", "healthy", "insufficient"


def run(machine: AlertMachine, verdicts: str) -> list[tuple[int, str, str]]:
    """Feed verdicts (B/H/I letters, period numbers from 1); return (period, from, to) transitions."""
    out = []
    for n, letter in enumerate(verdicts, 1):
        t = machine.observe({"B": B, "H": H, "I": INSUF}[letter], n)
        if t is not None:
            out.append((t.period, t.from_state, t.to_state))
    return out


def test_fires_exactly_on_the_third_breaching_period_not_the_second():
    m = AlertMachine("P99High", fire_after=3, resolve_after=3)
    assert run(m, "BB") == [(1, "inactive", "pending")] and m.state == "pending"
    assert m.observe(B, 3).to_state == "firing"


def test_a_healthy_period_between_breaches_resets_pending():
    assert run(AlertMachine("P99High"), "BBHBB") == [(1, "inactive", "pending"), (3, "pending", "inactive"),
                                                       (4, "inactive", "pending")]


def test_insufficient_periods_neither_breach_nor_heal():
    m = AlertMachine("P99High")
    assert run(m, "BIBIIB") == [(1, "inactive", "pending"), (6, "pending", "firing")]
    # While firing: insufficient periods do not count towards resolving either.
    assert run(m, "HIHIH") == [(5, "firing", "inactive")]


def test_resolves_after_m_consecutive_healthy_periods_and_a_breach_restarts_the_count():
    m = AlertMachine("P99High", fire_after=3, resolve_after=3)
    got = run(m, "BBB" + "HHB" + "HHH")
    assert got == [(1, "inactive", "pending"), (3, "pending", "firing"), (9, "firing", "inactive")]


def test_fire_after_one_goes_straight_to_firing():
    assert run(AlertMachine("X", fire_after=1, resolve_after=1), "BH") == [(1, "inactive", "firing"),
                                                                          (2, "firing", "inactive")]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        AlertMachine("X", fire_after=0)


def test_period_verdicts_threshold_and_minimum_samples():
    assert classify(19, 50.0, 20.0, 20) == INSUF
    assert classify(20, 20.0, 20.0, 20) == H       # at the threshold is not above it
    assert classify(20, 20.5, 20.0, 20) == B
    s = summary_from_values(1, 0.0, 1.0, [1.0] * 98 + [30.0, 30.0], threshold_ms=20.0, min_samples=20)
    assert s.count == 100 and s.state == B and s.p99_ms == pytest.approx(30.0, rel=1e-3)
    s = summary_from_values(1, 0.0, 1.0, [1.0] * 99 + [30.0], threshold_ms=20.0, min_samples=20)
    assert s.state == H and s.p50_ms == pytest.approx(1.0, rel=1e-3)


def test_error_ratio_above_half_a_percent_breaches():
    assert ratio_verdict(5, 1000, 0.005, 20) == H          # exactly 0.5 % is not above it
    assert ratio_verdict(6, 1000, 0.005, 20) == B
    assert ratio_verdict(5, 10, 0.005, 20) == INSUF


def test_alert_set_runs_the_golden_signals_with_the_same_mechanism():
    alerts = AlertSet(fire_after=2, resolve_after=1, error_ratio=0.005, rejected_ratio=0.10, min_samples=20)
    moves = []
    for n in (1, 2):
        s = summary_from_values(n, 0.0, 1.0, [1.0] * 100, 20.0, 20, rejected=20, errors=1)
        moves += [(t.alert, t.to_state, t.period) for t in alerts.observe(s)]
    assert moves == [("ErrorRatioHigh", "pending", 1), ("RejectedRatioHigh", "pending", 1),
                     ("ErrorRatioHigh", "firing", 2), ("RejectedRatioHigh", "firing", 2)]
    assert not alerts.firing("P99High") and alerts.firing("ErrorRatioHigh")
