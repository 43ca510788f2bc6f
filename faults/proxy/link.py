"""One direction of one proxied connection: a chain of toxic stages between a reader and a writer.

    source socket --push--> head Channel -> [Stage: toxic] -> Channel -> [Stage] -> tail -> writer -> dest
                    \\____ no toxics and nothing queued: written straight to dest (direct write) ____/

Bytes reach `push` only on the chunk path: while a direction has no toxic, nothing queued here and no
call tap on its connection, its `flow.Flow` moves them socket to socket without a chunk (flow.py), and
`stages` and `tail` are what it checks before each read.

Adding or removing a toxic interrupts only its neighbours, as Toxiproxy's ToxicLink does: the
interrupted stage flushes the chunk it held (minus what it already sent) into its output, the
channels are re-joined, and the stage restarts. Order is kept and no byte is lost or doubled.

Every stage meters what its toxic does (`Meter` -> the proxy's `ToxicEffect` for that toxic name):
chunks and bytes in and out, bytes it cut or dropped, how long each chunk was held (from entering the
stage to its last byte leaving), the ends it held and the closes and resets it made.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from faults.proxy.channel import CLOSE, DATA, RESET, Channel, Chunk
from faults.proxy.toxics import NoopToxic, Toxic, ToxicEffect

if TYPE_CHECKING:
    from faults.proxy.model import ToxicSpec

log = logging.getLogger(__name__)
_NOOP = NoopToxic({})


class Meter:
    """One stage's bookkeeping for its toxic's `ToxicEffect`: the chunk in hand, since when, and how
    much of it has not left yet (what never leaves was cut or dropped).

    A chunk enters the first stage of a link when it arrived at the proxy (its `t`), a later stage
    when that stage takes it (a lower bound: it may have queued a little before). Only a connection
    the toxicity draw made active counts chunks and holds; the others count `bypassed`.
    """

    __slots__ = ("effect", "active", "first", "since", "left", "kind_in", "busy_until")

    def __init__(self, effect: ToxicEffect) -> None:
        self.effect = effect
        self.active = False
        self.first = False
        self.since = 0.0
        self.left = 0
        self.kind_in: int | None = None
        self.busy_until = 0.0

    def drawn(self, active: bool, first_draw: bool) -> None:
        e = self.effect
        if first_draw:
            e.connections += 1
        elif self.active:
            e.active -= 1
        e.active += active
        self.active = active

    def took(self, c: Chunk, now: float) -> None:
        self._lost()
        self.kind_in, self.since = c.kind, (c.t if self.first and c.kind == DATA else now)
        self.left = len(c.data) if c.kind == DATA else 0
        if c.kind != DATA:
            return
        if self.active:
            self.effect.chunks += 1
            self.effect.bytes_in += len(c.data)
        else:
            self.effect.bypassed += 1

    def sent(self, chunk: Chunk, rest: Chunk | None, now: float) -> None:
        if not self.active:
            return
        e = self.effect
        if chunk.kind != DATA:
            return self._ended(chunk.kind, now)
        e.pieces += 1
        e.bytes_out += len(chunk.data)
        self.left -= len(chunk.data)
        if rest is not None:
            self._cut(self.left - len(rest.data))
            self.left = len(rest.data)
            return
        self._lost()
        self._held(now)

    def _ended(self, kind: int, now: float) -> None:
        e = self.effect
        if kind in (CLOSE, RESET) and kind != self.kind_in:
            if kind == CLOSE:
                e.closed += 1
            else:
                e.reset += 1
        elif self.kind_in is not None and self.kind_in != DATA:
            e.ends += 1
            e.end_held_s += max(0.0, now - self.since)

    def dropped(self) -> None:
        self._lost()

    def _cut(self, n: int) -> None:
        if n > 0 and self.active:
            self.effect.bytes_dropped += n

    def _lost(self) -> None:
        """What is left of the chunk in hand will never leave: the toxic cut or dropped it."""
        self._cut(self.left)
        self.left = 0

    def _held(self, now: float) -> None:
        """The chunk in hand has left: its hold, and the stage's busy time (holds overlap when queued)."""
        held = max(0.0, now - self.since)
        self.effect.held(held)
        start = max(self.since, self.busy_until)
        if now > start:
            self.effect.busy_s += now - start
        self.busy_until = max(self.busy_until, now)


class Stage:
    """A running toxic on one link; the `Stub` a toxic pipes through."""

    def __init__(self, spec: ToxicSpec, rng: random.Random, inp: Channel, out: Channel,
                 on_crash: Callable[[], None], effect: ToxicEffect | None = None) -> None:
        self.spec = spec
        self.rng = rng
        self.state: Any = spec.toxic.new_state()
        self.inp, self.out = inp, out
        self.pending: Chunk | None = None
        self.task: asyncio.Task[None] | None = None
        self.finished = False
        self._on_crash = on_crash
        self.meter = Meter(effect if effect is not None else ToxicEffect(spec.type))
        self.active = False
        self.draw(first=True)

    def draw(self, first: bool = False) -> None:
        """Decide toxicity for this connection (one seeded draw per connection and toxic version)."""
        self.active = self.rng.random() < self.spec.toxicity
        self.meter.drawn(self.active, first)

    # --- the Stub protocol -------------------------------------------------------------------
    async def recv(self) -> Chunk:
        c = await self.inp.get()
        self.pending = c
        self.meter.took(c, self.now())
        return c

    async def send(self, chunk: Chunk, rest: Chunk | None = None) -> None:
        await self.out.put(chunk)
        self.pending = rest
        self.meter.sent(chunk, rest, self.now())

    def drop(self) -> None:
        self.pending = None
        self.meter.dropped()

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if not self.finished:
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        toxic: Toxic = self.spec.toxic if self.active else _NOOP
        try:
            await toxic.pipe(self)
            self.finished = True
        except asyncio.CancelledError:
            if self.pending is not None:  # Don't drop data on the floor: the peer may still read
                self.out.put_nowait(self.pending)
                self.meter.sent(self.pending, None, self.now())
                self.pending = None
            raise
        except Exception:  # noqa: BLE001 - a broken toxic must not take the proxy down
            log.exception("toxic %s crashed; closing its connection", self.spec.name)
            self.finished = True
            self._on_crash()

    async def interrupt(self) -> None:
        """Stop the toxic, flushing what it held; `start()` resumes it."""
        task, self.task = self.task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass


class Link:
    """Chunks from one side to the other through the toxics of one stream direction."""

    def __init__(self, write: Callable[[bytes], None], end: Callable[[int], None],
                 pause_source: Callable[[bool], None], on_crash: Callable[[], None],
                 effect_of: Callable[[ToxicSpec], ToxicEffect] | None = None) -> None:
        self._write, self._end, self._pause_source, self._on_crash = write, end, pause_source, on_crash
        self._effect_of = effect_of
        self.tail = Channel(64)
        self.head = self.tail
        self.stages: list[Stage] = []
        self.dest_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._source_paused = False
        self._set_head(self.tail)
        self.writer = asyncio.get_running_loop().create_task(self._writer())

    # --- data path -----------------------------------------------------------------------------
    def push(self, chunk: Chunk) -> None:
        """Called from the source socket's callbacks (never waits; pauses reading when backed up)."""
        if not self.stages and not self.tail.items and not self.dest_paused and chunk.kind == DATA:
            self._write(chunk.data)
            return
        self.head.put_nowait(chunk)
        if len(self.head) >= self.head.maxsize and not self._source_paused:
            self._source_paused = True
            self._pause_source(True)

    def _resume_source(self) -> None:
        if self._source_paused:
            self._source_paused = False
            self._pause_source(False)

    def _set_head(self, channel: Channel) -> None:
        self.head.on_space = None
        self.head = channel
        channel.on_space = self._resume_source
        if len(channel) < channel.maxsize:
            self._resume_source()

    def set_dest_paused(self, paused: bool) -> None:
        self.dest_paused = paused
        if not paused and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def _writer(self) -> None:
        while True:
            c = await self.tail.get()
            if c.kind != DATA:
                self._end(c.kind)
                return
            self._write(c.data)
            if self.dest_paused:
                self._drained = asyncio.get_running_loop().create_future()
                await self._drained

    # --- toxics --------------------------------------------------------------------------------
    def build(self, specs: list[ToxicSpec], rng: random.Random) -> None:
        """Start a fresh link's chain (nothing in flight yet, so no interrupts are needed)."""
        for spec in specs:
            self._append(spec, rng)

    def _append(self, spec: ToxicSpec, rng: random.Random) -> Stage:
        inp = Channel()
        if self.stages:
            self.stages[-1].out = inp
        else:
            self._set_head(inp)
        effect = self._effect_of(spec) if self._effect_of is not None else None
        stage = Stage(spec, random.Random(rng.getrandbits(64)), inp, self.tail, self._on_crash, effect)
        self.stages.append(stage)
        self._mark_first()
        stage.start()
        return stage

    def _mark_first(self) -> None:
        """Only the first stage takes chunks the moment they arrived (see `Meter`)."""
        for i, stage in enumerate(self.stages):
            stage.meter.first = i == 0

    async def add(self, spec: ToxicSpec, rng: random.Random) -> None:
        """Append a toxic at the end of the chain, interrupting only the current last stage."""
        last = self.stages[-1] if self.stages else None
        if last is not None:
            await last.interrupt()  # flushes its held chunk into the tail: those bytes are older
        self._append(spec, rng)
        if last is not None:
            last.start()

    async def remove(self, name: str) -> None:
        """Remove a toxic; what it held or queued moves on, in order, to the next stage."""
        k = next((i for i, s in enumerate(self.stages) if s.spec.name == name), None)
        if k is None:
            return
        prev, stage = (self.stages[k - 1] if k else None), self.stages[k]
        if prev is not None:
            await prev.interrupt()
        await stage.interrupt()
        while stage.inp.items:  # still-queued input is newer than what `stage` flushed
            stage.out.put_nowait(stage.inp.items.popleft())
        del self.stages[k]
        self._mark_first()
        if prev is not None:
            prev.out = stage.out
            prev.start()
        else:
            self._set_head(stage.out)

    async def update(self, spec: ToxicSpec) -> None:
        """Swap a toxic's settings in place; it keeps its per-connection state (limit_data's count)."""
        for stage in self.stages:
            if stage.spec.name == spec.name:
                await stage.interrupt()
                stage.spec = spec
                stage.draw()
                stage.start()

    def stop(self) -> None:
        for stage in self.stages:
            if stage.task is not None:
                stage.task.cancel()
        self.writer.cancel()
