"""Open-loop arrival schedules (pure): when each call should be sent, as offsets in seconds from start.

    poisson  exponential gaps at `rate`
    bursty   a two-state (calm/burst) modulated Poisson process with the same mean rate: 20% of the time
             in bursts at 2.5x the mean rate, calm at 0.625x; state lengths exponential (0.2 s / 0.8 s)
    constant evenly spaced at 1/rate (no random draw)

Every random draw comes from the `random.Random` passed in, so a seed fixes the whole schedule.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator

from wire.registry import Registry

BURST_SHARE, BURST_FACTOR, BURST_MEAN_S = 0.2, 2.5, 0.2
_CALM_FACTOR = (1.0 - BURST_SHARE * BURST_FACTOR) / (1.0 - BURST_SHARE)
_CALM_MEAN_S = BURST_MEAN_S * (1.0 - BURST_SHARE) / BURST_SHARE


def poisson(rate: float, duration_s: float, rng: random.Random) -> Iterator[float]:
    t = rng.expovariate(rate)
    while t < duration_s:
        yield t
        t += rng.expovariate(rate)


def bursty(rate: float, duration_s: float, rng: random.Random) -> Iterator[float]:
    t, in_burst = 0.0, False
    state_end = rng.expovariate(1.0 / _CALM_MEAN_S)
    while t < duration_s:
        r = rate * (BURST_FACTOR if in_burst else _CALM_FACTOR)
        nxt = t + rng.expovariate(r)
        if nxt >= state_end:  # memoryless: restart the draw at the state change
            t, in_burst = state_end, not in_burst
            state_end = t + rng.expovariate(1.0 / (BURST_MEAN_S if in_burst else _CALM_MEAN_S))
            continue
        t = nxt
        if t < duration_s:
            yield t


def constant(rate: float, duration_s: float, rng: random.Random) -> Iterator[float]:
    for i in itertools.count():
        t = i / rate
        if t >= duration_s:
            return
        yield t


PATTERNS: Registry[str, Callable[[float, float, random.Random], Iterator[float]]] = Registry(
    "arrival pattern", {"poisson": poisson, "bursty": bursty, "constant": constant}, error=ValueError)
