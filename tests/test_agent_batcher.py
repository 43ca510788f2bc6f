"""The micro-batcher in isolation: a fake forward pass, real asyncio, the Guard's view of batches."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from agent_under_test.batcher import Batcher, Pace
from agent_under_test.features import Features
from agent_under_test.hooks import NullGuard


class Seen(NullGuard):
    def __init__(self, tier: str = "full") -> None:
        super().__init__(tier)
        self.calls: list[tuple[str, int, int, str]] = []

    def choose_tier(self, queue_depth: int) -> str:
        self.calls.append(("choose", queue_depth, 0, ""))
        return self.tier

    def on_batch(self, size: int, queue_depth: int, tier: str) -> None:
        self.calls.append(("batch", size, queue_depth, tier))


def feat(i: float) -> Features:
    return Features(np.full((2, 8), i, np.float32), np.zeros(2, np.float32), np.ones(2, np.float32), 1.0, 1.0, 1.0)


def run_fn(items, tier):
    return np.array([[f.x[0, 0], len(items), 0, 0, 0] for f in items], dtype=np.float32)


async def _submit_all(batcher: Batcher, n: int, gap_s: float = 0.0):
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(batcher.submit(feat(i))))
        if gap_s:
            await asyncio.sleep(gap_s)
    return await asyncio.gather(*tasks)


def _with_batcher(guard, coro_fn, **kw):
    async def main():
        with ThreadPoolExecutor(1) as pool:
            b = Batcher(run_fn, guard, pool, **kw)
            b.start()
            try:
                return await coro_fn(b)
            finally:
                await b.close()
    return asyncio.run(main())


def test_simultaneous_requests_share_a_forward_pass_and_keep_their_rows() -> None:
    guard = Seen()
    results = _with_batcher(guard, lambda b: _submit_all(b, 10), window_s=0.05, max_batch=32)
    assert [r.output[0] for r in results] == list(range(10))  # each caller gets its own row
    assert {r.batch_size for r in results} == {10}
    assert guard.calls == [("choose", 10, 0, ""), ("batch", 10, 0, "full")]
    assert all(r.queue_s >= 0 and r.forward_s >= 0 for r in results)


def test_max_batch_splits_and_tier_is_reported() -> None:
    guard = Seen("light")
    results = _with_batcher(guard, lambda b: _submit_all(b, 20), window_s=0.05, max_batch=8)
    assert sorted({r.batch_size for r in results}) == [4, 8]
    batches = [c for c in guard.calls if c[0] == "batch"]
    assert [c[1] for c in batches] == [8, 8, 4] and {c[3] for c in batches} == {"light"}
    assert [c[1] for c in guard.calls if c[0] == "choose"] == [20, 12, 4]  # depth before each pass
    assert {r.tier for r in results} == {"light"}


def test_a_lone_request_waits_at_most_about_the_window() -> None:
    results = _with_batcher(Seen(), lambda b: _submit_all(b, 1), window_s=0.01, max_batch=32, adaptive=False)
    # Tolerance: the window is 10 ms; allow 200 ms for a loaded CI host.
    assert results[0].batch_size == 1 and 0.009 <= results[0].queue_s < 0.2


def test_pace_trajectory_in_virtual_time() -> None:
    # Arrivals 10 ms apart, then 1 ms apart; passes of 3 ms. Each gap is capped at two windows (4 ms),
    # smoothed with alpha 0.2. Waiting is worth it once the smoothed gap is shorter than the smoothed pass.
    pace = Pace(0.002)
    assert not pace.worth_waiting()                     # no history: a lone call runs at once
    pace.arrived(0.0)
    assert pace.gap_s is None
    gaps, verdicts = [], []
    pace.ran(0.003)
    t = 0.0
    for step in [0.010, 0.010, 0.001, 0.001, 0.001, 0.001]:
        t += step
        pace.arrived(t)
        gaps.append(round(pace.gap_s * 1e6, 3))
        verdicts.append(pace.worth_waiting())
    # 4000 (capped), 4000, 4000 + 0.2 * (1000 - 4000) = 3400, 2920, 2536, 2228.8 us
    assert gaps == [4000.0, 4000.0, 3400.0, 2920.0, 2536.0, 2228.8]
    assert verdicts == [False, False, False, True, True, True]
    pace.ran(0.001)                                     # passes got cheaper: 3 + 0.2 * (1 - 3) = 2.6 ms
    assert round(pace.forward_s * 1e6, 3) == 2600.0 and pace.worth_waiting() is True
    pace.arrived(t - 1.0)                               # a clock going back counts as a zero gap, not negative
    assert round(pace.gap_s * 1e6, 3) == round(2228.8 * 0.8, 3)


@pytest.mark.parametrize("history", ["none", "sparse", "dense"])
def test_adaptive_window_waits_only_while_calls_come_faster_than_a_pass(history: str) -> None:
    # A 300 ms window and one call. With no history, or calls further apart than a pass, the call runs at
    # once; with calls closer together than a pass, it waits the window for company (as a fixed window would).
    async def one(b: Batcher):
        if history != "none":
            b.pace.gap_s, b.pace.forward_s = (0.050, 0.010) if history == "sparse" else (0.001, 0.010)
            b.pace._last = None   # this call's arrival leaves the seeded gap as it is
        return await _submit_all(b, 1)
    results = _with_batcher(Seen(), one, window_s=0.3, max_batch=32)
    waited = results[0].queue_s
    if history == "dense":
        assert 0.29 <= waited < 2.0, f"expected the call to wait the 300 ms window, it waited {waited * 1e3:.1f} ms"
    else:
        assert waited < 0.15, f"expected the call to run at once, it waited {waited * 1e3:.1f} ms"


def test_adaptive_window_still_batches_a_burst() -> None:
    # Twenty calls at once while the first pass runs (a slow 50 ms pass): natural batching, no window needed.
    def slow(items, tier):
        import time
        time.sleep(0.05)
        return run_fn(items, tier)

    async def main():
        guard = Seen()
        with ThreadPoolExecutor(1) as pool:
            b = Batcher(slow, guard, pool, window_s=0.002, max_batch=32)
            b.start()
            try:
                first = asyncio.create_task(b.submit(feat(0)))
                await asyncio.sleep(0.01)                     # the first call's pass is running
                rest = await _submit_all(b, 20)
                return guard, [await first, *rest]
            finally:
                await b.close()
    guard, results = asyncio.run(main())
    sizes = [c[1] for c in guard.calls if c[0] == "batch"]
    assert sizes[0] == 1 and sum(sizes) == 21 and max(sizes[1:]) >= 10, sizes


def test_forward_failure_reaches_every_caller() -> None:
    def broken(items, tier):
        raise RuntimeError("boom")

    async def main():
        with ThreadPoolExecutor(1) as pool:
            b = Batcher(broken, Seen(), pool, window_s=0.01)
            b.start()
            try:
                return await asyncio.gather(*(b.submit(feat(i)) for i in range(3)), return_exceptions=True)
            finally:
                await b.close()
    out = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) for e in out)


@pytest.mark.parametrize("n", [0, 5])
def test_close_cancels_queued_requests(n: int) -> None:
    async def main():
        with ThreadPoolExecutor(1) as pool:
            b = Batcher(run_fn, Seen(), pool, window_s=10.0, adaptive=False)
            b.start()
            tasks = [asyncio.create_task(b.submit(feat(i))) for i in range(n)]
            await asyncio.sleep(0.01)
            await b.close()
            return await asyncio.gather(*tasks, return_exceptions=True)
    out = asyncio.run(main())
    assert len(out) == n and all(isinstance(e, asyncio.CancelledError) for e in out)


def test_inline_mode_batches_without_an_executor() -> None:
    async def main():
        guard = Seen()
        b = Batcher(run_fn, guard, None, window_s=0.02, max_batch=32)
        b.start()
        try:
            return guard, await _submit_all(b, 6)
        finally:
            await b.close()
    guard, results = asyncio.run(main())
    assert [r.output[0] for r in results] == list(range(6)) and {r.batch_size for r in results} == {6}
    assert guard.calls[-1] == ("batch", 6, 0, "full")


class _Expiry(Seen):
    def __init__(self, drops: bool) -> None:
        super().__init__()
        self.drops, self.expired = drops, []

    def drops_expired(self) -> bool:
        return self.drops

    def on_expired(self, fate: str, n: int) -> None:
        self.expired.append((fate, n))


@pytest.mark.parametrize("drops", [True, False])
def test_calls_whose_caller_is_gone_are_not_computed(drops: bool) -> None:
    # Five calls wait out a fixed 50 ms window; the servers cancel three of them at their deadline meanwhile.
    # An agent that honours deadlines takes them out of the batch; one that does not computes them for nobody.
    seen: list[list[float]] = []

    def forward(items, tier):
        seen.append([float(f.x[0, 0]) for f in items])
        return run_fn(items, tier)

    async def main() -> list[bool]:
        guard = _Expiry(drops)
        batcher = Batcher(forward, guard, None, window_s=0.05, max_batch=32, adaptive=False)
        batcher.start()
        tasks = [asyncio.create_task(batcher.submit(feat(i))) for i in range(5)]
        await asyncio.sleep(0.01)
        for i in (0, 2, 3):
            tasks[i].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        # A batch of nothing but expired calls runs no forward pass at all.
        lone = asyncio.create_task(batcher.submit(feat(9)))
        await asyncio.sleep(0.01)
        lone.cancel()
        await asyncio.sleep(0.1)
        await batcher.close()
        assert guard.expired == ([("dropped", 3), ("dropped", 1)] if drops else [("computed", 3), ("computed", 1)])
        assert (batcher.expired_dropped, batcher.expired_computed) == ((4, 0) if drops else (0, 4))
        return [isinstance(d, asyncio.CancelledError) for d in done]

    cancelled = asyncio.run(main())
    assert cancelled == [True, False, True, True, False]
    assert seen == ([[1.0, 4.0]] if drops else [[0.0, 1.0, 2.0, 3.0, 4.0], [9.0]])
