"""Chunks and the bounded FIFO channel that joins toxic stages.

A chunk carries its arrival time (`t`, loop monotonic seconds): a latency toxic waits
`delay - age`, so a backlog never adds up and order is never changed. Non-data chunks mark the
end of a direction: EOF (peer half-closed), CLOSE (a toxic closes the connection), RESET (RST).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Final

DATA: Final = 0
EOF: Final = 1
CLOSE: Final = 2
RESET: Final = 3


class Chunk:
    """Bytes read from one side, stamped with the time they arrived at the proxy."""

    __slots__ = ("data", "t", "kind")

    def __init__(self, data: bytes, t: float, kind: int = DATA) -> None:
        self.data = data
        self.t = t
        self.kind = kind

    def __repr__(self) -> str:
        return f"Chunk({len(self.data)}B, t={self.t:.6f}, kind={self.kind})"


class Channel:
    """A FIFO of chunks: `get` waits for one, `put` waits while full, `put_nowait` never waits.

    `put_nowait` ignores the bound on purpose: it is used to flush a stage's held chunk when the
    stage is interrupted (don't drop data on the floor) and by socket callbacks, which cannot wait
    and pause reading instead (see `on_space`).
    """

    __slots__ = ("items", "maxsize", "_getter", "_putters", "on_space")

    def __init__(self, maxsize: int = 32) -> None:
        self.items: deque[Chunk] = deque()
        self.maxsize = maxsize
        self._getter: asyncio.Future[None] | None = None
        self._putters: deque[asyncio.Future[None]] = deque()
        self.on_space: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def put_nowait(self, chunk: Chunk) -> None:
        self.items.append(chunk)
        g = self._getter
        if g is not None:
            self._getter = None
            if not g.done():
                g.set_result(None)

    async def put(self, chunk: Chunk) -> None:
        while len(self.items) >= self.maxsize:
            fut = asyncio.get_running_loop().create_future()
            self._putters.append(fut)
            await fut
        self.put_nowait(chunk)

    async def get(self) -> Chunk:
        while not self.items:
            fut = asyncio.get_running_loop().create_future()
            self._getter = fut
            await fut
        chunk = self.items.popleft()
        if len(self.items) < self.maxsize:
            self._wake_putter()
        return chunk

    def _wake_putter(self) -> None:
        while self._putters:
            p = self._putters.popleft()
            if not p.done():
                p.set_result(None)
                break
        if self.on_space is not None and len(self.items) <= self.maxsize // 2:
            self.on_space()
