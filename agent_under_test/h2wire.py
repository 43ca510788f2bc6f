"""HTTP/2 wire pieces the lean gRPC server needs: frame packing, SETTINGS, and header blocks.

Response header blocks use only HPACK's static table (indexed fields and literals *without indexing*),
so every block is valid on every connection, is built once and reused byte for byte, and a capture
that joins a connection mid-way can still decode it. Requests are decoded with `hpack.Decoder`
(clients do use the dynamic table).

The agent is the system under test and imports nothing of the harness, so it keeps its own copy of
these few lines rather than sharing the replayer's client-side framing.
"""

from __future__ import annotations

import base64
import struct
from urllib.parse import quote

from hpack.hpack import encode_integer
from hpack.table import HeaderTable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 1, 2, 3, 4, 5
MAX_HEADER_LIST_SIZE = 6
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 0x7, 0x8, 0xB

HEAD = struct.Struct(">BHBBL")  # length as 8+16 bits, type, flags, stream id
U32 = struct.Struct(">L")
SETTING = struct.Struct(">HL")
GOAWAY_BODY = struct.Struct(">LL")


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return HEAD.pack(n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(SETTING.pack(k, v) for k, v in values.items()))


def goaway(last_sid: int, error: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, GOAWAY_BODY.pack(last_sid, error) + debug)


def headers(sid: int, block: bytes, max_frame: int, end_stream: bool) -> bytes:
    """HEADERS, plus CONTINUATION frames when the block is larger than the peer's MAX_FRAME_SIZE."""
    flags = END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return frame(HEADERS, flags | END_HEADERS, sid, block)
    parts = [block[i:i + max_frame] for i in range(0, len(block), max_frame)]
    last = len(parts) - 1
    return b"".join([frame(HEADERS, flags, sid, parts[0])]
                    + [frame(CONTINUATION, END_HEADERS if i == last else 0, sid, p) for i, p in enumerate(parts)
                       if i > 0])


def data_frames(sid: int, payload: bytes, max_frame: int) -> bytes:
    """`payload` as DATA frames of at most `max_frame` bytes (never END_STREAM: gRPC ends with trailers)."""
    if len(payload) <= max_frame:
        return frame(DATA, 0, sid, payload)
    return b"".join(frame(DATA, 0, sid, payload[i:i + max_frame]) for i in range(0, len(payload), max_frame))


# ---- header blocks from the static table only -------------------------------------------------------
_EXACT: dict[tuple[bytes, bytes], int] = {}
_NAME: dict[bytes, int] = {}
for _i, (_n, _v) in enumerate(HeaderTable.STATIC_TABLE, 1):
    _EXACT.setdefault((_n, _v), _i)
    _NAME.setdefault(_n, _i)


def _literal(s: bytes) -> bytes:
    return (bytes((len(s),)) if len(s) < 127 else bytes(encode_integer(len(s), 7))) + s  # no Huffman


def field(name: str, value: str) -> bytes:
    """One header field: indexed when the static table holds it whole, else a literal never indexed."""
    n, v = name.encode(), value.encode()
    idx = _EXACT.get((n, v))
    if idx is not None:
        head = encode_integer(idx, 7)
        head[0] |= 0x80
        return bytes(head)
    idx = _NAME.get(n)
    if idx is not None:
        return (bytes((idx,)) if idx < 15 else bytes(encode_integer(idx, 4))) + _literal(v)
    return b"\x00" + _literal(n) + _literal(v)


def block(fields: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> bytes:
    return b"".join(field(k, v) for k, v in fields)


RESPONSE_HEADERS = block([(":status", "200"), ("content-type", "application/grpc")])
TRAILERS_OK = block([("grpc-status", "0")])


def grpc_message(text: str) -> str:
    """gRPC's percent-encoding for grpc-message: printable ASCII stays, everything else is %XX of UTF-8."""
    return quote(text, safe=" !\"#$&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`"
                            "abcdefghijklmnopqrstuvwxyz{|}~")


_STATUS: dict[tuple[int, str, tuple[tuple[str, str], ...], bool], bytes] = {}


def status_block(code: int, message: str, metadata: tuple[tuple[str, str], ...] = (),
                 trailers_only: bool = False) -> bytes:
    """The trailer block for a call's end (with :status and content-type when nothing was sent yet).

    Memoised (bounded): a refusal under overload is the same few blocks thousands of times a second."""
    key = (code, message, metadata, trailers_only)
    hit = _STATUS.get(key)
    if hit is None:
        if len(_STATUS) >= 1024:
            _STATUS.clear()
        hit = _STATUS[key] = _status_block(code, message, metadata, trailers_only)
    return hit


def _status_block(code: int, message: str, metadata: tuple[tuple[str, str], ...], trailers_only: bool) -> bytes:
    fields = [(":status", "200"), ("content-type", "application/grpc")] if trailers_only else []
    fields.append(("grpc-status", str(code)))
    if message:
        fields.append(("grpc-message", grpc_message(message)))
    return block(fields + [(k, _b64(v) if k.endswith("-bin") else v) for k, v in metadata])


def _b64(value: str | bytes) -> str:
    """A binary (-bin) metadata value as gRPC sends it: base64 without padding."""
    raw = value if isinstance(value, bytes) else value.encode()
    return base64.b64encode(raw).decode().rstrip("=")


_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def parse_timeout(value: str) -> float | None:
    """grpc-timeout ('250m', '5S', ...) in seconds; None when it is malformed (then it is ignored)."""
    unit = _UNITS.get(value[-1:]) if value else None
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit
