"""Call-level toxics for HTTP/2 and gRPC: delay or fail a share of calls on one shared connection.

Toxiproxy's toxics act on whole connections, and gRPC multiplexes every call onto one, so a
connection fault is all or nothing. The tap follows the HTTP/2 frames of an h2 connection from its
first byte (HPACK is stateful, so it must) and, per new call, asks the call toxics for a fate:

    client --frames--> tap.feed_up --+--> HEADERS always forwarded (the server's HPACK table must stay in step)
                                     +--> DATA of a delayed call held until `delay` after its HEADERS
                                     +--> failed call: RST_STREAM(CANCEL) to the server, its DATA dropped
                                          (and given back to the client as a connection WINDOW_UPDATE)
    client <--frames-- tap.feed_down <-- trailers-only HEADERS (grpc-status) injected at a frame boundary,
                                         encoded without touching the client's HPACK dynamic table

A request whose HEADERS carry END_STREAM (no body) cannot be delayed (nothing can be held without
breaking HPACK order); gRPC requests always have a body.

Upstream-leg timing (`SHADOWTEST_LEG_LOG=PATH` in the proxy's environment): for every call the tap
appends one line `SENT DONE DATA` to PATH: SENT when the request's last frame (END_STREAM) left the
tap towards the server, DONE when the server's last frame of the call (END_STREAM or RST_STREAM)
reached the proxy, both CLOCK_MONOTONIC seconds, DATA 1 when the response carried a DATA frame (a
served call; 0: trailers only, e.g. a refusal). That is the latency the server side of the proxy saw,
before any downstream toxic: network faults on the client's side do not reach it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from wire.h2 import (
    HEAD,
    PREFACE,
    BlockAssembler,
    ErrorCode,
    Flag,
    FrameType,
    H2Error,
    frame,
    rst_stream,
    split,
    strip,
    window_update,
)
from wire.headers import CachedDecoder
from wire.status import status_block

__all__ = ["CallRule", "H2Tap", "LEG_LOG_ENV"]

LEG_LOG_ENV = "SHADOWTEST_LEG_LOG"
_leg_files: dict[str, TextIO | None] = {}     # the leg log of this process, opened once


def _leg_log() -> TextIO | None:
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
_END_STREAM, _END_HEADERS = int(Flag.END_STREAM), int(Flag.END_HEADERS)
MAX_HEADER_BLOCK = 1 << 20   # a client block open longer than this turns the tap off (it is forwarded)


@dataclass
class CallRule:
    """One call toxic as this connection sees it (toxicity already drawn)."""

    kind: str  # "delay" | "error"
    attrs: dict[str, Any]

    def matches(self, path: str) -> bool:
        want = str(self.attrs.get("method") or "")
        return not want or path == want or path == "/" + want.lstrip("/") or path.endswith("/" + want)


@dataclass
class _Fate:
    delay_s: float = 0.0
    error: tuple[int, str] | None = None
    released: bool = False
    failed: bool = False
    held: list[bytes] = field(default_factory=list)
    held_flow: int = 0


class H2Tap:
    """Frame-aware filter between a connection's sockets and its two links (see module doc)."""

    def __init__(self, push_up: Callable[[bytes], None], push_down: Callable[[bytes], None],
                 rules: Callable[[], list[CallRule]], rng: random.Random) -> None:
        self._push_up, self._push_down, self._rules, self._rng = push_up, push_down, rules, rng
        self._up = bytearray()
        self._preface_left = len(PREFACE)
        self._decoder = CachedDecoder(max_table_size=1 << 20)
        self._block = BlockAssembler(MAX_HEADER_BLOCK)   # the client's open header block, if any
        self._max_stream = 0
        self._fates: dict[int, _Fate] = {}
        self._d_hdr = bytearray()
        self._d_left = 0
        self._d_in_block = False
        self._inject: list[bytes] = []
        self._deferred_up: list[bytes] = []  # timer-released frames waiting for a header block to end
        self.broken = False
        self._open_on_wire = False  # off while the client's header block was open: still find its end
        self.calls_seen = 0
        self.calls_delayed = 0
        self.calls_failed = 0
        self._legs = _leg_log()               # upstream-leg timing (module doc), when configured
        self._sent: dict[int, float] = {}     # stream -> when its request's END_STREAM went up
        self._answered: set[int] = set()      # streams whose response carried DATA
        self._early: set[int] = set()         # streams answered before their request ended

    # --- client -> server -------------------------------------------------------------------
    def feed_up(self, data: bytes) -> None:
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
        self._up = bytearray(buf[used:])
        if out:
            self._push_up(b"".join(out))

    def flush_up(self) -> None:
        """The client closed: pass on any partial frame as it is."""
        if self._up:
            self._push_up(bytes(self._up))
            self._up.clear()

    def _on_up_frame(self, ftype: int, flags: int, sid: int, payload: bytes, raw: bytes, out: list[bytes]) -> None:
        if ftype == _HEADERS or ftype == _CONTINUATION:
            out.append(raw)
            self._on_header_fragment(ftype, flags, sid, payload, out)
            if self._legs is not None and ftype == _HEADERS and flags & _END_STREAM and sid not in self._fates:
                self._sent[sid] = time.monotonic()
            return
        fate = self._fates.get(sid) if sid else None
        if fate is None:
            out.append(raw)
            if self._legs is not None and ftype == _DATA and flags & _END_STREAM:
                if sid in self._early:
                    self._early.discard(sid)
                else:
                    self._sent[sid] = time.monotonic()
            elif ftype == _RST:
                self._sent.pop(sid, None)
        elif ftype == _RST and not fate.failed:  # the client gave up on a delayed call: drop what we held
            fate.failed = True
            fate.held.clear()
            self._give_back_window(fate)
            out.append(raw)
        elif fate.failed or (ftype == _DATA and not fate.released):
            if ftype == _DATA:
                fate.held_flow += len(raw) - 9
                if not fate.failed:
                    fate.held.append(raw)
                else:
                    self._give_back_window(fate)
        else:
            out.append(raw)

    def _on_header_fragment(self, ftype: int, flags: int, sid: int, payload: bytes, out: list[bytes]) -> None:
        if self.broken:          # switched off: only the end of the block open on the wire matters
            if self._open_on_wire and ftype == _CONTINUATION and flags & _END_HEADERS:
                self._open_on_wire = False
                out.extend(self._deferred_up)
                self._deferred_up.clear()
            return
        asm = self._block
        try:
            if ftype == _HEADERS:
                block = asm.headers(sid, flags, strip(ftype, flags, payload))
                first_flags = flags
            else:
                first_flags = asm.flags
                block = asm.continuation(sid, flags, payload)
            if block is None:
                return
            if self._deferred_up:  # HEADERS + CONTINUATION must be contiguous: released frames go after
                out.extend(self._deferred_up)
                self._deferred_up.clear()
            headers = self._decoder.decode(block, sid)
        except H2Error as exc:   # never break the connection: stop tapping instead (all is forwarded)
            log.warning("cannot follow the client's header blocks (%s); call-level toxics off for this "
                        "connection", exc)
            self._off(ftype, flags, out)
            return
        if sid > self._max_stream and sid % 2 == 1:
            self._max_stream = sid
            self._new_call(sid, headers, bool(first_flags & _END_STREAM), out)

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

    def _new_call(self, sid: int, headers: list[tuple[str, str]], ended: bool, out: list[bytes]) -> None:
        self.calls_seen += 1
        path = next((v for k, v in headers if k == ":path"), "")
        fate = _Fate()
        for rule in self._rules():
            if not rule.matches(path) or self._rng.random() >= float(rule.attrs.get("share", 1.0)):
                continue
            if rule.kind == "delay":
                jitter = int(rule.attrs.get("jitter", 0))
                extra = self._rng.randrange(2 * jitter) - jitter if jitter > 0 else 0
                fate.delay_s += max(0, int(rule.attrs.get("delay", 0)) + extra) / 1000.0
            elif fate.error is None:
                fate.error = (int(rule.attrs.get("status", 14)), str(rule.attrs.get("message", "")))
        if fate.delay_s <= 0 and fate.error is None:
            return
        self._fates[sid] = fate
        if fate.error is not None:
            self.calls_failed += 1
        if fate.delay_s > 0 and not ended:
            self.calls_delayed += 1
            asyncio.get_running_loop().call_later(fate.delay_s, self._release, sid)
        elif fate.error is not None:
            self._fail(sid, fate, out)
        else:
            del self._fates[sid]

    def _release(self, sid: int) -> None:
        fate = self._fates.get(sid)
        if fate is None:
            return
        if fate.error is not None:
            return self._fail(sid, fate, None)
        fate.released = True
        if fate.held:
            if self._legs is not None and any(r[3] == _DATA and r[4] & _END_STREAM for r in fate.held):
                if sid in self._early:
                    self._early.discard(sid)
                else:
                    self._sent[sid] = time.monotonic()
            self._push_up_frames(b"".join(fate.held))
            fate.held.clear()
        del self._fates[sid]

    def _push_up_frames(self, raw: bytes) -> None:
        """Whole frames from a timer: never inside the client's open header block."""
        if self._block.sid or self._open_on_wire:
            self._deferred_up.append(raw)
        else:
            self._push_up(raw)

    def _fail(self, sid: int, fate: _Fate, out: list[bytes] | None) -> None:
        fate.failed = True
        fate.held.clear()
        rst = rst_stream(sid, ErrorCode.CANCEL)
        if out is not None:
            out.append(rst)
        else:
            self._push_up_frames(rst)
        self._give_back_window(fate)
        status, message = fate.error or (14, "")
        # Static-table encoding only: injecting it never touches the client's HPACK dynamic table.
        self.inject_down(frame(FrameType.HEADERS, _END_STREAM | _END_HEADERS, sid,
                               status_block(status, message, trailers_only=True)))

    def _give_back_window(self, fate: _Fate) -> None:
        # The server never sees these bytes, so it never returns their flow-control window: we do.
        if fate.held_flow > 0:
            self.inject_down(window_update(0, fate.held_flow))
            fate.held_flow = 0

    # --- server -> client -------------------------------------------------------------------
    def inject_down(self, raw: bytes) -> None:
        """Queue a frame for the client; it goes out at the next frame boundary of the server's stream."""
        self._inject.append(raw)
        if self._at_boundary():
            self._flush_inject()

    def _at_boundary(self) -> bool:
        return not self._d_left and not self._d_hdr and not self._d_in_block

    def _flush_inject(self) -> None:
        if self._inject:
            self._push_down(b"".join(self._inject))
            self._inject.clear()

    def feed_down(self, data: bytes) -> None:
        """Forward the server's bytes at once, tracking frame boundaries for injections."""
        start, i, n = 0, 0, len(data)
        while i < n:
            if self._d_left:
                take = min(self._d_left, n - i)
                i += take
                self._d_left -= take
            else:
                need = 9 - len(self._d_hdr)
                self._d_hdr += data[i:i + need]
                i += min(need, n - i)
                if len(self._d_hdr) == 9:
                    self._on_down_header(bytes(self._d_hdr))
                    self._d_hdr.clear()
            if self._inject and self._at_boundary():
                self._push_down(data[start:i])
                start = i
                self._flush_inject()
        if start < n:
            self._push_down(data[start:] if start else data)

    def sync_down(self, data: bytes) -> None:
        """Account for server bytes forwarded before the tap existed."""
        saved, self._push_down = self._push_down, lambda _b: None
        try:
            self.feed_down(data)
        finally:
            self._push_down = saved

    def _on_down_header(self, hdr: bytes) -> None:
        hi, lo, ftype, flags, sid = HEAD.unpack(hdr)
        self._d_left = hi << 16 | lo
        sid &= 0x7FFFFFFF
        if self._legs is not None:
            if sid in self._sent:
                self._leg(ftype, flags, sid)
            elif sid % 2 == 1 and ((ftype in (_DATA, _HEADERS) and flags & _END_STREAM) or ftype == _RST):
                # Answered before the request ended (a refusal at its headers): never timed.
                if len(self._early) > 10_000:
                    self._early.clear()
                self._early.add(sid)
        if ftype == _HEADERS or ftype == _PUSH_PROMISE or ftype == _CONTINUATION:  # header blocks
            self._d_in_block = not flags & _END_HEADERS

    def _leg(self, ftype: int, flags: int, sid: int) -> None:
        """The server's frame header for a timed call: note a DATA frame, log the call at its end."""
        if ftype == _DATA:
            self._answered.add(sid)
        if (ftype in (_DATA, _HEADERS) and flags & _END_STREAM) or ftype == _RST:
            sent = self._sent.pop(sid)
            data = sid in self._answered
            self._answered.discard(sid)
            try:
                if self._legs is not None:
                    self._legs.write(f"{sent:.6f} {time.monotonic():.6f} {int(data)}\n")
            except OSError:
                self._legs = None
