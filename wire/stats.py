"""The one percentile every report, check, live view and bench of shadowtest uses.

Nearest rank: P(q) of n values is the ceil(q * n)-th smallest (1-based; the smallest for q = 0), a value
that was measured, never an interpolation between two. "P99 = 23 ms" then means that 99 % of the calls
took 23 ms or less and that a call took exactly 23 ms. Where latencies are kept in an HDR histogram
(the replayer's and the agent's own monitor, 3 significant digits), `HdrHistogram.get_value_at_percentile`
is the same rank, reported as the upper end of the histogram bucket that holds it (within 0.1 % of the
value; exact below 2,048 units of the histogram).

    percentile(sorted_values, 0.99)     an ascending list, q in 0..1
    percentiles(values, (0.5, 0.99))    any iterable, sorted here: {0.5: v, 0.99: v}

Both raise ValueError on no values: an empty set has no percentile, and a report says so (None) rather
than print a 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeVar

T = TypeVar("T", int, float)

_EPS = 1e-9   # q * n computed in floating point: 0.07 * 100 = 7.000000000000001 is rank 7, not 8


def rank(q: float, n: int) -> int:
    """The 1-based rank of the q-percentile (q in 0..1) among n values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile {q!r} is outside 0..1")
    if n <= 0:
        raise ValueError("no values: a percentile of nothing is undefined")
    return min(n, max(1, math.ceil(q * n - _EPS)))


def percentile(sorted_values: Sequence[T], q: float) -> T:
    """Nearest-rank percentile of an ascending sequence (q in 0..1)."""
    return sorted_values[rank(q, len(sorted_values)) - 1]


def percentiles(values: Iterable[T], qs: Iterable[float]) -> dict[float, T]:
    """{q: nearest-rank percentile} of `values` (any order) for each q in 0..1."""
    ordered = sorted(values)
    return {q: percentile(ordered, q) for q in qs}
