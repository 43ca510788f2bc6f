"""Call-level toxics and upstream-leg timing for HTTP/1.x connections.

Connection-wide toxics hit every request on a keep-alive connection alike. The tap follows the
requests and responses of one HTTP/1.x connection and asks the HTTP call toxics (`http_delay`,
`http_error`) for each request's fate as its head arrives:

    client --bytes--> feed_up --> request framing (Content-Length, chunked, none) --> per request:
        passed    forwarded as it is read
        delayed   held until `delay` after its head arrived; every request behind it waits too
                  (HTTP/1 answers in request order, so a later request may not overtake it)
        failed    its bytes never go upstream; the proxy answers it with `status` (and `body`)
                  in its turn among the server's responses
    client <--bytes-- feed_down <-- response framing (HEAD, 1xx, 204/304, Content-Length, chunked,
                                    until close) finds each response's end: injected answers go in
                                    between responses, never inside one

A request that asks to switch protocols (Upgrade, CONNECT) or that cannot be framed (a malformed
head, a head over 64 KiB, conflicting lengths) turns the tap off for the rest of the connection:
from then on every byte is passed through untouched, as by a plain proxy.

Upstream-leg timing (`SHADOWTEST_LEG_LOG`, the same `SENT DONE SERVED` lines as the HTTP/2 tap):
SENT when a request's last byte left the tap towards the server, DONE when its response's last
byte reached the proxy, SERVED 1 for a status below 400. A response that ends before its request
was sent whole (an early refusal) is not timed. Pipelined requests are timed each from its own send.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from typing import TextIO

from faults.proxy.calls import Call, CallRule, Fate
from faults.proxy.h2tap import FAULT_HEADER, DelayCredit, draw_fate, leg_line, leg_log

__all__ = ["H1Tap", "looks_like_http1", "MAX_HEAD", "MAX_HELD"]

log = logging.getLogger(__name__)

MAX_HEAD = 64 << 10          # a request or response head longer than this turns the tap off
MAX_LINE = 4096              # a chunk-size or trailer line
MAX_HELD = 8 << 20           # bytes held for delayed requests; beyond this the delay is cut short
_HTTP = frozenset({"http"})
_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"TRACE ", b"CONNECT ")

# Body framing of one message (_UNSAID: no length given; a request has no body, a response lasts
# until the connection closes)
_NONE, _FIXED, _CHUNKED, _CLOSE, _INTERIM, _OFF, _UNSAID = range(7)
# Framer states
_S_HEAD, _S_FIXED, _S_SIZE, _S_DATA, _S_DATA_END, _S_TRAILER, _S_CLOSE, _S_OFF = range(8)


def looks_like_http1(data: bytes) -> bool:
    """Whether a connection's first bytes start an HTTP/1.x request (a known method and a space)."""
    head = data.lstrip(b"\r\n")[:8]
    return any(m.startswith(head) or head.startswith(m) for m in _METHODS) if head else False


class _Framer:
    """Where each HTTP/1 message of one direction begins and ends, fed bytes as they come.

    `feed(data)` returns the bytes it can account for and their events; a partial head or line
    is kept until the rest arrives (bounded). Events: (pos, "head", head_bytes, framing),
    (pos, "end", b"", 0) and (pos, "off", b"", 0), pos the offset in the returned bytes just after
    that head or message (or where framing stopped). `on_head` (head -> (framing, length)) and
    `on_end` are called in stream order as the framer meets them."""

    def __init__(self, on_head: Callable[[bytes], tuple[int, int]],
                 on_end: Callable[[], None] = lambda: None) -> None:
        self.on_head, self.on_end = on_head, on_end
        self.state = _S_HEAD
        self.left = 0
        self.carry = b""

    def _give_up(self, buf: bytes, events: list[tuple[int, str, bytes, int]],
                 i: int) -> tuple[bytes, list[tuple[int, str, bytes, int]]]:
        """Framing stops at `i` (unframeable bytes, or a protocol switch): everything from there on is
        the caller's to pass through as it is."""
        self.state = _S_OFF
        events.append((i, "off", b"", 0))
        return buf, events

    def _end(self, events: list[tuple[int, str, bytes, int]], i: int) -> None:
        events.append((i, "end", b"", 0))
        self.on_end()

    def feed(self, data: bytes) -> tuple[bytes, list[tuple[int, str, bytes, int]]]:
        buf = self.carry + data if self.carry else data
        self.carry = b""
        events: list[tuple[int, str, bytes, int]] = []
        i, n = 0, len(buf)
        while i < n:
            st = self.state
            if st == _S_OFF or st == _S_CLOSE:
                i = n
                break
            if st == _S_FIXED or st == _S_DATA:
                take = min(self.left, n - i)
                i += take
                self.left -= take
                if not self.left:
                    if st == _S_FIXED:
                        self.state = _S_HEAD
                        self._end(events, i)
                    else:
                        self.state = _S_DATA_END
                continue
            if st == _S_HEAD:
                while i < n and buf[i] in (10, 13):   # empty lines between messages (RFC 9112 2.2)
                    i += 1
                if i == n:
                    break
                end = _head_end(buf, i)
                if end < 0:
                    if n - i > MAX_HEAD:
                        return self._give_up(buf, events, i)
                    self.carry = buf[i:]
                    return buf[:i], events
                head = buf[i:end]
                i = end
                framing, length = self.on_head(head)
                events.append((i, "head", head, framing))
                if framing == _OFF:
                    return self._give_up(buf, events, i)
                if framing == _INTERIM:
                    pass
                elif framing == _NONE or (framing == _FIXED and length == 0):
                    self._end(events, i)
                elif framing == _FIXED:
                    self.state, self.left = _S_FIXED, length
                elif framing == _CHUNKED:
                    self.state = _S_SIZE
                else:
                    self.state = _S_CLOSE
                continue
            # a line: chunk size, the CRLF after a chunk's data, or a trailer line
            nl = buf.find(b"\n", i, i + MAX_LINE + 2)
            if nl < 0:
                if n - i > MAX_LINE:
                    return self._give_up(buf, events, i)
                self.carry = buf[i:]
                return buf[:i], events
            line = buf[i:nl].rstrip(b"\r")
            i = nl + 1
            if st == _S_SIZE:
                size = _chunk_size(line)
                if size is None:
                    return self._give_up(buf, events, i)
                if size == 0:
                    self.state = _S_TRAILER
                else:
                    self.state, self.left = _S_DATA, size
            elif st == _S_DATA_END:
                if line:
                    return self._give_up(buf, events, i)
                self.state = _S_SIZE
            elif not line:        # the empty line that ends the trailer section
                self.state = _S_HEAD
                self._end(events, i)
        return buf, events

    def eof(self) -> bool:
        """The stream ended: True when that ended a message framed by the connection's close."""
        ended = self.state == _S_CLOSE
        self.state = _S_OFF
        return ended


def _head_end(buf: bytes, start: int) -> int:
    """Offset just after the blank line that ends a head starting at `start`, or -1."""
    a = buf.find(b"\r\n\r\n", start)
    b = buf.find(b"\n\n", start, a + 2 if a >= 0 else len(buf))
    if b >= 0 and (a < 0 or b < a):
        return b + 2
    return a + 4 if a >= 0 else -1


def _chunk_size(line: bytes) -> int | None:
    text = line.split(b";", 1)[0].strip()
    if not text or len(text) > 16:
        return None
    try:
        return int(text, 16)
    except ValueError:
        return None


# A head we will not frame: whitespace before a field's colon, a folded (obsolete) line, a line without a
# colon. Servers refuse these or read them their own way; a proxy that guessed would lose its place.
_MALFORMED = re.compile(rb"\n(?:[^:\r\n]*[ \t]:|[ \t]|[^:\r\n]+\r?\n)")


def _scan(head: bytes) -> tuple[list[bytes], bytes] | None:
    """The start line's parts and the whole head in lower case (for `_values`), or None when malformed.
    Cheaper than `_fields`: the framing needs two or three headers, not all of them decoded."""
    nl = head.find(b"\n")
    start = head[:nl].rstrip(b"\r").split(b" ", 2)
    if len(start) < 2:
        return None
    low = head.lower()
    if _MALFORMED.search(low, nl):
        return None
    return start, low


def _values(low: bytes, key: bytes) -> list[bytes]:
    """The values of header `key` (b"\\nname:", lower case) in a lower-cased head."""
    out = []
    i = low.find(key)
    while i >= 0:
        start = i + len(key)
        end = low.find(b"\n", start)
        out.append(low[start:end].strip())
        i = low.find(key, start)
    return out


_TE, _CL, _UPGRADE = b"\ntransfer-encoding:", b"\ncontent-length:", b"\nupgrade:"
_CONNECTION, _EXPECT = b"\nconnection:", b"\nexpect:"


def _body_framing(low: bytes) -> tuple[int, int] | None:
    """(framing, length) from Transfer-Encoding / Content-Length; None when they are ambiguous."""
    if _TE in low:
        codings = [c.strip() for c in b",".join(_values(low, _TE)).split(b",") if c.strip()]
        return (_CHUNKED, 0) if codings and codings[-1] == b"chunked" else None
    if _CL not in low:
        return _UNSAID, 0
    lengths = set(_values(low, _CL))
    if len(lengths) != 1:
        return None
    value = lengths.pop()
    if not value.isdigit() or len(value) > 18:
        return None
    return _FIXED, int(value)


def _fields(head: bytes) -> tuple[list[bytes], list[tuple[str, str]]] | None:
    """The start line's parts and the header fields (names lower case), or None when malformed."""
    lines = head.split(b"\n")
    start = lines[0].rstrip(b"\r").split(b" ", 2)
    if len(start) < 2:
        return None
    fields: list[tuple[str, str]] = []
    for raw in lines[1:]:
        raw = raw.rstrip(b"\r")
        if not raw:
            continue
        name, sep, value = raw.partition(b":")
        if not sep or not name or name != name.strip():
            return None
        fields.append((name.decode("latin-1").lower(), value.strip().decode("latin-1")))
    return start, fields


class _Slot:
    """One response the client is owed, in request order: the server's, or one the proxy made up."""

    __slots__ = ("head_only", "sent", "inject", "status", "close_after")

    def __init__(self, head_only: bool) -> None:
        self.head_only = head_only
        self.sent: float | None = None      # when the request's last byte went upstream
        self.inject: bytes | None = None    # the proxy's own answer (failed requests)
        self.status = 0
        self.close_after = False


class _Req:
    """A request on its way up (or bytes passed through once the tap is off: no slot)."""

    __slots__ = ("chunks", "complete", "until", "drop", "slot", "held", "credit", "cut")

    def __init__(self, slot: _Slot | None, until: float = 0.0, drop: bool = False) -> None:
        self.chunks: list[bytes] = []
        self.complete = slot is None
        self.until = until
        self.drop = drop
        self.slot = slot
        self.held = 0
        self.credit: DelayCredit | None = None   # the delay toxics to credit when it goes up
        self.cut = False


class H1Tap:
    """HTTP/1.x filter between a connection's sockets and its two links (see module doc)."""

    def __init__(self, push_up: Callable[[bytes], None], push_down: Callable[[bytes], None],
                 rules: Callable[[], list[CallRule]], rng: random.Random,
                 end_down: Callable[[], None] | None = None) -> None:
        self._push_up, self._push_down, self._rules, self._rng = push_up, push_down, rules, rng
        self._end_down = end_down
        self._loop = asyncio.get_running_loop()
        self._reqs: deque[_Req] = deque()     # requests not yet wholly forwarded (or dropped)
        self._slots: deque[_Slot] = deque()   # responses owed to the client, in order
        self._cur: _Req | None = None          # the request being read
        self._parsed: deque[tuple[list[bytes], bytes] | None] = deque()   # request heads framed, in order
        self._up = _Framer(self._on_request_head)
        self._down = _Framer(self._on_response_head, self._on_response_end)
        self._ended = 0                        # responses the down framer ended, not yet handled
        self._held = 0
        self.off = False          # client side passed through (module doc)
        self._down_off = False    # server side passed through
        self.calls_seen = 0
        self.calls_delayed = 0
        self.calls_failed = 0
        self.calls_cut = 0        # delays cut short: more than MAX_HELD bytes held
        self._legs: TextIO | None = leg_log()
        self._closing = False
        self._eof_up: Callable[[], None] | None = None   # the client's end, waiting for held requests

    # --- client -> server -------------------------------------------------------------------
    def feed_up(self, data: bytes) -> None:
        if self._closing:                  # after an injected "connection: close": nothing more goes up
            return
        if self.off:
            return self._raw(data)
        buf, events = self._up.feed(data)
        pos = 0
        for at, what, head, framing in events:
            if what == "head":
                self._start_request(head, framing != _OFF)
                self._emit(buf[pos:at])      # any blank lines before it, and the head
                pos = at
            elif what == "end":
                self._emit(buf[pos:at])
                pos = at
                if self._cur is not None:
                    self._cur.complete = True
                    self._cur = None
            else:
                self._emit(buf[pos:at])
                rest = buf[at:] + self._up.carry
                self._up.carry = b""
                self._switch_off()
                self._raw(rest)
                return
        self._emit(buf[pos:])
        self._pump()

    def flush_up(self) -> None:
        """The client closed: anything not yet framed (a partial head) goes on as it is."""
        rest, self._up.carry = self._up.carry, b""
        if rest and not self._closing:
            self._raw(rest)

    def end_up(self, push_eof: Callable[[], None]) -> None:
        """The client closed its side: pass the end on once every held request has gone up."""
        self.flush_up()
        if self._cur is not None:           # it will never be finished: what came of it goes as it is
            self._cur.complete = True
            self._cur = None
        self._eof_up = push_eof
        self._pump()

    def _raw(self, data: bytes) -> None:
        """Bytes passed through as they are, behind whatever is still queued."""
        if not data:
            return
        if not self._reqs:
            return self._push_up(data)
        tail = self._reqs[-1]
        if tail.slot is not None:
            tail = _Req(None)
            self._reqs.append(tail)
        tail.chunks.append(data)
        self._pump()

    def _start_request(self, head: bytes, framed: bool) -> None:
        self.calls_seen += 1
        parsed = self._parsed.popleft()      # every head went through _on_request_head first
        method, target, version, low = b"", b"", b"HTTP/1.1", b""
        if parsed is not None:
            start, low = parsed
            method, target = start[0], start[1]
            version = start[2] if len(start) > 2 else b"HTTP/1.0"
        slot = _Slot(head_only=method == b"HEAD")
        fate, credit = Fate(), None
        rules = self._rules() if framed else []
        if rules and parsed is not None:
            # every field decoded only for a rule that looks at one
            fields = (_fields(head) or ([], []))[1] if any(r.attrs.get("header") for r in rules) else []
            call = Call(method.decode("latin-1"), _path(target.decode("latin-1")), fields)
            fate, credit = draw_fate(rules, call, self._rng, _HTTP, self._loop.time())
        req = _Req(slot)
        if fate.error is not None:
            req.drop = True
            self.calls_failed += 1
            # A client waiting for 100-continue may never send the body we would have to skip.
            expects = b"100-continue" in _values(low, _EXPECT)
            slot.close_after = expects or _wants_close(version, low)
            slot.inject = _answer(version, fate.error[1], fate.error[2], slot.head_only, slot.close_after)
        elif fate.delay_s > 0:
            self.calls_delayed += 1
            req.credit = credit
            req.until = self._loop.time() + fate.delay_s
            self._loop.call_later(fate.delay_s, self._pump)
        self._cur = req
        self._reqs.append(req)
        self._slots.append(slot)
        if req.drop:
            self._answer_ready()

    def _on_request_head(self, head: bytes) -> tuple[int, int]:
        parsed = _scan(head)
        self._parsed.append(parsed)          # read again by _start_request, in the same order
        if parsed is None or not parsed[0][0].isalpha() or not parsed[0][-1].startswith(b"HTTP/1."):
            return _OFF, 0
        (method, *_), low = parsed
        if method == b"CONNECT" or _UPGRADE in low:
            return _OFF, 0   # the connection may stop being HTTP/1 after this request
        framing = _body_framing(low)
        if framing is None:
            return _OFF, 0
        return (_NONE, 0) if framing[0] == _UNSAID else framing

    def _emit(self, data: bytes) -> None:
        if not data:
            return
        req = self._cur
        if req is None:
            return self._raw(data)
        if req.drop:
            return
        req.chunks.append(data)
        if req.until or req is not self._reqs[0]:
            req.held += len(data)
            self._held += len(data)
            if self._held > MAX_HELD:
                self._cut_delays()

    def _switch_off(self) -> None:
        """Stop framing requests: the current one ends here, later bytes pass through as they are."""
        if not self.off:
            self.off = True
            log.info("HTTP/1 call toxics off for this connection (upgrade, CONNECT or unframed bytes)")
        if self._cur is not None:
            self._cur.complete = True
            self._cur = None
        self._pump()
        self._down_off_when_owed_nothing()

    def _down_off_when_owed_nothing(self) -> None:
        """With the client side passed through, the server side is too once it owes no response."""
        if self.off and not any(s.inject is None for s in self._slots):
            self._down_off = True

    def _cut_delays(self) -> None:
        for r in self._reqs:
            if r.until:
                r.until = 0.0
                r.cut = True
                self.calls_cut += 1
        log.warning("more than %d bytes held for delayed HTTP requests: their delay is cut short", MAX_HELD)
        self._pump()

    def _pump(self) -> None:
        """Forward, in order, every request whose time has come; stop at the first still held."""
        now = self._loop.time()
        reqs = self._reqs
        out: list[bytes] = []
        while reqs:
            r = reqs[0]
            if r.drop:
                r.chunks.clear()
                if not r.complete:
                    break
                reqs.popleft()
                continue
            if r.until > now:
                break
            r.until = 0.0
            if r.credit is not None:
                r.credit.release(now, r.cut)
                r.credit = None
            if r.chunks:
                out.extend(r.chunks)
                r.chunks.clear()
                self._held -= r.held
                r.held = 0
            if not r.complete:
                break
            reqs.popleft()
            if self._legs is not None and r.slot is not None:
                r.slot.sent = time.monotonic()
        if out:
            self._push_up(b"".join(out) if len(out) > 1 else out[0])
        if not reqs and self._eof_up is not None:
            eof, self._eof_up = self._eof_up, None
            eof()

    # --- server -> client -------------------------------------------------------------------
    def feed_down(self, data: bytes) -> None:
        if self._down_off:
            return self._push_down(data)
        buf, events = self._down.feed(data)
        pos = 0
        for at, what, _head, _framing in events:
            if what == "end":
                self._ended -= 1
                self._time_leg()                # timed as its last byte arrived, before it goes on
                self._push_down(buf[pos:at])
                pos = at
                self._response_done()
                if self._down_off:          # the client side went off and nothing more is owed
                    break
            elif what == "off":
                self._down_stops()
                break
        rest = buf[pos:] + (self._down.carry if self._down_off else b"")
        if self._down_off:
            self._down.carry = b""
        if rest:
            self._push_down(rest)

    def _down_stops(self) -> None:
        """The server's bytes cannot be framed any more (101, or malformed): pass both sides through.
        Answers the proxy still owed cannot be placed between responses it cannot see: they are dropped."""
        self._down_off = True
        lost = sum(1 for s in self._slots if s.inject is not None)
        if lost:
            log.warning("%d injected HTTP answers dropped: the server's responses cannot be framed", lost)
        self._slots.clear()
        if not self.off:
            self.off = True
            self._switch_off()

    def sync_down(self, data: bytes) -> None:
        """Server bytes forwarded before the tap existed: a server speaks after the request, so none."""

    def eof_down(self) -> None:
        """The server closed its side: a response framed by the close is complete."""
        if self._down.eof():
            self._ended -= 1 if self._ended > 0 else 0
            self._time_leg()
            self._response_done()

    def _server_slot(self) -> _Slot:
        """The slot the server's next response belongs to: past the responses already ended in this
        feed, skipping answers the proxy makes itself."""
        skip = self._ended
        for slot in self._slots:
            if slot.inject is None:
                if not skip:
                    return slot
                skip -= 1
        slot = _Slot(head_only=False)            # unasked (a 408 before closing): framed all the same
        self._slots.append(slot)
        return slot

    def _on_response_head(self, head: bytes) -> tuple[int, int]:
        slot = self._server_slot()
        parsed = _scan(head)
        if parsed is None or not parsed[0][0].startswith(b"HTTP/1.") or len(parsed[0]) < 2:
            return _OFF, 0
        (_, code, *_), low = parsed
        if not code.isdigit() or len(code) != 3:
            return _OFF, 0
        status = int(code)
        if status == 101:
            return _OFF, 0
        if 100 <= status < 200:
            return _INTERIM, 0
        slot.status = status
        if slot.head_only or status in (204, 304):
            return _NONE, 0
        framing = _body_framing(low)
        if framing is None:
            return _OFF, 0
        return (_CLOSE, 0) if framing[0] == _UNSAID else framing

    def _on_response_end(self) -> None:
        self._ended += 1

    def _time_leg(self) -> None:
        """The server's response at the head of the line ended: write its leg."""
        slot = self._slots[0] if self._slots else None
        if self._legs is not None and slot is not None and slot.sent is not None:
            try:
                self._legs.write(leg_line(slot.sent, time.monotonic(), slot.status < 400))
            except OSError:
                self._legs = None

    def _response_done(self) -> None:
        """The server's response at the head of the line went on: send the answers that follow it."""
        if not self._slots:
            return
        self._slots.popleft()
        self._answer_ready()
        self._down_off_when_owed_nothing()

    def _answer_ready(self) -> None:
        """Send the proxy's own answers that are next in line (the server owes nothing before them)."""
        while self._slots and self._slots[0].inject is not None:
            slot = self._slots.popleft()
            self._push_down(slot.inject or b"")
            if slot.close_after:
                self._closing = True
                self._slots.clear()
                self._reqs.clear()
                self._pump()                 # nothing more goes up; a client end waiting may go now
                if self._end_down is not None:
                    self._end_down()
                return


def _path(target: str) -> str:
    """The path and query of a request target (absolute-form `http://host/p` -> `/p`)."""
    if target.startswith(("http://", "https://")):
        rest = target.split("://", 1)[1]
        slash = rest.find("/")
        return rest[slash:] if slash >= 0 else "/"
    return target


def _wants_close(version: bytes, low: bytes) -> bool:
    tokens = {t.strip() for v in _values(low, _CONNECTION) for t in v.split(b",")}
    if version == b"HTTP/1.0":
        return b"keep-alive" not in tokens
    return b"close" in tokens


def _answer(version: bytes, status: int, body: str, head_only: bool, close: bool) -> bytes:
    """The proxy's own response to a failed request."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Injected"
    data = body.encode()
    v = "HTTP/1.0" if version == b"HTTP/1.0" else "HTTP/1.1"
    head = (f"{v} {status} {reason}\r\ncontent-type: text/plain\r\ncontent-length: {len(data)}\r\n"
            f"{FAULT_HEADER}: http_error\r\n" + ("connection: close\r\n" if close else
                                                 "connection: keep-alive\r\n" if v == "HTTP/1.0" else "")
            + "\r\n")
    return head.encode("latin-1") + (b"" if head_only else data)
