"""The dependency checks (fallback_serves, cache_effective, dependency_alert, circuit_recovers) on exact,
hand-built timelines: a Redis latency fault on `redis` from 10 s to 20 s of a 30 s run (phases baseline,
slow, recovery), scrapes every 0.5 s. Real agents (and the broken ones) in test_scenario_dependencies.py."""

from __future__ import annotations

from typing import Any

from harness.checks import CHECKS, Verdict
from harness.scenario import CheckSpec
from harness.timeline import CallResult, Event, FaultWindow, MetricSample, Timeline

PHASES = [("baseline", 0.0, 10.0), ("slow", 10.0, 20.0), ("recovery", 20.0, 30.0)]
FAULT = "network:latency on redis (latency_ms=100)"


def calls(latency_s: float = 0.005, slow_from: float = 99.0, slow_s: float = 0.0, failed_every: int = 0,
          ) -> list[CallResult]:
    """100 calls a second for 30 s; those due in [slow_from, slow_from + 10) take `slow_s` instead."""
    out = []
    for i in range(3000):
        t = i / 100
        lat = slow_s if slow_from <= t < slow_from + 10 else latency_s
        outcome = "error" if failed_every and i % failed_every == 0 else "ok"
        out.append(CallResult(t, t, t + lat, "/Decide", outcome))
    return out


def cache_samples(hit_share: dict[tuple[float, float], float] | None = None, ops_stop: tuple[float, float] | None = None,
                  cache: bool = True, ops_after: bool = True, pings: bool = False) -> list[MetricSample]:
    """Scrapes every 0.5 s: 100 lookups a second, hits at `hit_share` (by window; default 0.7), misses the
    rest; Redis ops 60 a second, none in `ops_stop`, errors 0; with `pings`, 40 health PINGs a second
    throughout (not the cache path)."""
    shares = hit_share or {}
    out = []
    hits = miss = ops = 0.0
    for k in range(0, 62):
        t = k * 0.5
        share = next((v for (a, b), v in shares.items() if a <= t < b), 0.7)
        values: dict[str, float] = {}
        if cache:
            values |= {'agent_cache_total{result="hit_local"}': hits, 'agent_cache_total{result="hit_redis"}': 0.0,
                       'agent_cache_total{result="stale"}': 0.0, 'agent_cache_total{result="miss"}': miss}
            values |= {'agent_dependency_seconds_count{dependency="redis",op="get"}': ops,
                       'agent_dependency_errors_total{dependency="redis",kind="timeout",op="get"}': 0.0}
            if pings:
                values['agent_dependency_seconds_count{dependency="redis",op="ping"}'] = 20.0 * k
        out.append(MetricSample(t, values))
        hits += 50 * share
        miss += 50 * (1 - share)
        stopped = ops_stop is not None and ops_stop[0] <= t < ops_stop[1]
        if not stopped and (ops_after or t < 20):
            ops += 30
    return out


def fault(applied: float | None = 10.0, removed: float | None = 20.0, error: str | None = None,
          on: str | None = "redis") -> FaultWindow:
    return FaultWindow(FAULT if on else "network:latency (latency_ms=100)", "slow", "network", "latency", 10.0,
                       applied_s=applied, removed_s=removed, error=error, on=on)


def timeline(call_list: list[CallResult] | None = None, samples: list[MetricSample] | None = None,
             events: list[Event] | None = None, faults: list[FaultWindow] | None = None) -> Timeline:
    return Timeline(period_s=1.0, threshold_ms=20.0, phases=PHASES, calls=calls() if call_list is None else call_list,
                    events=events or [], samples=cache_samples() if samples is None else samples,
                    faults=[fault()] if faults is None else faults, alert_periods=3)


def run(kind: str, tl: Timeline, **params: Any) -> Verdict:
    return CHECKS[kind].evaluate(tl, CheckSpec(kind, params))


# ---- fallback_serves ---------------------------------------------------------------------------------

def test_fallback_serves_passes_when_calls_are_answered_fast_from_the_slow_path() -> None:
    v = run("fallback_serves", timeline(), phase="slow", p99_ms=50)
    assert v.passed and not v.skipped, v.summary
    assert v.summary == ("1000 of 1000 calls answered while redis was faulted (10.0-20.0s) (0.00% failed, limit "
                         "0.5%), client P99 5.0 ms <= 50 ms, 300 from the slow path (cache misses, 30% of lookups)")
    assert v.evidence["cache"]["miss"] == 300.0


def test_fallback_serves_fails_when_calls_wait_on_the_dependency() -> None:
    v = run("fallback_serves", timeline(calls(slow_from=10.0, slow_s=0.105)), phase="slow", p99_ms=50)
    assert not v.passed
    assert v.summary == ("client P99 105.0 ms > 50 ms while redis was faulted (10.0-20.0s) over 1000 answered "
                         "calls: calls waited on the dependency instead of falling back")


def test_fallback_serves_fails_on_errors_and_without_a_slow_path() -> None:
    v = run("fallback_serves", timeline(calls(failed_every=50)), phase="slow", p99_ms=50)
    assert not v.passed
    assert v.summary == ("20 of 1000 calls failed while redis was faulted (10.0-20.0s) (2.00%, limit 0.5%): "
                         "the service did not fall back")
    assert run("fallback_serves", timeline(calls(failed_every=50)), phase="slow", max_error_pct=3).passed
    no_miss = timeline(samples=cache_samples({(0.0, 31.0): 1.0}))
    v = run("fallback_serves", no_miss, phase="slow")
    assert not v.passed
    assert v.summary == ("no cache misses while redis was faulted (10.0-20.0s) (1000 lookups): no call took the "
                         "slow path, so falling back was not exercised")


def test_fallback_serves_has_nothing_to_judge_without_cache_metrics_and_fails_without_a_fault() -> None:
    v = run("fallback_serves", timeline(samples=cache_samples(cache=False)), phase="slow")
    assert v.skipped and v.summary == ("nothing to judge: the target exports no agent_cache_total: whether the "
                                       "calls while redis was faulted (10.0-20.0s) came from the slow path cannot "
                                       "be told")
    v = run("fallback_serves", timeline(faults=[fault(on=None)]), phase="slow")
    assert not v.passed and not v.skipped
    assert v.summary.startswith("no fault on a dependency in phase 'slow': fallback_serves judges")
    v = run("fallback_serves", timeline(faults=[fault(applied=None, removed=None, error="RunError: boom")]),
            phase="slow")
    assert not v.passed and v.summary == f"fault {FAULT} never took effect: RunError: boom"


# ---- cache_effective ---------------------------------------------------------------------------------

def test_cache_effective_judges_the_hit_ratio_of_the_phase() -> None:
    v = run("cache_effective", timeline(), phase="baseline", min_hit_pct=60)
    assert v.passed and not v.skipped
    assert v.summary == ("cache hit ratio 70.0% >= 60% over 1000 lookups in 0.0-10.0s (hit_local 700, hit_redis 0, "
                         "stale 0, miss 300)")
    v = run("cache_effective", timeline(samples=cache_samples({(0.0, 10.0): 0.4})), phase="baseline",
            min_hit_pct=60)
    assert not v.passed
    assert v.summary == ("cache hit ratio 40.0% < 60% over 1000 lookups in 0.0-10.0s (hit_local 400, hit_redis 0, "
                         "stale 0, miss 600)")


def test_cache_effective_has_nothing_to_judge_without_metrics_or_lookups() -> None:
    v = run("cache_effective", timeline(samples=cache_samples(cache=False)), phase="baseline", min_hit_pct=50)
    assert v.skipped and v.summary == "nothing to judge: the target exports no agent_cache_total: no cache to judge"
    flat = [MetricSample(s.t, {k: 0.0 for k in s.values}) for s in cache_samples()]
    v = run("cache_effective", timeline(samples=flat), phase="baseline", min_hit_pct=50)
    assert v.skipped and v.summary == ("nothing to judge: no cache lookups in 0.0-10.0s (agent_cache_total did not "
                                       "grow): is the cache on?")


# ---- dependency_alert --------------------------------------------------------------------------------

def alert(t: float, to: str, name: str = "DependencySlow") -> Event:
    return Event(t, "alert", {"alert": name, "from": "pending" if to == "firing" else "firing", "to": to})


def test_dependency_alert_fires_in_the_fault_and_resolves() -> None:
    tl = timeline(events=[alert(12.5, "firing"), alert(23.0, "inactive")])
    v = run("dependency_alert", tl, fault_phase="slow", quiet_phases=("baseline", "recovery"))
    assert v.passed and not v.skipped, v.summary
    assert v.summary == ("DependencySlow fired at 12.5s, +2.5s after the fault took effect (deadline 15.0s), "
                         "resolved at 23.0s; silent in baseline, recovery")


def test_dependency_alert_fails_never_late_false_or_unresolved() -> None:
    never = timeline(events=[alert(12.0, "firing", "P99High")])
    v = run("dependency_alert", never, fault_phase="slow")
    assert not v.passed and not v.skipped
    assert v.summary == ("DependencySlow never fired while redis was faulted (10.0-20.0s); it should have by "
                         "15.0s")
    late = timeline(events=[alert(16.0, "firing"), alert(24.0, "inactive")])
    v = run("dependency_alert", late, fault_phase="slow")
    assert not v.passed
    assert v.summary == ("DependencySlow fired only at 16.0s; it should have by 15.0s (3 + 2 periods after the "
                         "fault took effect at 10.0s)")
    assert run("dependency_alert", late, fault_phase="slow", within_periods=3).passed
    false = timeline(events=[alert(4.0, "firing"), alert(6.0, "inactive"), alert(12.0, "firing"),
                             alert(23.0, "inactive")])
    v = run("dependency_alert", false, fault_phase="slow", quiet_phases=("baseline",))
    assert not v.passed
    assert v.summary == "DependencySlow fired at 4.0s in the quiet phase 'baseline' (0.0-10.0s): a false alarm"
    stuck = timeline(events=[alert(12.0, "firing")])
    v = run("dependency_alert", stuck, fault_phase="slow")
    assert not v.passed
    assert v.summary == ("DependencySlow fired at 12.0s (fault at 10.0s) but was still firing when the run ended "
                         "at 30.0s: it never resolved")


def test_dependency_alert_without_alert_state_has_nothing_to_judge() -> None:
    v = run("dependency_alert", timeline(samples=[]), fault_phase="slow")
    assert v.skipped
    assert v.summary == ('nothing to judge: the target reported no alert state (no events, no '
                         'agent_alert_firing{alert="DependencySlow"} samples)')


# ---- circuit_recovers --------------------------------------------------------------------------------

def circuit(t: float, old: str, new: str, dependency: str = "redis") -> Event:
    return Event(t, "circuit", {"dependency": dependency, "from": old, "to": new})


OPENED = [circuit(10.2, "closed", "open"), circuit(12.2, "open", "half_open"), circuit(12.21, "half_open", "open")]


def test_circuit_recovers_when_it_closes_after_the_fault_and_redis_answers() -> None:
    tl = timeline(events=[*OPENED, circuit(20.4, "open", "half_open"), circuit(20.41, "half_open", "closed")],
                  samples=cache_samples(ops_stop=(10.0, 20.5), pings=True))
    v = run("circuit_recovers", tl, phase="slow", within_s=5.0)
    assert v.passed and not v.skipped, v.summary
    assert v.summary == ("the redis circuit closed at 20.4s, +0.4s after the fault was removed at 20.0s (allowed "
                         "5s); then 600 redis operations answered and 735 cache hits")


def test_circuit_recovers_fails_when_it_stays_open_or_redis_stays_unused() -> None:
    stuck = timeline(events=OPENED)
    v = run("circuit_recovers", stuck, phase="slow", within_s=5.0)
    assert not v.passed
    assert v.summary == ("the redis circuit never closed after the fault was removed at 20.0s; it was open at "
                         "25.0s (allowed 5s)")
    late = timeline(events=[*OPENED, circuit(26.0, "half_open", "closed")])
    v = run("circuit_recovers", late, phase="slow", within_s=5.0)
    assert not v.passed and v.summary.startswith("the redis circuit closed only at 26.0s, after the fault")
    unused = timeline(events=[*OPENED, circuit(20.41, "half_open", "closed")],
                      samples=cache_samples(ops_after=False, pings=True))   # PINGs are not the cache path
    v = run("circuit_recovers", unused, phase="slow")
    assert not v.passed
    assert v.summary == ("the redis circuit closed at 20.4s but no redis operation succeeded after it: the cache "
                         "path was not used again")


def test_circuit_recovers_from_the_gauge_and_with_nothing_to_judge() -> None:
    gauge = [MetricSample(s.t, s.values | {'agent_dependency_circuit_state{dependency="redis"}':
                                           2.0 if 10.5 <= s.t < 21.0 else 0.0}) for s in cache_samples()]
    v = run("circuit_recovers", timeline(samples=gauge), phase="slow")
    assert v.passed and v.evidence["source"] == "metrics" and v.evidence["closed_s"] == 21.0
    never = timeline(events=[circuit(5.0, "closed", "closed")])
    v = run("circuit_recovers", never, phase="slow")
    assert v.skipped
    assert v.summary == "nothing to judge: the redis circuit never opened while faulted (10.0-20.0s): no recovery to judge"
    v = run("circuit_recovers", timeline(samples=cache_samples(cache=False)), phase="slow")
    assert v.skipped and v.summary.startswith("nothing to judge: the target reported no circuit state for redis")
