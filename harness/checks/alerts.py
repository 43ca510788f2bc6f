"""Alert and degradation checks: alert_fires, alert_silent, degrades, restores.

The ground truth for `alert_fires` is measured outside the service but where the service can observe
it: the fault proxy's upstream leg (harness.checks.truth), never the client's latency, which holds
network faults the service cannot see. The alert must fire no later than K periods after the leg's P99
first exceeded the threshold for N consecutive periods. Without leg timings (no proxy, or Toxiproxy in
front) the client's P99 is the truth, as the evidence says. Where the leg breached before the service's
own P99 did (time calls waited in the kernel while the CPU was throttled), an alert that followed the
service's own breach in time passes with that difference reported as a finding, with numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.checks.base import CHECKS, Param, Verdict, nothing_to_judge, phase_window, verdict
from harness.checks.truth import LEG_TOLERANCE, leg_periods
from harness.scenario import CheckSpec
from harness.timeline import Timeline


def first_breach(periods: list[Any], start: float, end: float, threshold_ms: float,
                 consecutive: int) -> tuple[float, list[int]] | None:
    """End time of the first run of `consecutive` periods whose client P99 exceeds the threshold, the
    run starting within [start, end) (it may finish after `end`: queues outlive a fault), and those
    periods' indexes; None when it never happened."""
    run: list[int] = []
    for p in periods:
        if p.start_s < start - 1e-9 or (not run and p.start_s >= end - 1e-9):
            continue
        if p.p99_ms is not None and p.p99_ms > threshold_ms:
            run.append(p.index)
            if len(run) >= consecutive:
                return p.end_s, run
        else:
            run = []   # a healthy or insufficient period breaks the run, as it resets the agent's alert
    return None


def _p99s(tl: Timeline, start: float, end: float) -> list[float | None]:
    return [p.p99_ms for p in tl.periods if start - 1e-9 <= p.start_s < end]


@dataclass(frozen=True)
class _Own:
    """One of the service's own periods, on the service's grid (`end_s` = its period event's time)."""

    index: int
    start_s: float
    end_s: float
    p99_ms: float | None


def _own_periods(tl: Timeline, min_samples: int) -> list[_Own]:
    from harness.checks.rule import service_periods

    out = []
    for p in service_periods(tl):
        enough = p.count is None or p.count >= min_samples
        out.append(_Own(p.period, p.t - tl.period_s, p.t, p.p99_ms if enough else None))
    return out


_SOURCE = Param("choice:service,prometheus", help="whose alert: the service's own (default) or ALERTS{alertname} "
                                                  "from the run's Prometheus (the scenario's `prometheus:` rules)")


def alert_intervals(tl: Timeline, alert: str, source: str) -> list[tuple[float, float | None]] | None:
    """Firing intervals of `alert` as the service reports it, or as the run's Prometheus evaluated the
    scenario's rules (None: no Prometheus in this run)."""
    if source != "prometheus":
        return tl.alert_intervals(alert)
    prom = tl.outside.get("prometheus")
    if prom is None:
        return None
    return [(float(s), None if e is None else float(e)) for s, e in prom["alerts"].get(alert, [])]


def _no_prometheus(spec: CheckSpec) -> Verdict:
    return verdict(spec, False, "source: prometheus, but no Prometheus ran: add `prometheus: {rules: [FILE]}` "
                   "to the scenario (docs/harness.md, Alerts as deployed)")


class AlertFires:
    name = "alert_fires"
    params = {"phase": Param("phase", required=True), "alert": Param("str"), "source": _SOURCE,
              "within_periods": Param("int", help="K: periods allowed after the ground truth (default 1)"),
              "consecutive": Param("int", help="N: breaching periods that make the truth (default alert_periods)"),
              "threshold_ms": Param("number")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        alert = spec.params.get("alert", "P99High")
        k = spec.params.get("within_periods", 1)
        n = spec.params.get("consecutive", tl.alert_periods)
        threshold = spec.params.get("threshold_ms", tl.threshold_ms)
        start, end = phase_window(tl, spec)
        legs = leg_periods(tl)
        periods: list[Any]
        if legs is not None:
            source, periods = "proxy_leg", legs
            tolerance = LEG_TOLERANCE
        else:
            source, periods = "client", tl.periods
            tolerance = ("client latency from the intended send time: it includes network faults the "
                         "service cannot see (no proxy leg timings in this run)")
        truth = first_breach(periods, start, end, threshold, n)
        evidence: dict[str, Any] = {
            "truth": source, "tolerance": tolerance, "threshold_ms": threshold, "consecutive": n,
            "within_periods": k, f"{source}_p99_ms": [p.p99_ms for p in periods if start - 1e-9 <= p.start_s < end],
            "client_p99_ms": _p99s(tl, start, end)}
        if truth is None:
            return nothing_to_judge(spec, f"{_what(source)} P99 never exceeded {threshold:g} ms for {n} "
                                    "consecutive periods in the phase: the fault did not breach, so whether "
                                    "the alert fires cannot be told", **evidence)
        truth_s, run = truth
        deadline = truth_s + k * tl.period_s
        source_of_alert = spec.params.get("source", "service")
        found = alert_intervals(tl, alert, source_of_alert)
        if found is None:
            return _no_prometheus(spec)
        intervals = found
        evidence["alert_source"] = source_of_alert
        if source_of_alert == "prometheus":
            alert = f'ALERTS{{alertname="{alert}"}}'
        evidence |= {"ground_truth_s": round(truth_s, 3), "breach_periods": run, "deadline_s": round(deadline, 3)}
        fired = _fired_by(intervals, truth_s, deadline, k * tl.period_s)
        if fired is not None:
            evidence["fired_s"] = round(fired, 3)
            early = " (already firing before the breach)" if fired < truth_s - n * tl.period_s else ""
            return verdict(spec, True, f"{alert} fired at {fired:.1f}s, {fired - truth_s:+.1f}s after "
                           f"{_what(source)} P99 > {threshold:g} ms for {n} periods (deadline {deadline:.1f}s)"
                           f"{early}", **evidence)
        later = [s for s, _ in intervals if s > deadline]
        evidence["fired_s"] = round(later[0], 3) if later else None
        when = f"only at {later[0]:.1f}s" if later else "never"
        if source == "proxy_leg":
            # The leg breached first: did the service's own P99 breach later, and the alert follow it?
            own = first_breach(_own_periods(tl, tl.min_samples), start, end + tl.period_s, threshold, n)
            if own is not None:
                own_s, own_run = own
                own_deadline = own_s + k * tl.period_s
                late = _fired_by(intervals, own_s, own_deadline, k * tl.period_s)
                leg_p99 = [p.p99_ms for p in periods if p.index in run]
                finding = (f"finding: the proxy leg's P99 breached {threshold:g} ms for {n} periods by "
                           f"{truth_s:.1f}s ({_ms(leg_p99)}), the service's own P99 only by {own_s:.1f}s "
                           f"({own_s - truth_s:+.1f}s): latency outside the service's view (calls waiting "
                           "in the kernel before it read them)")
                evidence |= {"finding": finding, "service_truth_s": round(own_s, 3),
                             "service_breach_periods": own_run, "view_difference_s": round(own_s - truth_s, 3)}
                if late is not None:
                    evidence["fired_s"] = round(late, 3)
                    return verdict(spec, True, f"{alert} fired at {late:.1f}s, {late - own_s:+.1f}s after the "
                                   f"service's own P99 breached for {n} periods (deadline {own_deadline:.1f}s); "
                                   + finding, **evidence)
                return verdict(spec, False, f"{alert} fired {when}; it should have by {own_deadline:.1f}s "
                               f"({k} period(s) after even the service's own P99 breached for {n} periods at "
                               f"{own_s:.1f}s; the proxy leg breached at {truth_s:.1f}s)", **evidence)
        return verdict(spec, False, f"{alert} fired {when}; it should have by {deadline:.1f}s "
                       f"({k} period(s) after {_what(source)} P99 breached for {n} periods at {truth_s:.1f}s)",
                       **evidence)


def _fired_by(intervals: list[tuple[float, float | None]], truth_s: float, deadline: float,
              slack: float) -> float | None:
    """When the alert was firing by `deadline` (an alert already firing is not late; whether it was a
    false alarm is alert_silent's question), else None."""
    fired = [s for s, e in intervals if s <= deadline + 1e-9 and (e is None or e >= truth_s - slack)]
    return fired[0] if fired else None


def _what(source: str) -> str:
    return {"proxy_leg": "the proxy leg's (server-side)", "client": "client"}.get(source, source)


def _ms(values: list[float | None]) -> str:
    return ", ".join("-" if v is None else f"{v:.1f}" for v in values) + " ms"


class AlertSilent:
    name = "alert_silent"
    params = {"phase": Param("phase"), "alert": Param("str"), "source": _SOURCE,
              "service_breach": Param("bool", help="the window must hold a short breach of the service's own "
                                                   "P99 (fewer periods than its rule needs), else nothing to judge")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        alert = spec.params.get("alert", "P99High")
        start, end = phase_window(tl, spec)
        source = spec.params.get("source", "service")
        found = alert_intervals(tl, alert, source)
        if found is None:
            return _no_prometheus(spec)
        if source == "prometheus":
            alert = f'ALERTS{{alertname="{alert}"}}'
        hits = [(s, e) for s, e in found if s < end and (e is None or e > start)]
        p99s = [p for p in _p99s(tl, start, end) if p is not None]
        evidence: dict[str, Any] = {"firing": hits, "max_client_p99_ms": max(p99s) if p99s else None,
                                    "alert_source": source}
        breached: list[int] = []
        if spec.params.get("service_breach"):
            # A spike the service itself saw, shorter than its rule: silence then shows the rule counts
            # consecutive periods; without one, silence proves only that nothing happened.
            own = [p for p in _own_periods(tl, tl.min_samples) if start - 1e-9 <= p.start_s < end]
            breached = [p.index for p in own if p.p99_ms is not None and p.p99_ms > tl.threshold_ms]
            evidence |= {"service_p99_ms": [p.p99_ms for p in own], "service_breach_periods": breached}
        if hits:
            return verdict(spec, False, f"{alert} fired at {hits[0][0]:.1f}s: a false alarm in "
                           f"{start:.1f}-{end:.1f}s", **evidence)
        if source != "prometheus" and not tl.alert_observed(alert):      # (alert: still the plain name here)
            return nothing_to_judge(spec, f"the target reported no alert state (no events, no "
                                    f"{tl.alert_metric(alert)} samples): {alert} never firing there is not "
                                    "silence seen", **evidence)
        if spec.params.get("service_breach") and not breached:
            return nothing_to_judge(spec, f"the service's own P99 never exceeded {tl.threshold_ms:g} ms in "
                                    f"{start:.1f}-{end:.1f}s, so its silence does not show that a short "
                                    "breach is ignored", **evidence)
        more = (f"; the service's own P99 breached {tl.threshold_ms:g} ms in {len(breached)} period(s) "
                f"({', '.join(map(str, breached))}; its rule fires on {tl.alert_periods} in a row)"
                if breached else "")
        return verdict(spec, True, f"{alert} stayed silent from {start:.1f}s to {end:.1f}s{more}", **evidence)


def _tier_at(series: list[tuple[float, str]], t: float, default: str = "full") -> str:
    tier = default
    for when, value in series:
        if when > t:
            break
        tier = value
    return tier


class Degrades:
    name = "degrades"
    params = {"phase": Param("phase", required=True), "alert": Param("str"),
              "within_periods": Param("int", help="periods after the alert fired (default 2)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        alert = spec.params.get("alert", "P99High")
        k = spec.params.get("within_periods", 2)
        start, end = phase_window(tl, spec)
        firing = [(max(s, start), e) for s, e in tl.alert_intervals(alert) if s < end and (e is None or e > start)]
        tiers = tl.tier_series()
        if not firing:
            return nothing_to_judge(spec, f"{alert} never fired in the phase, so there is no degradation "
                                    "to judge", tiers=tiers)
        fired, resolved = firing[0]
        deadline = fired + k * tl.period_s
        held_until = min(end, resolved if resolved is not None else end)
        evidence: dict[str, Any] = {"alert_fired_s": round(fired, 3), "deadline_s": round(deadline, 3),
                                    "tiers": tiers}
        # Only a change at or after the alert fired shows the alert degrading; a light tier that came
        # earlier (from the queue) says nothing about the alert.
        light = [t for t, tier in tiers if tier == "light" and fired - 1e-6 <= t <= deadline + 1e-9]
        before = _tier_at(tiers, fired - 1e-6) == "light"
        back = [t for t, tier in tiers if tier == "full" and max(fired, light[0] if light else fired) < t < held_until]
        if back:
            return verdict(spec, False, f"the tier went back to full at {back[0]:.1f}s while {alert} was still "
                           f"firing (fired {fired:.1f}s)", full_s=round(back[0], 3), **evidence)
        if light:
            return verdict(spec, True, f"tier light at {light[0]:.1f}s, alert fired at {fired:.1f}s and the "
                           f"tier stayed light while it fired", light_s=round(light[0], 3), **evidence)
        if before:
            since = max((t for t, tier in tiers if tier == "light" and t < fired), default=start)
            return nothing_to_judge(spec, f"the tier was already light (since {since:.1f}s, before {alert} "
                                    f"fired at {fired:.1f}s) and stayed light while it fired: whether the alert "
                                    "degrades cannot be told", **evidence)
        return verdict(spec, False, f"tier stayed full until {deadline:.1f}s although {alert} fired at "
                       f"{fired:.1f}s", **evidence)


class Restores:
    name = "restores"
    params = {"phase": Param("phase", required=True), "alert": Param("str"),
              "within_s": Param("duration", help="after the alert resolved (default 10s)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        alert = spec.params.get("alert", "P99High")
        within = spec.params.get("within_s", 10.0)
        start, end = phase_window(tl, spec)
        tiers = tl.tier_series()
        intervals = [(s, e) for s, e in tl.alert_intervals(alert) if s < end]
        resolved = [e for s, e in intervals if e is not None and e <= end]
        still = [s for s, e in intervals if e is None or e > end]
        evidence: dict[str, object] = {"tiers": tiers, "alert_intervals": intervals}
        light_ever = any(tier == "light" for t, tier in tiers if t < end)
        if not intervals and not light_ever:
            return nothing_to_judge(spec, f"{alert} never fired and the tier was never light by {end:.1f}s: "
                                    "nothing to restore", **evidence)
        if still:
            return verdict(spec, False, f"{alert} was still firing at {end:.1f}s: nothing restored",
                           **evidence)
        if not light_ever:
            # The alert fired and resolved but the tier never left full (or the target reports no tier):
            # "full again" would pass on nothing restored; degrades judges whether it should have gone light.
            unseen = "" if tiers else " (the target reported no tier at all)"
            return nothing_to_judge(spec, f"the tier was never light by {end:.1f}s{unseen} although {alert} "
                                    "fired: nothing to restore", **evidence)
        since = max(resolved[-1], start) if resolved else start
        deadline = since + within
        full = [t for t, tier in tiers if tier == "full" and since - tl.period_s <= t <= deadline]
        if _tier_at(tiers, min(deadline, end)) == "full":
            when = full[0] if full else since
            why = (f"alert resolved at {resolved[-1]:.1f}s" if resolved else
                   f"{alert} never fired; the tier had gone light")
            return verdict(spec, True, f"tier full again at {when:.1f}s ({why})", **evidence)
        if deadline > end:
            return verdict(spec, False, f"tier still light when the phase ended at {end:.1f}s, "
                           f"{end - since:.1f}s after the alert resolved at {since:.1f}s (allowed {within:g}s): "
                           "lengthen the phase to judge", **evidence)
        return verdict(spec, False, f"tier still light at {deadline:.1f}s, {within:g}s after the alert "
                       f"resolved at {since:.1f}s", **evidence)


for _check in (AlertFires(), AlertSilent(), Degrades(), Restores()):
    CHECKS.add(_check.name, _check)
