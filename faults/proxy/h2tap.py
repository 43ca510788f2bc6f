"""Call-level toxics for HTTP/2 and gRPC: delay or fail a share of calls on one shared connection.

Toxiproxy's toxics act on whole connections, and gRPC multiplexes every call onto one, so a
connection fault is all or nothing. The tap follows the HTTP/2 frames of an h2 connection from its
first byte (HPACK is stateful, so it must) and, per new call, asks the call toxics for a fate:

    client --frames--> tap.feed_up --+--> HEADERS forwarded once their block is whole (in order: HPACK)
                                     +--> DATA of a delayed call held until `delay` after its HEADERS
                                     +--> failed call: never reaches the server. Its HEADERS are
                                          withheld, its DATA dropped (and given back to the client as a
                                          connection WINDOW_UPDATE); the proxy answers after any delay
    client <--frames-- tap.feed_down <-- injected answers (gRPC trailers-only, or an HTTP status and body)
                                     |   go in at a frame boundary after the server's first frame,
                                     |   encoded without touching the client's HPACK dynamic table
                                     +-- response DATA of a delayed call without a request body, held

Withholding a header block leaves the server's HPACK table behind the client's, so from the first
withheld call on the tap re-encodes every request header block it forwards with its own encoder (its
table starts as a copy of the server's, taken before that block; its size follows the client's). The
fields, their order and never-indexed marks stay as the client sent them. A client block the tap
cannot decode after that ends the connection (GOAWAY): it can no longer be passed on as it is.

A request whose HEADERS carry END_STREAM (a GET: no body) has nothing to hold on the way up, so its
delay holds the response on the way down instead: the response's DATA frames wait until `delay`
after the request's HEADERS reached the tap, then go out in order. Its HEADERS still go out at once
(the client's HPACK table must stay in step); when they end the stream (a bodiless response) they go
out with END_STREAM cleared and an empty DATA frame with END_STREAM follows at the release. Trailers
(a HEADERS frame after the response's head) arriving before the release take the held DATA out
right before them: the delay is cut short (`calls_cut`). Telling an interim 1xx head from the final
one takes the leg log's decoder (below); without it a second HEADERS counts as trailers. A server
RST_STREAM drops what is held (the server's window is given back) and is forwarded, unless the
response was whole already (then it goes first); a client RST_STREAM drops it too. At most
MAX_HELD_DOWN bytes are held per connection; beyond that a held response goes at once (cut short,
logged once). While anything is held the server's bytes are forwarded frame by frame (a partial frame
waits for its end); otherwise they stream through as they come. The server closing its side
releases everything held before the end.

Upstream-leg timing (`SHADOWTEST_LEG_LOG=PATH` in the proxy's environment): for every call the tap
appends one line `SENT DONE SERVED` to PATH: SENT when the request's last frame (END_STREAM) left the
tap towards the server, DONE when the server's last frame of the call (END_STREAM or RST_STREAM)
reached the proxy, both CLOCK_MONOTONIC seconds. A held response does not count: DONE is the
server's time, before the proxy's hold or any downstream toxic. SERVED for a gRPC call (request
content-type application/grpc..., or a response carrying grpc-status) is 1 when the response carried
a DATA frame (0: trailers only, e.g. a refusal); for any other call it is 1 when the response's final
`:status` is below 400 (as for HTTP/1) and the stream was not reset. Reading the status takes a
second HPACK decoder for the server's header blocks, kept only while the leg log is on; if it cannot
follow them, SERVED falls back to the DATA rule for the rest of the connection (logged once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import hpack
from hpack.table import HeaderTable

from faults.proxy.calls import Call, CallRule, Fate, fate_of
from faults.proxy.toxics import ToxicEffect
from wire.h2 import (
    HEAD,
    PREFACE,
    BlockAssembler,
    ErrorCode,
    Flag,
    FrameType,
    H2Error,
    frame,
    goaway,
    split,
    strip,
    window_update,
)
from wire.headers import CachedDecoder, encode_block
from wire.status import status_block

__all__ = ["CallRule", "DelayCredit", "EffectRule", "H2Tap", "LEG_LOG_ENV", "FAULT_HEADER", "MAX_HELD_DOWN",
           "draw_fate", "leg_line", "leg_log"]

LEG_LOG_ENV = "SHADOWTEST_LEG_LOG"
FAULT_HEADER = "x-shadowtest-fault"           # on every response the proxy made up itself
_PROTOS = frozenset({"grpc", "http"})
_leg_files: dict[str, TextIO | None] = {}     # the leg log of this process, opened once


def leg_log() -> TextIO | None:
    """The leg log (line-buffered append), opened once per process; None when not asked for."""
    path = os.environ.get(LEG_LOG_ENV, "")
    if path not in _leg_files:
        try:
            _leg_files[path] = open(path, "a", buffering=1) if path else None  # noqa: SIM115 -- process lifetime
        except OSError as exc:
            log.warning("cannot write the upstream-leg log %s: %s", path, exc)
            _leg_files[path] = None
    return _leg_files[path]

log = logging.getLogger(__name__)

_DATA, _HEADERS, _RST, _CONTINUATION = (int(FrameType.DATA), int(FrameType.HEADERS),
                                        int(FrameType.RST_STREAM), int(FrameType.CONTINUATION))
_PUSH_PROMISE = int(FrameType.PUSH_PROMISE)
_BLOCK_FRAMES = frozenset({_HEADERS, _CONTINUATION, _PUSH_PROMISE})
_END_STREAM, _END_HEADERS, _PADDED = int(Flag.END_STREAM), int(Flag.END_HEADERS), int(Flag.PADDED)
MAX_HEADER_BLOCK = 1 << 20   # a client block open longer than this turns the tap off (it is forwarded)
MAX_HELD_DOWN = 8 << 20      # response bytes held per connection; beyond this a held response goes at once
_MAX_TRACKED = 10_000        # per-stream bookkeeping kept for streams that never end
_SAFE_FRAME = 16_384         # a frame size every server accepts (its MAX_FRAME_SIZE is never lower)
_PRIORITY = int(Flag.PRIORITY)


def leg_line(sent: float, done: float, served: bool) -> str:
    """One call's line in the leg log (`SENT DONE SERVED`, read by harness.checks.truth.read_leg_log)."""
    return f"{sent:.6f} {done:.6f} {int(served)}\n"


@dataclass
class EffectRule(CallRule):
    """A call toxic's rule that also knows where to count what it did (its proxy's `ToxicEffect`)."""

    effect: ToxicEffect | None = None


class DelayCredit:
    """A delayed call's hold, as each delay toxic asked for it. At the release each toxic is credited
    its delay, scaled down when the hold was cut short: what it actually applied."""

    __slots__ = ("start", "parts")

    def __init__(self, start: float, parts: list[tuple[ToxicEffect, float]]) -> None:
        self.start, self.parts = start, parts

    def release(self, now: float, cut: bool = False) -> None:
        """Credit the time held (once; later calls do nothing)."""
        asked = sum(d for _, d in self.parts)
        share = min(1.0, max(0.0, now - self.start) / asked) if asked > 0 else 0.0
        for effect, delay in self.parts:
            effect.calls_delayed += 1
            effect.delay_s += delay * share
            effect.calls_cut += cut
        self.parts = []


def draw_fate(rules: list[CallRule], call: Call, rng: random.Random, protos: frozenset[str],
              now: float) -> tuple[Fate, DelayCredit | None]:
    """`fate_of(rules, ...)` drawn rule by rule (the same draws, in the same order), so that each
    toxic is counted for the calls it matched and failed, and credited the delay it asked for."""
    delay_ms, error, parts = 0, None, []
    for rule in rules:
        if rule.proto not in protos or not rule.matches(call):
            continue
        effect = rule.effect if isinstance(rule, EffectRule) else None
        drawn = fate_of([rule], call, rng, protos)
        ms = round(drawn.delay_s * 1000)
        delay_ms += ms
        if effect is not None:
            effect.calls += 1
            if ms > 0:
                parts.append((effect, ms / 1000.0))
            if drawn.error is not None and error is None:
                effect.calls_failed += 1
        error = error or drawn.error
    return Fate(delay_ms / 1000.0, error), (DelayCredit(now, parts) if parts else None)


@dataclass
class _Fate:
    delay_s: float = 0.0
    error: tuple[str, int, str] | None = None
    released: bool = False
    failed: bool = False
    held: list[bytes] = field(default_factory=list)
    held_flow: int = 0
    credit: DelayCredit | None = None


@dataclass
class _Hold:
    """A response held on its way down: the delayed call had no request body (module doc)."""

    timer: asyncio.TimerHandle | None = None
    frames: list[bytes] = field(default_factory=list)
    size: int = 0                   # bytes of the held frames
    flow: int = 0                   # their flow-controlled bytes (DATA payloads), owed to the server if dropped
    heads: int = 0                  # HEADERS frames of the response seen so far
    last_status: int | None = None  # :status of the latest of them, when the server's blocks are decoded
    data_seen: bool = False
    end_owed: bool = False          # its head's END_STREAM was cleared: an empty DATA with END_STREAM is owed
    ended: bool = False             # the server ended the stream (its END_STREAM is held or owed)
    credit: DelayCredit | None = None


@dataclass(frozen=True)
class _Table:
    """A copy of an HPACK dynamic table: the server's, taken before a block that may be withheld."""

    entries: tuple[tuple[bytes, bytes], ...]
    size: int
    maxsize: int

    @classmethod
    def of(cls, table: HeaderTable) -> _Table:
        return cls(tuple(table.dynamic_entries), table._current_size, table.maxsize)

    def encoder(self) -> hpack.Encoder:
        """An encoder whose table is this one: what the server's decoder holds."""
        enc = hpack.Encoder()
        t = enc.header_table
        t.dynamic_entries = deque(self.entries)
        t._current_size, t._maxsize = self.size, self.maxsize
        return enc


def _priority_of(flags: int, payload: bytes) -> bytes:
    """The 5 priority bytes of a HEADERS frame (b"" without the PRIORITY flag)."""
    if not flags & _PRIORITY:
        return b""
    start = 1 if flags & _PADDED else 0
    return bytes(payload[start:start + 5])


def _decode_raw(decoder: CachedDecoder, block: bytes) -> list[tuple[bytes, bytes]]:
    """The block's fields as the client's bytes (re-encoding must not change them), through the same
    HPACK context as CachedDecoder.decode."""
    try:
        return list(decoder.decoder.decode(block, raw=True))   # HeaderTuples: never-indexed fields stay so
    except hpack.OversizedHeaderListError as exc:
        raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, f"header list too large: {exc}") from exc
    except (hpack.HPACKError, IndexError, ValueError) as exc:
        raise H2Error(ErrorCode.COMPRESSION_ERROR, f"cannot decode a header block: {exc}") from exc


def _text(raw: bytes) -> str:
    """As CachedDecoder's fields: UTF-8, else Latin-1 (never an exception)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _promised_block(flags: int, payload: bytes) -> bytes:
    """The header-block fragment of a PUSH_PROMISE frame (after padding and the promised stream id)."""
    start = pad = 0
    if flags & _PADDED:
        if not payload:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "PADDED PUSH_PROMISE too short for its pad length")
        pad, start = payload[0], 1
    if len(payload) - start - pad < 4:
        raise H2Error(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE too short for its padding and promised stream")
    return payload[start + 4:len(payload) - pad]


class H2Tap:
    """Frame-aware filter between a connection's sockets and its two links (see module doc)."""

    def __init__(self, push_up: Callable[[bytes], None], push_down: Callable[[bytes], None],
                 rules: Callable[[], list[CallRule]], rng: random.Random) -> None:
        self._push_up, self._push_down, self._rules, self._rng = push_up, push_down, rules, rng
        self._up = bytearray()
        self._preface_left = len(PREFACE)
        self._decoder = CachedDecoder(max_table_size=1 << 20)
        self._block = BlockAssembler(MAX_HEADER_BLOCK)   # the client's open header block, if any
        self._blk_raw: list[bytes] = []                  # its frames, held until it ends
        self._blk_prio = b""                             # its HEADERS frame's priority fields
        self._enc: hpack.Encoder | None = None           # the server's HPACK context, once a call was withheld
        self._dead = False                               # a client block we could not re-encode: closed
        self._max_stream = 0
        self._fates: dict[int, _Fate] = {}
        # The server's bytes: the frame in flight on the streaming path (its header bytes went out as
        # they came), or whole-frame buffering while responses are held (module doc).
        self._d_hdr = bytearray()
        self._d_left = 0
        self._d_in_block = False
        self._d_open = False                   # the server's first frame (its SETTINGS) has begun
        self._d_buf = bytearray()              # a partial frame not yet forwarded (frame-by-frame path)
        self._d_part: bytearray | None = None  # payload of the header-block frame in flight, when decoding
        self._d_cur = (0, 0, 0)                # (type, flags, stream) of that frame
        self._holds: dict[int, _Hold] = {}
        self._held_total = 0
        self._warned_held = False
        self._inject: list[bytes] = []
        self._deferred_up: list[bytes] = []  # timer-released frames waiting for a header block to end
        self.broken = False
        self._open_on_wire = False  # off while the client's header block was open: still find its end
        self.calls_seen = 0
        self.calls_delayed = 0
        self.calls_failed = 0
        self.calls_cut = 0                    # delays cut short (trailers, MAX_HELD_DOWN, the server's end)
        self._legs = leg_log()               # upstream-leg timing (module doc), when configured
        self._sent: dict[int, float] = {}     # stream -> when its request's END_STREAM went up
        self._answered: set[int] = set()      # streams whose response carried DATA
        self._early: set[int] = set()         # streams answered before their request ended
        self._plain: set[int] = set()         # streams of non-gRPC requests (leg log on)
        self._status: dict[int, int] = {}     # timed stream -> its response's final :status
        self._leg_wait: tuple[int, float, float, int | None] | None = None  # a leg waiting for its block
        # The server's header blocks, decoded only for the leg log (the :status of plain HTTP/2 calls).
        self._srv_dec = CachedDecoder(max_table_size=1 << 20, max_header_list_size=MAX_HEADER_BLOCK) \
            if self._legs is not None else None
        self._srv_asm = BlockAssembler(MAX_HEADER_BLOCK)
        self._srv_head = False                # the server's open block is a HEADERS (not a PUSH_PROMISE)

    # --- client -> server -------------------------------------------------------------------
    def feed_up(self, data: bytes) -> None:
        if self._dead:
            return
        if self.broken and not self._open_on_wire:
            if self._up:        # a partial frame from before we switched off goes first
                data = bytes(self._up) + data
                self._up.clear()
            return self._push_up(data)
        if self._preface_left:
            n = min(self._preface_left, len(data))
            self._preface_left -= n
            self._push_up(data[:n])
            data = data[n:]
        buf = bytes(self._up) + data if self._up else bytes(data)
        frames, used, _ = split(buf)   # no size limit here: the server enforces its MAX_FRAME_SIZE
        out: list[bytes] = []
        pos = 0
        for ftype, flags, sid, payload in frames:
            end = pos + 9 + len(payload)
            self._on_up_frame(ftype, flags, sid, payload, buf[pos:end], out)
            pos = end
            if self._dead:
                return
        self._up = bytearray(buf[used:])
        if out:
            self._push_up(b"".join(out))

    def end_up(self, push_eof: Callable[[], None]) -> None:
        """The client closed its side: what is partial goes on, then the end."""
        self.flush_up()
        push_eof()

    def flush_up(self) -> None:
        """The client closed: pass on any partial frame as it is."""
        if self._up and not self._dead:
            self._push_up(bytes(self._up))
        self._up.clear()

    def _on_up_frame(self, ftype: int, flags: int, sid: int, payload: bytes, raw: bytes, out: list[bytes]) -> None:
        if ftype == _HEADERS or ftype == _CONTINUATION:
            if self.broken:      # switched off: passed on as they come
                out.append(raw)
                self._on_header_fragment(ftype, flags, sid, payload, out)
                if self._legs is not None and ftype == _HEADERS and flags & _END_STREAM and sid not in self._fates:
                    self._sent[sid] = time.monotonic()
            else:                # held until the block ends: then forwarded, re-encoded or withheld
                self._blk_raw.append(raw)
                self._on_header_fragment(ftype, flags, sid, payload, out)
            return
        if ftype == _RST and sid in self._holds:   # the client gave up on a held response: drop it
            self._drop_hold(sid, out)
        fate = self._fates.get(sid) if sid else None
        if fate is None:
            out.append(raw)
            if self._legs is not None and ftype == _DATA and flags & _END_STREAM:
                if sid in self._early:
                    self._early.discard(sid)
                    self._plain.discard(sid)
                else:
                    self._sent[sid] = time.monotonic()
            elif ftype == _RST:
                self._forget(sid)
        elif ftype == _RST and not fate.failed:  # the client gave up on a delayed call: drop what we held
            fate.failed = True
            fate.held.clear()
            self._give_back_window(fate)
            out.append(raw)
        elif fate.failed or (ftype == _DATA and not fate.released):
            if ftype == _DATA:   # a withheld call's frames never go up (the server never saw its stream)
                fate.held_flow += len(raw) - 9
                if not fate.failed:
                    fate.held.append(raw)
                else:
                    self._give_back_window(fate)
        else:
            out.append(raw)

    def _forget(self, sid: int) -> None:
        """A stream reset before its leg was logged: it is not timed."""
        self._sent.pop(sid, None)
        self._plain.discard(sid)
        self._status.pop(sid, None)
        self._answered.discard(sid)

    def _on_header_fragment(self, ftype: int, flags: int, sid: int, payload: bytes, out: list[bytes]) -> None:
        if self.broken:          # switched off: only the end of the block open on the wire matters
            if self._open_on_wire and ftype == _CONTINUATION and flags & _END_HEADERS:
                self._open_on_wire = False
                out.extend(self._deferred_up)
                self._deferred_up.clear()
            return
        asm = self._block
        snap: _Table | None = None
        rules: list[CallRule] = []
        try:
            if ftype == _HEADERS:
                block = asm.headers(sid, flags, strip(ftype, flags, payload))
                first_flags = flags
                self._blk_prio = _priority_of(flags, payload)
            else:
                first_flags = asm.flags
                block = asm.continuation(sid, flags, payload)
            if block is None:
                return
            new = sid > self._max_stream and sid % 2 == 1
            if new:
                rules = self._rules()
                if self._enc is None and any(r.kind == "error" for r in rules):
                    snap = _Table.of(self._decoder.decoder.header_table)   # the server's table, if withheld
            if self._enc is None:
                headers, raw_fields = self._decoder.decode(block, sid), None
            else:
                raw_fields = _decode_raw(self._decoder, block)
                headers = [(_text(k), _text(v)) for k, v in raw_fields]
        except H2Error as exc:   # never break the connection: stop tapping instead (all is forwarded)
            self._client_block_error(exc, ftype, flags, out)
            return
        frames, self._blk_raw = self._blk_raw, []
        withhold = False
        if new:
            self._max_stream = sid
            withhold = self._new_call(sid, headers, bool(first_flags & _END_STREAM), rules)
            if withhold and self._enc is None:
                if snap is None:      # cannot happen (an error needs an error rule); forward, never lose sync
                    withhold = False
                else:
                    self._enc = snap.encoder()
                    log.info("a call withheld from the server: this connection's request headers are "
                             "re-encoded from now on")
        else:                         # a later block (trailers) of a withheld call stays withheld
            fate = self._fates.get(sid)
            withhold = fate is not None and fate.failed and self._enc is not None
        if not withhold:
            if self._enc is None:
                out.extend(frames)
            else:
                assert raw_fields is not None
                out.append(self._reencode(sid, first_flags, raw_fields))
            if self._legs is not None and first_flags & _END_STREAM and sid not in self._fates:
                self._sent[sid] = time.monotonic()
        if self._deferred_up:  # HEADERS + CONTINUATION must be contiguous: released frames go after
            out.extend(self._deferred_up)
            self._deferred_up.clear()

    def _reencode(self, sid: int, flags: int, raw_fields: list[tuple[bytes, bytes]]) -> bytes:
        """A client's header block for the server, encoded with the tap's own HPACK context."""
        enc = self._enc
        assert enc is not None
        size = self._decoder.decoder.header_table.maxsize   # the client keeps within the server's limit
        if enc.header_table.maxsize != size:
            enc.header_table_size = size
        block = self._blk_prio + enc.encode(raw_fields)
        end = (flags & _END_STREAM) | (_PRIORITY if self._blk_prio else 0)
        if len(block) <= _SAFE_FRAME:
            return frame(FrameType.HEADERS, end | _END_HEADERS, sid, block)
        parts = [block[i:i + _SAFE_FRAME] for i in range(0, len(block), _SAFE_FRAME)]
        return b"".join([frame(FrameType.HEADERS, end, sid, parts[0])]
                        + [frame(FrameType.CONTINUATION, _END_HEADERS if i == len(parts) - 1 else 0, sid, p)
                           for i, p in enumerate(parts) if i])

    def _client_block_error(self, exc: H2Error, ftype: int, flags: int, out: list[bytes]) -> None:
        frames, self._blk_raw = self._blk_raw, []
        if self._enc is None:
            log.warning("cannot follow the client's header blocks (%s); call-level toxics off for this "
                        "connection", exc)
            out.extend(frames)   # what we held of the block goes on as it is
            self._off(ftype, flags, out)
            return
        # The server's HPACK table is the tap's now: a block we cannot decode cannot reach it at all.
        log.warning("cannot follow the client's header blocks (%s) after a withheld call; closing the "
                    "connection", exc)
        self._dead = True
        self._push_up(b"".join(out) + goaway(0, ErrorCode.INTERNAL_ERROR))
        out.clear()
        self.inject_down(goaway(self._max_stream, ErrorCode.COMPRESSION_ERROR))

    def _off(self, ftype: int, flags: int, out: list[bytes]) -> None:
        """Stop tapping after the frame (ftype, flags). Frames a timer released while a header block
        was open go out once no block is open on the wire any more: now, or at its END_HEADERS."""
        self.broken = True
        # The block is still open on the wire when this frame did not end it (a HEADERS or
        # CONTINUATION without END_HEADERS). A CONTINUATION that came without an open block
        # leaves none open.
        self._open_on_wire = not flags & _END_HEADERS and (ftype == _HEADERS or bool(self._block.sid))
        self._block.reset()
        if not self._open_on_wire:
            out.extend(self._deferred_up)
            self._deferred_up.clear()

    def _new_call(self, sid: int, headers: list[tuple[str, str]], ended: bool, rules: list[CallRule]) -> bool:
        """Draw a new call's fate and set it going; True when its headers must be withheld (it fails)."""
        self.calls_seen += 1
        if self._legs is not None and not any(k == "content-type" and v.startswith("application/grpc")
                                              for k, v in headers):
            if len(self._plain) >= _MAX_TRACKED:   # streams that never ended: keep the recent ones
                self._plain = {s for s in self._plain if s in self._sent or s > sid - 2000}
            self._plain.add(sid)
        if not rules:
            return False
        path = method = ""
        for k, v in headers:
            if k == ":path":
                path = v
            elif k == ":method":
                method = v
        loop = asyncio.get_running_loop()
        drawn, credit = draw_fate(rules, Call(method, path, headers), self._rng, _PROTOS, loop.time())
        if drawn.delay_s <= 0 and drawn.error is None:
            return False
        if drawn.delay_s > 0:
            self.calls_delayed += 1
        if drawn.error is not None:   # the server never sees it; the proxy answers, after any delay
            fate = self._fates[sid] = _Fate(drawn.delay_s, drawn.error, failed=True, credit=credit)
            self.calls_failed += 1
            self._plain.discard(sid)
            if drawn.delay_s > 0:
                loop.call_later(drawn.delay_s, self._answer_late, sid)
            else:
                self._answer(sid, fate)
            return True
        if ended:                     # no request body to hold: hold the response (module doc)
            hold = self._holds[sid] = _Hold(credit=credit)
            hold.timer = loop.call_later(drawn.delay_s, self._release_down, sid)
        else:
            self._fates[sid] = _Fate(drawn.delay_s, credit=credit)
            loop.call_later(drawn.delay_s, self._release, sid)
        return False

    def _release(self, sid: int) -> None:
        fate = self._fates.get(sid)
        if fate is None or fate.failed:
            return
        fate.released = True
        if fate.credit is not None:
            fate.credit.release(asyncio.get_running_loop().time())
        if fate.held:
            if self._legs is not None and any(r[3] == _DATA and r[4] & _END_STREAM for r in fate.held):
                if sid in self._early:
                    self._early.discard(sid)
                    self._plain.discard(sid)
                else:
                    self._sent[sid] = time.monotonic()
            self._push_up_frames(b"".join(fate.held))
            fate.held.clear()
        del self._fates[sid]

    def _push_up_frames(self, raw: bytes) -> None:
        """Whole frames from a timer: never inside the client's open header block."""
        if self._dead:
            return
        if self._block.sid or self._open_on_wire:
            self._deferred_up.append(raw)
        else:
            self._push_up(raw)

    def _answer_late(self, sid: int) -> None:
        fate = self._fates.get(sid)
        if fate is not None:
            if fate.credit is not None:
                fate.credit.release(asyncio.get_running_loop().time())
            self._answer(sid, fate)

    def _answer(self, sid: int, fate: _Fate) -> None:
        """The proxy's own answer to a failed call, injected for the client."""
        proto, status, text = fate.error or ("grpc", 14, "")
        # Static-table encoding only: injecting it never touches the client's HPACK dynamic table.
        if proto == "grpc":
            self.inject_down(frame(FrameType.HEADERS, _END_STREAM | _END_HEADERS, sid,
                                   status_block(status, text, trailers_only=True)))
            return
        body = text.encode()
        block = encode_block([(":status", str(status)), ("content-type", "text/plain"),
                              ("content-length", str(len(body))), (FAULT_HEADER, "http_error")])
        self.inject_down(frame(FrameType.HEADERS, _END_HEADERS | (0 if body else _END_STREAM), sid, block)
                         + (frame(FrameType.DATA, _END_STREAM, sid, body) if body else b""))

    def _give_back_window(self, fate: _Fate) -> None:
        # The server never sees these bytes, so it never returns their flow-control window: we do.
        if fate.held_flow > 0:
            self.inject_down(window_update(0, fate.held_flow))
            fate.held_flow = 0

    # --- held responses (a delayed call without a request body) --------------------------------
    def _release_down(self, sid: int) -> None:
        """The delay is over: the held response goes out (at the next frame boundary)."""
        if sid in self._holds:
            raw = self._take_hold(sid, cut=False)
            if raw:
                self.inject_down(raw)

    def _take_hold(self, sid: int, cut: bool) -> bytes:
        """End the hold of `sid`; its frames (and an owed END_STREAM) to forward now."""
        hold = self._holds.pop(sid)
        if hold.timer is not None:
            hold.timer.cancel()
        self._held_total -= hold.size
        if hold.credit is not None:
            hold.credit.release(asyncio.get_running_loop().time(), cut)
        if cut:
            self.calls_cut += 1
        if hold.end_owed:
            hold.frames.append(frame(FrameType.DATA, _END_STREAM, sid))
        return b"".join(hold.frames)

    def _drop_hold(self, sid: int, out: list[bytes] | None) -> None:
        """The stream was reset: what is held is dropped, and its window given back to the server."""
        hold = self._holds.pop(sid)
        if hold.timer is not None:
            hold.timer.cancel()
        self._held_total -= hold.size
        if hold.credit is not None:
            hold.credit.release(asyncio.get_running_loop().time(), cut=True)
        if hold.flow > 0:   # the client never sees these bytes, so it never returns their window: we do
            credit = window_update(0, hold.flow)
            out.append(credit) if out is not None else self._push_up_frames(credit)

    def _held_frame(self, hold: _Hold, sid: int, ftype: int, flags: int, payload: bytes, raw: bytes,
                    out: list[bytes]) -> None:
        """A whole frame of the server's on a held stream."""
        if ftype == _DATA:
            hold.data_seen = True
            hold.frames.append(raw)
            hold.size += len(raw)
            hold.flow += len(payload)
            self._held_total += len(raw)
            if flags & _END_STREAM:
                hold.ended = True
            if self._held_total > MAX_HELD_DOWN:
                if not self._warned_held:
                    self._warned_held = True
                    log.warning("more than %d response bytes held for delayed HTTP/2 calls on one connection: "
                                "their delay is cut short", MAX_HELD_DOWN)
                out.append(self._take_hold(sid, cut=True))
        elif ftype == _HEADERS:
            # A head: the first HEADERS, or one after an interim (1xx) head. Anything later is trailers.
            head = not hold.data_seen and (hold.heads == 0 or (hold.last_status is not None
                                                                and hold.last_status < 200))
            hold.heads += 1
            hold.last_status = None
            if not head:          # trailers: the held DATA goes right before them, the delay is cut short
                out.append(self._take_hold(sid, cut=True))
                out.append(raw)
            elif flags & _END_STREAM:  # a bodiless response: its end goes at the release
                hold.end_owed = hold.ended = True
                out.append(raw[:4] + bytes((flags & ~_END_STREAM,)) + raw[5:])
            else:
                out.append(raw)
        elif ftype == _RST:
            if hold.ended:        # the response was whole already: it goes, then the reset
                out.append(self._take_hold(sid, cut=True))
            else:
                self._drop_hold(sid, None)
            out.append(raw)
        else:
            out.append(raw)

    # --- server -> client -------------------------------------------------------------------
    def inject_down(self, raw: bytes) -> None:
        """Queue a frame for the client; it goes out at the next frame boundary of the server's stream."""
        self._inject.append(raw)
        if self._at_boundary():
            self._flush_inject()

    def _at_boundary(self) -> bool:
        # Nothing goes before the server's preface: a client takes any other first frame as an error.
        return self._d_open and not self._d_left and not self._d_hdr and not self._d_in_block

    def _flush_inject(self) -> None:
        if self._inject:
            self._push_down(b"".join(self._inject))
            self._inject.clear()

    def feed_down(self, data: bytes) -> None:
        """Forward the server's bytes: streamed through at once, or frame by frame while any response
        is held (module doc)."""
        if not self._holds and not self._d_buf:
            self._stream_down(data, False)
            return
        i = 0
        if self._d_left or self._d_hdr:   # first the end of the frame in flight: its start went out already
            i = self._stream_down(data, True)
        if i < len(data):
            self._frames_down(data[i:] if i else data)

    def _stream_down(self, data: bytes, to_boundary: bool) -> int:
        """Forward bytes as they come, tracking frame boundaries (for injections) and collecting header
        blocks when they are decoded; with `to_boundary`, stop at the first frame boundary. Returns
        how much of `data` was used."""
        start, i, n = 0, 0, len(data)
        while i < n:
            if self._d_left:
                take = min(self._d_left, n - i)
                if self._d_part is not None:
                    self._d_part += data[i:i + take]
                i += take
                self._d_left -= take
                if not self._d_left and self._d_part is not None:
                    self._end_part()
            else:
                need = 9 - len(self._d_hdr)
                self._d_hdr += data[i:i + need]
                i += min(need, n - i)
                if len(self._d_hdr) == 9:
                    self._on_down_header(bytes(self._d_hdr))
                    self._d_hdr.clear()
                    if not self._d_left and self._d_part is not None:
                        self._end_part()
            if self._inject and self._at_boundary():
                if i > start:
                    self._push_down(data[start:i])
                start = i
                self._flush_inject()
            if to_boundary and not self._d_left and not self._d_hdr:
                break
        if i > start:
            self._push_down(data if start == 0 and i == n else data[start:i])
        return i

    def _frames_down(self, data: bytes) -> None:
        """Whole frames while responses are held: those of a held stream wait, the rest go on."""
        pending = self._d_buf
        if len(pending) >= 9:   # a big frame coming in pieces: gather it without re-reading it each time
            hi, lo = pending[0], int.from_bytes(pending[1:3], "big")
            if len(pending) + len(data) < 9 + (hi << 16 | lo):
                pending += data
                return
        buf = bytes(pending) + data if pending else data
        self._d_buf.clear()
        frames, used, err = split(buf)
        out: list[bytes] = []
        pos = 0
        for ftype, flags, sid, payload in frames:
            end = pos + 9 + len(payload)
            raw = buf[pos:end]
            pos = end
            self._on_down_frame(ftype, flags, sid)
            hold = self._holds.get(sid) if sid else None
            if hold is None:
                out.append(raw)
            else:
                self._held_frame(hold, sid, ftype, flags, payload, raw, out)
            if self._srv_dec is not None and ftype in _BLOCK_FRAMES:
                self._down_block(ftype, flags, sid, payload)
            if self._inject and not self._d_in_block:   # (the server's first frame has passed)
                out.extend(self._inject)
                self._inject.clear()
        if err is not None:   # not a frame we can wait for: stop holding, stream the rest as it is
            out.extend(self._take_hold(sid, cut=True) for sid in list(self._holds))
        if out:
            self._push_down(b"".join(out))
        rest = buf[used:]
        if rest:
            if self._holds:
                self._d_buf += rest
            else:                       # nothing held any more: back to streaming
                self._stream_down(rest, False)

    def eof_down(self) -> None:
        """The server closed its side: what is held goes now, before the end."""
        out = [self._take_hold(sid, cut=True) for sid in list(self._holds)]
        if self._d_buf:
            out.append(bytes(self._d_buf))
            self._d_buf.clear()
        if any(out):
            self._push_down(b"".join(out))

    def sync_down(self, data: bytes) -> None:
        """Account for server bytes forwarded before the tap existed."""
        saved, self._push_down = self._push_down, lambda _b: None
        try:
            self.feed_down(data)
        finally:
            self._push_down = saved

    def _on_down_header(self, hdr: bytes) -> None:
        """A frame header of the server's on the streaming path."""
        hi, lo, ftype, flags, sid = HEAD.unpack(hdr)
        length = self._d_left = hi << 16 | lo
        if self._legs is None:         # the common case, inline: only frame boundaries matter
            self._d_open = True
            if ftype in _BLOCK_FRAMES:
                self._d_in_block = not flags & _END_HEADERS
            return
        sid &= 0x7FFFFFFF
        self._on_down_frame(ftype, flags, sid)
        if self._srv_dec is not None and ftype in _BLOCK_FRAMES:
            if length > MAX_HEADER_BLOCK:
                self._status_off(f"a {length}-byte header-block frame")
            else:
                self._d_part = bytearray()
                self._d_cur = (ftype, flags, sid)

    def _end_part(self) -> None:
        assert self._d_part is not None
        part, self._d_part = bytes(self._d_part), None
        ftype, flags, sid = self._d_cur
        self._down_block(ftype, flags, sid, part)

    def _on_down_frame(self, ftype: int, flags: int, sid: int) -> None:
        """Every frame of the server's as it reaches the proxy: leg timing, header-block boundaries."""
        self._d_open = True
        if self._legs is not None:
            if sid in self._sent:
                self._leg(ftype, flags, sid)
            elif sid % 2 == 1 and ((ftype in (_DATA, _HEADERS) and flags & _END_STREAM) or ftype == _RST):
                # Answered before the request ended (a refusal at its headers): never timed.
                if len(self._early) > _MAX_TRACKED:
                    self._early.clear()
                self._early.add(sid)
        if ftype in _BLOCK_FRAMES:
            self._d_in_block = not flags & _END_HEADERS

    def _leg(self, ftype: int, flags: int, sid: int) -> None:
        """The server's frame for a timed call: note a DATA frame, log the call at its end."""
        if ftype == _DATA:
            self._answered.add(sid)
        if (ftype in (_DATA, _HEADERS) and flags & _END_STREAM) or ftype == _RST:
            sent = self._sent.pop(sid)
            done = time.monotonic()
            status = self._status.pop(sid, None)
            if ftype == _HEADERS and self._srv_dec is not None and sid in self._plain:
                self._leg_wait = (sid, sent, done, status)   # this block may carry the status: log it after
                return
            self._write_leg(sid, sent, done, status, ftype == _RST)

    def _write_leg(self, sid: int, sent: float, done: float, status: int | None, reset: bool) -> None:
        data = sid in self._answered
        self._answered.discard(sid)
        served = data
        if sid in self._plain:
            self._plain.discard(sid)
            if self._srv_dec is not None:
                served = status is not None and status < 400 and not reset
        try:
            if self._legs is not None:
                self._legs.write(leg_line(sent, done, served))
        except OSError:
            self._legs = self._srv_dec = None

    def _down_block(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        """A header-block frame of the server's (leg log on): decode its blocks, note final statuses."""
        dec = self._srv_dec
        if dec is None:
            return
        asm = self._srv_asm
        try:
            if ftype == _CONTINUATION:
                block = asm.continuation(sid, flags, payload)
            else:
                frag = strip(ftype, flags, payload) if ftype == _HEADERS else _promised_block(flags, payload)
                block = asm.headers(sid, flags, frag)
                self._srv_head = ftype == _HEADERS
            if block is None:
                return
            fields = dec.decode(block, sid)
        except H2Error as exc:
            self._status_off(str(exc))
            return
        if not self._srv_head:
            return
        code = 0
        for k, v in fields:
            if k == ":status":
                code = int(v) if v.isascii() and v.isdigit() else 0
            elif k == "grpc-status":      # a gRPC response: its calls keep the DATA rule
                self._plain.discard(sid)
        hold = self._holds.get(sid)
        if hold is not None:
            hold.last_status = code or None
        final = code if code >= 200 else None
        wait = self._leg_wait
        if wait is not None and wait[0] == sid:
            self._leg_wait = None
            self._write_leg(sid, wait[1], wait[2], final if final is not None else wait[3], False)
        elif final is not None and sid in self._sent:
            self._status[sid] = final

    def _status_off(self, why: str) -> None:
        """The server's header blocks cannot be followed: the DATA rule for the rest of the connection."""
        if self._srv_dec is not None:
            log.warning("cannot follow the server's header blocks (%s); upstream legs of this connection's "
                        "HTTP/2 calls count a response with DATA as served", why)
        self._srv_dec = None
        self._d_part = None
        self._srv_asm.reset()
        self._status.clear()
        wait, self._leg_wait = self._leg_wait, None
        if wait is not None:
            self._write_leg(wait[0], wait[1], wait[2], None, False)
