"""The response cache's vector kernel (agent_under_test/similarity.py): the compiled functions agree with
the numpy reference on real features and on random matrices, refuse what is not float32 in one line, and
are what serves wherever a C compiler and the Python headers were there to build them."""

from __future__ import annotations

import random
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from agent_under_test import similarity
from agent_under_test.features import build_features
from agent_under_test.market import make_snapshot
from agent_under_test.snapshot import parse_snapshot

compiled = pytest.importorskip("agent_under_test._similarity", reason="the kernel was not built here")
KERNELS = [("numpy", similarity.unit_numpy, similarity.scan_numpy, similarity.sims_numpy),
           ("compiled", compiled.unit, compiled.scan, compiled.sims)]


def floats(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<f4")


def test_the_compiled_kernel_serves_where_it_could_be_built():
    can_build = shutil.which("cc") is not None and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()
    if not can_build:
        pytest.skip("no C compiler or Python headers here: the numpy reference serves (slower cache misses)")
    assert similarity.KERNEL == "compiled"
    assert similarity.unit is compiled.unit and similarity.scan is compiled.scan


@pytest.mark.parametrize("levels", [1, 2, 10, 25])
def test_unit_agrees_with_the_reference_on_real_features(levels: int):
    snap = make_snapshot(random.Random(levels), 1, "ACME", ts_ns=1_700_000_000_000_000_000, levels=levels)
    x = build_features(parse_snapshot(snap, 65536)).x
    want = x.astype(np.float64)
    want = (want - want.mean(axis=0)).ravel() if levels > 1 else want.ravel()
    want /= np.linalg.norm(want)
    for name, unit, _, _ in KERNELS:
        got = floats(unit(x, levels))
        assert np.abs(got - want).max() < 1e-6, name


def test_a_flat_book_is_the_zero_vector_that_matches_nothing():
    x = np.ones((4, 8), dtype=np.float32)        # every column constant over the levels: centred, nothing left
    for name, unit, scan, _ in KERNELS:
        v = unit(x, 4)
        assert v == bytes(4 * 32), name
        assert scan(floats(v).tobytes() + unit(np.eye(4, 8, dtype=np.float32), 4), v) == (0, 0.0), name


def test_scan_and_sims_agree_with_the_reference_and_take_the_first_best_row():
    rng = np.random.default_rng(7)
    for rows in (0, 1, 5, 32):
        m = rng.normal(size=(rows, 80)).astype(np.float32)
        v = rng.normal(size=80).astype(np.float32)
        matrix, vec = m.tobytes(), v.tobytes()
        (best_n, top_n), (best_c, top_c) = similarity.scan_numpy(matrix, vec), compiled.scan(matrix, vec)
        assert best_n == best_c and (top_n == top_c or abs(top_n - top_c) < 1e-9)
        assert np.allclose(compiled.sims(matrix, vec), similarity.sims_numpy(matrix, vec), rtol=0, atol=1e-9)
        if rows:
            assert np.allclose(compiled.sims(matrix, vec), m.astype(np.float64) @ v.astype(np.float64), atol=1e-9)
    assert compiled.scan(b"", vec) == (-1, float("-inf"))
    twice = np.stack([v, v * 0.5, v]).astype(np.float32)
    for name, _, scan, _ in KERNELS:
        assert scan(twice.tobytes(), vec)[0] == 0, name    # ties: the first (the newest) row


def test_scan_tails_reads_each_rows_last_vector_wherever_it_starts():
    rng = np.random.default_rng(3)
    vec = rng.normal(size=80).astype(np.float32).tobytes()
    tails = [rng.normal(size=80).astype(np.float32).tobytes() for _ in range(6)]
    rows: list[object] = [b"h" * (10 + 8 * i) + t for i, t in enumerate(tails)]   # headers of 10, 18, ... bytes
    rows[2] = "not bytes"
    rows[4] = vec                                        # no longer than vec: no header, passed over
    want = [float(np.frombuffer(t, "<f4").astype(np.float64) @ np.frombuffer(vec, "<f4").astype(np.float64))
            for t in tails]
    best = max((i for i in (0, 1, 3, 5)), key=lambda i: want[i])
    for name, scan_tails in (("numpy", similarity.scan_tails_numpy), ("compiled", compiled.scan_tails)):
        got = scan_tails(rows, vec)
        assert got[0] == best and abs(got[1] - want[best]) < 1e-9, name
        assert scan_tails(["x", b""], vec) == (-1, float("-inf")), name
    with pytest.raises(TypeError, match="list"):
        compiled.scan_tails(tuple(rows), vec)


@pytest.mark.parametrize("call, message", [
    (lambda k: k.unit(np.zeros((2, 8)), 2), "float32"),                        # float64
    (lambda k: k.unit(np.zeros((3, 8), dtype=np.float32), 5), "rows"),
    (lambda k: k.unit(b"abc", 1), "float32"),
    (lambda k: k.unit(np.zeros((1, 65), dtype=np.float32), 1), "columns"),
    (lambda k: k.scan(b"\0" * 12, b"\0" * 8), "rows of 8"),
    (lambda k: k.sims(b"\0" * 8, b""), "rows of 0"),
])
def test_bad_input_is_a_one_line_error_not_a_crash(call, message: str):
    with pytest.raises((TypeError, ValueError), match=message) as info:
        call(compiled)
    assert "\n" not in str(info.value)


def test_the_cache_answers_alike_with_either_kernel(monkeypatch: pytest.MonkeyPatch):
    """The same lookups and stores through the cache, once on each kernel: the same hits, misses and
    evictions (the numpy reference is what serves where the compiled kernel could not be built)."""
    import asyncio

    from agent_under_test import cache
    from wire.clock import FakeClock

    books = [build_features(parse_snapshot(make_snapshot(random.Random(i), 1, "ACME", ts_ns=1_700_000_000_000_000_000,
                                                         levels=10), 65536)) for i in range(6)]

    def trace(unit, scan, sims) -> list[object]:
        for name, fn in (("unit", unit), ("scan", scan), ("sims", sims)):
            monkeypatch.setattr(cache, name, fn)
        c = cache.ResponseCache(cache.CacheSettings(mode="local"), cache.NullCacheHooks(), FakeClock.at(1000.0),
                                cache.LocalTier(max_entries=100, per_bucket=3))
        out: list[object] = []

        async def run() -> None:
            for i, feats in enumerate(books[:5]):                      # five books, a bucket of three
                probe = c.probe("ACME", 0.0, feats)
                out.append(c.lookup_now(probe))
                c.store(probe, (float(i),) * 5, "light")
            for feats in books:                                          # the last three are kept; book 5 is new
                hit = c.lookup_now(c.probe("ACME", 0.0, feats))
                out.append(hit.entry.output[0] if hit else None)
            c.store(c.probe("ACME", 0.0, books[4]), (9.0,) * 5, "full")  # the same book again: replaced
            hit = c.lookup_now(c.probe("ACME", 0.0, books[4]))
            out.append((hit.entry.output[0], hit.entry.tier, len(c.local)) if hit else None)

        asyncio.run(run())
        return out

    numpy_trace = trace(similarity.unit_numpy, similarity.scan_numpy, similarity.sims_numpy)
    assert numpy_trace == [None] * 5 + [None, None, 2.0, 3.0, 4.0, None, (9.0, "full", 3)]
    assert trace(compiled.unit, compiled.scan, compiled.sims) == numpy_trace
