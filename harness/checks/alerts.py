"""Alert and degradation checks: alert_fires, alert_silent, degrades, restores.

The ground truth for `alert_fires` is computed from the client's own per-call results, never from
the agent's view: the alert must fire no later than K periods after the client-side P99 first
exceeded the threshold for N consecutive periods.
"""

from __future__ import annotations

from harness.checks.base import Param, Verdict, phase_window, register, verdict
from harness.scenario import CheckSpec
from harness.timeline import PeriodStats, Timeline


def first_breach(periods: list[PeriodStats], start: float, end: float, threshold_ms: float,
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


class AlertFires:
    name = "alert_fires"
    params = {"phase": Param("phase", required=True), "alert": Param("str"),
              "within_periods": Param("int", help="K: periods allowed after the ground truth (default 1)"),
              "consecutive": Param("int", help="N: breaching periods that make the truth (default alert_periods)"),
              "threshold_ms": Param("number")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        alert = spec.params.get("alert", "P99High")
        k = spec.params.get("within_periods", 1)
        n = spec.params.get("consecutive", tl.alert_periods)
        threshold = spec.params.get("threshold_ms", tl.threshold_ms)
        start, end = phase_window(tl, spec)
        truth = first_breach(tl.periods, start, end, threshold, n)
        evidence = {"threshold_ms": threshold, "consecutive": n, "within_periods": k,
                    "client_p99_ms": _p99s(tl, start, end)}
        if truth is None:
            return verdict(spec, False, f"client P99 never exceeded {threshold:g} ms for {n} consecutive "
                           "periods in the phase: the fault did not breach, so the alert cannot be judged",
                           **evidence)
        truth_s, run = truth
        deadline = truth_s + k * tl.period_s
        # Firing by the deadline counts, even if it began earlier and never stopped (an alert that was
        # already firing is not late; whether it was a false alarm is alert_silent's question).
        fired = [s for s, e in tl.alert_intervals(alert)
                 if s <= deadline + 1e-9 and (e is None or e >= truth_s - k * tl.period_s)]
        evidence |= {"ground_truth_s": round(truth_s, 3), "breach_periods": run, "deadline_s": round(deadline, 3)}
        if not fired:
            later = [s for s, _ in tl.alert_intervals(alert) if s > deadline]
            evidence["fired_s"] = round(later[0], 3) if later else None
            when = f"only at {later[0]:.1f}s" if later else "never"
            return verdict(spec, False, f"{alert} fired {when}; it should have by {deadline:.1f}s "
                           f"({k} period(s) after client P99 breached for {n} periods at {truth_s:.1f}s)",
                           **evidence)
        evidence["fired_s"] = round(fired[0], 3)
        early = " (already firing before the breach)" if fired[0] < truth_s - n * tl.period_s else ""
        return verdict(spec, True, f"{alert} fired at {fired[0]:.1f}s, {fired[0] - truth_s:+.1f}s after client "
                       f"P99 > {threshold:g} ms for {n} periods (deadline {deadline:.1f}s){early}", **evidence)


class AlertSilent:
    name = "alert_silent"
    params = {"phase": Param("phase"), "alert": Param("str")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        alert = spec.params.get("alert", "P99High")
        start, end = phase_window(tl, spec)
        hits = [(s, e) for s, e in tl.alert_intervals(alert) if s < end and (e is None or e > start)]
        p99s = [p for p in _p99s(tl, start, end) if p is not None]
        evidence = {"firing": hits, "max_client_p99_ms": max(p99s) if p99s else None}
        if hits:
            return verdict(spec, False, f"{alert} fired at {hits[0][0]:.1f}s: a false alarm in "
                           f"{start:.1f}-{end:.1f}s", **evidence)
        return verdict(spec, True, f"{alert} stayed silent from {start:.1f}s to {end:.1f}s", **evidence)


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
        fired = [max(s, start) for s, e in tl.alert_intervals(alert) if s < end and (e is None or e > start)]
        tiers = tl.tier_series()
        if not fired:
            return verdict(spec, False, f"{alert} never fired in the phase, so no degradation to judge",
                           tiers=tiers)
        deadline = fired[0] + k * tl.period_s
        light = [t for t, tier in tiers if tier == "light" and start - tl.period_s <= t <= deadline + 1e-9]
        evidence = {"alert_fired_s": round(fired[0], 3), "deadline_s": round(deadline, 3), "tiers": tiers}
        if light or _tier_at(tiers, fired[0]) == "light":
            when = light[0] if light else fired[0]
            return verdict(spec, True, f"tier light at {when:.1f}s, alert fired at {fired[0]:.1f}s",
                           light_s=round(when, 3), **evidence)
        return verdict(spec, False, f"tier stayed full until {deadline:.1f}s although {alert} fired at "
                       f"{fired[0]:.1f}s", **evidence)


class Restores:
    name = "restores"
    params = {"phase": Param("phase", required=True), "alert": Param("str"),
              "within_s": Param("duration", help="after the alert resolved (default 10s)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        alert = spec.params.get("alert", "P99High")
        within = spec.params.get("within_s", 10.0)
        start, end = phase_window(tl, spec)
        tiers = tl.tier_series()
        intervals = tl.alert_intervals(alert)
        resolved = [e for s, e in intervals if e is not None and e <= end]
        still = [s for s, e in intervals if e is None or e > end]
        evidence: dict[str, object] = {"tiers": tiers, "alert_intervals": intervals}
        if still:
            return verdict(spec, False, f"{alert} was still firing at {end:.1f}s: nothing restored",
                           **evidence)
        since = max(resolved[-1], start) if resolved else start
        deadline = since + within
        full = [t for t, tier in tiers if tier == "full" and since - tl.period_s <= t <= deadline]
        if _tier_at(tiers, min(deadline, end)) == "full":
            when = full[0] if full else since
            return verdict(spec, True, f"tier full again at {when:.1f}s (alert resolved at "
                           f"{resolved[-1] if resolved else since:.1f}s)", **evidence)
        if deadline > end:
            return verdict(spec, False, f"tier still light when the phase ended at {end:.1f}s, "
                           f"{end - since:.1f}s after the alert resolved at {since:.1f}s (allowed {within:g}s): "
                           "lengthen the phase to judge", **evidence)
        return verdict(spec, False, f"tier still light at {deadline:.1f}s, {within:g}s after the alert "
                       f"resolved at {since:.1f}s", **evidence)


for _check in (AlertFires(), AlertSilent(), Degrades(), Restores()):
    register(_check)
