"""HTTP/2 and gRPC decoding: frames split here, headers with `hpack` (capture/decode/hpack_tolerant.py).

    c2s bytes --frames--> HEADERS (:path, metadata) / DATA (5-byte-prefixed messages) --+
    s2c bytes --frames--> HEADERS (status) / DATA (messages) / trailers (grpc-status) ---+--> Call

Each message carries the timestamp of the chunk that completed it. A call is emitted once both
directions ended (END_STREAM) or the stream was reset. On a connection joined mid-stream the first
bytes may start inside a frame: each direction stays unsynchronised until a chunk parses as whole
frames, and header fields that refer to dynamic-table entries we never saw are skipped and the call
is marked `method_unknown` when its :path was among them.

Frames are split on their 9-byte header and unpadded here rather than through `hyperframe` objects:
this runs for every frame a production service sends while it is being recorded, and a frame object
per frame was a third of the recorder's CPU. The rules are hyperframe's: a frame whose padding or
RST_STREAM body is malformed, or a stream frame on stream 0, is skipped (the raw chunks keep it).
"""

from __future__ import annotations

import struct

from capture.decode.hpack_tolerant import DecodedBlock, HpackBlockError, TolerantDecoder
from capture.recording import Call, Direction, Message

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_MAX_FRAME = 1 << 24
_DATA, _HEADERS, _RST_STREAM, _CONTINUATION = 0, 1, 3, 9
_END_STREAM, _END_HEADERS, _PADDED, _PRIORITY = 0x1, 0x4, 0x8, 0x20
_HEADER = struct.Struct(">HBBBI")   # length (24 bits as 16 + 8), type, flags, stream id


def frame_body(ftype: int, flags: int, body: bytes) -> bytes | None:
    """The data or header-block fragment of a DATA/HEADERS frame without padding and priority
    fields; None where hyperframe would raise (padding too long, fields cut short)."""
    if not flags & (_PADDED | _PRIORITY):
        return body                      # the usual case: nothing to strip
    start = pad = 0
    if flags & _PADDED:
        if not body:
            return None
        pad, start = body[0], 1
    body_len = len(body)                 # hyperframe compares DATA padding with the whole body...
    if ftype == _HEADERS:
        body_len -= start                # ...and HEADERS padding with what follows the pad length
        if flags & _PRIORITY:
            if body_len < 5:
                return None
            start += 5
    if pad and pad >= body_len:
        return None
    return body[start:len(body) - pad]


def plausible_frames(data: bytes) -> bool:
    """True when `data` parses as a run of well-formed HTTP/2 frame headers (at least one)."""
    pos, seen = 0, 0
    while pos + 9 <= len(data):
        length = int.from_bytes(data[pos:pos + 3], "big")
        ftype, stream = data[pos + 3], struct.unpack(">I", data[pos + 5:pos + 9])[0]
        if ftype > 9 or stream & 0x80000000 or length >= _MAX_FRAME:
            return False
        if ftype in (4, 6, 7) and stream != 0:   # SETTINGS, PING, GOAWAY live on stream 0
            return False
        if ftype in (0, 1, 3) and stream == 0:
            return False
        pos += 9 + length
        seen += 1
    return seen > 0


class _Side:
    """One direction's frame parser state."""

    def __init__(self, synced: bool) -> None:
        self.buf = b""                 # a partial frame carried to the next chunk
        self.synced = synced
        self.hpack = TolerantDecoder()
        self.block: tuple[int, bytearray, int] | None = None   # (stream, fragment, flags)
        self.skipped = 0


class _Stream:
    def __init__(self, call: Call) -> None:
        self.call = call
        self.buf = {"c2s": bytearray(), "s2c": bytearray()}
        self.ended = {"c2s": False, "s2c": False}
        self.headers_seen = 0


class H2Decoder:
    """Decode one HTTP/2 connection into gRPC (or plain HTTP/2) calls."""

    protocol = "grpc"

    def __init__(self, flow_id: int | None = None, joined: bool = False) -> None:
        self.flow_id = flow_id
        self.joined = joined
        self.sides = {"c2s": _Side(not joined), "s2c": _Side(not joined)}
        self.streams: dict[int, _Stream] = {}
        self.saw_preface = joined
        self.unknown_method_calls = 0
        self.grpc_seen = False

    # -- bytes in -------------------------------------------------------------------------

    def feed(self, direction: Direction, ts_ns: int, data: bytes) -> list[Call]:
        side = self.sides[direction]
        if not side.synced:
            if not plausible_frames(bytes(data)):
                side.skipped += len(data)   # wait for a chunk that starts on a frame boundary
                return []
            side.synced = True
        buf = side.buf + data if side.buf else bytes(data)
        if direction == "c2s" and not self.saw_preface:
            if len(buf) < len(PREFACE):
                side.buf = buf
                return []
            if buf.startswith(PREFACE):
                buf = buf[len(PREFACE):]
            self.saw_preface = True
        done: list[Call] = []
        pos, end, unpack = 0, len(buf), _HEADER.unpack_from
        while pos + 9 <= end:
            hi, lo, ftype, flags, stream_id = unpack(buf, pos)
            nxt = pos + 9 + (hi << 8 | lo)
            if nxt > end:
                break
            # SETTINGS, PING, WINDOW_UPDATE, ...: no call content, not worth a look
            if ftype in (_DATA, _HEADERS, _CONTINUATION, _RST_STREAM) and stream_id & 0x7FFFFFFF:
                done += self._frame(direction, ts_ns, ftype, flags, stream_id & 0x7FFFFFFF, buf[pos + 9:nxt])
            pos = nxt
        # Only a partial last frame stays behind (at most the peer's maximum frame size).
        side.buf = buf[pos:] if pos < end else b""
        return done

    def _frame(self, direction: Direction, ts_ns: int, ftype: int, flags: int, stream_id: int,
               body: bytes) -> list[Call]:
        if ftype == _RST_STREAM:
            return self._reset(ts_ns, stream_id, int.from_bytes(body, "big")) if len(body) == 4 else []
        if ftype == _CONTINUATION:
            return self._continuation(direction, ts_ns, stream_id, flags, body)
        payload = frame_body(ftype, flags, body)
        if payload is None:
            return []   # malformed padding: skip, the raw chunks keep it
        if ftype == _HEADERS:
            return self._headers_start(direction, ts_ns, stream_id, flags, payload)
        return self._data(direction, ts_ns, stream_id, flags, payload)

    # -- headers ----------------------------------------------------------------------------

    def _headers_start(self, direction: Direction, ts_ns: int, stream_id: int, flags: int,
                       fragment: bytes) -> list[Call]:
        side = self.sides[direction]
        side.block = (stream_id, bytearray(fragment), flags & _END_STREAM)
        if flags & _END_HEADERS:
            return self._headers_done(direction, ts_ns)
        return []

    def _continuation(self, direction: Direction, ts_ns: int, stream_id: int, flags: int,
                      fragment: bytes) -> list[Call]:
        side = self.sides[direction]
        if side.block is None or side.block[0] != stream_id:
            return []
        side.block[1].extend(fragment)
        if flags & _END_HEADERS:
            return self._headers_done(direction, ts_ns)
        return []

    def _headers_done(self, direction: Direction, ts_ns: int) -> list[Call]:
        side = self.sides[direction]
        assert side.block is not None
        stream_id, block, end_stream = side.block
        side.block = None
        try:
            decoded = side.hpack.decode(bytes(block))
        except HpackBlockError:
            decoded = DecodedBlock(missing=1)
        st = self._stream(stream_id, ts_ns, direction)
        if direction == "c2s":
            self._request_headers(st, decoded)
        else:
            self._response_headers(st, ts_ns, decoded)
        if end_stream:
            return self._end(st, direction, ts_ns)
        return []

    def _request_headers(self, st: _Stream, decoded: DecodedBlock) -> None:
        call = st.call
        if decoded.view is None:
            headers = decoded.headers
            path = next((v for k, v in headers if k == ":path"), None)
            ctype = next((v for k, v in headers if k == "content-type"), "")
            decoded.view = (path, ctype.startswith("application/grpc"),
                            tuple((k, v) for k, v in headers if not k.startswith(":")))
        path, grpc, meta = decoded.view
        if path is not None:
            call.method, call.method_unknown = path, False
        elif decoded.missing and call.method is None:
            call.method_unknown = True
        if grpc:
            self.grpc_seen = True
        call.request_metadata = list(meta)

    def _response_headers(self, st: _Stream, ts_ns: int, decoded: DecodedBlock) -> None:
        call = st.call
        st.headers_seen += 1
        if decoded.view is None:
            decoded.view = _response_view(decoded.headers)
        status, message, trailer_meta, http, meta = decoded.view
        if status is not None:                      # trailers (or trailers-only)
            call.status = int(status) if status.isdigit() else None
            call.status_message = message
            call.end_ts_ns = ts_ns
            if call.response_ts_ns is None:
                call.response_ts_ns = ts_ns
            call.response_metadata += trailer_meta
            return
        if http is not None and not http.startswith("2"):
            call.status = int(http) if http.isdigit() else None
        call.response_ts_ns = call.response_ts_ns or ts_ns
        call.response_metadata += meta

    # -- data and the end of a stream ------------------------------------------------------------

    def _stream(self, stream_id: int, ts_ns: int, direction: Direction) -> _Stream:
        st = self.streams.get(stream_id)
        if st is None:
            call = Call(protocol="grpc", method=None, request_ts_ns=ts_ns, flow_id=self.flow_id,
                        stream_id=stream_id)
            if direction == "s2c" or self.joined:
                call.method_unknown = True        # we missed its request headers
            st = self.streams[stream_id] = _Stream(call)
        return st

    def _data(self, direction: Direction, ts_ns: int, stream_id: int, flags: int, payload: bytes) -> list[Call]:
        st = self._stream(stream_id, ts_ns, direction)
        buf = st.buf[direction]
        buf += payload
        msgs = st.call.requests if direction == "c2s" else st.call.responses
        while len(buf) >= 5:
            size = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + size:
                break
            msgs.append(Message(direction, len(msgs), ts_ns, bytes(buf[5:5 + size]), bool(buf[0] & 1)))
            del buf[:5 + size]
        if direction == "s2c" and st.call.response_ts_ns is None:
            st.call.response_ts_ns = ts_ns
        if flags & _END_STREAM:
            return self._end(st, direction, ts_ns)
        return []

    def _end(self, st: _Stream, direction: Direction, ts_ns: int) -> list[Call]:
        st.ended[direction] = True
        if direction == "s2c":
            st.call.end_ts_ns = st.call.end_ts_ns or ts_ns
        if st.ended["s2c"]:
            return [self._close(st)]
        return []

    def _reset(self, ts_ns: int, stream_id: int, error_code: int) -> list[Call]:
        st = self.streams.get(stream_id)
        if st is None:
            return []
        st.call.end_ts_ns = ts_ns
        if st.call.status is None:
            st.call.status_message = f"RST_STREAM error code {error_code}"
        return [self._close(st)]

    def _close(self, st: _Stream) -> Call:
        call = st.call
        self.streams.pop(call.stream_id or 0, None)
        call.kind = _kind(len(call.requests), len(call.responses))
        if not self.grpc_seen and not call.method_unknown:
            call.protocol = "http2"
        if call.method_unknown:
            self.unknown_method_calls += 1
        return call

    def gap(self, direction: Direction) -> None:
        """Bytes went missing: drop partial frames and messages, wait for a frame boundary."""
        side = self.sides[direction]
        side.buf = b""
        side.block = None
        side.synced = False
        for st in self.streams.values():
            st.buf[direction].clear()

    def finish(self, ts_ns: int | None = None) -> list[Call]:
        """Calls still open when the flow ended or capture stopped (status None)."""
        return [self._close(st) for st in list(self.streams.values())]


def _response_view(headers: list[tuple[str, str]]) -> tuple[str | None, str | None, tuple[tuple[str, str], ...],
                                                            str | None, tuple[tuple[str, str], ...]]:
    """(grpc-status, grpc-message, trailer metadata, :status, metadata) of a response header block."""
    meta = tuple((k, v) for k, v in headers if not k.startswith(":"))
    return (next((v for k, v in headers if k == "grpc-status"), None),
            next((v for k, v in headers if k == "grpc-message"), None),
            tuple((k, v) for k, v in meta if k not in ("grpc-status", "grpc-message")),
            next((v for k, v in headers if k == ":status"), None), meta)


def _kind(n_req: int, n_resp: int) -> str:
    # The wire does not say whether a method is streaming; message counts are the evidence.
    if n_req > 1 and n_resp > 1:
        return "bidi"
    if n_req > 1:
        return "client_stream"
    if n_resp > 1:
        return "server_stream"
    return "unary"
