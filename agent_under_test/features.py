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


def spread_outlier_weights(spreads: np.ndarray, sigmas: float = OUTLIER_SIGMAS,
                           weight: float = OUTLIER_WEIGHT) -> np.ndarray:
    """Key weights: `weight` for levels whose spread exceeds the others' mean by more than `sigmas`
    of the others' standard deviation (leave-one-out, so one wide level cannot hide itself by
    inflating the std), else 1. Needs at least 3 levels; fewer are never outliers."""
    n = len(spreads)
    out = np.ones(n, dtype=np.float32)
    if n < 3:
        return out
    s = spreads.astype(np.float64)
    total, total_sq = s.sum(), (s * s).sum()
    mean_o = (total - s) / (n - 1)
    var_o = np.maximum((total_sq - s * s) / (n - 1) - mean_o * mean_o, 0.0)
    std_o = np.maximum(np.sqrt(var_o), _STD_FLOOR_FRACTION * np.abs(mean_o))
    out[s - mean_o > sigmas * std_o] = weight
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
    book = snap.book
    n = len(book)
    mid = 0.5 * (book[0, 0] + book[0, 2])
    x = np.zeros((n, N_FEATURES), dtype=np.float32)
    # Columns 0..3 in two vector ops: price offsets in bps/100, log sizes / 10.
    x[:, 0:4:2] = (book[:, 0::2] - mid) * (100.0 / mid)
    x[:, 1:4:2] = np.log1p(book[:, 1::2]) * 0.1
    spreads = book[:, 2] - book[:, 0]
    x[:, 4] = spreads * (100.0 / mid)
    if len(snap.ticks):
        recent = snap.ticks[::-1][:n]
        k = len(recent)
        x[:k, 5] = (recent[:, 1] - mid) * (100.0 / mid)
        x[:k, 6] = np.log1p(recent[:, 2]) * 0.1
    x[:, 7] = math.tanh(snap.position / 1000.0)
    return Features(x, token_times(snap.ticks, n), spread_outlier_weights(spreads),
                    float(mid), float(book[0, 0]), float(book[0, 2]))
