"""The response cache's vector work: a probe's unit vector, and a bucket's best match for it.

Vectors are little-endian float32 `bytes`; a bucket's matrix is its rows' bytes one after another, so a
row is a slice and a new matrix is a concatenation, with no numpy call. The three functions:

    unit(x, n)          x (n rows of features) with each column's mean over the rows taken out (not when
                        n == 1), divided by its norm; all zeros when the norm is <= 1e-12
    scan(matrix, vec)   (the first row with the largest dot product with vec, that product); (-1, -inf)
                        for no rows
    sims(matrix, vec)   every row's dot product with vec
    scan_tails(rows, vec)  scan() over a list of byte strings that each end with a vector (packed Redis
                        entries), without slicing them out; items that are not bytes or are no longer
                        than vec are passed over

come compiled from `_similarity.c` where it was built (`pip install` builds it; where no C compiler was
found the install goes on without it), and otherwise from the numpy code below, which is also the
reference the compiled functions are tested against. Sums are doubles in both. KERNEL says which serves.

Why compiled: a cache miss is on every uncached call's path. As numpy it was seven calls of 2-4 us each
in a serving agent (the model's forward pass between calls leaves the caches cold), about 40 us a miss
against a budget of 5 % of a call; compiled it is two calls of well under a microsecond (issue 27,
bench/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_F4 = np.dtype("<f4")


def _floats(buf: object) -> np.ndarray:
    a = np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, (bytes, bytearray, memoryview)) else np.asarray(buf)
    if a.dtype == np.uint8:
        if a.size % 4:
            raise ValueError(f"{a.size} bytes is not a whole number of float32")
        return np.ascontiguousarray(a).view(_F4)
    if a.dtype != np.float32:
        raise TypeError(f"float32 values or their bytes, not {a.dtype}")
    return np.ascontiguousarray(a).ravel().astype(_F4, copy=False)


def unit_numpy(x: object, n: int) -> bytes:
    v = _floats(x).astype(np.float64)
    if n <= 0 or v.size == 0 or v.size % n:
        raise ValueError(f"unit: {v.size} values are not {n} rows")
    m = v.reshape(n, -1)
    if n > 1:
        m = m - m.mean(axis=0)
    norm = float(np.sqrt(np.dot(m.ravel(), m.ravel())))
    if norm <= 1e-12:
        return bytes(4 * v.size)
    return (m.ravel() / norm).astype(_F4).tobytes()


def _pair(matrix: object, vec: object) -> tuple[np.ndarray, np.ndarray]:
    m, v = _floats(matrix).astype(np.float64), _floats(vec).astype(np.float64)
    if v.size == 0 or m.size % v.size:
        raise ValueError(f"a matrix of {4 * m.size} bytes is not rows of {4 * v.size}")
    return m.reshape(-1, v.size), v


def scan_numpy(matrix: object, vec: object) -> tuple[int, float]:
    m, v = _pair(matrix, vec)
    if not len(m):
        return -1, float("-inf")
    s = m @ v
    best = int(s.argmax())
    return best, float(s[best])


def sims_numpy(matrix: object, vec: object) -> list[float]:
    m, v = _pair(matrix, vec)
    return [float(s) for s in m @ v]


def scan_tails_numpy(rows: list[object], vec: object) -> tuple[int, float]:
    v = _floats(vec).astype(np.float64)
    width, best, top = 4 * v.size, -1, float("-inf")
    for r, row in enumerate(rows):
        if not isinstance(row, bytes) or width == 0 or len(row) <= width:
            continue
        s = float(np.frombuffer(row, dtype=_F4, offset=len(row) - width).astype(np.float64) @ v)
        if s > top or best < 0:
            best, top = r, s
    return best, top


try:
    from agent_under_test import _similarity as _compiled
except ImportError:   # not built (no C compiler at install) or a big-endian host: the numpy reference serves
    _compiled = None  # type: ignore[assignment]

unit: Callable[[object, int], bytes] = _compiled.unit if _compiled else unit_numpy
scan: Callable[[object, object], tuple[int, float]] = _compiled.scan if _compiled else scan_numpy
sims: Callable[[object, object], list[float]] = _compiled.sims if _compiled else sims_numpy
scan_tails: Callable[[list[object], object], tuple[int, float]] = _compiled.scan_tails if _compiled \
    else scan_tails_numpy
KERNEL = "compiled" if _compiled else "numpy"
