"""Dependency checks: fallback_serves, cache_effective, dependency_alert, circuit_recovers.

The question of a dependency experiment: "Redis got slow / went away: did we fall back, did our P99
hold, did the alert name the dependency, did we go back to the cache once it healed?" The faults are
network faults `on:` the dependency's link (its own proxy), so the client->service path is untouched.

Truth, per check:

    fallback_serves   client side (every call due while the dependency was faulted, its latency from
                      the intended send time) + the agent's agent_cache_total{result="miss"} growth over
                      that window (scraped): answered calls that missed the cache came from the slow path
    cache_effective   agent_cache_total growth by result over the phase (scraped)
    dependency_alert  the service's alert events (as alert_fires/alert_silent read them), or the run's
                      Prometheus with source: prometheus; the window is when the dependency fault took
                      effect and was removed (the fault log)
    circuit_recovers  the agent's `circuit` events (else agent_dependency_circuit_state samples) after
                      the fault was removed, then agent_dependency_seconds_count growth less
                      agent_dependency_errors_total growth (Redis answering again) and cache hits

Counters are read at the last scrape at or before each bound (scrapes every half period, at most
0.5 s): a window's counts are off by at most one scrape interval's calls at each end.
"""

from __future__ import annotations

from typing import Any

from harness.checks.alerts import _SOURCE, alert_intervals
from harness.checks.base import CHECKS, Param, Verdict, nothing_to_judge, verdict
from harness.scenario import CheckSpec
from harness.timeline import FaultWindow, Timeline
from wire.stats import percentile

HITS = ("hit_local", "hit_redis", "stale")
_EPS = 1e-6


# ---- helpers ---------------------------------------------------------------------------------------

def dependency_faults(tl: Timeline, phase: str, dependency: str | None = None) -> list[FaultWindow]:
    """The phase's faults on a dependency's link (`on:`), of `dependency` when given."""
    return [f for f in tl.faults if f.phase == phase and f.on is not None
            and (dependency is None or f.on == dependency)]


def fault_span(tl: Timeline, windows: list[FaultWindow]) -> tuple[float, float]:
    """From when the first fault took effect to when the last was removed (its phase's end if never)."""
    start = min(float(w.applied_s) for w in windows if w.applied_s is not None)
    ends = []
    for w in windows:
        bounds = tl.phase_bounds(w.phase) or (0.0, tl.duration_s)
        ends.append(w.removed_s if w.removed_s is not None else bounds[1])
    return start, max(ends)


def counter_at(tl: Timeline, name: str, t: float, **labels: str) -> float | None:
    """The sum of `name`'s series whose labels include `labels`, at the last scrape at or before `t`
    (the first scrape when none is that early); None when no scrape has the metric."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    chosen = None
    for sample in tl.samples:
        if chosen is not None and sample.t > t + _EPS:
            break
        if any(key.startswith(name + "{") for key in sample.values):
            chosen = sample
    if chosen is None:
        return None
    return sum(v for k, v in chosen.values.items()
               if k.startswith(name + "{") and all(w in k for w in want))


def counter_growth(tl: Timeline, name: str, start: float, end: float, **labels: str) -> float | None:
    a, b = counter_at(tl, name, start, **labels), counter_at(tl, name, end, **labels)
    return None if a is None or b is None else max(0.0, b - a)


def cache_counts(tl: Timeline, start: float, end: float) -> dict[str, float] | None:
    """agent_cache_total's growth by result over [start, end]; None when the target does not export it."""
    name = tl.metric_names.get("cache_total", "agent_cache_total")
    out = {}
    for result in (*HITS, "miss"):
        grown = counter_growth(tl, name, start, end, result=result)
        if grown is None:
            return None
        out[result] = round(grown, 3)
    return out


def _name(tl: Timeline, key: str, default: str) -> str:
    return tl.metric_names.get(key, default)


def _broken(windows: list[FaultWindow]) -> FaultWindow | None:
    return next((w for w in windows if w.error or w.applied_s is None), None)


def _no_fault(spec: CheckSpec, phase: str, check: str) -> Verdict:
    return verdict(spec, False, f"no fault on a dependency in phase {phase!r}: {check} judges the run while a "
                   "dependency is faulted (a network fault with `on: redis` in that phase)")


# ---- fallback_serves -------------------------------------------------------------------------------

class FallbackServes:
    """While the dependency is faulted (from when the phase's `on:` faults took effect to when they
    were removed), every call is still answered from the slow path within the SLO.

    Truth: the client's calls due in that window: failures are errors, timeouts and rejections (a
    rejected call was not answered either) over the calls sent, at most `max_error_pct` (default 0.5);
    the P99 of the answered calls' latency from the intended send time (no coordinated omission) at
    most `p99_ms` (default the target's threshold), nearest rank, over at least min_samples calls; the
    slow path: agent_cache_total{result="miss"} grew over the window (scraped; +/- one scrape interval
    at each end). A target without cache metrics has nothing to judge (falling back cannot be told
    from never caching)."""

    name = "fallback_serves"
    params = {"phase": Param("phase", required=True, help="the phase whose dependency fault is judged"),
              "p99_ms": Param("number", help="client P99 limit while faulted (default: the target's threshold)"),
              "max_error_pct": Param("number", help="failed calls allowed, % (default 0.5)"),
              "dependency": Param("str", help="only faults on this dependency (default: any)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        phase = spec.params["phase"]
        windows = dependency_faults(tl, phase, spec.params.get("dependency"))
        if not windows:
            return _no_fault(spec, phase, self.name)
        if (bad := _broken(windows)) is not None:
            return verdict(spec, False, f"fault {bad.label} never took effect: {bad.error}")
        start, end = fault_span(tl, windows)
        limit = spec.params.get("p99_ms", tl.threshold_ms)
        max_pct = spec.params.get("max_error_pct", 0.5)
        deps = sorted({w.on for w in windows if w.on})
        calls = [c for c in tl.calls if start <= c.intended_s < end and c.outcome != "not_sent"]
        failed = sum(1 for c in calls if c.outcome in ("error", "timeout", "rejected"))
        lat = sorted(c.latency_ms for c in calls if c.outcome == "ok" and c.latency_ms is not None)
        counts = cache_counts(tl, start, end)
        evidence: dict[str, Any] = {"window_s": [round(start, 3), round(end, 3)], "dependency": deps,
                                    "sent": len(calls), "failed": failed, "max_error_pct": max_pct,
                                    "limit_ms": limit, "cache": counts,
                                    "truth": "client calls due while faulted; slow path: agent_cache_total miss"}
        what = f"while {', '.join(deps)} was faulted ({start:.1f}-{end:.1f}s)"
        if not calls:
            return nothing_to_judge(spec, f"no calls were sent {what}", **evidence)
        if counts is None:
            name = _name(tl, "cache_total", "agent_cache_total")
            return nothing_to_judge(spec, f"the target exports no {name}: whether the calls {what} came from the "
                                    "slow path cannot be told", **evidence)
        pct = failed / len(calls) * 100
        evidence["error_pct"] = round(pct, 3)
        if pct > max_pct:
            return verdict(spec, False, f"{failed} of {len(calls)} calls failed {what} ({pct:.2f}%, limit "
                           f"{max_pct:g}%): the service did not fall back", **evidence)
        if len(lat) < tl.min_samples:
            return verdict(spec, False, f"only {len(lat)} answered calls {what}: too few to judge a P99", **evidence)
        p99 = percentile(lat, 0.99)
        evidence["p99_ms"] = round(p99, 3)
        misses = counts["miss"]
        lookups = sum(counts.values())
        if p99 > limit:
            return verdict(spec, False, f"client P99 {p99:.1f} ms > {limit:g} ms {what} over {len(lat)} answered "
                           "calls: calls waited on the dependency instead of falling back", **evidence)
        if misses <= 0:
            return verdict(spec, False, f"no cache misses {what} ({lookups:.0f} lookups): no call took the slow "
                           "path, so falling back was not exercised", **evidence)
        return verdict(spec, True, f"{len(calls) - failed} of {len(calls)} calls answered {what} ({pct:.2f}% "
                       f"failed, limit {max_pct:g}%), client P99 {p99:.1f} ms <= {limit:g} ms, {misses:.0f} from "
                       f"the slow path (cache misses, {misses / max(lookups, 1) * 100:.0f}% of lookups)", **evidence)


# ---- cache_effective -------------------------------------------------------------------------------

class CacheEffective:
    """The cache answers at least `min_hit_pct` of the lookups in the phase.

    Truth: agent_cache_total growth over the phase (scraped; +/- one scrape interval at each end):
    (hit_local + hit_redis + stale) / (those + miss). No tolerance beyond the scrape's: the ratio is a
    count. A target without cache metrics, or a phase without lookups, has nothing to judge."""

    name = "cache_effective"
    params = {"phase": Param("phase", required=True),
              "min_hit_pct": Param("number", required=True, help="hits of all lookups, %")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        start, end = tl.phase_bounds(spec.params["phase"]) or (0.0, 0.0)
        least = spec.params["min_hit_pct"]
        counts = cache_counts(tl, start, end)
        name = _name(tl, "cache_total", "agent_cache_total")
        if counts is None:
            return nothing_to_judge(spec, f"the target exports no {name}: no cache to judge",
                                    window_s=[round(start, 3), round(end, 3)])
        hits = sum(counts[r] for r in HITS)
        total = hits + counts["miss"]
        evidence: dict[str, Any] = {"window_s": [round(start, 3), round(end, 3)], "cache": counts,
                                    "min_hit_pct": least}
        if total <= 0:
            return nothing_to_judge(spec, f"no cache lookups in {start:.1f}-{end:.1f}s ({name} did not grow): "
                                    "is the cache on?", **evidence)
        pct = hits / total * 100
        evidence["hit_pct"] = round(pct, 3)
        ok = pct >= least
        parts = ", ".join(f"{r} {counts[r]:.0f}" for r in (*HITS, "miss"))
        return verdict(spec, ok, f"cache hit ratio {pct:.1f}% {'>=' if ok else '<'} {least:g}% over {total:.0f} "
                       f"lookups in {start:.1f}-{end:.1f}s ({parts})", **evidence)


# ---- dependency_alert ------------------------------------------------------------------------------

class DependencyAlert:
    """The alert that names the dependency fires while it is faulted, and not in the quiet phases.

    Truth: the alert's firing intervals as the service reports them (its events, else its
    agent_alert_firing gauge; `source: prometheus`: the run's Prometheus), read by the same code as
    alert_fires/alert_silent. Tolerance: it must fire by the time the fault took effect plus
    (alert_periods + within_periods) periods (the rule needs alert_periods breaching periods on the
    service's own period grid, up to a period off the fault's; within_periods default 2). A firing that
    began in the fault window may run on into the next phases while it resolves (the rule's
    resolve_periods), but must have resolved by the end of the run; any firing that begins outside it,
    overlapping a quiet phase, is a false alarm."""

    name = "dependency_alert"
    params = {"fault_phase": Param("phase", required=True, help="the phase with the dependency fault"),
              "alert": Param("str", help="default DependencySlow"),
              "quiet_phases": Param("phases", help="phases in which it must not fire (default: none)"),
              "within_periods": Param("int", help="periods allowed after alert_periods (default 2)"),
              "source": _SOURCE}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        alert = spec.params.get("alert", "DependencySlow")
        phase = spec.params["fault_phase"]
        k = spec.params.get("within_periods", 2)
        source = spec.params.get("source", "service")
        windows = dependency_faults(tl, phase)
        if not windows:
            return _no_fault(spec, phase, self.name)
        if (bad := _broken(windows)) is not None:
            return verdict(spec, False, f"fault {bad.label} never took effect: {bad.error}")
        start, end = fault_span(tl, windows)
        deadline = start + (tl.alert_periods + k) * tl.period_s
        found = alert_intervals(tl, alert, source)
        if found is None:
            return verdict(spec, False, "source: prometheus, but no Prometheus ran: add `prometheus: {rules: "
                           "[FILE]}` to the scenario")
        shown = f'ALERTS{{alertname="{alert}"}}' if source == "prometheus" else alert
        own = [(s, e) for s, e in found if start - _EPS <= s <= max(end, deadline) + _EPS]
        evidence: dict[str, Any] = {"alert": alert, "alert_source": source, "fault_s": [round(start, 3), round(end, 3)],
                                    "deadline_s": round(deadline, 3), "firing": found,
                                    "faults": [w.label for w in windows]}
        for q in spec.params.get("quiet_phases", ()):
            q0, q1 = tl.phase_bounds(q) or (0.0, 0.0)
            false = [(s, e) for s, e in found if (s, e) not in own and s < q1 and (e is None or e > q0)]
            if false:
                return verdict(spec, False, f"{shown} fired at {false[0][0]:.1f}s in the quiet phase {q!r} "
                               f"({q0:.1f}-{q1:.1f}s): a false alarm", **evidence)
        if not own:
            if source != "prometheus" and not tl.alert_observed(alert):
                return nothing_to_judge(spec, f"the target reported no alert state (no events, no "
                                        f"{tl.alert_metric(alert)} samples)", **evidence)
            return verdict(spec, False, f"{shown} never fired while {', '.join(sorted({str(w.on) for w in windows}))} "
                           f"was faulted ({start:.1f}-{end:.1f}s); it should have by {deadline:.1f}s", **evidence)
        fired, resolved = own[0]
        evidence |= {"fired_s": round(fired, 3), "resolved_s": None if resolved is None else round(resolved, 3)}
        if fired > deadline + _EPS:
            return verdict(spec, False, f"{shown} fired only at {fired:.1f}s; it should have by {deadline:.1f}s "
                           f"({tl.alert_periods} + {k} periods after the fault took effect at {start:.1f}s)",
                           **evidence)
        if own[-1][1] is None:
            return verdict(spec, False, f"{shown} fired at {fired:.1f}s (fault at {start:.1f}s) but was still "
                           f"firing when the run ended at {tl.duration_s:.1f}s: it never resolved", **evidence)
        quiet = spec.params.get("quiet_phases", ())
        silent = f"; silent in {', '.join(quiet)}" if quiet else ""
        return verdict(spec, True, f"{shown} fired at {fired:.1f}s, {fired - start:+.1f}s after the fault took "
                       f"effect (deadline {deadline:.1f}s), resolved at {own[-1][1]:.1f}s{silent}", **evidence)


# ---- circuit_recovers ------------------------------------------------------------------------------

def circuit_series(tl: Timeline, dependency: str) -> tuple[str, list[tuple[float, str]]] | None:
    """(source, [(t, state)]) of the dependency's circuit: its `circuit` events (the state each moved
    to), else the scraped agent_dependency_circuit_state gauge (0 closed, 1 half_open, 2 open: changes
    faster than a scrape are invisible there); None when the run has neither."""
    events = [e for e in tl.events_of("circuit") if e.data.get("dependency", dependency) == dependency]
    if events:
        first = events[0]
        start = [(min(0.0, first.t), str(first.data["from"]))] if "from" in first.data else []
        return "events", start + [(e.t, str(e.data.get("to"))) for e in events]
    name = _name(tl, "circuit_state", "agent_dependency_circuit_state") + f'{{dependency="{dependency}"}}'
    samples = tl.metric(name)
    if not samples:
        return None
    states = ("closed", "half_open", "open")
    out: list[tuple[float, str]] = []
    for t, value in samples:
        state = states[min(2, max(0, int(round(value))))]
        if not out or out[-1][1] != state:
            out.append((t, state))
    return "metrics", out


def _state_at(series: list[tuple[float, str]], t: float) -> str:
    state = "closed"
    for when, value in series:
        if when > t + _EPS:
            break
        state = value
    return state


class CircuitRecovers:
    """After the dependency fault ends, the cache path is used again within `within_s`.

    Truth: the agent's `circuit` events for the dependency (else its scraped
    agent_dependency_circuit_state): the circuit opened while the fault held, and is closed again at
    most `within_s` (default 5s) after the fault was removed (the fault log's time), and still closed
    then; then, from the scrapes, Redis answered operations again after it closed
    (agent_dependency_seconds_count growth beyond agent_dependency_errors_total's) and the cache kept
    answering (hits grew). A circuit that never opened has nothing to recover (nothing to judge)."""

    name = "circuit_recovers"
    params = {"phase": Param("phase", required=True, help="the phase whose dependency fault ends"),
              "within_s": Param("duration", help="after the fault was removed (default 5s)"),
              "dependency": Param("str", help="default: the one faulted in the phase")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        phase = spec.params["phase"]
        within = spec.params.get("within_s", 5.0)
        windows = dependency_faults(tl, phase, spec.params.get("dependency"))
        if not windows:
            return _no_fault(spec, phase, self.name)
        if (bad := _broken(windows)) is not None:
            return verdict(spec, False, f"fault {bad.label} never took effect: {bad.error}")
        dep = spec.params.get("dependency") or str(windows[0].on)
        start, end = fault_span(tl, windows)
        deadline = end + within
        found = circuit_series(tl, dep)
        evidence: dict[str, Any] = {"dependency": dep, "fault_s": [round(start, 3), round(end, 3)],
                                    "deadline_s": round(deadline, 3), "within_s": within}
        if found is None:
            name = _name(tl, "circuit_state", "agent_dependency_circuit_state")
            return nothing_to_judge(spec, f"the target reported no circuit state for {dep} (no circuit events, "
                                    f"no {name} samples)", **evidence)
        source, series = found
        evidence |= {"source": source, "circuit": [[round(t, 3), s] for t, s in series]}
        opened = [t for t, s in series if s == "open" and start - _EPS <= t <= end + _EPS]
        if not opened and _state_at(series, start) != "open":
            return nothing_to_judge(spec, f"the {dep} circuit never opened while faulted ({start:.1f}-{end:.1f}s): "
                                    "no recovery to judge", **evidence)
        closed = [t for t, s in series if s == "closed" and t >= end - _EPS]
        at_end = _state_at(series, end)
        closed_at = end if at_end == "closed" else (closed[0] if closed else None)
        evidence["closed_s"] = None if closed_at is None else round(closed_at, 3)
        if closed_at is None or closed_at > deadline + _EPS:
            state = _state_at(series, min(deadline, tl.duration_s))
            when = f"closed only at {closed_at:.1f}s," if closed_at is not None else "never closed"
            short = (f" (the run ended {tl.duration_s - end:.1f}s after the fault: lengthen the phase after it)"
                     if tl.duration_s < deadline else "")
            return verdict(spec, False, f"the {dep} circuit {when} after the fault was removed at {end:.1f}s; "
                           f"it was {state} at {min(deadline, tl.duration_s):.1f}s (allowed {within:g}s){short}",
                           **evidence)
        check_at = min(deadline, tl.duration_s)
        if _state_at(series, check_at) != "closed":
            return verdict(spec, False, f"the {dep} circuit closed at {closed_at:.1f}s but was "
                           f"{_state_at(series, check_at)} again at {check_at:.1f}s without a fault", **evidence)
        used = self._used(tl, dep, closed_at)
        evidence |= used
        if used.get("redis_ok") is not None and used["redis_ok"] <= 0:
            return verdict(spec, False, f"the {dep} circuit closed at {closed_at:.1f}s but no {dep} operation "
                           "succeeded after it: the cache path was not used again", **evidence)
        after = f"{closed_at - end:+.1f}s after the fault was removed at {end:.1f}s (allowed {within:g}s)"
        more = ("" if used.get("redis_ok") is None else
                f"; then {used['redis_ok']:.0f} {dep} operations answered and {used['hits']:.0f} cache hits")
        return verdict(spec, True, f"the {dep} circuit closed at {closed_at:.1f}s, {after}{more}", **evidence)

    def _used(self, tl: Timeline, dep: str, since: float) -> dict[str, Any]:
        """The cache's Redis operations answered (count less errors; health PINGs, op="ping", are not the
        cache path) and cache hits from `since` to the run's end."""
        seconds = _name(tl, "dependency_seconds", "agent_dependency_seconds") + "_count"
        errors = _name(tl, "dependency_errors", "agent_dependency_errors_total")
        end = tl.duration_s + 60.0

        def cache_path(name: str) -> float | None:   # `name`'s growth, the PINGs' left out
            grown = counter_growth(tl, name, since, end, dependency=dep)
            return None if grown is None else grown - (counter_growth(tl, name, since, end, dependency=dep, op="ping")
                                                       or 0.0)

        ops = cache_path(seconds)
        if ops is None:
            return {"redis_ok": None, "note": f"no {seconds} samples: judged on the circuit alone"}
        failed = cache_path(errors) or 0.0
        counts = cache_counts(tl, since, end) or {}
        return {"redis_ok": ops - failed, "redis_failed": failed, "hits": sum(counts.get(r, 0.0) for r in HITS)}


for _check in (FallbackServes(), CacheEffective(), DependencyAlert(), CircuitRecovers()):
    CHECKS.add(_check.name, _check)
