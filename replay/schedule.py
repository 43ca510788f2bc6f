"""The replay plan: a pure, lazily built, time-ordered list of sends (no I/O, no clock).

    recording calls (time order, streamed)
        |  window -> method/flow filters -> rate scaling (copies per flow, seeded) -> loop N
        v
    PlannedCall(due_ns = (request_ts - base) / speed + loop * period / speed, messages at own offsets)
        |  shard by call: plan index % workers == worker (round-robin in due order)
        |  (or by connection: connection ordinal % workers == worker)
        v
    engine / Locust user

Order within each original connection is preserved because due times are a monotonic function of
the recorded times and the recording yields calls in (request_ts, id) order. Each message of a
stream keeps its own offset from the call start, divided by the speed, and a call (with all its
stream messages) is never split: sharding by call hands whole calls to workers, so one recorded
connection's calls are spread over the workers, each of which opens its own connection for them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field

from capture.recording import BODY_NOT_CAPTURED, STATUS_HIDDEN, Call, call_damage
from replay.errors import PlanError
from replay.shadow import ShadowValues

MIN_SPEED, MAX_SPEED = 0.1, 100.0
SHARD_BY = ("call", "connection")


@dataclass(frozen=True)
class PlannedMessage:
    """One request message (gRPC message, HTTP body or TCP chunk) at its own offset from the call."""

    offset_ns: int
    data: bytes
    compressed: bool = False


@dataclass
class PlannedCall:
    """One scheduled call. `index` is unique within a plan (across shards); `due_ns` is from t0."""

    index: int
    due_ns: int
    connection: str
    protocol: str
    method: str | None
    kind: str
    messages: list[PlannedMessage]
    metadata: list[tuple[str, str]] = field(default_factory=list)
    flow_id: int | None = None
    call_id: int | None = None
    loop: int = 0
    copy: int = 0
    expected_status: int | None = None
    status_hidden: bool = False          # the recorded status was unreadable (HPACK, joined), not missing
    request_body_missing: bool = False   # HTTP/1: the request body fell in a capture gap (never sent)
    not_comparable: str | None = None    # why its recording cannot be compared (capture.recording.call_damage)
    expected_responses: list[bytes] = field(default_factory=list)

    @property
    def last_offset_ns(self) -> int:
        return self.messages[-1].offset_ns if self.messages else 0


@dataclass(frozen=True)
class ScheduleOptions:
    """What to replay and how fast.

    speed: 0.1-100 (2.0 plays twice as fast). window: (start_s, end_s) in recorded seconds from the
    first call. methods: full names ("/pkg.Svc/M") or bare ("M"). flows: recorded flow ids.
    loop: play the (windowed) recording N times back to back. rate: flow multiplier (2.0 duplicates
    every flow, 0.5 keeps each flow with probability 0.5, 1.5 adds a second copy to half of them),
    decided per flow with `random.Random(seed)`. shard: (worker, workers).
    shard_by: "call" (default: the plan's calls round-robin over the workers, so even a recording of
    one connection splits evenly; each worker opens its own connections) or "connection" (each
    worker gets whole recorded connections: per-connection order on one socket, but a recording of
    one connection lands on one worker).
    method_map: ((flow_id or None, ref, method), ...) from `--method-map`: names groups of calls whose
    method the recording could not see, for this replay only (applied where the recording is read,
    replay/plan.py; see replay/method_map.py).
    shadow: `--set-query` / `--set-field` values, set in each planned HTTP call's path and body here,
    where they are built, so every sender and worker sends the same (see replay/shadow.py).
    """

    speed: float = 1.0
    window: tuple[float, float] | None = None
    methods: frozenset[str] = frozenset()
    flows: frozenset[int] = frozenset()
    loop: int = 1
    rate: float = 1.0
    seed: int = 0
    shard: tuple[int, int] = (0, 1)
    shard_by: str = "call"
    method_map: tuple[tuple[int | None, str, str], ...] = ()
    shadow: ShadowValues = ShadowValues()

    def validate(self) -> None:
        """Raise PlanError for options that cannot produce a sensible plan."""
        if not MIN_SPEED <= self.speed <= MAX_SPEED:
            raise PlanError(f"speed {self.speed} is outside {MIN_SPEED}-{MAX_SPEED}x; pick a speed in range")
        if self.window and not 0 <= self.window[0] < self.window[1]:
            raise PlanError(f"window {self.window[0]}:{self.window[1]} is empty; use START:END with START < END")
        if self.loop < 1:
            raise PlanError("loop must be at least 1")
        if self.rate <= 0:
            raise PlanError("scale must be positive (1.0 replays every recorded connection once)")
        worker, workers = self.shard
        if workers < 1 or not 0 <= worker < workers:
            raise PlanError(f"shard {worker}/{workers} is invalid")
        if self.shard_by not in SHARD_BY:
            raise PlanError(f"shard_by {self.shard_by!r} is not one of {', '.join(SHARD_BY)}")


def method_matches(method: str | None, wanted: frozenset[str]) -> bool:
    """True when no filter is set or `method` equals or ends with '/'+name of a wanted entry."""
    if not wanted:
        return True
    if method is None:
        return False
    return any(method == m or method.endswith("/" + m.lstrip("/")) for m in wanted)


class _Copies:
    """Per-flow copy count for rate scaling, drawn once per flow in first-seen order (seeded)."""

    def __init__(self, rate: float, rng: random.Random) -> None:
        self.rate, self.rng = rate, rng
        self.copies: dict[Hashable, int] = {}

    def of(self, flow_key: Hashable) -> int:
        if flow_key not in self.copies:
            whole = math.floor(self.rate)
            extra = 1 if self.rng.random() < self.rate - whole else 0
            self.copies[flow_key] = whole + extra
        return self.copies[flow_key]


def _planned(call: Call, index: int, due_ns: int, conn: str, speed: float, loop: int,
             copy: int, shadow: ShadowValues | None) -> PlannedCall:
    msgs = [PlannedMessage(int(max(0, m.ts_ns - call.request_ts_ns) / speed), bytes(m.data), m.compressed)
            for m in call.requests]
    method = call.method
    if shadow is not None:        # --set-query / --set-field (None without: nothing per call)
        method = shadow.method(call.protocol, method)
        msgs = [PlannedMessage(m.offset_ns, shadow.body(call.protocol, call.request_metadata, m.data), m.compressed)
                for m in msgs]
    # Keep stream order even if the recorder's timestamps went backwards: offsets never decrease.
    for i in range(1, len(msgs)):
        if msgs[i].offset_ns < msgs[i - 1].offset_ns:
            msgs[i] = PlannedMessage(msgs[i - 1].offset_ns, msgs[i].data, msgs[i].compressed)
    return PlannedCall(index=index, due_ns=due_ns, connection=conn, protocol=call.protocol,
                       method=method, kind=call.kind, messages=msgs,
                       metadata=list(call.request_metadata), flow_id=call.flow_id, call_id=call.id,
                       loop=loop, copy=copy, expected_status=call.status,
                       status_hidden=call.status is None and call.status_message == STATUS_HIDDEN,
                       request_body_missing=(call.status_message or "").startswith(
                           f"{BODY_NOT_CAPTURED}: request"),
                       not_comparable=call_damage(call.status, call.status_message, call.protocol),
                       expected_responses=[bytes(m.data) for m in call.responses])


def build_plan(source: Callable[[], Iterable[Call]], opts: ScheduleOptions,
               rng: random.Random | None = None) -> Iterator[PlannedCall]:
    """Yield the plan lazily, in due-time order, holding one call at a time.

    Args:
        source: returns a fresh iterator of calls in request-time order (called once per loop).
        opts: the options (validated here; raises PlanError).
        rng: the seeded generator for rate scaling (default `random.Random(opts.seed)`); every shard
            must pass an identically seeded one so that all shards agree on the copies.

    The loop period is the window length when a window is given, else the span of the first pass
    plus its mean gap between calls (so the loop seam has a normal gap, not a double send).
    """
    opts.validate()
    copies = _Copies(opts.rate, rng or random.Random(opts.seed))
    conn_ordinal: dict[str, int] = {}
    worker, workers = opts.shard
    by_call = opts.shard_by == "call"
    shadow = opts.shadow or None
    index, base, period = 0, None, 0
    win = (round(opts.window[0] * 1e9), round(opts.window[1] * 1e9)) if opts.window else None
    for loop in range(opts.loop):
        first = last = None
        count = 0
        for call in source():
            if base is None:
                base = call.request_ts_ns + (win[0] if win else 0)
            rel = call.request_ts_ns - base
            if rel < 0 or (win and rel >= win[1] - win[0]):
                continue
            first = rel if first is None else first
            last, count = rel, count + 1
            if not method_matches(call.method, opts.methods) or (opts.flows and call.flow_id not in opts.flows):
                continue
            due = int((rel + loop * period) / opts.speed)
            for copy in range(copies.of(call.flow_id)):
                conn = f"f{call.flow_id}" + (f"#{copy}" if copy else "")
                ordinal = index if by_call else conn_ordinal.setdefault(conn, len(conn_ordinal))
                if ordinal % workers == worker:
                    yield _planned(call, index, due, conn, opts.speed, loop, copy, shadow)
                index += 1
        if loop == 0:
            period = _loop_period(win, first, last, count)


def _loop_period(win: tuple[int, int] | None, first: int | None, last: int | None, count: int) -> int:
    if win:
        return win[1] - win[0]
    if first is None or last is None:
        return 0
    gap = (last - first) // (count - 1) if count > 1 else 1_000_000_000
    return last + gap
