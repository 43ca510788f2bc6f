"""HTTP/2 and gRPC decoding with `hyperframe` (frames) and `hpack` (headers).

    c2s bytes --frames--> HEADERS (:path, metadata) / DATA (5-byte-prefixed messages) --+
    s2c bytes --frames--> HEADERS (status) / DATA (messages) / trailers (grpc-status) ---+--> Call

Each message carries the timestamp of the chunk that completed it. A call is emitted once both
directions ended (END_STREAM) or the stream was reset. On a connection joined mid-stream the first
bytes may start inside a frame: each direction stays unsynchronised until a chunk parses as whole
frames, and header fields that refer to dynamic-table entries we never saw are skipped and the call
is marked `method_unknown` when its :path was among them.
"""

from __future__ import annotations

import struct

from hyperframe.frame import ContinuationFrame, DataFrame, Frame, HeadersFrame, RstStreamFrame

from capture.decode.hpack_tolerant import HpackBlockError, TolerantDecoder
from capture.recording import Call, Direction, Message

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_MAX_FRAME = 1 << 24
_CALL_FRAMES = frozenset((0, 1, 3, 9))   # DATA, HEADERS, RST_STREAM, CONTINUATION


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
        self.buf = bytearray()
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
        side.buf += data
        if direction == "c2s" and not self.saw_preface:
            if len(side.buf) < len(PREFACE):
                return []
            if side.buf.startswith(PREFACE):
                del side.buf[:len(PREFACE)]
            self.saw_preface = True
        done: list[Call] = []
        while len(side.buf) >= 9:
            length = int.from_bytes(side.buf[:3], "big")
            if len(side.buf) < 9 + length:
                break
            raw = bytes(side.buf[:9 + length])
            del side.buf[:9 + length]
            done += self._frame(direction, ts_ns, raw)
        return done

    def _frame(self, direction: Direction, ts_ns: int, raw: bytes) -> list[Call]:
        if raw[3] not in _CALL_FRAMES:
            return []   # SETTINGS, PING, WINDOW_UPDATE, ...: no call content, not worth an object
        try:
            frame, length = Frame.parse_frame_header(memoryview(raw[:9]))
            frame.parse_body(memoryview(raw[9:9 + length]))
        except Exception:  # noqa: BLE001 - hyperframe raises several types for junk
            return []   # unknown extension frames and junk: skip, the raw chunks keep them
        if isinstance(frame, HeadersFrame):
            return self._headers_start(direction, ts_ns, frame)
        if isinstance(frame, ContinuationFrame):
            return self._continuation(direction, ts_ns, frame)
        if isinstance(frame, DataFrame):
            return self._data(direction, ts_ns, frame)
        if isinstance(frame, RstStreamFrame):
            return self._reset(ts_ns, frame)
        return []

    # -- headers ----------------------------------------------------------------------------

    def _headers_start(self, direction: Direction, ts_ns: int, frame: HeadersFrame) -> list[Call]:
        side = self.sides[direction]
        side.block = (frame.stream_id, bytearray(frame.data), 1 if "END_STREAM" in frame.flags else 0)
        if "END_HEADERS" in frame.flags:
            return self._headers_done(direction, ts_ns)
        return []

    def _continuation(self, direction: Direction, ts_ns: int, frame: ContinuationFrame) -> list[Call]:
        side = self.sides[direction]
        if side.block is None or side.block[0] != frame.stream_id:
            return []
        side.block[1].extend(frame.data)
        if "END_HEADERS" in frame.flags:
            return self._headers_done(direction, ts_ns)
        return []

    def _headers_done(self, direction: Direction, ts_ns: int) -> list[Call]:
        side = self.sides[direction]
        assert side.block is not None
        stream_id, block, end_stream = side.block
        side.block = None
        try:
            decoded = side.hpack.decode(bytes(block))
            headers, missing = decoded.headers, decoded.missing
        except HpackBlockError:
            headers, missing = [], 1
        st = self._stream(stream_id, ts_ns, direction)
        if direction == "c2s":
            self._request_headers(st, headers, missing)
        else:
            self._response_headers(st, ts_ns, headers)
        if end_stream:
            return self._end(st, direction, ts_ns)
        return []

    def _request_headers(self, st: _Stream, headers: list[tuple[str, str]], missing: int) -> None:
        call = st.call
        path = next((v for k, v in headers if k == ":path"), None)
        if path is not None:
            call.method, call.method_unknown = path, False
        elif missing and call.method is None:
            call.method_unknown = True
        ctype = next((v for k, v in headers if k == "content-type"), "")
        if ctype.startswith("application/grpc"):
            self.grpc_seen = True
        call.request_metadata = [(k, v) for k, v in headers if not k.startswith(":")]

    def _response_headers(self, st: _Stream, ts_ns: int, headers: list[tuple[str, str]]) -> None:
        call = st.call
        st.headers_seen += 1
        meta = [(k, v) for k, v in headers if not k.startswith(":")]
        status = next((v for k, v in headers if k == "grpc-status"), None)
        if status is not None:                      # trailers (or trailers-only)
            call.status = int(status) if status.isdigit() else None
            call.status_message = next((v for k, v in headers if k == "grpc-message"), None)
            call.end_ts_ns = ts_ns
            if call.response_ts_ns is None:
                call.response_ts_ns = ts_ns
            call.response_metadata += [(k, v) for k, v in meta if k not in ("grpc-status", "grpc-message")]
            return
        http = next((v for k, v in headers if k == ":status"), None)
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

    def _data(self, direction: Direction, ts_ns: int, frame: DataFrame) -> list[Call]:
        st = self._stream(frame.stream_id, ts_ns, direction)
        buf = st.buf[direction]
        buf += frame.data
        msgs = st.call.requests if direction == "c2s" else st.call.responses
        while len(buf) >= 5:
            size = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + size:
                break
            msgs.append(Message(direction, len(msgs), ts_ns, bytes(buf[5:5 + size]), bool(buf[0] & 1)))
            del buf[:5 + size]
        if direction == "s2c" and st.call.response_ts_ns is None:
            st.call.response_ts_ns = ts_ns
        if "END_STREAM" in frame.flags:
            return self._end(st, direction, ts_ns)
        return []

    def _end(self, st: _Stream, direction: Direction, ts_ns: int) -> list[Call]:
        st.ended[direction] = True
        if direction == "s2c":
            st.call.end_ts_ns = st.call.end_ts_ns or ts_ns
        if st.ended["s2c"]:
            return [self._close(st)]
        return []

    def _reset(self, ts_ns: int, frame: RstStreamFrame) -> list[Call]:
        st = self.streams.get(frame.stream_id)
        if st is None:
            return []
        st.call.end_ts_ns = ts_ns
        if st.call.status is None:
            st.call.status_message = f"RST_STREAM error code {frame.error_code}"
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
        side.buf.clear()
        side.block = None
        side.synced = False
        for st in self.streams.values():
            st.buf[direction].clear()

    def finish(self, ts_ns: int | None = None) -> list[Call]:
        """Calls still open when the flow ended or capture stopped (status None)."""
        return [self._close(st) for st in list(self.streams.values())]


def _kind(n_req: int, n_resp: int) -> str:
    # The wire does not say whether a method is streaming; message counts are the evidence.
    if n_req > 1 and n_resp > 1:
        return "bidi"
    if n_req > 1:
        return "client_stream"
    if n_resp > 1:
        return "server_stream"
    return "unary"
