"""Degradation: which model tier serves the next forward pass.

Two independent reasons to serve `light`:

  alert  P99High turns firing -> light, at once. After it resolves (itself M healthy periods), `full`
         returns once `hold_periods` healthy periods in a row have passed, the resolving period counting
         as the first (a resolved alert that breaches again at once does not flap the tier).
  queue  the batcher's depth above `light_depth` (5) at every forward pass for `sustain_s` (0.25 s) ->
         light; back once it stayed at or below `drain_depth` (2) for `sustain_s`. Two levels and a
         sustain time, so a queue that is deep for a moment (a burst, a CPU-quota stall) changes nothing.

The served tier is `light` while either reason holds, else the configured tier.

Hysteresis: after any tier change the tier holds for at least `hold_periods` periods (2 x 1 s), whatever
the queue does; a queue reason that comes due inside the hold takes effect at the first forward pass
after it. The one exception is the alert firing, which degrades at once (it is itself N breaching
periods, and fires again no sooner than N + M periods later). So in any window of k x hold the tier
changes at most k times plus the alert's firings: with the defaults (N = M = 3) at most 4 in any 6 s.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL = "full"
LIGHT = "light"
TIERS = (FULL, LIGHT)


@dataclass(frozen=True)
class TierChange:
    from_tier: str
    to_tier: str
    reason: str         # alert | queue | recovered

    def event_fields(self) -> dict[str, object]:
        return {"from": self.from_tier, "to": self.to_tier, "reason": self.reason}


class TierSelector:
    """Pure tier logic in the caller's time (`now`, monotonic seconds); the guard calls it under its lock."""

    def __init__(self, base_tier: str = FULL, light_depth: int = 5, drain_depth: int = 2,
                 hold_periods: int = 2, sustain_s: float = 0.25, period_s: float = 1.0) -> None:
        if base_tier not in TIERS:
            raise ValueError(f"unknown tier {base_tier!r}: choose full or light")
        if not 0 <= drain_depth < light_depth:
            raise ValueError("queue drain depth must be below the depth that switches to light")
        if hold_periods < 0 or sustain_s < 0 or period_s <= 0:
            raise ValueError("the tier hold and queue sustain must not be negative, the period positive")
        self.base = base_tier
        self.light_depth = light_depth
        self.drain_depth = drain_depth
        self.hold_periods = hold_periods
        self.hold_s = hold_periods * period_s     # the least time between two tier changes (but an alert)
        self.sustain_s = sustain_s
        self.deep_since: float | None = None      # start of the current run of passes above light_depth
        self.calm_since: float | None = None      # ... at or below drain_depth
        self.changed_at: float | None = None      # the last tier change
        self.alert_light = False
        self.queue_light = False
        self.calm_periods = 0
        self.tier = base_tier

    def on_queue(self, depth: int, now: float) -> TierChange | None:
        """Per forward pass at monotonic `now`: the queue reason starts after `sustain_s` deep, ends
        after `sustain_s` drained, and neither changes the tier within the hold of the last change."""
        if depth <= self.light_depth:
            self.deep_since = None
        elif self.deep_since is None:
            self.deep_since = now
        if depth > self.drain_depth:
            self.calm_since = None
        elif self.calm_since is None:
            self.calm_since = now
        if not self.queue_light:
            due = self.deep_since is not None and now - self.deep_since >= self.sustain_s - 1e-9
        else:
            due = self.calm_since is not None and now - self.calm_since >= self.sustain_s - 1e-9
        if not due or not (self.alert_light or self._held(now)):
            return None     # with the alert holding light the queue reason may come and go: no change
        self.queue_light = not self.queue_light
        return self._settle("queue" if self.queue_light else "recovered", now)

    def on_period(self, firing: bool, verdict: str, now: float) -> TierChange | None:
        """Per period at its tick time `now`, after the alerts moved: `firing` is P99High's state,
        `verdict` the period's (breaching | healthy | insufficient; an insufficient period neither
        resets nor counts)."""
        if firing:
            self.calm_periods = 0
            if self.alert_light:
                return None
            self.alert_light = True
            return self._settle("alert", now)
        if not self.alert_light:
            return None
        if verdict == "breaching":
            self.calm_periods = 0
        elif verdict == "healthy":
            self.calm_periods += 1
        if self.calm_periods < self.hold_periods:
            return None
        self.alert_light = False
        return self._settle("recovered", now)

    def _held(self, now: float) -> bool:
        """True once the hold since the last tier change is over (or there was none)."""
        return self.changed_at is None or now - self.changed_at >= self.hold_s - 1e-9

    def _settle(self, reason: str, now: float) -> TierChange | None:
        tier = LIGHT if (self.alert_light or self.queue_light) else self.base
        if tier == self.tier:
            return None
        change = TierChange(self.tier, tier, reason)
        self.tier, self.changed_at = tier, now
        return change
