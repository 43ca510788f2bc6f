"""Degradation: which model tier serves the next forward pass.

Two independent reasons to serve `light`:

  alert  P99High turns firing -> light. After it resolves (itself M healthy periods), `full` returns
         once `hold_periods` healthy periods in a row have passed, the resolving period counting as
         the first (hysteresis: a resolved alert that breaches again at once does not flap the tier).
  queue  queue depth above `light_depth` (5) -> light for new batches, until the depth falls to
         `drain_depth` (2) or below and at least `hold_s` (0.5 s) has passed since the switch. Two
         levels and a dwell time, so a queue hovering around 5 does not flip the model every batch.

The served tier is `light` while either reason holds, else the configured tier.
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
    """Pure tier logic; the guard calls it under its lock."""

    def __init__(self, base_tier: str = FULL, light_depth: int = 5, drain_depth: int = 2,
                 hold_periods: int = 2, hold_s: float = 0.5) -> None:
        if base_tier not in TIERS:
            raise ValueError(f"unknown tier {base_tier!r}: choose full or light")
        if not 0 <= drain_depth < light_depth:
            raise ValueError("queue drain depth must be below the depth that switches to light")
        self.base = base_tier
        self.light_depth = light_depth
        self.drain_depth = drain_depth
        self.hold_periods = hold_periods
        self.hold_s = hold_s
        self.queue_since = 0.0
        self.alert_light = False
        self.queue_light = False
        self.calm_periods = 0
        self.tier = base_tier

    def on_queue(self, depth: int, now: float) -> TierChange | None:
        """Per forward pass at monotonic `now`: switch on a deep queue, back once it drained and held."""
        if not self.queue_light and depth > self.light_depth:
            self.queue_light, self.queue_since = True, now
        elif self.queue_light and depth <= self.drain_depth and now - self.queue_since >= self.hold_s:
            self.queue_light = False
        else:
            return None
        return self._settle("queue" if self.queue_light else "recovered")

    def on_period(self, firing: bool, verdict: str) -> TierChange | None:
        """Per period, after the alerts moved: `firing` is P99High's state, `verdict` the period's
        (breaching | healthy | insufficient; an insufficient period neither resets nor counts)."""
        if firing:
            self.calm_periods = 0
            if self.alert_light:
                return None
            self.alert_light = True
            return self._settle("alert")
        if not self.alert_light:
            return None
        if verdict == "breaching":
            self.calm_periods = 0
        elif verdict == "healthy":
            self.calm_periods += 1
        if self.calm_periods < self.hold_periods:
            return None
        self.alert_light = False
        return self._settle("recovered")

    def _settle(self, reason: str) -> TierChange | None:
        tier = LIGHT if (self.alert_light or self.queue_light) else self.base
        if tier == self.tier:
            return None
        change = TierChange(self.tier, tier, reason)
        self.tier = tier
        return change
