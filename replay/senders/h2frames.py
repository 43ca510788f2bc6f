"""HTTP/2 framing for the lean gRPC sender: frame building, reusable HPACK blocks, status mapping.

Request header blocks use only HPACK's static table (indexed fields and literals *without indexing*),
never the dynamic table, so one encoded block is valid on every connection and can be reused byte for
byte: it is built once per (method, metadata, timeout) and only the 9-byte frame header is packed per
call. Responses are decoded with one `hpack.Decoder` per connection (see h2conn.py).
"""

from __future__ import annotations

import struct
from urllib.parse import unquote

from hpack.hpack import encode_integer
from hpack.table import HeaderTable

from replay.senders.base import CONNECTION_ERROR, ERROR, OK, REJECTED, TIMEOUT, SendOutcome

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
# SETTINGS identifiers
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 1, 2, 3, 4, 5
# error codes
NO_ERROR, PROTOCOL_ERROR, CANCEL = 0x0, 0x1, 0x8

FRAME_HEAD = struct.Struct(">BHBBL")  # length as 8+16 bits, type, flags, stream id
_U32 = struct.Struct(">L")

GRPC_CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
              "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
              "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")
UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE = 2, 4, 8, 13, 14
_KIND = {0: OK, RESOURCE_EXHAUSTED: REJECTED, DEADLINE_EXCEEDED: TIMEOUT, UNAVAILABLE: CONNECTION_ERROR}
# RST_STREAM error code -> gRPC status (gRPC's PROTOCOL-HTTP2.md); anything else is INTERNAL.
RST_TO_GRPC = {0x7: UNAVAILABLE, 0x8: 1, 0xB: RESOURCE_EXHAUSTED, 0xC: 7}
# HTTP status of a response without grpc-status -> gRPC status (http-grpc-status-mapping.md).
HTTP_TO_GRPC = {400: INTERNAL, 401: 16, 403: 7, 404: 12, 429: UNAVAILABLE, 502: UNAVAILABLE, 503: UNAVAILABLE,
                504: UNAVAILABLE}


def outcome(code: int, detail: str = "") -> SendOutcome:
    """The SendOutcome for gRPC status `code`, exactly as the grpc sender maps it."""
    name = GRPC_CODES[code] if 0 <= code < len(GRPC_CODES) else "UNKNOWN"
    if name == "UNKNOWN":
        code = UNKNOWN
    return SendOutcome(_KIND.get(code, ERROR), name, code, detail=detail)


def connection_failed(detail: str) -> SendOutcome:
    """A call that could not reach the target or lost its connection (grpc says UNAVAILABLE)."""
    return SendOutcome(CONNECTION_ERROR, "UNAVAILABLE", UNAVAILABLE, detail=detail)


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return FRAME_HEAD.pack(n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def settings_frame(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HL", k, v) for k, v in values.items()))


def window_update(sid: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, _U32.pack(increment))


def rst_stream(sid: int, error: int) -> bytes:
    return frame(RST_STREAM, 0, sid, _U32.pack(error))


def headers_frames(sid: int, block: bytes, max_frame: int, end_stream: bool = False) -> bytes:
    """HEADERS (+ CONTINUATION when the block exceeds the peer's MAX_FRAME_SIZE) for one stream."""
    flags = END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return frame(HEADERS, flags | END_HEADERS, sid, block)
    parts = [block[i:i + max_frame] for i in range(0, len(block), max_frame)]
    out = [frame(HEADERS, flags, sid, parts[0])]
    out += [frame(CONTINUATION, END_HEADERS if i == len(parts) - 1 else 0, sid, p) for i, p in enumerate(parts[1:], 1)]
    return b"".join(out)


# ---- HPACK encoding with the static table only ------------------------------------------------
_STATIC_EXACT: dict[tuple[bytes, bytes], int] = {}
_STATIC_NAME: dict[bytes, int] = {}
for _i, (_n, _v) in enumerate(HeaderTable.STATIC_TABLE, 1):
    _STATIC_EXACT.setdefault((_n, _v), _i)
    _STATIC_NAME.setdefault(_n, _i)


def _string(s: bytes) -> bytes:
    if len(s) < 127:
        return bytes((len(s),)) + s  # H bit 0: no Huffman
    return bytes(encode_integer(len(s), 7)) + s


def encode_field(name: str, value: str) -> bytes:
    """One header field: indexed if the static table has it whole, else a literal without indexing."""
    n, v = name.encode(), value.encode()
    idx = _STATIC_EXACT.get((n, v))
    if idx is not None:
        head = encode_integer(idx, 7)
        head[0] |= 0x80
        return bytes(head)
    idx = _STATIC_NAME.get(n)
    if idx is not None:  # 0000xxxx: literal, indexed name, not indexed
        return (bytes((idx,)) if idx < 15 else bytes(encode_integer(idx, 4))) + _string(v)
    return b"\x00" + _string(n) + _string(v)


_FIELDS: dict[tuple[str, str], bytes] = {}


def _field(name: str, value: str) -> bytes:
    """encode_field, memoised (bounded: recordings may carry a unique value per call)."""
    enc = _FIELDS.get((name, value))
    if enc is None:
        if len(_FIELDS) >= 8192:
            _FIELDS.clear()
        enc = _FIELDS[(name, value)] = encode_field(name, value)
    return enc


def request_block(method: str, authority: str, metadata: tuple[tuple[str, str], ...], timeout_s: float) -> bytes:
    """The encoded header block of a gRPC request (reusable on any connection)."""
    # the fixed part, memoised per (method, authority, timeout) in the same bounded table
    head = _FIELDS.get((method + "\0" + authority, repr(timeout_s)))
    if head is None:
        fields = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", authority),
                  ("content-type", "application/grpc"), ("te", "trailers"), ("user-agent", "shadowtest-h2/1"),
                  ("grpc-timeout", grpc_timeout(timeout_s))]
        head = _FIELDS[(method + "\0" + authority, repr(timeout_s))] = b"".join(encode_field(k, v) for k, v in fields)
    if not metadata:
        return head
    return head + b"".join([_field(k, v) for k, v in metadata])


def grpc_timeout(seconds: float) -> str:
    """gRPC's TimeoutValue: at most 8 digits and a unit."""
    for unit, scale in (("m", 1e3), ("S", 1.0), ("M", 1 / 60), ("H", 1 / 3600)):
        value = max(1, int(seconds * scale + 0.999))
        if value < 100_000_000:
            return f"{value}{unit}"
    return "99999999H"


def status_from_headers(headers: list[tuple[str, str]], http_status: int | None) -> tuple[int, str] | None:
    """(grpc code, message) from a trailer block, or None when it has no grpc-status."""
    code, message = None, ""
    for k, v in headers:
        if k == "grpc-status":
            code = int(v) if v.isdigit() else UNKNOWN
        elif k == "grpc-message":
            message = unquote(v)
    if code is None:
        if http_status is not None and http_status != 200:
            return HTTP_TO_GRPC.get(http_status, UNKNOWN), f"HTTP status {http_status} without grpc-status"
        return None
    return code, message
