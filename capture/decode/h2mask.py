"""Mask credentials inside raw HTTP/2 chunks without changing a single length.

Header values are HPACK literals: a masked value keeps its length prefix, loses its Huffman flag and
becomes '*' bytes, so the chunk stream stays valid HTTP/2 that decodes (and exports) as before, minus
the secret. DATA payloads get the body rules' same-length masks. Chunks are held back only while a
frame that spans them is incomplete, then released with their own timestamps.
"""

from __future__ import annotations

from collections.abc import Callable

from capture.decode.h2grpc import PREFACE, plausible_frames
from capture.decode.hpack_tolerant import HpackBlockError, TolerantDecoder


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
            if not plausible_frames(data):
                return [(ts_ns, data)]   # we cannot parse it, so it holds nothing we could mask
            self.synced = True
        self.held.append((ts_ns, bytearray(data)))
        self.buf += data
        if self.need_preface:
            if len(self.buf) < len(PREFACE):
                return []
            self.pos = len(PREFACE) if self.buf.startswith(PREFACE) else 0
            self.need_preface = False
        while self.pos + 9 <= len(self.buf):
            length = int.from_bytes(self.buf[self.pos:self.pos + 3], "big")
            end = self.pos + 9 + length
            if end > len(self.buf):
                break
            self._mask_frame(self.pos, end)
            self.pos = end
        return self._release()

    def _mask_frame(self, start: int, end: int) -> None:
        ftype, flags = self.buf[start + 3], self.buf[start + 4]
        body = start + 9
        if ftype == 0 and self.body_mask:                      # DATA
            pad = self.buf[body] if flags & 0x8 else 0
            lo, hi = body + (1 if flags & 0x8 else 0), end - pad
            self.buf[lo:hi] = self.body_mask(bytes(self.buf[lo:hi]))
        elif ftype in (1, 9):                                   # HEADERS, CONTINUATION
            lo, hi = body, end
            if ftype == 1:
                if flags & 0x8:
                    lo, hi = lo + 1, hi - self.buf[body]
                if flags & 0x20:
                    lo += 5
            try:
                spans = self.hpack.decode(bytes(self.buf[lo:hi]), self.header_mask).spans
            except HpackBlockError:
                return                 # a block split over CONTINUATION frames: left as is
            for prefix_at, vstart, vend in spans:
                self.buf[lo + prefix_at] &= 0x7F               # drop the Huffman flag
                self.buf[lo + vstart:lo + vend] = b"*" * (vend - vstart)

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
