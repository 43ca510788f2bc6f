"""Micro-batching: requests arriving within a short window run as one forward pass.

    submit() --> queue --(window from the oldest item, or max_batch reached)--> choose_tier(depth)
                   ^                                                              |
                   |                       worker thread: engine.run(batch, tier) v
                   +------------ futures resolved <-- on_batch(size, depth, tier) -+

A batch forms when a worker slot is free; while all workers are busy the queue grows, so batches
grow with load (that is what makes latency respond to queueing). Queue depth and batch sizes are
observable through `depth` and the Guard's on_batch.

The window is adaptive by default: a free slot waits for more calls only while they arrive faster than
a forward pass runs (the smoothed gap between arrivals is shorter than the smoothed pass), and never
longer than `window_s`. An idle server runs a lone call at once instead of waiting out a window that
nothing will join; a busy one batches as before. `adaptive=False` always waits the full window.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from agent_under_test.features import Features
from agent_under_test.hooks import Guard

RunFn = Callable[[Sequence[Features], str], np.ndarray]


@dataclass(slots=True)
class BatchResult:
    output: Sequence[float]   # this request's row of the model output, as plain floats
    batch_size: int
    tier: str
    queue_s: float       # waiting in the queue before the forward pass
    forward_s: float     # the forward pass itself


@dataclass(slots=True)
class _Item:
    features: Features
    arrival: float
    future: asyncio.Future[BatchResult]


class Pace:
    """Smoothed gap between arrivals and smoothed forward pass: is a free slot's wait worth it?

    Waiting pays only when another call is likely to join before a pass would have finished anyway:
    the gap between arrivals (each gap capped at two windows, so one idle spell does not hide the next
    burst for long) is shorter than a pass. With no history (a first call, no pass timed yet) it is not."""

    ALPHA = 0.2

    def __init__(self, window_s: float) -> None:
        self.cap = 2 * window_s
        self.gap_s: float | None = None       # smoothed gap between arrivals
        self.forward_s: float | None = None   # smoothed forward pass
        self._last: float | None = None

    def arrived(self, now: float) -> None:
        if self._last is not None:
            gap = min(max(now - self._last, 0.0), self.cap)
            self.gap_s = gap if self.gap_s is None else self.gap_s + self.ALPHA * (gap - self.gap_s)
        self._last = now

    def ran(self, forward_s: float) -> None:
        self.forward_s = forward_s if self.forward_s is None else self.forward_s + self.ALPHA * (forward_s - self.forward_s)

    def worth_waiting(self) -> bool:
        return self.gap_s is not None and self.forward_s is not None and self.gap_s < self.forward_s


class Batcher:
    """Collects submitted features into batches and runs them on `executor` (one slot per worker),
    or inline on the event loop when `executor` is None."""

    def __init__(self, run: RunFn, guard: Guard, executor: Executor | None, *, window_s: float = 0.002,
                 max_batch: int = 32, workers: int = 1, adaptive: bool = True,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._run, self._guard, self._executor = run, guard, executor
        self.window_s, self.max_batch, self.adaptive = window_s, max_batch, adaptive
        self._now = clock
        self.pace = Pace(window_s)
        self._queue: deque[_Item] = deque()
        self._slots = asyncio.Semaphore(max(1, workers))
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.max_batch_seen = 0
        self.expired_dropped = 0     # calls whose caller was gone when their batch formed: not computed
        self.expired_computed = 0    # ... computed all the same (a guard that does not drop them)

    @property
    def depth(self) -> int:
        """Requests waiting for a forward pass."""
        return len(self._queue)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._collect())

    async def close(self) -> None:
        """Stop collecting; in-flight forward passes finish, queued requests are cancelled."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._inflight, return_exceptions=True)
        while self._queue:
            self._queue.popleft().future.cancel()

    async def submit(self, features: Features) -> BatchResult:
        fut: asyncio.Future[BatchResult] = asyncio.get_running_loop().create_future()
        now = self._now()
        self.pace.arrived(now)
        self._queue.append(_Item(features, now, fut))
        # Wake the collector only when it can act: first arrival, or a full batch.
        if len(self._queue) == 1 or len(self._queue) >= self.max_batch:
            self._wake.set()
        return await fut

    async def _collect(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                batch, depth = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            if not batch:                # every call of it had expired: no forward pass at all
                self._slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._forward(batch, depth))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _next_batch(self) -> tuple[list[_Item], int]:
        while not self._queue:
            self._wake.clear()
            await self._wake.wait()
        # The window runs from the oldest waiting request: under load it has already expired.
        delay = self._queue[0].arrival + self.window_s - self._now()
        if delay > 0 and len(self._queue) < self.max_batch and (not self.adaptive or self.pace.worth_waiting()):
            self._wake.clear()
            timer = asyncio.get_running_loop().call_later(delay, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()
        depth = len(self._queue)
        n = min(depth, self.max_batch)
        batch = [self._queue.popleft() for _ in range(n)]
        # A call whose deadline passed while it waited was cancelled by its server (its future is done):
        # computing it would spend a forward pass on an answer nobody reads.
        if self._guard.drops_expired():
            live = [i for i in batch if not i.future.done()]
            if len(live) < n:
                self.expired_dropped += n - len(live)
                self._guard.on_expired("dropped", n - len(live))
                batch = live
        return batch, depth

    async def _forward(self, batch: list[_Item], depth: int) -> None:
        try:
            gone = sum(1 for i in batch if i.future.done())
            if gone:
                self.expired_computed += gone
                self._guard.on_expired("computed", gone)
            tier = self._guard.choose_tier(depth)
            start = self._now()
            loop = asyncio.get_running_loop()
            try:
                feats = [i.features for i in batch]
                if self._executor is None:  # inline: no thread hand-off, but the loop waits for the pass
                    out = self._run(feats, tier)
                else:
                    out = await loop.run_in_executor(self._executor, self._run, feats, tier)
            except Exception as exc:  # noqa: BLE001 - every caller in the batch gets the failure
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                return
            forward_s = self._now() - start
            self.pace.ran(forward_s)
            self.batches += 1
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            self._guard.on_batch(len(batch), len(self._queue), tier)
            rows = out.tolist()  # one conversion per batch: risk works on plain floats
            for row, item in zip(rows, batch, strict=True):
                if not item.future.done():  # the caller may have been cancelled meanwhile
                    item.future.set_result(BatchResult(row, len(batch), tier, start - item.arrival, forward_s))
        finally:
            self._slots.release()
