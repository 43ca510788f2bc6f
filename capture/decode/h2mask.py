"""Mask credentials inside raw HTTP/2 chunks without changing a single length.

Header values are HPACK literals: a masked value keeps its length prefix, loses its Huffman flag and
becomes '*' bytes, so the chunk stream stays valid HTTP/2 that decodes (and exports) as before, minus
the secret. DATA payloads get the body rules' same-length masks. Chunks are held back only while a
frame that spans them is incomplete, then released with their own timestamps. A chunk that starts
on a frame boundary (the usual case) is read in place and copied only when something in it is masked.

Frames are read with `wire.h2` and header blocks with `wire.headers.TolerantDecoder`, the decoder
(capture/decode/h2grpc.py) uses the same, so both keep the same HPACK table: a frame whose padding
`wire.h2.strip` rejects is skipped by both. A header block over HEADERS + CONTINUATION frames (gRPC
metadata over 16 KiB) is decoded whole: the chunks from its HEADERS frame on are held until its
END_HEADERS, and a value split between two fragments is blanked in both. What cannot be decoded is
blanked rather than stored: a block over MAX_HEADER_BLOCK, a block still open when the flow ends or
bytes are lost, a CONTINUATION with no block open (joined mid-block), the payload of a HEADERS frame
cut off by a gap. Chunks of a joined flow before the first frame boundary get the raw-TCP patterns.

Credential fields (capture/fields.py, with a FieldPolicy): a request's literal :path has its query's
secret values blanked (wire.headers.TolerantDecoder path_spans: same string length, Huffman coded
again where it was); DATA frames of a stream whose headers say JSON or form (without a content type,
or with one HPACK hid from a joined capture: by the body's first byte, capture.fields.SniffScanner) go
through that stream's scanner, which carries its state from one frame to the next. gRPC streams
(application/grpc*) are never scanned: their headers cost one memoised look per block.
"""

from __future__ import annotations

from collections.abc import Callable

from capture.fields import FORM, BodyScanner, FieldPolicy, Span, body_kind, query_spans, scanner
from capture.redact import mask_patterns
from wire.h2 import HEAD, PREFACE, Flag, FrameType, frame_lengths_plausible, strip_or_none
from wire.headers import DecodedBlock, HpackBlockError, TolerantDecoder

_DATA, _HEADERS, _CONTINUATION = int(FrameType.DATA), int(FrameType.HEADERS), int(FrameType.CONTINUATION)
_MASKED_TYPES = frozenset((_DATA, _HEADERS, _CONTINUATION))
_PADDED, _PRIORITY, _END_HEADERS = int(Flag.PADDED), int(Flag.PRIORITY), int(Flag.END_HEADERS)
_END_STREAM = int(Flag.END_STREAM)
_TRAILERS = "trailers"          # a header block without :method or :status: the body's scanner stays
_NOT_SCANNED = "not scanned"    # a body no scanner reads (gRPC, compressed, binary)
_DECIDED_NOTHING = (_NOT_SCANNED, _TRAILERS)
_STREAMS_CAP = 4096             # streams with a body scanner; beyond it the oldest are forgotten (never ended)
_PUSH_PROMISE = int(FrameType.PUSH_PROMISE)
_BLOCK_TYPES = frozenset((_HEADERS, _CONTINUATION, _PUSH_PROMISE))
MAX_HEADER_BLOCK = 1 << 20      # as the decoder's: a larger block is blanked, not held
# (payload start, payload end, new payload or None, header value spans to blank, block rewrites)
_Edit = tuple[int, int, bytes | None, list[tuple[int, int, int]], list[tuple[int, bytes]]]


def _apply(buf: bytearray, edit: _Edit) -> None:
    """Mask one frame in place; every length stays as it was."""
    lo, hi, body, spans, rewrites = edit
    if body is not None:
        buf[lo:hi] = body                                  # body rules keep lengths
    for prefix_at, vstart, vend in spans:
        buf[lo + prefix_at] &= 0x7F                        # drop the Huffman flag
        buf[lo + vstart:lo + vend] = b"*" * (vend - vstart)
    for at, new in rewrites:
        buf[lo + at:lo + at + len(new)] = new


def _blank(buf: bytearray, lo: int, hi: int) -> None:
    buf[lo:hi] = b"*" * (hi - lo)


class H2ChunkMasker:
    """One direction of one flow: feed chunks, get back (ts_ns, masked bytes) ready to store."""

    def __init__(self, header_mask: Callable[[str], bool], body_mask: Callable[[bytes], bytes] | None,
                 c2s: bool, joined: bool, fields: FieldPolicy | None = None) -> None:
        self.header_mask = header_mask
        self.body_mask = body_mask
        self.fields = fields or None
        # a request's :path query (credential names only: json-field rules are about bodies)
        self.path_spans: Callable[[bytes], list[Span]] | None = (
            self._path_spans if c2s and fields is not None and fields.names else None)
        self.bodies: dict[int, BodyScanner] = {}     # stream id -> its body's scanner
        self.hpack = TolerantDecoder()
        self.held: list[tuple[int, bytearray]] = []
        self.buf = bytearray()          # concatenation of held chunks
        self.pos = 0                    # next frame start within buf
        self.need_preface = c2s and not joined
        self.synced = not joined
        # a joined flow's first chunks, read as one stream until 9 bytes say whether it starts on a frame
        self.pre: list[tuple[int, bytes]] | None = [] if joined else None
        self.pre_bytes = 0
        # an open header block (HEADERS without END_HEADERS): its fragments' payload spans in buf, the
        # offset of its HEADERS frame (nothing from there on is released), and whether it is too big
        self.block: list[tuple[int, int]] | None = None
        self.block_at = 0
        self.block_size = 0
        self.block_over = False

    def feed(self, ts_ns: int, data: bytes) -> list[tuple[int, bytes]]:
        if not self.synced:
            return self._sync(ts_ns, data)
        if not self.held and not self.need_preface and self.block is None and not self.block_over:
            return self._feed_fresh(ts_ns, data)
        self.held.append((ts_ns, bytearray(data)))
        self.buf += data
        if self.need_preface:
            if len(self.buf) < len(PREFACE):
                return []
            self.pos = len(PREFACE) if self.buf.startswith(PREFACE) else 0
            self.need_preface = False
        self._advance()
        return self._release()

    def _sync(self, ts_ns: int, data: bytes) -> list[tuple[int, bytes]]:
        """A joined flow: its stream from the join on most likely starts on a frame boundary (a
        syscall wrote whole frames), so the first bytes are read as a stream, not chunk by chunk.
        If they do not parse, each later chunk that starts on a frame boundary resynchronises, and
        chunks before it get only the raw-TCP patterns (unparseable HPACK holds nothing we could find)."""
        if self.pre is not None:
            self.pre.append((ts_ns, data))
            self.pre_bytes += len(data)
            if self.pre_bytes < 9:
                return []
            pre, self.pre = self.pre, None
            if frame_lengths_plausible(b"".join(d for _, d in pre)):
                self.synced = True
                out: list[tuple[int, bytes]] = []
                for t, d in pre:
                    out += self.feed(t, d)
                return out
            return [piece for t, d in pre for piece in self._sync(t, d)]
        if not frame_lengths_plausible(data):
            masked = bytearray(data)
            mask_patterns(masked)
            return [(ts_ns, bytes(masked))]
        self.synced = True
        return self.feed(ts_ns, data)

    def _advance(self) -> None:
        """Mask every complete frame from `pos` on in buf, following header blocks over CONTINUATION."""
        buf = self.buf
        while self.pos + 9 <= len(buf):
            hi, lo, ftype, flags = HEAD.unpack_from(buf, self.pos)[:4]
            end = self.pos + 9 + (hi << 16 | lo)
            if end > len(buf):
                break
            if self.block is not None or self.block_over:
                if ftype == _CONTINUATION:
                    self._fragment(self.pos + 9, end, flags)
                    self.pos = end
                    continue
                self._close_block(False)   # a frame inside a block: the peer errors, the block is lost
            if ftype in (_HEADERS, _PUSH_PROMISE) and not flags & _END_HEADERS:
                span = self._payload(buf, self.pos, end)
                if span is None:
                    _blank(buf, self.pos + 9, end)
                else:
                    self.block, self.block_at, self.block_size = [], self.pos, 0
                    self._fragment(span[0], span[1], flags)
            elif ftype == _CONTINUATION:
                _blank(buf, self.pos + 9, end)    # no block open: joined mid-block, undecodable
            else:
                edit = self._edit(buf, self.pos, end)
                if edit is not None:
                    _apply(buf, edit)
            self.pos = end

    def _fragment(self, lo: int, hi: int, flags: int) -> None:
        """One more fragment of the open block at buf[lo:hi]."""
        if self.block_over:
            _blank(self.buf, lo, hi)
        else:
            assert self.block is not None
            self.block.append((lo, hi))
            self.block_size += hi - lo
            if self.block_size > MAX_HEADER_BLOCK:
                self._close_block(False)
                self.block_over = True
        if flags & _END_HEADERS:
            if self.block is not None:
                self._close_block(True)
            self.block_over = False

    def _close_block(self, complete: bool) -> None:
        """Decode the open block (complete) and blank its secrets, or blank it all (incomplete)."""
        block, self.block = self.block, None
        if not block:
            return
        decoded = None
        if complete:
            try:
                decoded = self.hpack.decode(b"".join(bytes(self.buf[lo:hi]) for lo, hi in block),
                                            self.header_mask, self.path_spans)
            except HpackBlockError:
                decoded = None
        if decoded is None:
            for lo, hi in block:
                _blank(self.buf, lo, hi)
            return
        if self.fields is not None:
            self._headers_seen(self.buf, self.block_at, decoded)
        starts, at = [], 0                # block offset of each fragment
        for lo, hi in block:
            starts.append(at)
            at += hi - lo
        for prefix_at, vstart, vend in decoded.spans:
            for (lo, hi), s in zip(block, starts, strict=True):
                if s <= prefix_at < s + hi - lo:
                    self.buf[lo + prefix_at - s] &= 0x7F
                a, b = max(vstart, s), min(vend, s + hi - lo)
                if a < b:
                    self.buf[lo + a - s:lo + b - s] = b"*" * (b - a)
        for at, new in decoded.rewrites:
            for (lo, hi), s in zip(block, starts, strict=True):
                a, b = max(at, s), min(at + len(new), s + hi - lo)
                if a < b:
                    self.buf[lo + a - s:lo + b - s] = new[a - at:b - at]

    @staticmethod
    def _payload(buf: bytes | bytearray, start: int, end: int) -> tuple[int, int] | None:
        """The header block fragment of a HEADERS/PUSH_PROMISE frame (padding, priority, promised id off)."""
        ftype, flags = buf[start + 3], buf[start + 4]
        lo, hi = start + 9, end
        if flags & _PADDED:
            if lo >= hi:
                return None
            hi -= buf[lo]
            lo += 1
        if ftype == _HEADERS and flags & _PRIORITY:
            lo += 5
        if ftype == _PUSH_PROMISE:
            lo += 4
        return (lo, hi) if lo <= hi else None

    def _feed_fresh(self, ts_ns: int, data: bytes) -> list[tuple[int, bytes]]:
        """A chunk that starts on a frame boundary with nothing held: the usual case. Its frames are
        read in place and the chunk is copied only when one of them has something to mask."""
        out: bytearray | None = None
        pos, end = 0, len(data)
        unpack = HEAD.unpack_from
        while pos + 9 <= end:
            hi, lo, ftype = unpack(data, pos)[:3]
            nxt = pos + 9 + (hi << 16 | lo)
            if nxt > end:
                break
            if ftype in _BLOCK_TYPES and (ftype == _CONTINUATION or not data[pos + 4] & _END_HEADERS):
                # a header block over several frames: the general path holds and follows it
                self.held.append((ts_ns, bytearray(data if out is None else out)))
                self.buf += self.held[-1][1]
                self.pos = pos
                self._advance()
                return self._release()
            if ftype in _MASKED_TYPES:
                edit = self._edit(data, pos, nxt)
                if edit is not None:
                    if out is None:
                        out = bytearray(data)
                    _apply(out, edit)
            pos = nxt
        chunk = data if out is None else bytes(out)
        if pos == end:
            return [(ts_ns, chunk)]
        # A frame continues in the next chunk: hold this one (frames before `pos` are done).
        self.held.append((ts_ns, bytearray(chunk)))
        self.buf += chunk
        self.pos = pos
        return []

    def _edit(self, buf: bytes | bytearray, start: int, end: int) -> _Edit | None:
        """What masking the frame at buf[start:end] changes, or None. A header block is decoded
        here exactly once (decoding updates the HPACK table)."""
        ftype, flags = buf[start + 3], buf[start + 4]
        if ftype not in _MASKED_TYPES or (ftype == _DATA and not self.body_mask and not self.bodies):
            return None
        block = strip_or_none(ftype, flags, bytes(buf[start + 9:end]))
        if block is None:          # malformed padding: a peer rejects the frame, the decoder skips it
            return None if ftype == _DATA else (start + 9, end, b"*" * (end - start - 9), [], [])
        lo = start + 9
        if ftype != _CONTINUATION and flags & _PADDED:
            lo += 1                                            # the pad length
        if ftype == _HEADERS and flags & _PRIORITY:
            lo += 5                                            # stream dependency and weight
        hi = lo + len(block)
        if ftype == _DATA:
            masked = self._data(buf, start, block)
            return None if masked == block else (lo, hi, masked, [], [])
        try:                                                   # HEADERS with END_HEADERS
            decoded = self.hpack.decode(block, self.header_mask, self.path_spans)
        except HpackBlockError:
            return (lo, hi, b"*" * (hi - lo), [], [])   # undecodable: blanked, it may hold anything
        if self.fields is not None and (self.bodies or decoded.view not in _DECIDED_NOTHING):
            self._headers_seen(buf, start, decoded)       # (a repeated gRPC block: nothing to do)
        return (lo, hi, None, decoded.spans, decoded.rewrites) if decoded.spans or decoded.rewrites else None

    # ---- credential fields (capture/fields.py) -------------------------------------------------------
    def _path_spans(self, path: bytes) -> list[Span]:
        assert self.fields is not None
        return query_spans(path, self.fields.param) if b"?" in path else []

    def _headers_seen(self, buf: bytes | bytearray, start: int, decoded: DecodedBlock) -> None:
        """A request's or response's headers (the frame at buf[start]): the scanner of its body, if any."""
        kind = decoded.view
        if kind is None:                  # this decoder's blocks are ours alone: memoise the verdict
            kind = decoded.view = _body_kind(decoded.headers)
        if kind is _TRAILERS or (kind is _NOT_SCANNED and not self.bodies) or buf[start + 3] != _HEADERS:
            return                        # gRPC: nothing to scan and no stream to forget
        assert self.fields is not None
        sid = int.from_bytes(buf[start + 5:start + 9], "big") & 0x7FFFFFFF
        self.bodies.pop(sid, None)
        if kind is _NOT_SCANNED or buf[start + 4] & _END_STREAM or (kind == FORM and not self.fields.names):
            return
        if len(self.bodies) >= _STREAMS_CAP:
            del self.bodies[next(iter(self.bodies))]
        self.bodies[sid] = scanner(kind, self.fields)

    def _data(self, buf: bytes | bytearray, start: int, payload: bytes) -> bytes:
        """A DATA frame's payload with its stream's secret fields and the body rules' matches masked."""
        sid = int.from_bytes(buf[start + 5:start + 9], "big") & 0x7FFFFFFF
        scan = self.bodies.get(sid)
        if scan is not None:
            spans: list[Span] = []
            scan.feed(payload, 0, len(payload), spans)
            if buf[start + 4] & _END_STREAM:
                del self.bodies[sid]
            if spans:
                out = bytearray(payload)
                for s, e in spans:
                    out[s:e] = b"*" * (e - s)
                payload = bytes(out)
        return self.body_mask(payload) if self.body_mask is not None else payload

    def _release(self) -> list[tuple[int, bytes]]:
        """Give back every held chunk that lies wholly before the incomplete frame at `pos`."""
        out: list[tuple[int, bytes]] = []
        offset = 0
        limit = self.pos if self.block is None else min(self.pos, self.block_at)
        while self.held and offset + len(self.held[0][1]) <= limit:
            ts, chunk = self.held.pop(0)
            out.append((ts, bytes(self.buf[offset:offset + len(chunk)])))
            offset += len(chunk)
        if offset:
            del self.buf[:offset]
            self.pos -= offset
            if self.block is not None:
                self.block_at -= offset
                self.block = [(lo - offset, hi - offset) for lo, hi in self.block]
        return out

    def flush(self) -> list[tuple[int, bytes]]:
        """Capture ended or bytes were lost: release what is held. An open header block, and the payload
        of an incomplete last HEADERS/CONTINUATION frame, are blanked: they cannot be decoded, and may
        hold a secret."""
        if self.pre:
            pre, self.pre = self.pre, None
            return [piece for t, d in pre for piece in self._sync(t, d)]
        self._close_block(False)
        self.block_over = False
        if self.pos + 9 <= len(self.buf) and self.buf[self.pos + 3] in _BLOCK_TYPES:
            _blank(self.buf, self.pos + 9, len(self.buf))
        out, offset = [], 0
        for ts, chunk in self.held:
            out.append((ts, bytes(self.buf[offset:offset + len(chunk)])))
            offset += len(chunk)
        self.held.clear()
        self.buf.clear()
        self.pos = 0
        return out


def _body_kind(headers: list[tuple[str, str]]) -> str:
    """capture.fields.body_kind for the body that follows these headers (SNIFF without a content
    type, or when HPACK hid it from a joined capture), _NOT_SCANNED for none; _TRAILERS for a block
    without :method or :status (trailers: the body's scanner stays)."""
    head = False
    ctype = encoding = None
    for name, value in headers:
        if name in (":method", ":status"):
            head = True
        elif name == "content-type":
            if value.startswith("application/grpc"):
                return _NOT_SCANNED          # gRPC (pseudo headers come first): decided, never scanned
            ctype = value
        elif name == "content-encoding":
            encoding = value
    if not head:
        return _TRAILERS
    return body_kind(ctype, encoding) or _NOT_SCANNED
