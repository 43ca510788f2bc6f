"""Risk check and order generation: turn the model's raw output into an order that obeys the limits.

Rules (a violated rule turns the order into HOLD and says why in `reason`):
  - price band: a limit price further than `price_band_bps` from mid is refused
  - position: the order is cut so |position + signed size| <= max_position; nothing left -> HOLD
  - confidence: below `min_confidence` -> HOLD
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

HOLD, BUY, SELL = 0, 1, 2


@dataclass(frozen=True)
class RiskLimits:
    max_position: float = 1000.0
    max_order_size: float = 100.0
    price_band_bps: float = 50.0
    min_confidence: float = 0.0


@dataclass(slots=True)
class Order:
    side: int
    price: float
    size: float
    confidence: float
    reason: str = ""


def propose(raw: Sequence[float] | np.ndarray, mid: float, best_bid: float, best_ask: float, limits: RiskLimits) -> Order:
    """The model's order before risk: side by argmax, a limit price around the touch, a size.

    The price offset may reach twice the band so that the band rule has something to catch.
    """
    # Plain floats: numpy's per-call overhead dwarfs the arithmetic on three numbers.
    a, b, c = float(raw[0]), float(raw[1]), float(raw[2])
    top = max(a, b, c)
    exps = [math.exp(a - top), math.exp(b - top), math.exp(c - top)]
    side = exps.index(max(exps))
    confidence = exps[side] / sum(exps)
    offset_bps = math.tanh(float(raw[3])) * 2.0 * limits.price_band_bps
    size = max(1.0, round(limits.max_order_size / (1.0 + math.exp(-float(raw[4])))))
    if side == BUY:
        price = best_ask * (1.0 + offset_bps / 1e4)
    elif side == SELL:
        price = best_bid * (1.0 - offset_bps / 1e4)
    else:
        price, size = mid, 0.0
    return Order(side, round(price, 6), size, confidence)


def check(order: Order, mid: float, position: float, limits: RiskLimits) -> Order:
    """Apply the limits; returns the order to send (possibly HOLD with a reason)."""
    if order.side == HOLD:
        return order
    if order.confidence < limits.min_confidence:
        return Order(HOLD, mid, 0.0, order.confidence, f"confidence {order.confidence:.2f} below minimum")
    band = abs(order.price - mid) / mid * 1e4
    if band > limits.price_band_bps:
        return Order(HOLD, mid, 0.0, order.confidence,
                     f"price band: {band:.1f} bps from mid exceeds {limits.price_band_bps:g}")
    sign = 1.0 if order.side == BUY else -1.0
    room = limits.max_position - sign * position
    size = min(order.size, math.floor(max(room, 0.0)))
    if size <= 0:
        return Order(HOLD, mid, 0.0, order.confidence,
                     f"position limit: position {position:g} at limit {limits.max_position:g}")
    return Order(order.side, order.price, size, order.confidence)
