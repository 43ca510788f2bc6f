"""The whole guard in virtual time: exact event trajectory from calls to alerts, limiter and tier."""

from __future__ import annotations

import pytest

from agent_under_test.errors import ServeError
from agent_under_test.hooks import GuardConfig
from agent_under_test.protection import ProtectionGuard, build_guard
from wire.clock import FakeClock


def guard(**kw) -> tuple[ProtectionGuard, FakeClock]:
    clock = FakeClock.at(1000.0)
    cfg = GuardConfig(**{"limiter": "seed", "initial_rate": 1000.0, "min_samples": 10, **kw})
    return ProtectionGuard(cfg, clock), clock


def one_period(g: ProtectionGuard, clock: FakeClock, latency_ms: float, calls: int = 20) -> None:
    for _ in range(calls):
        assert g.admit("Decide") is None
        g.finish("Decide", latency_ms / 1000.0, "ok")
    clock.advance(1.0)
    g.tick()


def test_overload_then_recovery_gives_the_exact_event_trajectory():
    g, clock = guard()
    for ms in [30.0] * 3 + [5.0] * 4:
        one_period(g, clock, ms)
    events = g.events.since(0)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    alerts = [(e["period"], e["from"], e["to"]) for e in events if e["type"] == "alert"]
    assert alerts == [(1, "inactive", "pending"), (3, "pending", "firing"), (6, "firing", "inactive")]
    rates = [e["new_rate"] for e in events if e["type"] == "limiter"]
    assert rates == pytest.approx([900.0, 810.0, 729.0, 801.9, 882.09, 970.299, 1067.3289])
    tiers = [(e["from"], e["to"], e["reason"], e["mono"]) for e in events if e["type"] == "tier"]
    # Light on the 3rd breaching period; full again one healthy period after the alert resolved.
    assert tiers == [("full", "light", "alert", 1003.0), ("light", "full", "recovered", 1007.0)]
    periods = [e for e in events if e["type"] == "period"]
    assert [p["state"] for p in periods] == ["breaching"] * 3 + ["healthy"] * 4
    assert periods[0]["count"] == 20 and periods[0]["p99_ms"] == pytest.approx(30.0, rel=1e-3)
    assert g.tier == "full" and g.alert_state() == "inactive"


def test_each_period_event_carries_the_keys_the_harness_codes_against():
    g, clock = guard()
    one_period(g, clock, 1.0, calls=3)
    (event,) = g.events.since(0, "period")
    for key in ("seq", "ts", "mono", "type", "period", "count", "p50_ms", "p95_ms", "p99_ms", "ok", "rejected",
                "errors", "state"):
        assert key in event
    assert event["state"] == "insufficient" and event["ts"] == clock.wall()


def test_rejections_get_a_retry_hint_and_are_counted_everywhere():
    g, clock = guard(initial_rate=20.0, min_rate=20.0, burst_s=0.1)   # 2 calls of burst
    hints = [g.admit("Decide") for _ in range(5)]
    assert hints[:2] == [None, None] and hints[2] == pytest.approx(0.05)
    clock.advance(1.0)
    summary = g.tick()
    assert summary.rejected == 3 and summary.count == 0
    assert 'agent_requests_total{outcome="rejected"} 3.0' in g.metrics.exposition().decode()


def test_queue_depth_switches_tier_and_emits_events_with_reason_queue():
    g, clock = guard()
    tiers = []
    for depth in (3, 6, 7, 8) + (2,) * 10:       # one pass every 0.25 s
        tiers.append(g.choose_tier(depth))
        clock.advance(0.25)
    # Light once deep for 0.25 s; full once drained 0.25 s and 2 periods after the switch.
    assert tiers == ["full"] * 2 + ["light"] * 8 + ["full"] * 4
    assert [(e["to"], e["reason"]) for e in g.events.since(0, "tier")] == [("light", "queue"), ("full", "recovered")]


def test_queue_light_depth_zero_leaves_degradation_to_the_alert_alone() -> None:
    from agent_under_test.config import ServeOptions

    cfg = ServeOptions(queue_light_depth=0, metrics_port=None).guard_config()
    g, clock = guard(queue_light_depth=cfg.queue_light_depth)
    assert [g.choose_tier(depth) for depth in (6, 500, 10_000)] == ["full"] * 3 and g.events.since(0, "tier") == []
    assert ServeOptions(queue_light_depth=8, metrics_port=None).guard_config().queue_light_depth == 8


def test_metrics_show_rate_alert_tier_and_the_threshold_bucket():
    g, clock = guard(p99_threshold_ms=7.0)
    for _ in range(3):
        one_period(g, clock, 30.0)
    text = g.metrics.exposition().decode()
    assert 'agent_request_latency_seconds_bucket{le="0.007"}' in text
    assert 'agent_alert_firing{alert="P99High"} 1.0' in text
    assert 'agent_model_tier{tier="light"} 1.0' in text and "agent_limiter_rate 729.0" in text
    assert 'agent_period_latency_seconds{quantile="0.99"} 0.030' in text
    g.on_stage("strategy", 0.001)
    g.on_batch(8, 3, "light")
    text = g.metrics.exposition().decode()
    assert 'agent_stage_latency_seconds_count{stage="strategy"} 1.0' in text and "agent_queue_depth 3.0" in text
    assert "agent_batch_size_count 1.0" in text


def test_off_limiter_still_monitors_and_bad_settings_fail_with_a_hint():
    g, clock = guard(limiter="off")
    for _ in range(3):
        one_period(g, clock, 30.0, calls=500)
    assert g.alert_state() == "firing" and not g.events.since(0, "limiter")
    with pytest.raises(ServeError, match="unknown limiter 'fast'"):
        build_guard(GuardConfig(limiter="fast"))
    with pytest.raises(ServeError, match="period-s"):
        build_guard(GuardConfig(period_s=0))


def test_alerts_disabled_never_fire_nor_degrade_but_the_limiter_still_acts():
    g, clock = guard(alerts=False)
    for ms in [30.0] * 4:
        one_period(g, clock, ms)
    events = g.events.since(0)
    assert [e for e in events if e["type"] in ("alert", "tier")] == []
    assert g.alert_state() == "inactive" and g.tier == "full"
    assert [e["new_rate"] for e in events if e["type"] == "limiter"] == pytest.approx([900.0, 810.0, 729.0, 656.1])
