"""Every check against synthetic timelines: one that should pass, and one that should fail."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.checks import CHECKS, Verdict, evaluate_all
from harness.scenario import CheckSpec
from harness.timeline import CallResult, CpuSample, Event, FaultWindow, MetricSample, Timeline

PHASES = [("baseline", 0.0, 5.0), ("fault", 5.0, 10.0), ("recovery", 10.0, 15.0)]


def calls_with(latencies_ms: list[float], per_period: int = 20, outcome: str = "ok") -> list[CallResult]:
    """`per_period` calls in each 1 s period i, each taking latencies_ms[i], sent early in the period."""
    out = []
    for i, lat in enumerate(latencies_ms):
        for j in range(per_period):
            t = i + j * 0.02
            out.append(CallResult(t, t, t + lat / 1000, "/Decide", outcome))
    return out


def timeline(latencies_ms: list[float] | None = None, events: list[Event] | None = None, **kw) -> Timeline:
    lat = latencies_ms if latencies_ms is not None else [5.0] * 15
    return Timeline(period_s=1.0, threshold_ms=20.0, phases=PHASES, calls=kw.pop("calls", calls_with(lat)),
                    events=events or [], alert_periods=3, **kw)


def alert(t: float, to: str) -> Event:
    return Event(t, "alert", {"alert": "P99High", "from": "pending", "to": to})


def limiter(t: float, old: float, new: float) -> Event:
    return Event(t, "limiter", {"policy": "seed", "old_rate": old, "new_rate": new})


def tier(t: float, to: str) -> Event:
    return Event(t, "tier", {"from": "full" if to == "light" else "light", "to": to})


def run(kind: str, tl: Timeline, **params: Any) -> Verdict:
    return CHECKS[kind].evaluate(tl, CheckSpec(kind, params))


BREACH = [5.0] * 5 + [50.0] * 5 + [5.0] * 5   # client P99 over 20 ms in periods 5..9


def test_client_periods_are_computed_from_calls_alone() -> None:
    tl = timeline(BREACH)
    p = tl.periods
    assert len(p) == 15 and [x.p99_ms for x in p[4:7]] == [5.0, 50.0, 50.0]
    # A call stuck for 3 s counts in the period it was due in, with its whole latency.
    stuck = timeline(calls=calls_with([5.0] * 15) + [CallResult(2.1, 2.1, 5.1, "/Decide", "ok")])
    assert stuck.periods[2].p99_ms == 3000.0 and stuck.periods[5].completed == 21
    assert (p[0].offered, p[0].ok, p[0].phase, p[0].offered_rate) == (20, 20, "baseline", 20.0)
    few = timeline(calls=calls_with([5.0] * 15, per_period=3))
    assert few.periods[0].p99_ms is None   # too few samples: insufficient, neither breaching nor healthy


def test_alert_fires_within_k_periods_of_client_truth() -> None:
    # Truth: periods 5,6,7 breach -> truth at 8.0 s; K=1 -> deadline 9.0 s.
    good = run("alert_fires", timeline(BREACH, [alert(8.6, "firing")]), phase="fault")
    assert good.passed and good.evidence["ground_truth_s"] == 8.0 and good.evidence["breach_periods"] == [5, 6, 7]
    late = run("alert_fires", timeline(BREACH, [alert(9.5, "firing")]), phase="fault")
    assert not late.passed and "only at 9.5s" in late.summary and late.evidence["fired_s"] == 9.5
    # Already firing before the breach and still firing: not late (alert_silent judges false alarms).
    already = run("alert_fires", timeline(BREACH, [alert(3.0, "firing")]), phase="fault")
    assert already.passed and "already firing" in already.summary
    gone = run("alert_fires", timeline(BREACH, [alert(3.0, "firing"), alert(4.0, "inactive")]), phase="fault")
    assert not gone.passed
    never = run("alert_fires", timeline(BREACH), phase="fault")
    assert not never.passed and "never" in never.summary
    no_truth = run("alert_fires", timeline([5.0] * 15, [alert(6.0, "firing")]), phase="fault")
    assert not no_truth.passed and "did not breach" in no_truth.summary
    # A healthy period in the middle resets the run: 50,50,5,50,50,50 -> truth at the end of the 2nd run.
    broken = [5.0] * 5 + [50, 50, 5, 50, 50] + [50] + [5.0] * 4
    tl = timeline(broken, [alert(11.2, "firing")])
    v = run("alert_fires", tl, phase="fault", within_periods=1)
    assert v.passed and v.evidence["ground_truth_s"] == 11.0


def test_alert_silent() -> None:
    assert run("alert_silent", timeline(BREACH, [alert(8.5, "firing"), alert(12.0, "inactive")]),
               phase="baseline").passed
    v = run("alert_silent", timeline(BREACH, [alert(3.0, "firing"), alert(4.0, "inactive")]), phase="baseline")
    assert not v.passed and v.evidence["firing"] == [(3.0, 4.0)]
    # Firing before the phase and still firing during it is a false alarm in the phase too.
    assert not run("alert_silent", timeline(events=[alert(3.0, "firing")]), phase="recovery").passed


def test_limiter_reduces_and_recovers() -> None:
    evs = [limiter(1.0, 100, 110), limiter(2.0, 110, 121)] + \
          [limiter(6.0 + i, 121 * 0.9 ** i, 121 * 0.9 ** (i + 1)) for i in range(4)] + \
          [limiter(11.0 + i, 121 * 0.9 ** 4 * 1.1 ** i, 121 * 0.9 ** 4 * 1.1 ** (i + 1)) for i in range(4)]
    tl = timeline(events=evs)
    cut = run("limiter_reduces", tl, phase="fault", at_least_pct=30)
    assert cut.passed and cut.evidence["rate_at_start"] == 121 and cut.evidence["cut_pct"] == 34.4
    assert not run("limiter_reduces", tl, phase="fault", at_least_pct=40).passed
    back = run("limiter_recovers", tl, phase="recovery", to_pct_of_baseline=90, within_s=5.0)
    assert back.passed and back.evidence["reached_s"] == 14.0       # 79.4 * 1.1^4 = 116.2 >= 108.9
    slow = run("limiter_recovers", tl, phase="recovery", to_pct_of_baseline=90, within_s=2.5)
    assert not slow.passed and "needed 109/s" in slow.summary
    assert not run("limiter_reduces", timeline(), phase="fault").passed   # no limiter at all: says so


def test_degrades_and_restores() -> None:
    evs = [alert(8.0, "firing"), tier(8.1, "light"), alert(11.0, "inactive"), tier(12.0, "full")]
    tl = timeline(BREACH, evs)
    assert run("degrades", tl, phase="fault").passed
    assert run("restores", tl, phase="recovery", within_s=3.0).passed
    stuck = timeline(BREACH, [alert(8.0, "firing"), alert(11.0, "inactive")])
    assert not run("degrades", stuck, phase="fault").passed
    late = timeline(BREACH, [alert(8.0, "firing"), tier(8.1, "light"), alert(11.0, "inactive"), tier(14.5, "full")])
    v = run("restores", late, phase="recovery", within_s=2.0)
    assert not v.passed and "still light" in v.summary
    assert not run("restores", timeline(BREACH, [alert(8.0, "firing")]), phase="recovery").passed


def test_slo_and_error_rate() -> None:
    tl = timeline(BREACH)
    assert run("slo", tl, phase="baseline").passed
    bad = run("slo", tl, phase="fault", p99_ms=20)
    assert not bad.passed and bad.evidence["p99_ms"] == 50.0
    assert run("slo", tl, phase="fault", p99_ms=20, settle_s=5.0).passed is False  # window empty: too few
    calls = calls_with([5.0] * 15) + calls_with([5.0], per_period=4, outcome="error")
    assert not run("error_rate", timeline(calls=calls), max_pct=1.0).passed
    assert run("error_rate", timeline(calls=calls), max_pct=1.0, phase="fault").passed
    rej = calls_with([5.0] * 15) + calls_with([1.0] * 15, per_period=1, outcome="rejected")
    assert run("error_rate", timeline(calls=rej), max_pct=1.0).passed
    assert not run("error_rate", timeline(calls=rej), max_pct=1.0, include_rejected=True).passed


def _samples(ok: float, rejected: float) -> list[MetricSample]:
    return [MetricSample(-0.1, {'agent_requests_total{outcome="ok"}': 7.0}),
            MetricSample(15.5, {'agent_requests_total{outcome="ok"}': 7.0 + ok,
                                'agent_requests_total{outcome="rejected"}': rejected})]


def test_no_loss() -> None:
    calls = calls_with([5.0] * 15)
    good = run("no_loss", timeline(calls=calls, samples=_samples(300, 0), replay_report={"scheduled": 300}))
    assert good.passed and good.evidence["agent"] == {"ok": 300, "rejected": 0}
    lost = run("no_loss", timeline(calls=calls, samples=_samples(250, 0), replay_report={"scheduled": 300}))
    assert not lost.passed and lost.evidence["agent_seen"] == 250 and lost.evidence["client_sent"] == 300
    # A call the client gave up on (timeout) that the agent still answered is not a loss.
    late = calls[:-1] + [CallResult(14.5, 14.5, 16.5, "/Decide", "timeout")]
    assert run("no_loss", timeline(calls=late, samples=_samples(300, 0), replay_report={"scheduled": 300})).passed
    broken = run("no_loss", timeline(calls=calls, replay_report={"scheduled": 310}))
    assert not broken.passed and "accounting broken" in broken.summary


def test_fault_effective() -> None:
    fw = [FaultWindow("network:latency", "fault", "network", "latency", 5.0, 5.01)]
    assert run("fault_effective", timeline(BREACH, faults=fw), phase="fault").passed
    flat = run("fault_effective", timeline(faults=fw), phase="fault")
    assert not flat.passed and "did not reach" in flat.summary
    failed = [FaultWindow("cpu:quota", "fault", "cpu", "quota", 5.0, None, error="no cgroup")]
    assert "never took effect" in run("fault_effective", timeline(BREACH, faults=failed), phase="fault").summary
    cpu = [CpuSample(t, 50.0, 30.0 if t < 5 else 95.0) for t in range(15)]
    fw_cpu = [FaultWindow("cpu:contention", "fault", "cpu", "contention", 5.0, 5.1)]
    assert run("fault_effective", timeline(cpu=cpu, faults=fw_cpu), phase="fault", signal="host_cpu").passed
    srv = [Event(t + 0.5, "period", {"p99_ms": 10.0 if t < 5 else 12.0}) for t in range(15)]
    v = run("fault_effective", timeline(events=srv, faults=fw_cpu), phase="fault", min_increase_ms=5)
    assert not v.passed and v.evidence["signal"] == "server_latency"


def test_a_crashing_check_is_a_failed_verdict() -> None:
    verdicts = evaluate_all(timeline(), [CheckSpec("limiter_recovers", {"phase": "nope"})])
    assert len(verdicts) == 1 and verdicts[0].passed is False


def _service_periods(p99s: list[float], p95_of: Callable[[float], float] = lambda p99: p99 * 0.8) -> list[Event]:
    """The service's own period events (period k ends at t=k), 50 calls each."""
    return [Event(float(k), "period", {"period": k, "seq": k, "count": 50, "p50_ms": p99 / 2, "p95_ms": p95_of(p99),
                                       "p99_ms": p99, "state": "breaching" if p99 > 20 else "healthy"})
            for k, p99 in enumerate(p99s, start=1)]


def test_alert_rule_and_percentiles_judge_the_services_own_series() -> None:
    rule = {"resolve_after": 3, "min_samples": 20}
    p99s = [5.0] * 4 + [30.0] * 3 + [5.0] * 4          # breaches 5,6,7: fires at 7; heals 8,9,10: resolves at 10
    moves = [(5, "inactive", "pending"), (7, "pending", "firing"), (10, "firing", "inactive")]
    alerts = [Event(float(p), "alert", {"alert": "P99High", "from": f, "to": to, "period": p, "seq": 100 + p})
              for p, f, to in moves]
    assert run("alert_rule", timeline(events=_service_periods(p99s) + alerts), **rule).passed
    late = [Event(e.t + 1, "alert", e.data | {"period": e.data["period"] + 1}) for e in alerts]
    v = run("alert_rule", timeline(events=_service_periods(p99s) + late), **rule)
    assert not v.passed and v.summary.startswith("period 5 (t=5.0s): p99 30 ms > 20 was only the 1st consecutive")
    assert run("percentiles_distinct", timeline(events=_service_periods(p99s))).passed
    v = run("percentiles_distinct", timeline(events=_service_periods(p99s, p95_of=lambda p99: p99)))
    assert not v.passed and "P99 equals P95 in 11 of 11 periods" in v.summary
