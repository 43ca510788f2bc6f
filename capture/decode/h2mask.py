"""Mask credentials inside raw HTTP/2 chunks without changing a single length.

Header values are HPACK literals: a masked value keeps its length prefix, loses its Huffman flag and
becomes '*' bytes, so the chunk stream stays valid HTTP/2 that decodes (and exports) as before, minus
the secret. DATA payloads get the body rules' same-length masks. Chunks are held back only while a
frame that spans them is incomplete, then released with their own timestamps. A chunk that starts
on a frame boundary (the usual case) is read in place and copied only when something in it is masked.

Frames are read with `wire.h2` and header blocks with `wire.headers.TolerantDecoder`, the decoder
(capture/decode/h2grpc.py) uses the same, so both keep the same HPACK table: a frame whose padding
`wire.h2.strip` rejects is skipped by both. Each HEADERS or CONTINUATION fragment is decoded on its
own: a field split across two fragments is not masked (a header block over one frame, 16 KiB).
"""

from __future__ import annotations

from collections.abc import Callable

from wire.h2 import HEAD, PREFACE, Flag, FrameType, frame_lengths_plausible, strip_or_none
from wire.headers import HpackBlockError, TolerantDecoder

_DATA, _HEADERS, _CONTINUATION = int(FrameType.DATA), int(FrameType.HEADERS), int(FrameType.CONTINUATION)
_MASKED_TYPES = frozenset((_DATA, _HEADERS, _CONTINUATION))
_PADDED, _PRIORITY = int(Flag.PADDED), int(Flag.PRIORITY)
# (payload start, payload end, new payload or None, header value spans to blank)
_Edit = tuple[int, int, bytes | None, list[tuple[int, int, int]]]


def _apply(buf: bytearray, edit: _Edit) -> None:
    """Mask one frame in place; every length stays as it was."""
    lo, hi, body, spans = edit
    if body is not None:
        buf[lo:hi] = body                                  # body rules keep lengths
    for prefix_at, vstart, vend in spans:
        buf[lo + prefix_at] &= 0x7F                        # drop the Huffman flag
        buf[lo + vstart:lo + vend] = b"*" * (vend - vstart)


class H2ChunkMasker:
    """One direction of one flow: feed chunks, get back (ts_ns, masked bytes) ready to store."""

    def __init__(self, header_mask: Callable[[str], bool], body_mask: Callable[[bytes], bytes] | None,
                 c2s: bool, joined: bool) -> None:
        self.header_mask = header_mask
        self.body_mask = body_mask
        self.hpack = TolerantDecoder()
        self.held: list[tuple[int, bytearray]] = []
        self.buf = bytearray()          # concatenation of held chunks
        self.pos = 0                    # next frame start within buf
        self.need_preface = c2s and not joined
        self.synced = not joined

    def feed(self, ts_ns: int, data: bytes) -> list[tuple[int, bytes]]:
        if not self.synced:
            if not frame_lengths_plausible(data):
                return [(ts_ns, data)]   # we cannot parse it, so it holds nothing we could mask
            self.synced = True
        if not self.held and not self.need_preface:
            return self._feed_fresh(ts_ns, data)
        self.held.append((ts_ns, bytearray(data)))
        self.buf += data
        if self.need_preface:
            if len(self.buf) < len(PREFACE):
                return []
            self.pos = len(PREFACE) if self.buf.startswith(PREFACE) else 0
            self.need_preface = False
        while self.pos + 9 <= len(self.buf):
            hi, lo = HEAD.unpack_from(self.buf, self.pos)[:2]
            end = self.pos + 9 + (hi << 16 | lo)
            if end > len(self.buf):
                break
            edit = self._edit(self.buf, self.pos, end)
            if edit is not None:
                _apply(self.buf, edit)
            self.pos = end
        return self._release()

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
        if ftype not in _MASKED_TYPES or (ftype == _DATA and not self.body_mask):
            return None
        block = strip_or_none(ftype, flags, bytes(buf[start + 9:end]))
        if block is None:
            return None            # malformed padding: a peer rejects the frame, the decoder skips it
        lo = start + 9
        if ftype != _CONTINUATION and flags & _PADDED:
            lo += 1                                            # the pad length
        if ftype == _HEADERS and flags & _PRIORITY:
            lo += 5                                            # stream dependency and weight
        hi = lo + len(block)
        if ftype == _DATA:
            assert self.body_mask is not None
            masked = self.body_mask(block)
            return None if masked == block else (lo, hi, masked, [])
        try:                                                   # HEADERS, CONTINUATION
            spans = self.hpack.decode(block, self.header_mask).spans
        except HpackBlockError:
            return None            # a block split over CONTINUATION frames: left as is
        return (lo, hi, None, spans) if spans else None

    def _release(self) -> list[tuple[int, bytes]]:
        """Give back every held chunk that lies wholly before the incomplete frame at `pos`."""
        out: list[tuple[int, bytes]] = []
        offset = 0
        while self.held and offset + len(self.held[0][1]) <= self.pos:
            ts, chunk = self.held.pop(0)
            out.append((ts, bytes(self.buf[offset:offset + len(chunk)])))
            offset += len(chunk)
        del self.buf[:offset]
        self.pos -= offset
        return out

    def flush(self) -> list[tuple[int, bytes]]:
        """Capture ended: release what is held (an incomplete last frame cannot hold a secret we could parse)."""
        out, offset = [], 0
        for ts, chunk in self.held:
            out.append((ts, bytes(self.buf[offset:offset + len(chunk)])))
            offset += len(chunk)
        self.held.clear()
        self.buf.clear()
        self.pos = 0
        return out
