"""Mask credential fields in one direction of an HTTP/1 byte stream, however the reads cut it.

    head   the request line's query string: its secret values (capture/fields.py PairScanner) as the
           bytes come; the head itself is collected (at most HEAD_CAP) until its blank line, for
           Content-Type, Content-Encoding, Content-Length, Transfer-Encoding and the status
    body   Content-Length, chunked (sizes, CRLFs and trailers stepped over) or, for a response
           without either, to the end of the connection: a form or JSON body (or one without a
           content type that starts with '{' or '[') through its scanner, any other body skipped
    lost   a stream joined (or resumed after a gap) mid-message, a head over HEAD_CAP, a chunk-size line
           that is not one, a protocol switch (101): the raw-TCP patterns
           (capture/decode/streammask.py PatternMasker) until a later read starts a message again

Header values are LineMasker's (streammask.py); this masker leaves them alone, and says where the
last chunk it returned holds an opaque body (`opaque_spans`: compressed, or a binary media type such as
a file download), which has no header lines for LineMasker to read. Every mask is in place
and keeps lengths, so the masked stream frames exactly as the original. A response to HEAD says
Content-Length yet sends no body: a response "body" that starts with "HTTP/1." is taken for the next
response instead (the directions are not paired: their reads need not arrive in order).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

from capture.fields import (
    FORM,
    BodyScanner,
    FieldPolicy,
    PairScanner,
    Span,
    body_kind,
    mask_spans,
    may_hold_names,
    opaque_body,
    scanner,
)

if TYPE_CHECKING:
    from capture.decode.streammask import PatternMasker

HEAD_CAP = 64 * 1024         # a longer head is not one we can frame: the direction goes "lost"
_SIZE_LINE_CAP = 1024
_PRE_BYTES = 17              # enough for "[A-Z]{1,16} " or "HTTP/1.": whether a joined stream starts a message
_MESSAGE_START = re.compile(rb"^(?:[A-Z]{1,16} |HTTP/1\.)")
# A response "body" that starts so is the next response: its request was HEAD (maybe not seen yet: the
# two directions' reads need not come in order), or the body was never sent.
_RESPONSE = b"HTTP/1."
_TARGET_STOP = re.compile(rb"[? \r\n]")
_QUERY_STOP = re.compile(rb"[ #\r\n]")
_HEAD_END = b"\r\n\r\n"
_BLANK = b"\r\n"
# The headers that say what body follows, in one pass over a head (a header line starts after "\n").
_FRAMING = re.compile(rb"\n(c(?:ontent-(?:type|encoding|length))|transfer-encoding)[ \t]*:[ \t]*([^\r\n]*)", re.I)

# modes
_HEAD, _BODY, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _TO_CLOSE, _LOST = range(8)
# where the request line is: the method, the path, the query, after the target
_METHOD, _PATH, _QUERY, _LINE_DONE = range(4)


class H1FieldMasker:
    """One direction: chunks in, (ts_ns, masked chunk) out; held only while a joined stream's first
    bytes are too few to tell whether they start a message, or by the raw-TCP patterns when lost."""

    def __init__(self, policy: FieldPolicy, request: bool, joined: bool) -> None:
        self.policy = policy
        self.request = request
        self.mode = _HEAD
        self.head = bytearray()
        self.line = _METHOD
        self.query: PairScanner | None = None
        self.body: BodyScanner | None = None
        self.left = 0                     # body or chunk bytes still to come
        self.size_line = bytearray()
        self.trailer_line = 0             # bytes of the current trailer line (0: at its start)
        self.probe: bytearray | None = None     # a response body's first bytes while they may be _RESPONSE
        self.pattern: PatternMasker | None = None
        self.pre: list[tuple[int, bytes]] | None = [] if joined else None
        self.opaque = False               # the body being read is opaque (see the module docstring)
        self.opaque_spans: list[Span] = []    # where the last chunk feed() returned holds such a body

    # ---- chunks in, chunks out -------------------------------------------------------------------
    def feed(self, ts_ns: int, data: bytes) -> list[tuple[int, bytes]]:
        if self.plain_read(data):
            return [(ts_ns, data)]
        return self.feed_scanned(ts_ns, data)

    def feed_scanned(self, ts_ns: int, data: bytes) -> list[tuple[int, bytes]]:
        """feed for a read that plain_read has just turned down (the state machine's steps)."""
        self.opaque_spans = []
        if self.pre is not None:
            return self._joined(ts_ns, data)
        out: list[tuple[int, bytes]] = []
        if self.mode == _LOST:
            if not _MESSAGE_START.match(data):
                assert self.pattern is not None
                return self.pattern.feed(ts_ns, data)
            out, self.pattern = self.pattern.flush() if self.pattern else [], None   # a message starts: resync
            self._restart()
        spans: list[Span] = []
        opaque: list[Span] = []
        self._scan(data, spans, opaque)
        chunk = mask_spans(data, spans) if spans else data
        if self.mode == _LOST:            # went lost inside this chunk: patterns from here on
            self.pattern = _pattern_masker()
            return out + self.pattern.feed(ts_ns, chunk)
        self.opaque_spans = opaque
        return out + [(ts_ns, chunk)]

    def plain_read(self, data: bytes) -> bool:
        """True when `data` passes unchanged and leaves this masker as it was (feed's fast path, for
        callers that want to skip the chunk list): the usual read of one whole message."""
        if self.pre is None and self.mode == _HEAD and not self.head and self._whole_and_plain(data):
            self.opaque_spans = []
            return True
        return False

    def _whole_and_plain(self, data: bytes) -> bool:
        """The usual read: exactly one whole message with nothing to mask (no query string; a body no
        scanner reads, or one without a trace of a credential name, or none), after which a head is
        expected again, as before it. Saves the state machine's steps for most traffic; anything else
        takes them."""
        stop = data.find(_HEAD_END)
        if stop <= 0 or data[0] in _BLANK:
            return False
        stop += len(_HEAD_END)
        if self.request and self.policy.names and data.find(b"?", 0, data.find(b"\n", 0, stop)) >= 0:
            return False
        plan = _plan(data, self.request, stop)
        if plan.lose:
            return False
        if plan.mode == _HEAD:
            return stop == len(data)
        if plan.mode != _BODY or stop + plan.length != len(data) or \
                (not self.request and data.startswith(_RESPONSE, stop)):
            return False
        kind = None if plan.kind == FORM and not self.policy.names else plan.kind   # as _head_done reads it
        if kind is None:
            return True
        return not self.policy.paths and not may_hold_names(data[stop:], kind)    # json-field rules: always

    def flush(self) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        if self.pre:
            pre, self.pre = self.pre, None
            self._lose()                  # too few bytes ever came to tell: patterns
            for ts, d in pre:
                out += self.feed(ts, d)
        elif self.pre is not None:
            self.pre = None
        if self.pattern is not None:
            out += self.pattern.flush()
        return out

    def _joined(self, ts_ns: int, data: bytes) -> list[tuple[int, bytes]]:
        """A joined stream: its first bytes, held until there are enough to see whether they start a
        message (then they are read from there) or not (then the raw-TCP patterns apply)."""
        assert self.pre is not None
        self.pre.append((ts_ns, data))
        first = b"".join(d for _, d in self.pre)
        if len(first) < _PRE_BYTES and b"\n" not in first:
            return []
        pre, self.pre = self.pre, None
        if not _MESSAGE_START.match(first):
            self._lose()
        out: list[tuple[int, bytes]] = []
        for ts, d in pre:
            out += self.feed(ts, d) if self.mode != _LOST else self._lost_feed(ts, d)
        return out

    def _lost_feed(self, ts_ns: int, data: bytes) -> list[tuple[int, bytes]]:
        assert self.pattern is not None
        return self.pattern.feed(ts_ns, data)

    def _lose(self) -> None:
        self.mode = _LOST
        self.pattern = self.pattern or _pattern_masker()
        self.head.clear()
        self.body = self.query = self.probe = None

    def _restart(self) -> None:
        self.mode, self.line, self.body, self.query, self.probe = _HEAD, _METHOD, None, None, None
        self.opaque = False
        self.head.clear()

    # ---- the state machine -----------------------------------------------------------------------
    def _scan(self, data: bytes, spans: list[Span], opaque: list[Span] | None = None) -> None:
        pos, end = 0, len(data)
        while pos < end and self.mode != _LOST:
            if self.probe is not None:
                pos = self._probe(data, pos, end)
            elif self.mode == _HEAD:
                pos = self._head(data, pos, end, spans)
            elif self.mode in (_BODY, _CHUNK_DATA):
                n = min(self.left, end - pos)
                if self.body is not None:
                    self.body.feed(data, pos, pos + n, spans)
                elif self.opaque and opaque is not None and n:
                    opaque.append((pos, pos + n))
                pos += n
                self.left -= n
                if not self.left:
                    self.mode = _CHUNK_END if self.mode == _CHUNK_DATA else _HEAD
                    if self.mode == _HEAD:
                        self._restart()
            elif self.mode == _TO_CLOSE:
                if self.body is not None:
                    self.body.feed(data, pos, end, spans)
                elif self.opaque and opaque is not None:
                    opaque.append((pos, end))
                pos = end
            elif self.mode == _CHUNK_SIZE:
                pos = self._chunk_size(data, pos, end)
            elif self.mode == _CHUNK_END:             # the CRLF after a chunk's data
                nl = data.find(b"\n", pos, end)
                pos = end if nl < 0 else nl + 1
                if nl >= 0:
                    self.mode = _CHUNK_SIZE
            else:
                pos = self._trailers(data, pos, end)

    def _probe(self, data: bytes, pos: int, end: int) -> int:
        """A response body's first bytes: if they are `_RESPONSE`, the body is not there (a HEAD or an
        unsent body) and a head starts. Bytes that may still be one are held in `probe` (they hold no
        secret: they are a prefix of `_RESPONSE`); once they cannot be, they go through the body."""
        assert self.probe is not None
        if not self.probe and end - pos >= len(_RESPONSE):     # the usual case: all there, decided now
            self.probe = None
            if data.startswith(_RESPONSE, pos):
                self._restart()
            return pos
        k = min(len(_RESPONSE) - len(self.probe), end - pos)
        seen = self.probe + data[pos:pos + k]
        if _RESPONSE.startswith(seen):
            if len(seen) < len(_RESPONSE):
                self.probe = seen
                return pos + k
            self.probe = None
            self._restart()
            self.head += seen
            return pos + k
        pending, self.probe = bytes(self.probe), None
        if pending:
            self._scan(pending, [])       # framing state only: a prefix of _RESPONSE is no secret
        return pos

    def _head(self, data: bytes, pos: int, end: int, spans: list[Span]) -> int:
        if not self.head:
            while pos < end and data[pos] in _BLANK:     # blank lines before a message are allowed
                pos += 1
            stop = data.find(_HEAD_END, pos, end)
            if stop >= 0:                                # the usual case: the whole head in this read
                stop += len(_HEAD_END)
                if self.request and self.policy.names and data.find(b"?", pos, data.find(b"\n", pos, stop)) >= 0:
                    self._request_line(data, pos, stop, spans)
                self._head_done(data[pos:stop])
                return stop
            if pos == end:
                return end
        stop = self._head_end(data, pos, end)
        if self.request and self.policy.names and self.line != _LINE_DONE:
            self._request_line(data, pos, stop, spans)
        self.head += data[pos:stop]
        if len(self.head) > HEAD_CAP:
            self._lose()
            return end
        if self.head.endswith(_HEAD_END):
            head = bytes(self.head)
            self.head.clear()
            self._head_done(head)
        return stop

    def _head_end(self, data: bytes, pos: int, end: int) -> int:
        """Where this head ends in data[pos:end] (just after its blank line), or `end`."""
        kept = min(3, len(self.head))
        if kept:                                      # the blank line may straddle the last read
            k = (bytes(self.head[-kept:]) + data[pos:pos + 3]).find(_HEAD_END)
            if k >= 0:
                return pos + k + len(_HEAD_END) - kept
        stop = data.find(_HEAD_END, pos, end)
        return end if stop < 0 else stop + len(_HEAD_END)

    def _request_line(self, data: bytes, pos: int, end: int, spans: list[Span]) -> None:
        """Follow the request line as it comes: the query string's secret values go to `spans`."""
        while pos < end and self.line != _LINE_DONE:
            if self.line == _METHOD:
                sp = data.find(b" ", pos, end)
                nl = data.find(b"\n", pos, end if sp < 0 else sp)
                if nl >= 0:
                    self.line = _LINE_DONE            # not a request line
                elif sp >= 0:
                    self.line, pos = _PATH, sp + 1
                else:
                    return
            elif self.line == _PATH:
                m = _TARGET_STOP.search(data, pos, end)
                if m is None:
                    return
                if data[m.start()] == 0x3F:           # '?'
                    self.line, self.query, pos = _QUERY, PairScanner(self.policy.param), m.end()
                else:
                    self.line = _LINE_DONE
            else:
                assert self.query is not None
                m = _QUERY_STOP.search(data, pos, end)
                self.query.feed(data, pos, end if m is None else m.start(), spans)
                if m is None:
                    return
                self.line, self.query = _LINE_DONE, None

    def _head_done(self, head: bytes) -> None:
        """A whole head: what body follows, how it is framed, and its scanner."""
        self.line, self.query = _METHOD, None
        plan = _plan(head, self.request, len(head))
        if plan.lose:
            self._lose()
            return
        if plan.mode == _HEAD:
            return
        if plan.kind is not None and (plan.kind != FORM or self.policy.names):
            self.body = scanner(plan.kind, self.policy)
        self.mode, self.left, self.opaque = plan.mode, plan.length, plan.opaque
        if not self.request:
            self.probe = bytearray()

    def _chunk_size(self, data: bytes, pos: int, end: int) -> int:
        nl = data.find(b"\n", pos, end)
        self.size_line += data[pos:end if nl < 0 else nl]
        if len(self.size_line) > _SIZE_LINE_CAP:
            self._lose()
            return end
        if nl < 0:
            return end
        digits = bytes(self.size_line).split(b";", 1)[0].strip()
        self.size_line.clear()
        try:
            self.left = int(digits, 16)
        except ValueError:
            self._lose()
            return end
        self.mode = _CHUNK_DATA if self.left else _TRAILERS
        self.trailer_line = 0
        return nl + 1

    def _trailers(self, data: bytes, pos: int, end: int) -> int:
        """Trailer lines (LineMasker masks their values) up to the empty line that ends the message."""
        while pos < end:
            nl = data.find(b"\n", pos, end)
            stop = end if nl < 0 else nl
            self.trailer_line += stop - pos - data.count(b"\r", pos, stop)    # CRs do not make a line
            if nl < 0:
                return end
            if self.trailer_line == 0:
                self._restart()
                return nl + 1
            self.trailer_line, pos = 0, nl + 1
        return end


def _pattern_masker() -> PatternMasker:
    from capture.decode.streammask import PatternMasker  # here: streammask imports this module
    return PatternMasker()


class _Plan(NamedTuple):
    """What a head says of the body after it."""

    mode: int                 # _BODY, _CHUNK_SIZE, _TO_CLOSE, or _HEAD: no body
    length: int = 0           # _BODY: its Content-Length
    kind: str | None = None   # capture.fields body kind (None: not scanned)
    lose: bool = False        # 101 Switching Protocols: what follows is not HTTP/1
    opaque: bool = False      # bytes with no text lines (capture.fields.opaque_body)


# Heads repeat (a client's headers, a server's answers): their plans are memoised, keyed by hash and
# length rather than by the bytes, because a head may hold credentials (LineMasker masks them after
# this masker) that a cache must not keep. A request's head is keyed without its request line.
_PLANS: dict[tuple[int, int, bool], _Plan] = {}
_PLANS_CAP = 4096


def _plan(data: bytes, request: bool, end: int) -> _Plan:
    """The plan of the head `data[:end]` (a slice of a whole read is not copied first)."""
    part = data[data.find(b"\n", 0, end):end] if request else data[:end]
    key = (hash(part), len(part), request)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_CAP:
            _PLANS.clear()
        plan = _PLANS[key] = _read_plan(data[:end], request)
    return plan


def _read_plan(head: bytes, request: bool) -> _Plan:
    if not request:
        code = head[9:12]
        status = int(code) if head.startswith(_RESPONSE) and code.isdigit() else 0
        if status == 101:
            return _Plan(_HEAD, lose=True)
        if 100 <= status < 200 or status in (204, 304):
            return _Plan(_HEAD)                        # interim, no content, not modified: no body
    fields = {m[1].lower(): m[2].strip() for m in _FRAMING.finditer(head)}
    ctype, encoding = _text(fields.get(b"content-type")), _text(fields.get(b"content-encoding"))
    kind, opaque = body_kind(ctype, encoding), opaque_body(ctype, encoding)
    if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
        return _Plan(_CHUNK_SIZE, kind=kind, opaque=opaque)
    length = fields.get(b"content-length", b"")
    if length.isdigit():
        return _Plan(_BODY, int(length), kind, opaque=opaque) if int(length) else _Plan(_HEAD)
    return _Plan(_HEAD) if request else _Plan(_TO_CLOSE, kind=kind, opaque=opaque)


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")
