"""Toxics with Toxiproxy 2.x semantics, one small class each, registered by name.

A toxic's `pipe(stub)` moves chunks from `stub.recv()` to `stub.send()` until the direction ends.
`stub.send(piece, rest=...)` records what is still unsent, so an interrupted stage (a toxic added,
removed or updated mid-stream) flushes exactly the unsent bytes downstream: nothing is dropped or
duplicated. Connection-level toxics (the gRPC call toxics) set `stage = False`: they are consulted
by the HTTP/2 tap per call instead of running as a stage.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, ClassVar, Protocol

from faults.proxy.channel import CLOSE, DATA, EOF, RESET, Chunk
from wire.registry import Registry


class Stub(Protocol):
    """What a toxic sees of its place in the chain (implemented by `link.Stage`)."""

    rng: random.Random
    state: Any

    async def recv(self) -> Chunk: ...

    async def send(self, chunk: Chunk, rest: Chunk | None = None) -> None: ...

    def drop(self) -> None: ...

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class Toxic:
    """Base class: `ATTRS` names each attribute with its default (its type is the default's type)."""

    ATTRS: ClassVar[dict[str, Any]] = {}
    GO_NAME: ClassVar[str] = "Toxic"
    stage: ClassVar[bool] = True

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = dict(attrs)
        for key, value in attrs.items():
            setattr(self, key, value)

    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {}
    MAX_TEXT: ClassVar[int] = 1 << 16   # a string attribute (a body, a path glob) is bounded too

    @classmethod
    def check(cls, attrs: dict[str, Any]) -> None:
        """Raise ValueError when an attribute is out of range: numbers are never negative (as
        Toxiproxy's toxics assume: a negative size or duration has no meaning), `LIMITS` narrows more."""
        for key, default in cls.ATTRS.items():
            value = attrs.get(key, default)
            if isinstance(value, str):
                if len(value) > cls.MAX_TEXT:
                    raise ValueError(f"{cls.GO_NAME}.attributes.{key} is {len(value)} characters; at most "
                                     f"{cls.MAX_TEXT}")
                continue
            if isinstance(value, bool):
                continue
            lo, hi = cls.LIMITS.get(key, (0, float("inf")))
            if not lo <= value <= hi:
                bound = f"at least {lo:g}" if hi == float("inf") else f"between {lo:g} and {hi:g}"
                raise ValueError(f"{cls.GO_NAME}.attributes.{key} {value:g} must be {bound}")

    def new_state(self) -> Any:
        return None

    async def pipe(self, stub: Stub) -> None:
        while True:
            c = await stub.recv()
            await stub.send(c)
            if c.kind != DATA:
                return


class ToxicEffect:
    """What one toxic was measured to do, summed over every connection it ran on.

    Kept by its proxy after the toxic is removed (`EffectLog`), so a harness can read what a fault did
    and judge it on that rather than on what a client saw. Stages (`link.Meter`) fill the chunk, byte,
    hold and close counts; the taps fill the call counts. Times are seconds (loop monotonic clock).
    """

    __slots__ = ("type", "stream", "toxicity", "attributes", "connections", "active", "chunks", "bytes_in",
                 "bytes_out", "bytes_dropped", "pieces", "held_chunks", "held_s", "held_max_s", "busy_s",
                 "bypassed", "ends", "end_held_s", "closed", "reset", "calls", "calls_delayed", "delay_s",
                 "calls_failed", "calls_cut")

    def __init__(self, type: str = "", stream: str = "", toxicity: float = 1.0,
                 attributes: dict[str, Any] | None = None) -> None:
        self.type, self.stream, self.toxicity = type, stream, toxicity
        self.attributes = dict(attributes or {})
        self.connections = self.active = 0          # stages run (one per connection), drawn active
        self.chunks = self.bytes_in = self.bytes_out = self.bytes_dropped = self.pieces = 0
        self.held_chunks, self.held_s, self.held_max_s, self.busy_s = 0, 0.0, 0.0, 0.0
        self.bypassed = 0                           # chunks through a connection the toxicity draw spared
        self.ends, self.end_held_s = 0, 0.0         # EOFs passed on, and how long they were held
        self.closed = self.reset = 0                # connections the toxic itself closed or reset
        self.calls = self.calls_delayed = self.calls_failed = self.calls_cut = 0
        self.delay_s = 0.0                          # delay actually applied to the delayed calls

    def held(self, seconds: float) -> None:
        """One chunk left after `seconds` in the toxic."""
        self.held_chunks += 1
        self.held_s += seconds
        self.held_max_s = max(self.held_max_s, seconds)

    def to_json(self) -> dict[str, Any]:
        """The counts, with times in ms (rounded to the microsecond)."""
        def ms(s: float) -> float:
            return round(s * 1000.0, 3)
        return {"type": self.type, "stream": self.stream, "toxicity": self.toxicity,
                "attributes": dict(self.attributes), "connections": self.connections,
                "active_connections": self.active, "chunks": self.chunks, "bytes": self.bytes_in,
                "bytes_out": self.bytes_out, "bytes_dropped": self.bytes_dropped, "pieces": self.pieces,
                "held_chunks": self.held_chunks, "held_ms_total": ms(self.held_s), "held_ms_max": ms(self.held_max_s),
                "busy_ms": ms(self.busy_s), "bypassed_chunks": self.bypassed, "ends": self.ends,
                "end_held_ms_total": ms(self.end_held_s), "closed": self.closed, "reset": self.reset,
                "calls": self.calls, "calls_delayed": self.calls_delayed, "delay_ms_total": ms(self.delay_s),
                "calls_failed": self.calls_failed, "calls_cut": self.calls_cut}


TOXICS: Registry[str, type[Toxic]] = Registry("toxic type")   # filled by @TOXICS.register(name) below


def parse_attributes(toxic_type: str, given: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Decode `attributes` the way Go's encoding/json does into the toxic's struct.

    Unknown keys are ignored; a value of the wrong JSON type raises ValueError with Go's wording.
    `base` holds current values (PATCH keeps what the body does not name).
    """
    cls = TOXICS.get(toxic_type)
    out = dict(cls.ATTRS if base is None else base)
    if given is None:
        return out
    if not isinstance(given, dict):
        raise ValueError(f"json: cannot unmarshal {_json_kind(given)} into Go struct field "
                         f"ToxicWrapper.attributes of type toxics.{cls.GO_NAME}")
    for key, value in given.items():
        if key in cls.ATTRS:
            out[key] = _coerce(cls, key, value)
    cls.check(out)
    return out


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    kinds: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return kinds.get(type(value), "null")


def _coerce(cls: type[Toxic], key: str, value: Any) -> Any:
    want = type(cls.ATTRS[key])
    if value is None:
        return cls.ATTRS[key]  # Go leaves the field unchanged on null
    ok = (want is str and isinstance(value, str)) or (
        want in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool))
    if want is int and ok and float(value) != int(value):
        ok = False
    if not ok:
        go_type = {int: "int64", float: "float64", str: "string"}[want]
        shown = _json_kind(value) if not isinstance(value, float) else f"number {value}"
        raise ValueError(f"json: cannot unmarshal {shown} into Go struct field "
                         f"{cls.GO_NAME}.attributes.{key} of type {go_type}")
    return want(value)


async def _forward_end(stub: Stub, c: Chunk) -> None:
    await stub.send(c)


@TOXICS.register("noop")
class NoopToxic(Toxic):
    GO_NAME = "NoopToxic"


def latency_delay(rng: random.Random, latency_ms: int, jitter_ms: int) -> float:
    """Seconds of delay for one chunk: latency +/- jitter, uniform in [latency-jitter, latency+jitter)."""
    delay = latency_ms
    if jitter_ms > 0:
        delay += rng.randrange(jitter_ms * 2) - jitter_ms
    return delay / 1000.0


@TOXICS.register("latency")
class LatencyToxic(Toxic):
    """Each chunk leaves `latency +/- jitter` ms after it ARRIVED (delay - age): no backlog, no reordering."""

    ATTRS = {"latency": 0, "jitter": 0}
    latency: int
    jitter: int
    GO_NAME = "LatencyToxic"

    async def pipe(self, stub: Stub) -> None:
        while True:
            c = await stub.recv()
            if c.kind != DATA:
                return await _forward_end(stub, c)
            wait = latency_delay(stub.rng, self.latency, self.jitter) - (stub.now() - c.t)
            if wait > 0:
                await stub.sleep(wait)
            await stub.send(c)


@TOXICS.register("bandwidth")
class BandwidthToxic(Toxic):
    """Limits the rate to `rate` KB/s (1 KB = 1000 bytes, as Toxiproxy); big chunks go in 100 ms slices."""

    ATTRS = {"rate": 0}
    rate: int
    GO_NAME = "BandwidthToxic"

    async def pipe(self, stub: Stub) -> None:
        debt = 0.0  # seconds we still owe; carries the sleep error from one chunk to the next
        while True:
            c = await stub.recv()
            if c.kind != DATA:
                return await _forward_end(stub, c)
            if self.rate <= 0:
                await stub.send(c)
                continue
            debt += len(c.data) / (self.rate * 1000.0)
            data, step = c.data, self.rate * 100
            while len(data) > step:
                await stub.sleep(0.1)
                piece, data = data[:step], data[step:]
                await stub.send(Chunk(piece, c.t), rest=Chunk(data, c.t))
                debt -= 0.1
            start = stub.now()
            await stub.sleep(debt)
            debt -= stub.now() - start
            await stub.send(Chunk(data, c.t))


@TOXICS.register("slow_close")
class SlowCloseToxic(Toxic):
    """Passes data; delays the close (EOF) by `delay` ms."""

    ATTRS = {"delay": 0}
    delay: int
    GO_NAME = "SlowCloseToxic"

    async def pipe(self, stub: Stub) -> None:
        while True:
            c = await stub.recv()
            if c.kind != DATA:
                await stub.sleep(self.delay / 1000.0)
                return await _forward_end(stub, c)
            await stub.send(c)


@TOXICS.register("timeout")
class TimeoutToxic(Toxic):
    """Stops all data; closes the connection after `timeout` ms (never, when 0)."""

    ATTRS = {"timeout": 0}
    timeout: int
    GO_NAME = "TimeoutToxic"

    async def pipe(self, stub: Stub) -> None:
        deadline = stub.now() + self.timeout / 1000.0
        while True:
            try:
                left = deadline - stub.now() if self.timeout > 0 else None
                c = await asyncio.wait_for(stub.recv(), left)
            except TimeoutError:
                return await stub.send(Chunk(b"", stub.now(), CLOSE))
            stub.drop()  # Drop the data on the ground: that is the fault
            if c.kind != DATA:
                return await _forward_end(stub, Chunk(b"", c.t, CLOSE))


@TOXICS.register("reset_peer")
class ResetPeerToxic(Toxic):
    """On the first chunk, waits `timeout` ms and then resets the connection (TCP RST)."""

    ATTRS = {"timeout": 0}
    timeout: int
    GO_NAME = "ResetToxic"

    async def pipe(self, stub: Stub) -> None:
        await stub.recv()
        stub.drop()
        await stub.sleep(self.timeout / 1000.0)
        await stub.send(Chunk(b"", stub.now(), RESET))


def slice_offsets(rng: random.Random, size: int, average: int, variation: int) -> list[int]:
    """Cut points for a chunk of `size` bytes, Toxiproxy's halving: [0, a, b, ..., size].

    Every cut lies strictly inside its span, so the pieces are non-empty, ascending and add up to
    `size` whatever `variation` is (Toxiproxy's own halving can step outside the chunk when the
    variation is larger than half of it). Iterative, so no input can exhaust the recursion limit.
    """
    if average <= 0 or size <= 0:
        return [0, size]
    variation = max(0, variation)
    cuts = [0]
    todo = [(0, size)]  # a stack; the left half is taken first, as Toxiproxy recurses
    while todo:
        start, end = todo.pop()
        if (end - start) - average <= variation or end - start < 2:
            cuts.append(end)
            continue
        vary = rng.randrange(variation * 2) - variation if variation > 0 else 0
        mid = min(end - 1, max(start + 1, start + (end - start) // 2 + vary))
        todo.append((mid, end))
        todo.append((start, mid))
    return cuts


@TOXICS.register("slicer")
class SlicerToxic(Toxic):
    """Slices each chunk into pieces of about `average_size` +/- `size_variation` bytes, `delay` us apart."""

    ATTRS = {"average_size": 0, "size_variation": 0, "delay": 0}
    average_size: int
    size_variation: int
    delay: int
    GO_NAME = "SlicerToxic"

    @classmethod
    def check(cls, attrs: dict[str, Any]) -> None:
        """Toxiproxy's rule (slicer.go, README): the variation must be less than the average size."""
        super().check(attrs)
        avg, var = attrs.get("average_size", 0), attrs.get("size_variation", 0)
        if var > 0 and var >= avg:
            raise ValueError(f"SlicerToxic.attributes.size_variation {var} must be less than "
                             f"average_size {avg}")

    async def pipe(self, stub: Stub) -> None:
        while True:
            c = await stub.recv()
            if c.kind != DATA:
                return await _forward_end(stub, c)
            cuts = slice_offsets(stub.rng, len(c.data), self.average_size, self.size_variation)
            for a, b in zip(cuts, cuts[1:], strict=False):
                rest = Chunk(c.data[b:], c.t) if b < len(c.data) else None
                await stub.send(Chunk(c.data[a:b], c.t), rest=rest)
                if self.delay > 0:
                    await stub.sleep(self.delay / 1e6)


class _Sent:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


@TOXICS.register("limit_data")
class LimitDataToxic(Toxic):
    """Closes the connection once `bytes` bytes have passed (counted per connection, across updates)."""

    ATTRS = {"bytes": 0}
    bytes: int
    GO_NAME = "LimitDataToxic"

    def new_state(self) -> Any:
        return _Sent()

    async def pipe(self, stub: Stub) -> None:
        sent: _Sent = stub.state
        while True:
            c = await stub.recv()
            if c.kind != DATA:
                return await _forward_end(stub, c)
            left = max(0, self.bytes - sent.n)
            if left < len(c.data):
                c = Chunk(c.data[:left], c.t)
            if c.data:
                sent.n += len(c.data)
                await stub.send(c)
            else:
                stub.drop()
            if self.bytes - sent.n <= 0:
                return await stub.send(Chunk(b"", stub.now(), CLOSE))


@TOXICS.register("grpc_delay")
class GrpcDelayToxic(Toxic):
    """Call-level (HTTP/2): delays `share` of the calls (optionally only `method`) by `delay` +/- `jitter` ms."""

    ATTRS = {"delay": 0, "jitter": 0, "share": 1.0, "method": ""}
    LIMITS = {"share": (0.0, 1.0)}
    GO_NAME = "GrpcDelayToxic"
    stage = False


@TOXICS.register("grpc_error")
class GrpcErrorToxic(Toxic):
    """Call-level (HTTP/2): fails `share` of the calls (optionally only `method`) with gRPC `status`."""

    ATTRS = {"status": 14, "message": "injected by shadowtest proxy", "share": 1.0, "method": ""}
    LIMITS = {"share": (0.0, 1.0), "status": (1, 16)}
    GO_NAME = "GrpcErrorToxic"
    stage = False


@TOXICS.register("http_delay")
class HttpDelayToxic(Toxic):
    """Call-level (HTTP/1.x, HTTP/2): holds `share` of the requests (optionally only those of HTTP
    `method`, a `path` prefix or glob, a `header`) `delay` +/- `jitter` ms before they go upstream
    (an HTTP/2 request without a body: its response's DATA is held instead)."""

    ATTRS = {"delay": 0, "jitter": 0, "share": 1.0, "method": "", "path": "", "header": ""}
    LIMITS = {"share": (0.0, 1.0)}
    GO_NAME = "HttpDelayToxic"
    stage = False


@TOXICS.register("http_error")
class HttpErrorToxic(Toxic):
    """Call-level (HTTP/1.x, HTTP/2): answers `share` of the requests (filters as http_delay) with HTTP
    `status` and `body` itself; the server never sees them."""

    ATTRS = {"status": 503, "body": "", "share": 1.0, "method": "", "path": "", "header": ""}
    LIMITS = {"share": (0.0, 1.0), "status": (200, 599)}
    GO_NAME = "HttpErrorToxic"
    stage = False


__all__ = ["TOXICS", "Toxic", "ToxicEffect", "Stub", "parse_attributes", "latency_delay", "slice_offsets",
           "DATA", "EOF", "CLOSE", "RESET"]
