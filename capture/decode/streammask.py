"""Mask credentials in a flow's byte stream, whatever way the bytes were split into chunks.

Chunks are stored exactly as they came (same boundaries, same lengths, same timestamps), so masking
must work on the reassembled stream of each direction, not chunk by chunk:

    FlowMasker (one per flow)
      protocol not known yet --> chunks held (both directions, bounded) until the decoder knows
      http1  --> LineMasker: `Name: value` lines, a line may start in one chunk and end in a later one
                 + H1FieldMasker: the request target's query, form and JSON bodies (capture/decode/h1mask.py)
      grpc / http2 --> H2ChunkMasker: HPACK blocks, also over HEADERS + CONTINUATION, the :path query,
                 form and JSON DATA (capture/decode/h2mask.py)
      tcp    --> LineMasker + PatternMasker (bearer/basic tokens, api-key/token/secret/cookie = value)
      tls    --> nothing to mask: the payload is encrypted

`LineMasker` needs no hold-back: a header name is not a secret, so it carries the state of the line
in progress (the name read so far, or "inside a masked value") into the next chunk. `PatternMasker`
holds back the last `WINDOW` bytes so that a trigger word split over chunks is still seen, and carries
"inside a token" into the next chunk so a token of any length is masked to its end.

A gap (bytes lost) restarts a direction conservatively: a line masker treats the bytes after it as
joined mid-line (the first line's value is masked), an HTTP/2 masker resynchronises on a frame
boundary (h2mask).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

from capture.decode.h1mask import H1FieldMasker
from capture.decode.h2mask import H2ChunkMasker
from capture.fields import FieldPolicy, Span
from capture.recording import Direction
from capture.redact import BodyRegexRule, HeaderRule, Redactor, mask_patterns

_TOKEN = re.compile(rb"[A-Za-z0-9!#$%&'*+.^_`|~-]*")
_LINE = re.compile(rb"(?m)^([A-Za-z0-9!#$%&'*+.^_`|~-]+):[ \t]*([^\r\n]*)")
_EOL = re.compile(rb"[\r\n]")
_WS = re.compile(rb"[ \t]*")
# A joined flow's first bytes that start a message (so its first line is not a stray value tail).
_MESSAGE_START = re.compile(rb"^(?:[A-Z]{1,16} |HTTP/|PRI )")
NAME_CAP = 256              # longer "names" are not header names: the line is skipped
HOLD_CAP = 256 * 1024       # bytes held while the protocol is unknown (the decoder decides well before)

_NAME, _WSP, _MASK, _SKIP = range(4)
_DIRECTIONS: tuple[Direction, ...] = ("c2s", "s2c")
BLOCKS_CAP = 4096          # header blocks remembered per rule set (LineMasker._line_spans), then forgotten


class LineRule(NamedTuple):
    """A header rule's lines at C speed (HeaderRule.line_pattern, line_hints), and the value spans of
    the header blocks read with them so far, by the block's hash and length (offsets only: no header
    bytes are kept). One per rule set, shared by every flow's maskers."""

    lines: re.Pattern[bytes]
    hints: re.Pattern[bytes] | None
    blocks: dict[tuple[int, int], tuple[Span, ...]]


class LineMasker:
    """One direction: blank the values of `Name: value` lines whose name `matches` accepts, in a
    stream of chunks (lengths kept). Lines anywhere count (as HTTP/1 trailers and text protocols have
    them); a line split over chunks is masked the same as a whole one."""

    def __init__(self, matches: Callable[[str], bool], joined: bool = False,
                 lines: LineRule | None = None) -> None:
        self.matches = matches
        # the lines `matches` accepts as one regex, and a quick test of lower-cased text that may hold
        # one (HeaderRule.line_pattern, line_hints): most reads have no credential header at all
        self.lines: re.Pattern[bytes] | None = lines.lines if lines is not None else None
        self.hints: re.Pattern[bytes] | None = lines.hints if lines is not None else None
        self.blocks: dict[tuple[int, int], tuple[Span, ...]] = lines.blocks if lines is not None else {}
        self.mode = _NAME
        self.name = b""
        self.first = joined          # the first line of a joined stream may be the tail of a value

    def feed(self, data: bytes) -> bytes:
        n = len(data)
        if not n:
            return data
        spans: list[tuple[int, int]] = []
        pos = 0
        if self.first:
            self.first = False
            if not _MESSAGE_START.match(data):
                self.mode = _MASK      # we may be inside a value: blank to the end of the line
        while pos < n and not (self.mode == _NAME and not self.name):
            if self.mode == _NAME:                       # a name started in an earlier chunk
                m = _TOKEN.match(data, pos)
                assert m is not None
                name, e = self.name + m.group(), m.end()
                if e == n:
                    if len(name) > NAME_CAP:
                        self.mode, self.name = _SKIP, b""
                    else:
                        self.name = name
                    pos = n
                    break
                self.name = b""
                if data[e] == 0x3A and self.matches(name.decode("latin-1")):     # ':'
                    self.mode, pos = _WSP, e + 1
                else:
                    self.mode, pos = _SKIP, e
            elif self.mode == _WSP:
                m = _WS.match(data, pos)
                assert m is not None
                pos = m.end()
                if pos < n:
                    self.mode = _MASK
            elif self.mode == _MASK:
                m = _EOL.search(data, pos)
                end = m.start() if m else n
                if end > pos:
                    spans.append((pos, end))
                pos = end
                if m:
                    self.mode = _SKIP
            else:                                        # _SKIP: to the next line
                nl = data.find(b"\n", pos)
                if nl < 0:
                    pos = n
                    break
                pos, self.mode, self.name = nl + 1, _NAME, b""
        if pos < n:
            # `pos` is at a line start: whole lines at C speed, then the state of the last one
            if self.lines is not None:
                spans += self._line_spans(data, pos)
            else:
                for m in _LINE.finditer(data, pos):
                    if m.end(2) > m.start(2) and self.matches(m.group(1).decode("latin-1")):
                        spans.append(m.span(2))
            nl = data.rfind(b"\n", pos)
            tail = nl + 1 if nl >= 0 else pos
            if tail == n:
                self.mode, self.name = _NAME, b""
            else:
                # a header line has its ':' within NAME_CAP bytes (a long body line never does)
                m = _LINE.match(data, tail) if data.find(b":", tail, tail + NAME_CAP + 1) >= 0 else None
                if m is not None and m.end(2) == n:
                    hit = self.matches(m.group(1).decode("latin-1"))
                    self.mode = (_MASK if m.end(2) > m.start(2) else _WSP) if hit else _SKIP
                    self.name = b""
                elif m is not None:
                    self.mode, self.name = _SKIP, b""      # ends in '\r'
                else:
                    t = _TOKEN.match(data, tail) if n - tail <= NAME_CAP else None
                    if t is not None and t.end() == n:
                        self.mode, self.name = _NAME, t.group()
                    else:
                        self.mode, self.name = _SKIP, b""
        if not spans:
            return data
        out = bytearray(data)
        for s, e in spans:
            out[s:e] = b"*" * (e - s)
        return bytes(out)

    def _line_spans(self, data: bytes, pos: int) -> list[tuple[int, int]]:
        """The values to blank in the whole lines of `data` from `pos` (a line start), by the rule's
        line regex. A header block (up to its blank line) is looked up by the hash of its lines after
        the first: a client sends the same headers call after call, and a server mostly the same, so
        the regex reads each distinct block once. The first line (request or status line, which
        differs from call to call) and what follows the block (a body) are read each time."""
        lines, hints = self.lines, self.hints
        assert lines is not None
        spans: list[tuple[int, int]] = []
        end = data.find(b"\r\n\r\n", pos)
        if end >= 0:
            stop = end + 4
            second = data.find(b"\n", pos, stop) + 1       # the block has a second line: end + 2 at most
            if data.find(b":", pos, second) >= 0:           # a request or status line has none, mostly
                m = lines.match(data, pos)
                if m is not None and m.end(1) > m.start(1) and m.end(1) < second:
                    spans.append(m.span(1))
            block = data[second:stop]
            key = (hash(block), len(block))                 # offsets only: no header bytes are kept
            rel = self.blocks.get(key)
            if rel is None:
                if len(self.blocks) >= BLOCKS_CAP:
                    self.blocks.clear()
                rel = self.blocks[key] = () if hints is not None and hints.search(block.lower()) is None else \
                    tuple(m.span(1) for m in lines.finditer(block) if m.end(1) > m.start(1))
            if rel:
                spans += [(a + second, b + second) for a, b in rel]
            if stop == len(data):
                return spans
            pos = stop
        if hints is None or hints.search(data.lower(), pos) is not None:
            spans += [m.span(1) for m in lines.finditer(data, pos) if m.end(1) > m.start(1)]
        return spans


class PatternMasker:
    """One direction of a raw TCP flow: credentials by pattern (`mask_patterns`) across chunks.

    Holds back chunks until at least `WINDOW` bytes follow them, so a trigger (`Bearer `,
    `api_key=`) split over chunks is whole in the buffer; a token reaching the end of the buffer is
    masked on into the next chunks for as long as token characters follow."""

    WINDOW = 128

    def __init__(self) -> None:
        self.held: list[tuple[int, int]] = []     # (ts, length) of the chunks in buf
        self.buf = bytearray()
        self.cont: re.Pattern[bytes] | None = None

    def feed(self, ts_ns: int, data: bytes) -> list[tuple[int, bytes]]:
        start = len(self.buf)
        self.buf += data
        self.held.append((ts_ns, len(data)))
        if self.cont is not None:
            m = self.cont.match(self.buf, start)
            assert m is not None
            self.buf[start:m.end()] = b"*" * (m.end() - start)
            if m.end() < len(self.buf):
                self.cont = None
        cont = mask_patterns(self.buf)
        if cont is not None:
            self.cont = cont
        out: list[tuple[int, bytes]] = []
        while self.held and len(self.buf) - self.held[0][1] >= self.WINDOW:
            ts, k = self.held.pop(0)
            out.append((ts, bytes(self.buf[:k])))
            del self.buf[:k]
        return out

    def flush(self) -> list[tuple[int, bytes]]:
        out = []
        for ts, k in self.held:
            out.append((ts, bytes(self.buf[:k])))
            del self.buf[:k]
        self.held.clear()
        self.cont = None
        return out


class _Direction:
    """The masker of one direction for one protocol: feed -> [(ts, bytes)], flush -> the rest."""

    def __init__(self, proto: str, direction: Direction, joined: bool, header: Callable[[str], bool],
                 body: Callable[[bytes], bytes] | None, fields: FieldPolicy | None = None,
                 lines: LineRule | None = None) -> None:
        self.proto = proto
        self.body = body
        self.line: LineMasker | None = None
        self.pattern: PatternMasker | None = None
        self.h2: H2ChunkMasker | None = None
        self.h1: H1FieldMasker | None = None
        if proto in ("grpc", "http2"):
            self.h2 = H2ChunkMasker(header, body, direction == "c2s", joined, fields)
        elif proto != "tls":
            self.line = LineMasker(header, joined, lines)
            if proto != "http1":
                self.pattern = PatternMasker()
            elif fields:
                self.h1 = H1FieldMasker(fields, direction == "c2s", joined)

    def feed(self, ts_ns: int, data: bytes) -> list[tuple[int, bytes]]:
        if self.h2 is not None:
            return self.h2.feed(ts_ns, data)
        if self.line is None:
            return [(ts_ns, data)]
        if self.h1 is not None:           # first: LineMasker blanks a joined stream's first line
            if self.h1.plain_read(data):  # the usual read: one whole message, no field to mask
                data = self.line.feed(data)
                return [(ts_ns, data if self.body is None else self.body(data))]
            out = self.h1.feed_scanned(ts_ns, data)   # plain_read said no: not asked twice
            last, opaque = len(out) - 1, self.h1.opaque_spans
            for i, (ts, chunk) in enumerate(out):
                chunk = self._lines(chunk, opaque if i == last else [])
                out[i] = (ts, chunk if self.body is None else self.body(chunk))
            return out
        data = self.line.feed(data)
        if self.body is not None:
            data = self.body(data)
        return self.pattern.feed(ts_ns, data) if self.pattern is not None else [(ts_ns, data)]

    def _lines(self, chunk: bytes, opaque: list[tuple[int, int]]) -> bytes:
        """`chunk` through the line masker, but for the opaque body bytes in it (a binary download),
        which hold no header lines; the masker is at a line's start on both sides of such a body."""
        assert self.line is not None
        if not opaque:
            return self.line.feed(chunk)
        parts, pos = [], 0
        for a, b in opaque:
            parts += [self.line.feed(chunk[pos:a]), chunk[a:b]]
            pos = b
        parts.append(self.line.feed(chunk[pos:]))
        return b"".join(parts)

    def flush(self) -> list[tuple[int, bytes]]:
        if self.h2 is not None:
            return self.h2.flush()
        if self.h1 is not None:
            assert self.line is not None
            out = self.h1.flush()
            for i, (ts, chunk) in enumerate(out):
                chunk = self.line.feed(chunk)
                out[i] = (ts, chunk if self.body is None else self.body(chunk))
            return out
        return self.pattern.flush() if self.pattern is not None else []


# HeaderRule patterns -> their line regex and hints: a recorder opens a FlowMasker per flow, same rules
_LINE_PATTERNS: dict[tuple[str, ...], LineRule | None] = {}


def _line_patterns(rule: HeaderRule | None) -> LineRule | None:
    if rule is None:
        return None
    if rule.patterns not in _LINE_PATTERNS:
        if len(_LINE_PATTERNS) > 64:
            _LINE_PATTERNS.clear()
        lines = rule.line_pattern()
        _LINE_PATTERNS[rule.patterns] = None if lines is None else LineRule(lines, rule.line_hints(), {})
    return _LINE_PATTERNS[rule.patterns]


class FlowMasker:
    """Both directions of one flow: chunks in, (direction, ts, masked chunk) out, lengths kept.

    `protocol` is the decoder's verdict so far (None: not known yet): until it is known, chunks are
    held (at most HOLD_CAP bytes, then raw-TCP rules apply), so nothing reaches the disk unmasked
    because the first bytes were split unluckily."""

    def __init__(self, redactor: Redactor, joined: bool) -> None:
        rule = redactor.header_rule()
        self.header: Callable[[str], bool] = rule.matches if rule else (lambda _n: False)
        self.lines = _line_patterns(rule)
        has_body = any(isinstance(r, BodyRegexRule) for r in redactor.rules)
        self.body = redactor.body if has_body else None
        self.fields = redactor.field_policy()
        self.active = bool(redactor.rules)
        self.joined = joined
        self.proto: str | None = None
        self.held: list[tuple[Direction, int, bytes]] = []
        self.held_bytes = 0
        self.dirs: dict[Direction, _Direction] = {}
        self.rejoined: set[Direction] = set()     # directions restarted after a gap

    def feed(self, direction: Direction, ts_ns: int, data: bytes,
             protocol: str | None) -> list[tuple[Direction, int, bytes]]:
        if not self.active:
            return [(direction, ts_ns, data)]
        if self.proto is None:
            if protocol is None and self.held_bytes + len(data) <= HOLD_CAP:
                self.held.append((direction, ts_ns, data))
                self.held_bytes += len(data)
                return []
            self.proto = protocol or "tcp"
            out: list[tuple[Direction, int, bytes]] = []
            held, self.held, self.held_bytes = self.held, [], 0
            for d, t, b in held:
                out += [(d, ts, c) for ts, c in self._dir(d).feed(t, b)]
            return out + [(direction, ts, c) for ts, c in self._dir(direction).feed(ts_ns, data)]
        done = (self.dirs.get(direction) or self._dir(direction)).feed(ts_ns, data)
        if len(done) == 1:                # the usual read: one chunk out, no comprehension's frame
            ts, c = done[0]
            return [(direction, ts, c)]
        return [(direction, ts, c) for ts, c in done]

    def _dir(self, direction: Direction) -> _Direction:
        m = self.dirs.get(direction)
        if m is None:
            assert self.proto is not None
            m = self.dirs[direction] = _Direction(self.proto, direction, self.joined or direction in self.rejoined,
                                                  self.header, self.body, self.fields, self.lines)
        return m

    def gap(self, direction: Direction) -> list[tuple[Direction, int, bytes]]:
        """Bytes of `direction` were lost: release what it holds; what follows starts as if joined."""
        out = self._flush_dir(direction)
        self.rejoined.add(direction)
        self.dirs.pop(direction, None)
        return out

    def flush(self) -> list[tuple[Direction, int, bytes]]:
        """The flow ended: release everything (held chunks of an undetected flow get raw-TCP rules)."""
        out: list[tuple[Direction, int, bytes]] = []
        for d in _DIRECTIONS:
            out += self._flush_dir(d)
        return out

    def _flush_dir(self, direction: Direction) -> list[tuple[Direction, int, bytes]]:
        out: list[tuple[Direction, int, bytes]] = []
        if self.proto is None:
            mine = [h for h in self.held if h[0] == direction]
            if mine:
                self.held = [h for h in self.held if h[0] != direction]
                self.held_bytes -= sum(len(h[2]) for h in mine)
                tmp = _Direction("tcp", direction, self.joined or direction in self.rejoined, self.header, self.body,
                                 lines=self.lines)
                for _, t, b in mine:
                    out += [(direction, ts, c) for ts, c in tmp.feed(t, b)]
                out += [(direction, ts, c) for ts, c in tmp.flush()]
            return out
        m = self.dirs.get(direction)
        if m is not None:
            out += [(direction, ts, c) for ts, c in m.flush()]
        return out
