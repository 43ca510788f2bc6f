"""HTTP/2 frames (RFC 9113): names, building, splitting, stripping and validation.

Hot-path shape: frames are split straight out of the receive buffer with one `struct` unpack per
frame into plain tuples `(type, flags, stream, payload)`; no object per frame. The enums are IntEnums,
so `ftype == FrameType.DATA` costs what comparing two ints costs; hot loops may bind the members to
locals.

    buf --split()--> [(type, flags, stream, payload), ...], next position, error or None
          strip()    DATA/HEADERS payload without padding and priority fields
          BlockAssembler   HEADERS + CONTINUATION -> one header block, capped while it grows
"""

from __future__ import annotations

import struct
from enum import IntEnum

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_MAX_FRAME = 16_384          # every peer must accept this; larger only when advertised
MAX_FRAME_LIMIT = (1 << 24) - 1     # the largest MAX_FRAME_SIZE a peer may advertise
DEFAULT_WINDOW = 65_535             # initial connection and stream window before SETTINGS
MAX_WINDOW = (1 << 31) - 1          # a flow-control window may never exceed this
MAX_STREAM_ID = (1 << 31) - 1

HEAD = struct.Struct(">BHBBL")      # length as 8+16 bits, type, flags, stream id (R bit included)
U32 = struct.Struct(">L")
SETTING = struct.Struct(">HL")
GOAWAY_BODY = struct.Struct(">LL")


class FrameType(IntEnum):
    DATA = 0x0
    HEADERS = 0x1
    PRIORITY = 0x2
    RST_STREAM = 0x3
    SETTINGS = 0x4
    PUSH_PROMISE = 0x5
    PING = 0x6
    GOAWAY = 0x7
    WINDOW_UPDATE = 0x8
    CONTINUATION = 0x9


class Flag(IntEnum):
    """Frame flags. An IntEnum, not an IntFlag: `int & IntFlag` runs Python code (~780 ns against
    ~18 ns for `int & IntEnum`), and flags are tested on every frame."""

    END_STREAM = 0x1
    ACK = 0x1                        # SETTINGS and PING reuse bit 0 (an alias of END_STREAM)
    END_HEADERS = 0x4
    PADDED = 0x8
    PRIORITY = 0x20


class Setting(IntEnum):
    HEADER_TABLE_SIZE = 0x1
    ENABLE_PUSH = 0x2
    MAX_CONCURRENT_STREAMS = 0x3
    INITIAL_WINDOW_SIZE = 0x4
    MAX_FRAME_SIZE = 0x5
    MAX_HEADER_LIST_SIZE = 0x6


class ErrorCode(IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


def error_name(code: int) -> str:
    """ErrorCode's name, or the number for codes this module does not know."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"error {code:#x}"


def frame_name(ftype: int) -> str:
    """FrameType's name, or "frame type 0x.." for extension frames."""
    try:
        return FrameType(ftype).name
    except ValueError:
        return f"frame type {ftype:#x}"


class WireError(Exception):
    """Root of the wire layer's errors (see the package docstring for the tree)."""


class H2Error(WireError):
    """An HTTP/2 error. `stream` 0: a connection error (GOAWAY); otherwise a stream error (RST_STREAM)."""

    def __init__(self, code: ErrorCode, why: str, stream: int = 0) -> None:
        super().__init__(why)
        self.code, self.why, self.stream = code, why, stream

    def __str__(self) -> str:
        where = f" on stream {self.stream}" if self.stream else ""
        return f"{self.code.name}{where}: {self.why}"


# ---- building ------------------------------------------------------------------------------------
def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return HEAD.pack(n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def settings(values: dict[int, int]) -> bytes:
    return frame(FrameType.SETTINGS, 0, 0, b"".join(SETTING.pack(k, v) for k, v in values.items()))


SETTINGS_ACK = frame(FrameType.SETTINGS, Flag.ACK, 0)


def window_update(sid: int, increment: int) -> bytes:
    return frame(FrameType.WINDOW_UPDATE, 0, sid, U32.pack(increment))


def rst_stream(sid: int, code: int) -> bytes:
    return frame(FrameType.RST_STREAM, 0, sid, U32.pack(code))


def goaway(last_sid: int, code: int, debug: bytes = b"") -> bytes:
    return frame(FrameType.GOAWAY, 0, 0, GOAWAY_BODY.pack(last_sid, code) + debug)


def ping(payload: bytes, ack: bool = False) -> bytes:
    return frame(FrameType.PING, Flag.ACK if ack else 0, 0, payload)


def headers(sid: int, block: bytes, max_frame: int, end_stream: bool = False) -> bytes:
    """HEADERS, plus CONTINUATION frames when the block is larger than the peer's MAX_FRAME_SIZE."""
    flags = Flag.END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return frame(FrameType.HEADERS, flags | Flag.END_HEADERS, sid, block)
    parts = [block[i:i + max_frame] for i in range(0, len(block), max_frame)]
    last = len(parts) - 1
    out = [frame(FrameType.HEADERS, flags, sid, parts[0])]
    out += [frame(FrameType.CONTINUATION, Flag.END_HEADERS if i == last else 0, sid, p)
            for i, p in enumerate(parts[1:], 1)]
    return b"".join(out)


def data_frames(sid: int, payload: bytes | memoryview, max_frame: int, end_stream: bool = False) -> bytes:
    """`payload` as DATA frames of at most `max_frame` bytes; END_STREAM on the last one if asked."""
    n = len(payload)
    if n <= max_frame:
        return frame(FrameType.DATA, Flag.END_STREAM if end_stream else 0, sid, bytes(payload))
    out = []
    for i in range(0, n, max_frame):
        last = i + max_frame >= n
        out.append(frame(FrameType.DATA, Flag.END_STREAM if end_stream and last else 0, sid,
                         bytes(payload[i:i + max_frame])))
    return b"".join(out)


# ---- splitting -----------------------------------------------------------------------------------
Frame = tuple[int, int, int, bytes]   # (type, flags, stream id without the R bit, payload)


def split(buf: bytes, pos: int = 0, max_size: int = MAX_FRAME_LIMIT) -> tuple[list[Frame], int, H2Error | None]:
    """Whole frames from `buf[pos:]`, the position after the last of them, and an error or None.

    A frame header whose length exceeds `max_size` (what we advertised as MAX_FRAME_SIZE) stops the
    split with FRAME_SIZE_ERROR as soon as its 9 bytes are in: the frames before it are returned
    for processing, and nothing of the oversized frame is ever buffered."""
    frames: list[Frame] = []
    size, unpack = len(buf), HEAD.unpack_from
    while size - pos >= 9:
        hi, lo, ftype, flags, sid = unpack(buf, pos)
        length = hi << 16 | lo
        if length > max_size:
            return frames, pos, H2Error(ErrorCode.FRAME_SIZE_ERROR,
                                        f"{length}-byte frame over MAX_FRAME_SIZE {max_size}")
        end = pos + 9 + length
        if end > size:
            break
        frames.append((ftype, flags, sid & MAX_STREAM_ID, buf[pos + 9:end]))
        pos = end
    return frames, pos, None


def frame_lengths_plausible(data: bytes) -> bool:
    """True when `data` parses as a run of well-formed HTTP/2 frame headers (at least one): how a
    decoder that joined a connection mid-way finds a frame boundary."""
    pos, seen = 0, 0
    while pos + 9 <= len(data):
        hi, lo, ftype, _flags, stream = HEAD.unpack_from(data, pos)
        length = hi << 16 | lo
        if ftype > FrameType.CONTINUATION or stream & 0x80000000 or length > MAX_FRAME_LIMIT:
            return False
        if ftype in _CONNECTION_ONLY and stream != 0:
            return False
        if ftype in _STREAM_ONLY and stream == 0:
            return False
        pos += 9 + length
        seen += 1
    return seen > 0


_CONNECTION_ONLY = frozenset((FrameType.SETTINGS, FrameType.PING, FrameType.GOAWAY))
_STREAM_ONLY = frozenset((FrameType.DATA, FrameType.HEADERS, FrameType.PRIORITY, FrameType.RST_STREAM,
                          FrameType.CONTINUATION, FrameType.PUSH_PROMISE))


# Module-level names for the per-frame paths below: an enum attribute lookup costs ~90 ns, a global ~20.
_PADDED, _PRIORITY, _END_HEADERS = Flag.PADDED, Flag.PRIORITY, Flag.END_HEADERS
_PAD_OR_PRIORITY = _PADDED | _PRIORITY
_DATA, _HEADERS, _CONTINUATION = FrameType.DATA, FrameType.HEADERS, FrameType.CONTINUATION


def strip(ftype: int, flags: int, body: bytes) -> bytes:
    """The data or header-block fragment of a DATA/HEADERS frame without padding and priority fields.

    Raises H2Error: FRAME_SIZE_ERROR when the frame is too short for its Pad Length or priority
    fields, PROTOCOL_ERROR when the padding is as long as the payload or longer (the limits are
    hyperframe's, which the tests use as the oracle)."""
    if not flags & _PAD_OR_PRIORITY or (ftype != _DATA and ftype != _HEADERS):
        return body                      # the usual case: nothing to strip
    start = pad = 0
    if flags & _PADDED:
        if not body:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "PADDED frame too short for its pad length")
        pad, start = body[0], 1
    body_len = len(body)                 # hyperframe compares DATA padding with the whole body...
    if ftype == _HEADERS:
        body_len -= start                # ...and HEADERS padding with what follows the pad length
        if flags & _PRIORITY:
            if body_len < 5:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its priority fields")
            start += 5
    if pad and pad >= body_len:
        raise H2Error(ErrorCode.PROTOCOL_ERROR, f"padding of {pad} bytes in a {len(body)}-byte payload")
    return body[start:len(body) - pad]


def strip_or_none(ftype: int, flags: int, body: bytes) -> bytes | None:
    """strip() for observers (capture): None where a peer would have raised an error."""
    try:
        return strip(ftype, flags, body)
    except H2Error:
        return None


# ---- control frames ------------------------------------------------------------------------------
def parse_settings(flags: int, sid: int, payload: bytes) -> list[tuple[int, int]]:
    """A SETTINGS frame's (identifier, value) pairs, validated; [] for an ACK.

    Raises H2Error (always a connection error) for what RFC 9113 section 6.5 forbids."""
    if sid:
        raise H2Error(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
    if flags & Flag.ACK:
        if payload:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
        return []
    if len(payload) % 6:
        raise H2Error(ErrorCode.FRAME_SIZE_ERROR, f"SETTINGS of {len(payload)} bytes (not a multiple of 6)")
    pairs = [SETTING.unpack_from(payload, i) for i in range(0, len(payload), 6)]
    for key, value in pairs:
        if key == Setting.ENABLE_PUSH and value > 1:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
        if key == Setting.INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
            raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, f"SETTINGS_INITIAL_WINDOW_SIZE {value} over 2^31-1")
        if key == Setting.MAX_FRAME_SIZE and not DEFAULT_MAX_FRAME <= value <= MAX_FRAME_LIMIT:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value} outside 2^14..2^24-1")
    return pairs


def check_control(ftype: int, flags: int, sid: int, payload: bytes) -> None:
    """Raise H2Error for a malformed PING, WINDOW_UPDATE, RST_STREAM, PRIORITY or GOAWAY frame."""
    n = len(payload)
    if ftype == FrameType.PING:
        if sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
        if n != 8:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, f"PING of {n} bytes")
    elif ftype == FrameType.WINDOW_UPDATE:
        if n != 4:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, f"WINDOW_UPDATE of {n} bytes")
        if not U32.unpack(payload)[0] & MAX_WINDOW:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE with increment 0", sid)
    elif ftype == FrameType.RST_STREAM or ftype == FrameType.PRIORITY:
        if not sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"{FrameType(ftype).name} on stream 0")
        want = 4 if ftype == FrameType.RST_STREAM else 5
        if n != want:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, f"{FrameType(ftype).name} of {n} bytes")
    elif ftype == FrameType.GOAWAY:
        if sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
        if n < 8:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, f"GOAWAY of {n} bytes")


def grow_window(window: int, increment: int, sid: int) -> int:
    """`window` + `increment`, or H2Error FLOW_CONTROL_ERROR when that exceeds 2^31-1."""
    window += increment
    if window > MAX_WINDOW:
        raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, "WINDOW_UPDATE took the window over 2^31-1", sid)
    return window


# ---- header blocks -------------------------------------------------------------------------------
class BlockAssembler:
    """HEADERS + CONTINUATION -> one header block, for one direction of one connection.

    The block is capped while it is assembled, before END_HEADERS: a peer that sends CONTINUATION
    without end holds at most `max_size` bytes of ours, then gets ENHANCE_YOUR_CALM. While a block is
    open `sid` is its stream and the caller must accept nothing but its CONTINUATION frames."""

    MAX_FRAGMENTS = 64   # a 64 KiB block needs 5 frames at the default frame size; 64 empty ones is a flood

    __slots__ = ("sid", "flags", "parts", "size", "max_size")

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.sid = 0
        self.flags = 0
        self.parts: list[bytes] = []
        self.size = 0

    def headers(self, sid: int, flags: int, fragment: bytes) -> bytes | None:
        """The whole block when this HEADERS frame ends it, else None (wait for CONTINUATION)."""
        if self.sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {sid} inside the header block of {self.sid}")
        if len(fragment) > self.max_size:
            raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, f"header block over {self.max_size} bytes")
        if flags & _END_HEADERS:
            return fragment
        self.sid, self.flags, self.parts, self.size = sid, flags, [fragment], len(fragment)
        return None

    def continuation(self, sid: int, flags: int, fragment: bytes) -> bytes | None:
        """The whole block when this CONTINUATION ends it, else None."""
        if not self.sid or sid != self.sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"CONTINUATION on stream {sid} without HEADERS")
        self.size += len(fragment)
        if self.size > self.max_size or len(self.parts) >= self.MAX_FRAGMENTS:
            raise H2Error(ErrorCode.ENHANCE_YOUR_CALM,
                          f"header block over {self.max_size} bytes or {self.MAX_FRAGMENTS} frames")
        self.parts.append(fragment)
        if not flags & _END_HEADERS:
            return None
        block = b"".join(self.parts)
        self.sid, self.parts = 0, []
        return block

    def reset(self) -> None:
        """Forget a partial block (observers after a gap in the bytes)."""
        self.sid, self.parts, self.size = 0, [], 0


# ---- the receive loop ----------------------------------------------------------------------------
class FrameLoop:
    """The receive loop both endpoints share (the agent's server, the replay sender): frames in order,
    header blocks assembled, stream errors kept to their stream.

    Subclasses give `blocks` (a BlockAssembler), `closed`, and the handlers below. A handler raises
    H2Error: one with a stream id becomes `on_stream_error` and the loop goes on; a connection error
    propagates to the caller, which answers GOAWAY."""

    blocks: BlockAssembler
    closed: bool

    def run_frames(self, frames: list[Frame]) -> None:
        blocks = self.blocks
        for ftype, flags, sid, payload in frames:
            try:
                if blocks.sid and ftype != _CONTINUATION:
                    raise H2Error(ErrorCode.PROTOCOL_ERROR, f"{frame_name(ftype)} on stream {sid} inside the header "
                                                            f"block of stream {blocks.sid}")
                if ftype == _DATA:
                    self.on_data(sid, flags, payload)
                elif ftype == _HEADERS:
                    self._headers(sid, flags, payload)
                elif ftype == _CONTINUATION:
                    if not payload and not flags & _END_HEADERS:
                        self.on_empty_frame("empty CONTINUATION frames")
                    block = blocks.continuation(sid, flags, payload)
                    if block is not None:
                        self.on_block(sid, blocks.flags, block)
                else:
                    self.on_control(ftype, sid, flags, payload)
            except H2Error as exc:
                if not exc.stream:
                    raise
                self.on_stream_error(exc)
            if self.closed:
                return

    def _headers(self, sid: int, flags: int, payload: bytes) -> None:
        if not sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        fragment = strip(_HEADERS, flags, payload) if flags & _PAD_OR_PRIORITY else payload
        block = self.blocks.headers(sid, flags, fragment)
        if block is not None:
            self.on_block(sid, flags, block)
        elif not fragment:
            self.on_empty_frame("empty header fragments")

    def on_data(self, sid: int, flags: int, payload: bytes) -> None:
        raise NotImplementedError

    def on_block(self, sid: int, flags: int, block: bytes) -> None:
        """A whole header block; `flags` are its HEADERS frame's (END_STREAM)."""
        raise NotImplementedError

    def on_control(self, ftype: int, sid: int, flags: int, payload: bytes) -> None:
        raise NotImplementedError

    def on_stream_error(self, exc: H2Error) -> None:
        raise NotImplementedError

    def on_empty_frame(self, what: str) -> None:
        """An empty frame that moves nothing forward; a server counts these against a flood budget."""
