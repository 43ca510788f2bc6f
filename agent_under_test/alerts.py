"""Alert state machines over periods: P99High, ErrorRatioHigh, RejectedRatioHigh, DependencySlow.

Each alert sees one verdict per period and moves like a Prometheus rule with `for:`:

    inactive --breach--> pending --(N-th consecutive breach)--> firing
       ^                    |                                      |
       +------healthy-------+          M consecutive healthy ------+--> inactive
    (an `insufficient` period changes nothing: it neither breaches nor heals)

With N = 1 the first breach goes straight to firing. The machine is pure: `observe()` returns the
transition, the guard turns it into an event. DependencySlow judges the period's Redis operations and
circuit (monitor.DependencyRecorder) instead of the calls, through `observe_dependency()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent_under_test.monitor import BREACHING, HEALTHY, INSUFFICIENT, PeriodSummary

INACTIVE = "inactive"
PENDING = "pending"
FIRING = "firing"


@dataclass(frozen=True)
class Transition:
    alert: str
    from_state: str
    to_state: str
    period: int

    def event_fields(self) -> dict[str, object]:
        return {"alert": self.alert, "from": self.from_state, "to": self.to_state, "period": self.period}


class AlertMachine:
    """One alert: fires on the `fire_after`-th consecutive breaching period, resolves after
    `resolve_after` consecutive healthy ones. A healthy period resets a pending alert."""

    def __init__(self, name: str, fire_after: int = 3, resolve_after: int = 3) -> None:
        if fire_after < 1 or resolve_after < 1:
            raise ValueError(f"alert {name}: periods to fire and to resolve must be at least 1")
        self.name = name
        self.fire_after = fire_after
        self.resolve_after = resolve_after
        self.state = INACTIVE
        self.breaches = 0   # consecutive breaching periods (insufficient ones skipped)
        self.heals = 0      # consecutive healthy periods while firing

    @property
    def firing(self) -> bool:
        return self.state == FIRING

    def observe(self, verdict: str, period: int) -> Transition | None:
        """Feed one period's verdict (breaching | healthy | insufficient); return the transition, if any."""
        if verdict == INSUFFICIENT:
            return None
        if verdict not in (BREACHING, HEALTHY):
            raise ValueError(f"alert {self.name}: unknown period verdict {verdict!r}")
        old = self.state
        if verdict == BREACHING:
            self.heals = 0
            self.breaches += 1
            if self.state != FIRING:
                self.state = FIRING if self.breaches >= self.fire_after else PENDING
        else:
            self.breaches = 0
            if self.state == PENDING:
                self.state = INACTIVE
            elif self.state == FIRING:
                self.heals += 1
                if self.heals >= self.resolve_after:
                    self.state, self.heals = INACTIVE, 0
        return None if old == self.state else Transition(self.name, old, self.state, period)


def ratio_verdict(part: int, whole: int, threshold: float, min_samples: int) -> str:
    """`breaching` when part/whole > threshold; `insufficient` when whole < min_samples."""
    if whole < max(1, min_samples):
        return INSUFFICIENT
    return BREACHING if part / whole > threshold else HEALTHY


# How each alert reads a period: name -> verdict(summary, error_threshold, rejected_threshold, min_samples).
Verdict = Callable[[PeriodSummary, float, float, int], str]

RULES: dict[str, Verdict] = {
    "P99High": lambda s, err, rej, n: s.state,
    # Invalid input is the client's fault (like HTTP 4xx), so only server errors count.
    "ErrorRatioHigh": lambda s, err, rej, n: ratio_verdict(s.errors, s.ok + s.errors, err, n),
    "RejectedRatioHigh": lambda s, err, rej, n: ratio_verdict(s.rejected, s.count + s.rejected, rej, n),
}


DEPENDENCY_ALERT = "DependencySlow"


class AlertSet:
    """All alerts of the guard, fed one period summary (and one dependency verdict) at a time."""

    def __init__(self, fire_after: int, resolve_after: int, error_ratio: float, rejected_ratio: float,
                 min_samples: int) -> None:
        self.machines = {name: AlertMachine(name, fire_after, resolve_after) for name in (*RULES, DEPENDENCY_ALERT)}
        self.error_ratio = error_ratio
        self.rejected_ratio = rejected_ratio
        self.min_samples = min_samples

    def observe(self, summary: PeriodSummary) -> list[Transition]:
        """Every alert's transition caused by this period, P99High first."""
        out = []
        for name, rule in RULES.items():
            verdict = rule(summary, self.error_ratio, self.rejected_ratio, self.min_samples)
            if (t := self.machines[name].observe(verdict, summary.period)) is not None:
                out.append(t)
        return out

    def observe_dependency(self, verdict: str, period: int) -> Transition | None:
        """DependencySlow's transition for this period's dependency verdict (see DependencyRecorder)."""
        return self.machines[DEPENDENCY_ALERT].observe(verdict, period)

    def firing(self, name: str) -> bool:
        return self.machines[name].firing
