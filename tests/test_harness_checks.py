"""Every check against synthetic timelines: one that should pass, and one that should fail."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

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
    assert no_truth.skipped and no_truth.status == "skipped" and "did not breach" in no_truth.summary
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
    # 20 calls/s offered, the rate never below 79/s and nothing refused: the cut proves nothing.
    far = run("limiter_reduces", tl, phase="fault", at_least_pct=30)
    assert not far.passed and "never came near the traffic" in far.summary and far.evidence["cut_pct"] == 34.4
    shed = timeline(events=evs, calls=calls_with([5.0] * 15) + calls_with([1.0] * 7, per_period=3, outcome="rejected"))
    cut = run("limiter_reduces", shed, phase="fault", at_least_pct=30)
    assert cut.passed and cut.evidence["rate_at_start"] == 121 and "6 calls refused" in cut.summary
    below = timeline(events=evs, calls=calls_with([5.0] * 15, per_period=100))
    assert "below the 100/s offered" in run("limiter_reduces", below, phase="fault", at_least_pct=30).summary
    assert not run("limiter_reduces", shed, phase="fault", at_least_pct=40).passed
    back = run("limiter_recovers", tl, phase="recovery", to_pct_of_baseline=90, within_s=5.0)
    assert back.passed and back.evidence["reached_s"] == 14.0       # 79.4 * 1.1^4 = 116.2 >= 108.9
    slow = run("limiter_recovers", tl, phase="recovery", to_pct_of_baseline=90, within_s=2.5)
    assert not slow.passed and "needed 109/s" in slow.summary
    assert not run("limiter_reduces", timeline(), phase="fault").passed   # no limiter at all: says so
    # Never below 90 % of the baseline rate: nothing was reduced, nothing to judge (not a pass).
    flat = timeline(events=[limiter(1.0, 100, 110), limiter(7.0, 110, 105)])
    v = run("limiter_recovers", flat, phase="recovery", to_pct_of_baseline=90)
    assert v.skipped and "nothing was reduced" in v.summary


def test_limiter_obeys_compares_admissions_with_the_reported_rate() -> None:
    # The limiter says 30/s from t=5; 100 calls/s are offered.
    evs = [limiter(5.0, 1000, 30)]
    obeyed = [CallResult(k / 100, k / 100, k / 100 + 0.005, "/Decide", "ok") for k in range(1500)]
    ok_calls = [c if c.intended_s < 5 or k % 100 < 30 else
                CallResult(c.intended_s, c.sent_s, c.done_s, c.method, "rejected") for k, c in enumerate(obeyed)]
    v = run("limiter_obeys", timeline(events=evs, calls=ok_calls))
    assert v.passed and not v.skipped and len(v.evidence["periods_judged"]) >= 9
    # The same rate reported, every call admitted: it does not enforce what it reports.
    bad = run("limiter_obeys", timeline(events=evs, calls=obeyed))
    assert not bad.passed and "does not enforce" in bad.summary
    # Offered load always under the rate: nothing had to be refused.
    assert run("limiter_obeys", timeline(events=[limiter(5.0, 1000, 500)])).skipped


def test_degrades_and_restores() -> None:
    evs = [alert(8.0, "firing"), tier(8.1, "light"), alert(11.0, "inactive"), tier(12.0, "full")]
    tl = timeline(BREACH, evs)
    assert run("degrades", tl, phase="fault").passed
    assert run("restores", tl, phase="recovery", within_s=3.0).passed
    stuck = timeline(BREACH, [alert(8.0, "firing"), alert(11.0, "inactive")])
    assert not run("degrades", stuck, phase="fault").passed
    # Light from the queue before the alert fired, then full again while it fires: the alert did nothing.
    queue = timeline(BREACH, [tier(6.0, "light"), alert(8.0, "firing"), tier(9.0, "full"), alert(11.0, "inactive")])
    v = run("degrades", queue, phase="fault")
    assert not v.passed and "went back to full at 9.0s" in v.summary
    # Light from the queue before and held throughout: whether the alert degrades cannot be told.
    held = timeline(BREACH, [tier(6.0, "light"), alert(8.0, "firing"), alert(11.0, "inactive"), tier(12.0, "full")])
    v = run("degrades", held, phase="fault")
    assert v.skipped and "already light" in v.summary
    assert run("degrades", timeline(), phase="fault").skipped           # never fired
    assert run("restores", timeline(), phase="recovery").skipped        # nothing fired or degraded
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
    # Exact: one call of 300 missing on the service's side is a failure, as is one counted twice.
    one = run("no_loss", timeline(calls=calls, samples=_samples(299, 0), replay_report={"scheduled": 300}))
    assert not one.passed and "1 sent but never counted" in one.summary and one.evidence["difference"] == -1
    extra = run("no_loss", timeline(calls=calls, samples=_samples(301, 0), replay_report={"scheduled": 300}))
    assert not extra.passed and "1 more counted than sent" in extra.summary


def test_fault_effective() -> None:
    fw = [FaultWindow("network:latency", "fault", "network", "latency", 5.0, 5.01)]
    assert run("fault_effective", timeline(BREACH, faults=fw), phase="fault", signal="client_latency").passed
    flat = run("fault_effective", timeline(faults=fw), phase="fault", signal="client_latency")
    assert not flat.passed and "did not reach" in flat.summary
    failed = [FaultWindow("cpu:quota (pct=4)", "fault", "cpu", "quota", 5.0, None, error="no cgroup")]
    assert "never took effect" in run("fault_effective", timeline(BREACH, faults=failed), phase="fault").summary
    cpu = [CpuSample(t, 50.0, 30.0 if t < 5 else 95.0) for t in range(15)]
    fw_cpu = [FaultWindow("cpu:contention", "fault", "cpu", "contention", 5.0, 5.1)]
    assert run("fault_effective", timeline(cpu=cpu, faults=fw_cpu), phase="fault", signal="host_cpu").passed
    srv = [Event(t + 0.5, "period", {"p99_ms": 10.0 if t < 5 else 12.0}) for t in range(15)]
    v = run("fault_effective", timeline(events=srv, faults=fw_cpu), phase="fault", min_increase_ms=5,
            signal="server_latency")
    assert not v.passed and v.evidence["signal"] == "server_latency"


def legs_from(latencies_ms: list[float], per_period: int = 20) -> list[tuple[float, float, bool]]:
    """Upstream-leg records like the proxy's tap writes: per_period served calls per 1 s period."""
    return [(i + j * 0.02, i + j * 0.02 + lat / 1000, True) for i, lat in enumerate(latencies_ms)
            for j in range(per_period)]


def sched(cpu_pct: Callable[[float], float], wait_ms_per_s: Callable[[float], float]) -> list[tuple[float, float, float]]:
    """Cumulative (t, CPU s, wait s) samples every 0.5 s from per-second rates."""
    out, cpu, wait = [], 0.0, 0.0
    for k in range(31):
        t = k * 0.5
        out.append((t, cpu, wait))
        cpu += cpu_pct(t) / 100 * 0.5
        wait += wait_ms_per_s(t) / 1000 * 0.5
    return out


def test_each_fault_is_judged_on_the_signal_it_alone_moves() -> None:
    both = [FaultWindow("network:latency (jitter_ms=15, latency_ms=5)", "fault", "network", "latency", 5.0, 5.0, 10.0),
            FaultWindow("cpu:contention (workers=4)", "fault", "cpu", "contention", 5.0, 5.0, 10.0),
            FaultWindow("cpu:quota (pct=4)", "fault", "cpu", "quota", 5.0, 5.0, 10.0)]
    # Client latency = leg + 10 ms during the fault (the toxic); the leg itself also rose (CPU).
    client = calls_with([5.0] * 5 + [40.0] * 5 + [5.0] * 5)
    good = {"proxy_legs": legs_from([4.5] * 5 + [30.0] * 5 + [4.5] * 5),
            "sched": sched(lambda t: 10.0 if t < 5 or t >= 10 else 3.5, lambda t: 20.0 if 5 <= t < 10 else 1.0)}
    v = run("fault_effective", timeline(calls=client, faults=both, outside=good), phase="fault", baseline="baseline")
    assert v.passed, v.summary
    signals = {f["fault"].split(" ")[0]: (f["signal"], f["before"], f["during"]) for f in v.evidence["faults"]}
    assert signals["network:latency"] == ("proxy_added", 0.5, 10.0)
    assert signals["cpu:contention"][0] == "target_runqueue" and signals["cpu:quota"][0] == "target_cpu"
    # The toxic did nothing (the client's latency moved only with the leg): that fault fails on its own
    # although the CPU faults moved the client's latency a lot.
    inert = {"proxy_legs": legs_from([4.5] * 5 + [39.5] * 5 + [4.5] * 5), "sched": good["sched"]}
    v = run("fault_effective", timeline(calls=client, faults=both, outside=inert), phase="fault", baseline="baseline")
    assert not v.passed and v.summary.startswith("network:latency") and "proxy_added 0.5 -> 0.5 ms" in v.summary
    # Contention that left the run queue alone, and a quota the target ran over.
    idle = {"proxy_legs": good["proxy_legs"], "sched": sched(lambda t: 10.0, lambda t: 1.0)}
    v = run("fault_effective", timeline(calls=client, faults=both, outside=idle), phase="fault", baseline="baseline")
    failed = [f["fault"].split(" ")[0] for f in v.evidence["faults"] if not f["ok"]]
    assert not v.passed and failed == ["cpu:contention", "cpu:quota"]


def test_proxy_added_counts_from_the_actual_send_and_averages_the_middle_of_each_distribution() -> None:
    toxic = [FaultWindow("network:latency (latency_ms=10)", "fault", "network", "latency", 5.0, 5.0, 10.0)]
    legs = {"proxy_legs": legs_from([4.5] * 5 + [300.0] * 5 + [4.5] * 5)}   # the target slow in the fault

    def calls(added_ms: float, lag_ms: float, outliers: int = 0) -> list[CallResult]:
        out = []
        for i in range(15):
            fault = 5 <= i < 10
            for j in range(20):
                t = i + j * 0.02
                sent = t + (lag_ms / 1000 if fault else 0.0)
                leg = (300.0 if fault else 4.5) / 1000
                extra = (2000.0 if fault and j < outliers else added_ms if fault else 0.5) / 1000
                out.append(CallResult(t, sent, sent + leg + extra, "/Decide", "ok"))
        return out

    # The replayer fell 20 ms behind its schedule in the fault; the proxy added nothing (0.5 ms, as
    # before). From the intended send the client's latency rose 20 ms: that is not the toxic's doing.
    v = run("fault_effective", timeline(calls=calls(0.5, 20.0), faults=toxic, outside=legs), phase="fault",
            baseline="baseline")
    assert not v.passed and "proxy_added 0.5 -> 0.5 ms, needed +2.0" in v.summary, v.summary
    # The toxic added 10 ms to every call; 1 call in 20 was also stamped 2 s late by a stalled client.
    # The mean of the middle (P5-P95) leaves those out: 10 ms; a plain mean would say ~110 ms.
    v = run("fault_effective", timeline(calls=calls(10.0, 0.0, outliers=1), faults=toxic, outside=legs),
            phase="fault", baseline="baseline")
    assert v.passed and v.evidence["faults"][0]["during"] == 10.0, v.evidence


def test_alert_fires_is_judged_on_the_proxy_leg_not_the_clients_network() -> None:
    # The client sees 50 ms (jitter on the way back); the leg the service sees stays at 5 ms.
    jitter = timeline(BREACH, outside={"proxy_legs": legs_from([5.0] * 15)})
    v = run("alert_fires", jitter, phase="fault")
    assert v.skipped and v.evidence["truth"] == "proxy_leg" and "tolerance" in v.evidence
    # The leg breaches at periods 5, 6, 7 (truth 8.0 s) and the service's own P99 too: on time.
    leg_breach = {"proxy_legs": legs_from(BREACH)}
    own = _service_periods([5.0] * 5 + [50.0] * 5 + [5.0] * 4)
    assert run("alert_fires", timeline(BREACH, own + [alert(8.6, "firing")], outside=leg_breach), phase="fault").passed
    # The leg breached 2 periods before the service's own P99 (kernel queueing): the alert that followed
    # the service's own breach passes, the difference reported as a finding with its numbers.
    late_own = _service_periods([5.0] * 7 + [50.0] * 5 + [5.0] * 2)
    v = run("alert_fires", timeline(BREACH, late_own + [alert(10.2, "firing")], outside=leg_breach), phase="fault")
    assert v.passed and "finding: the proxy leg's P99 breached 20 ms for 3 periods by 8.0s" in v.summary
    assert v.evidence["view_difference_s"] == 2.0
    # ... but an alert late even for the service's own series fails.
    v = run("alert_fires", timeline(BREACH, late_own + [alert(11.5, "firing")], outside=leg_breach), phase="fault")
    assert not v.passed and "even the service's own P99" in v.summary


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


def test_the_proxys_tap_logs_each_calls_upstream_leg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The h2 tap writes SENT DONE DATA per call: request END_STREAM out, response END_STREAM in."""
    import random

    import hpack

    from faults.proxy import h2tap
    from harness.checks.truth import read_leg_log
    from wire.h2 import PREFACE, Flag, FrameType, frame, settings

    log = tmp_path / "legs.txt"
    monkeypatch.setenv(h2tap.LEG_LOG_ENV, str(log))
    up: list[bytes] = []
    down: list[bytes] = []
    tap = h2tap.H2Tap(up.append, down.append, lambda: [], random.Random(1))
    enc = hpack.Encoder()
    req = enc.encode([(":method", "POST"), (":scheme", "http"), (":path", "/agent.Agent/Decide"),
                      (":authority", "x"), ("content-type", "application/grpc")])
    tap.feed_up(PREFACE + settings({}))
    tap.feed_up(frame(FrameType.HEADERS, Flag.END_HEADERS, 1, req))
    tap.feed_up(frame(FrameType.DATA, Flag.END_STREAM, 1, b"\x00\x00\x00\x00\x00"))
    tap.feed_up(frame(FrameType.HEADERS, Flag.END_HEADERS, 3, enc.encode([(":method", "POST"), (":path", "/x")])))
    tap.feed_up(frame(FrameType.DATA, Flag.END_STREAM, 3, b"\x00\x00\x00\x00\x00"))
    server = hpack.Encoder()
    replies = [settings({}),
               frame(FrameType.HEADERS, Flag.END_HEADERS, 1, server.encode([(":status", "200")])),
               frame(FrameType.DATA, 0, 1, b"\x00\x00\x00\x00\x01\x08"),
               frame(FrameType.HEADERS, Flag.END_STREAM | Flag.END_HEADERS, 1, server.encode([("grpc-status", "0")])),
               # Stream 3 refused: trailers only, no DATA (not a served call).
               frame(FrameType.HEADERS, Flag.END_STREAM | Flag.END_HEADERS, 3,
                     server.encode([(":status", "200"), ("grpc-status", "8")]))]
    for raw in replies:
        tap.feed_down(raw)
    assert b"".join(down) == b"".join(replies)     # timing only: the server's bytes pass untouched
    # Refused at its headers, before the request's body ended: not timed, and nothing left pending.
    tap.feed_up(frame(FrameType.HEADERS, Flag.END_HEADERS, 5, enc.encode([(":method", "POST"), (":path", "/x")])))
    tap.feed_down(frame(FrameType.HEADERS, Flag.END_STREAM | Flag.END_HEADERS, 5, server.encode([("grpc-status", "8")])))
    tap.feed_up(frame(FrameType.DATA, Flag.END_STREAM, 5, b"\x00\x00\x00\x00\x00"))
    assert not tap._sent and not tap._early and not tap._answered
    legs = read_leg_log(log, 0.0)
    assert [served for _, _, served in legs] == [True, False]
    assert all(0 <= done - sent < 1.0 for sent, done, _ in legs)
