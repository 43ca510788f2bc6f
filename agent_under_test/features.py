"""Features stage (numpy): one token per order-book level, with a time and an attention weight.

Token i pairs book level i (best first) with the i-th most recent tick, so the model's sequence runs
from the best, newest state outwards. Each token carries:

    x[i]  8 features, in book column order: bid offset from mid (bps/100), log1p(bid size)/10,
          ask offset, log1p(ask size)/10; then spread (bps/100), the aligned tick's price vs mid
          (bps/100), log1p(its size)/10, tanh(position/1000)
    t[i]  seconds since the newest tick (the attention decay uses |t[i] - t[j]|)
    w[i]  key weight: 1, or OUTLIER_WEIGHT when the level's spread is an outlier
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agent_under_test.snapshot import ParsedSnapshot

N_FEATURES = 8
OUTLIER_SIGMAS = 3.0
OUTLIER_WEIGHT = 0.1
# A book whose spreads are all equal has std 0; don't flag a 0.1% wider level as an outlier.
_STD_FLOOR_FRACTION = 0.01


@dataclass
class Features:
    x: np.ndarray       # [L, N_FEATURES] float32
    t: np.ndarray       # [L] float32, seconds
    w: np.ndarray       # [L] float32, key weights in (0, 1]
    mid: float
    best_bid: float
    best_ask: float


def _outlier_weights(s: list[float], sigmas: float, weight: float) -> list[float]:
    n = len(s)
    if n < 3:
        return [1.0] * n
    # Plain floats: at ~10 levels numpy's per-op cost is 3x this loop (measured).
    total, total_sq, k2 = sum(s), sum([v * v for v in s]), sigmas * sigmas
    m = n - 1
    out = []
    for v in s:
        mean_o = (total - v) / m
        d = v - mean_o
        if d > 0:   # d <= 0 is never an outlier: skip the variance
            var_o = (total_sq - v * v) / m - mean_o * mean_o
            # d > k*max(std, floor), compared squared: no sqrt.
            out.append(weight if d * d > k2 * max(var_o, (_STD_FLOOR_FRACTION * mean_o) ** 2) else 1.0)
        else:
            out.append(1.0)
    return out


def spread_outlier_weights(spreads: Sequence[float] | np.ndarray, sigmas: float = OUTLIER_SIGMAS,
                           weight: float = OUTLIER_WEIGHT) -> np.ndarray:
    """Key weights: `weight` for levels whose spread exceeds the others' mean by more than `sigmas`
    of the others' standard deviation (leave-one-out, so one wide level cannot hide itself by
    inflating the std), else 1. Needs at least 3 levels; fewer are never outliers."""
    s = spreads.tolist() if isinstance(spreads, np.ndarray) else list(spreads)
    return np.array(_outlier_weights(s, sigmas, weight), dtype=np.float32)


def _token_times(tick_rows: Sequence[Sequence[float]], n_levels: int) -> list[float]:
    """token_times on plain rows (oldest first); float(ts) first, so the arithmetic is numpy's float64."""
    if not tick_rows:
        return [0.0] * n_levels
    k = min(n_levels, len(tick_rows))
    newest = float(tick_rows[-1][0])
    out = [(newest - float(r[0])) / 1e9 for r in tick_rows[:-k - 1:-1]]
    if k < n_levels:
        out += [out[-1]] * (n_levels - k)
    return out


def token_times(ticks: np.ndarray, n_levels: int) -> np.ndarray:
    """Seconds since the newest tick for each token; tokens beyond the ticks reuse the oldest one."""
    if len(ticks) == 0:
        return np.zeros(n_levels, dtype=np.float32)
    newest_first = ticks[::-1, 0]
    idx = np.minimum(np.arange(n_levels), len(newest_first) - 1)
    return ((newest_first[0] - newest_first[idx]) / 1e9).astype(np.float32)


def build_features(snap: ParsedSnapshot) -> Features:
    """Turn a validated snapshot into model inputs (see the module docstring)."""
    rows = snap.book_rows
    ticks = snap.tick_rows
    n = len(rows)
    best_bid, _, best_ask, _ = rows[0]
    mid = 0.5 * (best_bid + best_ask)
    scale, pos, log1p = 100.0 / mid, math.tanh(snap.position / 1000.0), math.log1p
    # Plain floats in one flat list (x row by row, then t, then w) and one float32 array at the end,
    # viewed as x, t, w: at ~10 levels numpy's per-call cost dominates the arithmetic.
    flat: list[float] = []
    spreads = [ask - bid for bid, _, ask, _ in rows]
    recent = ticks[:-n - 1:-1]   # newest first, aligned with the levels
    for (bid, bid_size, ask, ask_size), spread, (_, price, size) in zip(rows, spreads, recent, strict=False):
        flat += ((bid - mid) * scale, log1p(bid_size) * 0.1, (ask - mid) * scale, log1p(ask_size) * 0.1,
                 spread * scale, (price - mid) * scale, log1p(size) * 0.1, pos)
    for (bid, bid_size, ask, ask_size), spread in zip(rows[len(recent):], spreads[len(recent):], strict=True):
        flat += ((bid - mid) * scale, log1p(bid_size) * 0.1, (ask - mid) * scale, log1p(ask_size) * 0.1,
                 spread * scale, 0.0, 0.0, pos)   # no aligned tick
    flat += _token_times(ticks, n)
    flat += _outlier_weights(spreads, OUTLIER_SIGMAS, OUTLIER_WEIGHT)
    arr = np.array(flat, dtype=np.float32)
    nx = n * N_FEATURES
    return Features(arr[:nx].reshape(n, N_FEATURES), arr[nx:nx + n], arr[nx + n:], mid, best_bid, best_ask)
