"""HTTP/2 and gRPC decoding on `wire`: frames split by `wire.h2`, headers by its tolerant HPACK decoder.

    c2s bytes --frames--> HEADERS (:path, metadata) / DATA (5-byte-prefixed messages) --+
    s2c bytes --frames--> HEADERS (status) / DATA (messages) / trailers (grpc-status) ---+--> Call

Each message carries the timestamp of the chunk that completed it. A call is emitted once both
directions ended (END_STREAM) or the stream was reset. On a connection joined mid-stream the first
bytes may start inside a frame: each direction stays unsynchronised until a chunk parses as whole
frames, and header fields that refer to dynamic-table entries we never saw are skipped and the call
is marked `method_unknown` when its :path was among them.

Identity of what was skipped: `wire.headers.TolerantDecoder` names each such reference by its
pre-join ordinal (stable while later insertions shift indices), and a call whose request headers had
any gets `method_ref = "hpack:" + ",".join(ordinals)` (e.g. "hpack:5,4,3,2,1"). Calls on one
connection with the same method_ref carry the same (unknown) values in all those fields, so the same
:path (gRPC method) and :authority: a method has to be found once per (flow, method_ref) group.
After a gap in the client's bytes the HPACK state cannot be trusted (insertions may have been lost):
the client side's table starts afresh, as on a join, and its refs are then "hpack@N:..." (N: the
gaps so far), so groups never mix references from before and after a gap.

This observes, it never answers: whatever `wire` would refuse as a peer is skipped here (the raw
chunks keep it). A frame whose padding or RST_STREAM body is malformed, or a stream frame on stream
0, is skipped; a header block over MAX_HEADER_BLOCK (or the assembler's fragment limit) is treated as
undecodable; a gRPC message whose prefix declares more than MAX_MESSAGE bytes is not buffered: its
bytes are skipped and counted in `truncated_messages` (the recording's meta and `inspect` report it).
Frames are split with one struct unpack each into plain tuples (`wire.h2.split`), no frame object:
this runs for every frame a production service sends while it is being recorded.
"""

from __future__ import annotations

from capture.recording import CALL_DAMAGED, STATUS_HIDDEN, Call, Direction, Message
from wire.h2 import PREFACE, BlockAssembler, Flag, FrameType, H2Error, split, strip_or_none
from wire.h2 import frame_lengths_plausible as plausible_frames
from wire.headers import DecodedBlock, HpackBlockError, TolerantDecoder
from wire.messages import PREFIX_LEN

__all__ = ["MAX_HEADER_BLOCK", "MAX_MESSAGE", "H2Decoder"]

MAX_HEADER_BLOCK = 1 << 20   # per direction: a block still open holds at most this much of ours
MAX_MESSAGE = 16 << 20       # per stream and direction: a longer message is skipped, not buffered

# Module-level names for the hot path: an enum attribute lookup per frame costs ~90 ns, a global ~20.
_DATA, _HEADERS, _RST_STREAM, _CONTINUATION = (int(FrameType.DATA), int(FrameType.HEADERS),
                                               int(FrameType.RST_STREAM), int(FrameType.CONTINUATION))
_END_STREAM = int(Flag.END_STREAM)


class _Side:
    """One direction's frame parser state."""

    def __init__(self, synced: bool) -> None:
        self.buf = b""                 # a partial frame carried to the next chunk
        self.synced = synced
        self.hpack = TolerantDecoder()
        self.block = BlockAssembler(MAX_HEADER_BLOCK)
        self.skipped = 0
        self.epoch = 0                 # gaps so far: a fresh HPACK table (and ref namespace) after each


class _Stream:
    def __init__(self, call: Call) -> None:
        self.call = call
        self.buf = {"c2s": bytearray(), "s2c": bytearray()}
        self.skip = {"c2s": 0, "s2c": 0}      # bytes still to come of a message over max_message
        self.ended = {"c2s": False, "s2c": False}
        self.headers_seen = 0
        self.ctype: bool | None = None        # its request's content-type: gRPC, not gRPC, or unseen
        self.damaged: list[str] = []          # why its messages may be incomplete (gaps, oversized)


class H2Decoder:
    """Decode one HTTP/2 connection into gRPC (or plain HTTP/2) calls."""

    protocol = "grpc"
    max_message = MAX_MESSAGE

    def __init__(self, flow_id: int | None = None, joined: bool = False) -> None:
        self.flow_id = flow_id
        self.joined = joined
        self.sides = {"c2s": _Side(not joined), "s2c": _Side(not joined)}
        self.streams: dict[int, _Stream] = {}
        self.saw_preface = joined
        self.unknown_method_calls = 0
        self.truncated_messages = 0   # messages over max_message: skipped, their bytes only in the chunks
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
        # No size limit to enforce: an observer takes whatever 24-bit length the peers agreed on.
        frames, pos, _ = split(buf)
        for ftype, flags, stream_id, body in frames:
            # SETTINGS, PING, WINDOW_UPDATE, ...: no call content, not worth a look
            if stream_id and (ftype == _DATA or ftype == _HEADERS or ftype == _CONTINUATION
                              or ftype == _RST_STREAM):
                done += self._frame(direction, ts_ns, ftype, flags, stream_id, body)
        # Only a partial last frame stays behind (at most the peer's maximum frame size).
        side.buf = buf[pos:] if pos < len(buf) else b""
        return done

    def _frame(self, direction: Direction, ts_ns: int, ftype: int, flags: int, stream_id: int,
               body: bytes) -> list[Call]:
        if ftype == _RST_STREAM:
            return self._reset(ts_ns, stream_id, int.from_bytes(body, "big")) if len(body) == 4 else []
        if ftype == _CONTINUATION:
            return self._continuation(direction, ts_ns, stream_id, flags, body)
        payload = strip_or_none(ftype, flags, body)
        if payload is None:
            return []   # malformed padding: skip, the raw chunks keep it
        if ftype == _HEADERS:
            return self._headers_start(direction, ts_ns, stream_id, flags, payload)
        return self._data(direction, ts_ns, stream_id, flags, payload)

    # -- headers ----------------------------------------------------------------------------

    def _headers_start(self, direction: Direction, ts_ns: int, stream_id: int, flags: int,
                       fragment: bytes) -> list[Call]:
        asm = self.sides[direction].block
        if asm.sid:
            asm.reset()            # HEADERS inside another block: that one is lost, this one starts
        try:
            block = asm.headers(stream_id, flags, fragment)
        except H2Error:            # over MAX_HEADER_BLOCK: undecodable, the stream goes on
            return self._headers_done(direction, ts_ns, stream_id, flags, None)
        if block is None:
            return []
        return self._headers_done(direction, ts_ns, stream_id, flags, block)

    def _continuation(self, direction: Direction, ts_ns: int, stream_id: int, flags: int,
                      fragment: bytes) -> list[Call]:
        asm = self.sides[direction].block
        if asm.sid != stream_id:
            return []              # no block open on this stream (joined mid-block, or a skipped one)
        first_flags = asm.flags
        try:
            block = asm.continuation(stream_id, flags, fragment)
        except H2Error:            # over the size or fragment cap: give the block up, its frames
            asm.reset()            # that follow are ignored as CONTINUATION without a block
            return self._headers_done(direction, ts_ns, stream_id, first_flags, None)
        if block is None:
            return []
        return self._headers_done(direction, ts_ns, stream_id, first_flags, block)

    def _headers_done(self, direction: Direction, ts_ns: int, stream_id: int, flags: int,
                      block: bytes | None) -> list[Call]:
        side = self.sides[direction]
        decoded = None
        if block is not None:
            try:
                decoded = side.hpack.decode(block)
            except HpackBlockError:
                pass
        if decoded is None:
            decoded = DecodedBlock(missing=1)
        st = self._stream(stream_id, ts_ns, direction)
        if direction == "c2s":
            self._request_headers(st, decoded, side.epoch)
        else:
            self._response_headers(st, ts_ns, decoded)
            if flags & _END_STREAM and decoded.missing and st.call.status is None:
                st.call.status_message = STATUS_HIDDEN   # trailers recorded whole, yet unreadable
        if flags & _END_STREAM:
            return self._end(st, direction, ts_ns)
        return []

    def _request_headers(self, st: _Stream, decoded: DecodedBlock, epoch: int) -> None:
        call = st.call
        if decoded.view is None:
            headers = decoded.headers
            path = next((v for k, v in headers if k == ":path"), None)
            ctype = next((v for k, v in headers if k == "content-type"), None)
            # An invalid reference leaves the identity incomplete: no ref rather than a wrong group.
            ords = ",".join(map(str, decoded.refs)) if decoded.refs and not decoded.invalid else None
            decoded.view = (path, ctype is not None and ctype.startswith("application/grpc"),
                            tuple((k, v) for k, v in headers if not k.startswith(":")), ords,
                            ctype is not None and not ctype.startswith("application/grpc"))
        path, grpc, meta, ords, plain = decoded.view
        if path is not None:
            call.method, call.method_unknown = path, False
        elif decoded.missing and call.method is None:
            call.method_unknown = True
        if ords is not None and call.method_ref is None:
            call.method_ref = ("hpack:" if not epoch else f"hpack@{epoch}:") + ords
        if grpc:
            self.grpc_seen = True
        if grpc or plain:
            st.ctype = grpc
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
        skip = st.skip[direction]
        if skip:                                   # inside a message too large to keep
            n = min(skip, len(payload))
            st.skip[direction] = skip - n
            payload = payload[n:]
        msgs = st.call.requests if direction == "c2s" else st.call.responses
        buf = st.buf[direction]
        n = len(payload)
        size = int.from_bytes(payload[1:5], "big") if not buf and n >= PREFIX_LEN else -1
        if n == PREFIX_LEN + size and size <= self.max_message:   # one whole message in one frame
            msgs.append(Message(direction, len(msgs), ts_ns, payload[PREFIX_LEN:], bool(payload[0] & 1)))
        elif payload:
            buf += payload
            while len(buf) >= PREFIX_LEN:
                size = int.from_bytes(buf[1:5], "big")
                if size > self.max_message:        # refuse to buffer it: skip what is here and the rest
                    self.truncated_messages += 1
                    _damage(st, f"a {direction} message over the {self.max_message >> 20} MiB cap was not stored")
                    st.skip[direction] = max(0, PREFIX_LEN + size - len(buf))
                    del buf[:PREFIX_LEN + size]
                    continue
                if len(buf) < PREFIX_LEN + size:
                    break
                msgs.append(Message(direction, len(msgs), ts_ns, bytes(buf[5:5 + size]), bool(buf[0] & 1)))
                del buf[:PREFIX_LEN + size]
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
        if st.damaged:                 # said on the call: inspect lists it, replay --compare does not compare it
            why = f"{CALL_DAMAGED}: {', '.join(st.damaged)}"
            call.status_message = why + (f"; {call.status_message}" if call.status_message else "")
        call.kind = _kind(len(call.requests), len(call.responses))
        # gRPC unless this connection never said application/grpc and this call does not look like it:
        # its request said another content-type, or HPACK hid it (joined) and its request body was not
        # gRPC-framed. A call without a method and without evidence stays "grpc", as before.
        plain = st.ctype is False or (st.ctype is None and not self.grpc_seen
                                      and not (call.requests and not st.buf["c2s"]))
        if plain and (not call.method_unknown or st.ctype is False):
            call.protocol = "http2"
        if call.method_unknown:
            self.unknown_method_calls += 1
        return call

    def gap(self, direction: Direction) -> None:
        """Bytes went missing: drop partial frames and messages, wait for a frame boundary. The lost
        bytes may have inserted HPACK entries, so this side's table starts afresh (as on a join, and
        as the chunk masker's does): what it held would now resolve to the wrong entries."""
        side = self.sides[direction]
        side.buf = b""
        side.block.reset()
        side.synced = False
        side.hpack = TolerantDecoder()
        side.epoch += 1
        self.joined = True      # a stream whose request headers were in the gap has no method
        for st in self.streams.values():
            st.buf[direction].clear()
            st.skip[direction] = 0
            _damage(st, f"bytes lost in a gap ({direction})")

    def finish(self, ts_ns: int | None = None) -> list[Call]:
        """Calls still open when the flow ended or capture stopped (status None)."""
        return [self._close(st) for st in list(self.streams.values())]


def _damage(st: _Stream, why: str) -> None:
    if why not in st.damaged:
        st.damaged.append(why)


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
