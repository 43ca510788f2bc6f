"""gRPC messages on HTTP/2 DATA: the 5-byte prefix, a bounded reader and bounded decompression.

    DATA payloads --MessageReader.feed()--> [(compressed flag, message bytes), ...]
                     refuses a message whose declared length is over the limit before buffering it
    (flag 1) --decompress(data, encoding, limit)--> at most `limit` bytes, however much the input inflates to

A 1 MB gzip body can inflate to 1 GiB: the limit is applied to the *decompressed* size with a
decompressor that stops at limit + 1 bytes, so neither memory nor CPU follows the attacker.
"""

from __future__ import annotations

import zlib

from wire.status import GrpcError, Status

PREFIX_LEN = 5


def prefix(payload: bytes, compressed: bool = False) -> bytes:
    """The 5-byte message prefix: compressed flag, 4-byte big-endian length."""
    return (b"\x01" if compressed else b"\x00") + len(payload).to_bytes(4, "big")


def frame_message(payload: bytes, compressed: bool = False) -> bytes:
    return prefix(payload, compressed) + payload


def too_large(size: int, limit: int) -> GrpcError:
    return GrpcError(Status.RESOURCE_EXHAUSTED, f"Received message larger than max ({size} vs. {limit})")


class MessageReader:
    """Cut length-prefixed messages out of one direction of one stream's DATA.

    `feed` raises GrpcError RESOURCE_EXHAUSTED as soon as a prefix declares more than `limit` bytes:
    the message is refused before it is buffered whole. `pending` is what is buffered now."""

    __slots__ = ("buf", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf: bytearray | None = None

    @property
    def pending(self) -> int:
        return 0 if self.buf is None else len(self.buf)

    def feed(self, payload: bytes) -> list[tuple[int, bytes]]:
        """The messages completed by `payload`, as (flag, bytes)."""
        n = len(payload)
        if self.buf is None and n >= PREFIX_LEN:
            size = int.from_bytes(payload[1:5], "big")
            if n == PREFIX_LEN + size and size <= self.limit:
                return [(payload[0], payload[5:])]     # the usual case: one whole message in one frame
        buf = self.buf = (self.buf or bytearray()) + payload
        out: list[tuple[int, bytes]] = []
        while len(buf) >= PREFIX_LEN:
            size = int.from_bytes(buf[1:5], "big")
            if size > self.limit:
                self.buf = None
                raise too_large(size, self.limit)
            if len(buf) < PREFIX_LEN + size:
                break
            out.append((buf[0], bytes(buf[5:5 + size])))
            del buf[:5 + size]
        if not buf:
            self.buf = None
        return out


_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
SUPPORTED_ENCODINGS = ("identity", "gzip", "deflate")


def decompress(data: bytes, encoding: str, limit: int) -> bytes:
    """A compressed message's bytes, at most `limit` of them.

    Raises GrpcError: INTERNAL when the flag is set with no (or identity) encoding, as grpc-go and
    grpcio refuse it; UNIMPLEMENTED for an encoding we do not support; RESOURCE_EXHAUSTED when the
    message inflates past `limit`; INTERNAL when the bytes do not decompress."""
    if encoding in ("", "identity"):
        raise GrpcError(Status.INTERNAL, "compressed flag set with identity or empty encoding")
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise GrpcError(Status.UNIMPLEMENTED, f"grpc-encoding {encoding} is not supported")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise GrpcError(Status.INTERNAL, f"cannot decompress the message ({encoding}): {exc}") from exc
    if len(out) > limit:
        raise GrpcError(Status.RESOURCE_EXHAUSTED,
                        f"Received message larger than max (over {limit} bytes after decompression)")
    if not inflater.eof:
        raise GrpcError(Status.INTERNAL, f"cannot decompress the message ({encoding}): truncated")
    return out
