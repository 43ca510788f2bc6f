"""HTTP/2 decoding on `wire`, gRPC or plain: frames split by `wire.h2`, headers by its tolerant HPACK decoder.

    c2s bytes --frames--> HEADERS (:method, :path, content-type) / DATA --+
    s2c bytes --frames--> HEADERS (:status) / DATA / trailers ------------+--> Call (grpc | http2)

    gRPC (the request said content-type application/grpc*):  DATA = 5-byte-prefixed messages, status
        from the trailers' grpc-status (a non-2xx :status is kept: a proxy answered)
    plain HTTP/2 (any other content-type, or none):  DATA = one HTTP body per direction, stored whole
        as one message (seq 0, as HTTP/1 bodies), `status` the :status (200 included), `method`
        "VERB /path" and `kind` "request" as for HTTP/1; `:method` and `:authority` are kept in
        `request_metadata` (where HTTP/1 keeps Host)

Each message carries the timestamp of the chunk that completed it. A call is emitted once both
directions ended (END_STREAM) or the stream was reset. A call whose response ended before its request
did (a server that answers without reading the body: nginx's `return`, a 413, a gRPC error before the
client's last message; or a capture that reordered the directions) waits for the rest of its request,
which the client may already have sent: until the client's END_STREAM or RST_STREAM, and a server's
RST_STREAM then does not end it; after HOLD_NS it is given up once another call of the connection ends
(or the flow ends), its request cut off. DATA of a stream already closed never start a new call (a
header block does: a request seen after its response is still a request). A body whose direction ended without END_STREAM (reset, cut off by the
end of the capture) is incomplete: not stored, and said ("body not captured: request, cut off ...").
On a connection joined mid-stream the first
bytes may start inside a frame: each direction stays unsynchronised until a chunk parses as whole
frames, and header fields that refer to dynamic-table entries we never saw are skipped and the call
is marked `method_unknown` when its :path was among them.

gRPC or not when the request's content-type was not seen (HPACK hid it on a joined connection, or its
request headers were before the join or in a gap): gRPC when the connection said gRPC elsewhere (a
request's or response's content-type application/grpc, a grpc-status), or when the call's DATA parse
exactly as gRPC length-prefixed messages (flags 0/1, each whole, nothing left over); plain otherwise.
Until that is known the DATA are kept as bytes and checked message by message as they come (`_Body`):
a prefix that cannot be gRPC settles it as plain at once, and 16 MiB of well-formed messages as gRPC.
The gRPC path itself (content-type seen) pays one attribute test per DATA frame for all this.

Identity of what was skipped: `wire.headers.TolerantDecoder` names each such reference by its
pre-join ordinal (stable while later insertions shift indices), and a call whose request headers had
any gets `method_ref = "hpack:" + ",".join(ordinals)` (e.g. "hpack:5,4,3,2,1"). Calls on one
connection with the same method_ref carry the same (unknown) values in all those fields, so the same
:path (gRPC method) and :authority: a method has to be found once per (flow, method_ref) group.
After a gap in the client's bytes the HPACK state cannot be trusted (insertions may have been lost):
the client side's table starts afresh, as on a join, and its refs are then "hpack@N:..." (N: the
gaps so far), so groups never mix references from before and after a gap. What a gap costs is said
on the call as the gap's doing, never as a join's: a call whose request headers fell in it, and
trailers that refer to entries the gap took, are `damaged` with that reason.

This observes, it never answers: whatever `wire` would refuse as a peer is skipped here (the raw
chunks keep it). A frame whose padding or RST_STREAM body is malformed, or a stream frame on stream
0, is skipped; a header block over MAX_HEADER_BLOCK (or the assembler's fragment limit) is treated as
undecodable; a gRPC message whose prefix declares more than MAX_MESSAGE bytes is not buffered: its
bytes are skipped and counted in `truncated_messages` (the recording's meta and `inspect` report it),
and the call says so with the message's size. A plain body over MAX_MESSAGE is not stored either:
the call's status_message says "body not captured: response, N bytes, over the decoder's 16 MiB cap"
(N the real size), which replay reads as it does for HTTP/1 (a request body not captured is not sent).
Frames are split with one struct unpack each into plain tuples (`wire.h2.split`), no frame object:
this runs for every frame a production service sends while it is being recorded.
"""

from __future__ import annotations

from capture.recording import BODY_NOT_CAPTURED, CALL_DAMAGED, STATUS_HIDDEN, Call, Direction, Message
from wire.h2 import PREFACE, BlockAssembler, Flag, FrameType, H2Error, split, strip_or_none
from wire.h2 import frame_lengths_plausible as plausible_frames
from wire.headers import DecodedBlock, HpackBlockError, TolerantDecoder
from wire.messages import PREFIX_LEN

__all__ = ["MAX_HEADER_BLOCK", "MAX_MESSAGE", "H2Decoder"]

MAX_HEADER_BLOCK = 1 << 20   # per direction: a block still open holds at most this much of ours
MAX_MESSAGE = 16 << 20       # per stream and direction: a longer message (or plain body) is not buffered
_MAX_REASONS = 8             # damage reasons kept per call (each oversized message is one, with its size)
HOLD_NS = 2_000_000_000      # how long a call whose response ended waits for the rest of its request
_CLOSED_KEPT = 1024          # recently closed stream ids remembered, so their late frames start no call
_GRPC_TYPE = "application/grpc"   # also application/grpc+proto, application/grpc-web, ...
_SIDES: tuple[tuple[Direction, str], ...] = (("c2s", "request"), ("s2c", "response"))

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


class _Body:
    """The DATA of a call that is plain HTTP/2, or may be (`sure` False: its content-type was not seen).

    Each direction's bytes are kept whole up to the cap; past it only counted (`size`, the size the
    call then quotes). While not sure, each direction is also walked as gRPC length-prefixed messages
    as its bytes come (`mark`: where the next prefix starts, `ends`: (end offset, ts) of each whole
    message), so the bytes can become gRPC messages with their own timestamps, and a prefix that
    cannot be gRPC settles the call as plain at once."""

    __slots__ = ("data", "size", "ts", "mark", "ends", "sure", "status", "verb", "pseudo", "lost", "partial")

    def __init__(self, sure: bool) -> None:
        self.data: dict[str, bytearray] = {"c2s": bytearray(), "s2c": bytearray()}
        self.size = {"c2s": 0, "s2c": 0}
        self.ts = {"c2s": 0, "s2c": 0}           # the chunk that completed the body: its last DATA
        self.mark = {"c2s": 0, "s2c": 0}
        self.ends: dict[str, list[tuple[int, int]]] = {"c2s": [], "s2c": []}
        self.sure = sure
        self.status: str | None = None           # the response's :status (the last one: 1xx come first)
        self.verb: str | None = None             # the request's :method
        self.pseudo: tuple[tuple[str, str], ...] = ()   # (":method", v), (":authority", v) as seen
        self.lost: set[str] = set()              # directions a gap cut inside the body: none stored
        # Directions whose DATA came before we saw their headers (joined, or a gap): as gRPC messages they
        # can still be recovered from a frame that starts one, as a plain body they are not known whole.
        self.partial: set[str] = set()

    def settle_plain(self) -> None:
        self.sure = True
        self.ends = {"c2s": [], "s2c": []}

    def add(self, direction: Direction, ts_ns: int, payload: bytes, cap: int) -> bool:
        """Take one DATA payload; True when the call should become gRPC now: over `cap` bytes that
        all parse as well-formed gRPC messages (far past what chance would give a plain body)."""
        self.ts[direction] = ts_ns
        size = self.size[direction] = self.size[direction] + len(payload)
        data = self.data[direction]
        if size > cap:
            if not self.sure:
                if self._walk(direction, data + payload, ts_ns, cap):
                    data += payload
                    return True
                self.settle_plain()
            data.clear()                          # a body over the cap is not stored: free it now
            return False
        data += payload
        if not self.sure and not self._walk(direction, data, ts_ns, cap):
            self.settle_plain()
        return False

    def _walk(self, direction: Direction, data: bytearray | bytes, ts_ns: int, cap: int) -> bool:
        """Advance the gRPC walk over `data`; False when a prefix cannot be gRPC's."""
        mark, ends = self.mark[direction], self.ends[direction]
        while len(data) >= mark + PREFIX_LEN:
            size = int.from_bytes(data[mark + 1:mark + PREFIX_LEN], "big")
            if data[mark] > 1 or size > cap:
                return False
            end = mark + PREFIX_LEN + size
            if len(data) < end:
                break
            ends.append((end, ts_ns))
            mark = end
        self.mark[direction] = mark
        return True

    def framed(self) -> bool:
        """Did every direction with bytes parse exactly as gRPC messages (and one had bytes)?"""
        kept = [d for d in ("c2s", "s2c") if d not in self.lost and self.data[d]]
        return not self.sure and bool(kept) and all(self.mark[d] == len(self.data[d]) for d in kept)

    def lose(self, direction: Direction) -> None:
        """A gap inside this direction's body: what came before is incomplete, what follows unplaced."""
        self.lost.add(direction)
        self.data[direction].clear()
        self.ends[direction].clear()
        self.mark[direction] = 0


class _Stream:
    # Defaults on the class: a gRPC call never sets them, so they cost it nothing per call.
    http: _Body | None = None           # not None: plain HTTP/2, or not yet known (module docstring)
    requested = False                   # its request headers were seen (and did not say gRPC: ctype then)

    def __init__(self, call: Call) -> None:
        self.call = call
        self.buf = {"c2s": bytearray(), "s2c": bytearray()}
        self.skip = {"c2s": 0, "s2c": 0}      # bytes still to come of a message over max_message
        self.ended = {"c2s": False, "s2c": False}
        self.headers_seen = 0
        self.ctype: bool | None = None        # its request's content-type: gRPC, not gRPC, or unseen
        self.damaged: list[str] = []          # why its messages may be incomplete (gaps, oversized)


class H2Decoder:
    """Decode one HTTP/2 connection into gRPC or plain HTTP/2 calls."""

    protocol = "grpc"
    max_message = MAX_MESSAGE

    def __init__(self, flow_id: int | None = None, joined: bool = False) -> None:
        self.flow_id = flow_id
        self.joined = joined          # the recording began inside this connection (never set by a gap)
        self.gapped = False           # bytes of it were lost since: request headers may be missing too
        self.sides = {"c2s": _Side(not joined), "s2c": _Side(not joined)}
        self.streams: dict[int, _Stream] = {}
        self.saw_preface = joined
        self.unknown_method_calls = 0
        self.truncated_messages = 0   # messages over max_message: skipped, their bytes only in the chunks
        self.grpc_seen = False        # the connection said gRPC (a content-type or a grpc-status)
        self.held: dict[int, int] = {}        # calls waiting for the rest of their request: sid -> ts
        self.closed: dict[int, None] = {}     # streams closed before both ends did (oldest first, bounded)

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
            return self._reset(direction, ts_ns, stream_id, int.from_bytes(body, "big")) if len(body) == 4 else []
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
        st = self.streams.get(stream_id) or self._new_stream(stream_id, ts_ns, direction)
        if direction == "c2s":
            self._request_headers(st, decoded, side.epoch)
        else:
            self._response_headers(st, ts_ns, decoded)
            if flags & _END_STREAM and decoded.missing and st.call.status is None:
                self._status_hidden(st)          # trailers recorded whole, yet unreadable
        if flags & _END_STREAM:
            return self._end(st, direction, ts_ns)
        return []

    def _status_hidden(self, st: _Stream) -> None:
        """The block that ended the response referred to HPACK entries we never saw. After a gap in
        the server's bytes its table started afresh: the entries went with the gap, not with a join."""
        if self.sides["s2c"].epoch:
            _damage(st, _HIDDEN_BY_GAP)
        else:
            st.call.status_message = STATUS_HIDDEN

    def _request_headers(self, st: _Stream, decoded: DecodedBlock, epoch: int) -> None:
        call = st.call
        if decoded.view is None:
            decoded.view = _request_view(decoded)
        path, grpc, meta, ords, said, verb, pseudo = decoded.view
        if path is not None:
            call.method, call.method_unknown = path, False
        elif decoded.missing and call.method is None:
            call.method_unknown = True
        if ords is not None and call.method_ref is None:
            call.method_ref = ("hpack:" if not epoch else f"hpack@{epoch}:") + ords
        if grpc:
            self.grpc_seen = True
            st.ctype = True
            if st.http is not None:              # its DATA came first (joined): they were gRPC after all
                self._to_grpc(st)
        elif st.ctype is None and not st.requested:   # its first block: a later one is client trailers
            self._plain_request(st, said or not decoded.missing, verb, pseudo)
        call.request_metadata = list(meta)

    def _plain_request(self, st: _Stream, sure: bool, verb: str | None,
                       pseudo: tuple[tuple[str, str], ...]) -> None:
        """A request that did not say application/grpc: plain when it is `sure` (another content-type,
        or none in a block read whole), else not known yet unless the connection said gRPC."""
        st.requested = True
        if not sure and self.grpc_seen:
            if st.http is not None:
                self._to_grpc(st)
            return
        body = st.http
        if body is None:
            body = st.http = _Body(sure)
        elif sure:
            body.settle_plain()
        if sure:
            st.ctype = False
        body.verb, body.pseudo = verb, pseudo

    def _response_headers(self, st: _Stream, ts_ns: int, decoded: DecodedBlock) -> None:
        call = st.call
        st.headers_seen += 1
        if decoded.view is None:
            decoded.view = _response_view(decoded.headers)
        status, message, trailer_meta, http, meta, grpc_said = decoded.view
        if st.http is not None and self._body_response(st, http, grpc_said):
            http = None                             # plain: its :status becomes `status` at the close
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

    def _body_response(self, st: _Stream, http: str | None, grpc_said: bool) -> bool:
        """Response headers of a call that is plain or not known yet: True when it stays plain (its
        :status is kept), False when the server just said gRPC and the call became gRPC."""
        body = st.http
        assert body is not None
        if grpc_said and not body.sure:
            self.grpc_seen = True
            self._to_grpc(st)
            return False
        if http is not None:
            body.status = http
        return True

    # -- data and the end of a stream ------------------------------------------------------------

    def _new_stream(self, stream_id: int, ts_ns: int, direction: Direction) -> _Stream:
        call = Call(protocol="grpc", method=None, request_ts_ns=ts_ns, flow_id=self.flow_id, stream_id=stream_id)
        st = self.streams[stream_id] = _Stream(call)
        if direction == "s2c" or self.joined or self.gapped:
            call.method_unknown = True            # we may have missed its request headers
            if not self.grpc_seen:
                st.http = _Body(False)            # gRPC or not: the evidence decides (module docstring)
        return st

    def _data(self, direction: Direction, ts_ns: int, stream_id: int, flags: int, payload: bytes) -> list[Call]:
        st = self.streams.get(stream_id)
        if st is None:
            if stream_id in self.closed:           # DATA of a stream already closed: the rest of a body
                return []                          # nobody waits for any more (ids are never reused)
            st = self._new_stream(stream_id, ts_ns, direction)
        if st.http is not None:                    # plain HTTP/2, or not known yet
            return self._body(st, direction, ts_ns, flags, payload)
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
                    _damage(st, f"a {direction} message of {size:,} bytes, over the "
                                f"{_amount(self.max_message)} cap, was not stored")
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

    def _body(self, st: _Stream, direction: Direction, ts_ns: int, flags: int, payload: bytes) -> list[Call]:
        """DATA of a plain (or not yet known) call: the body's bytes, whole."""
        body = st.http
        assert body is not None
        if not body.size[direction] and not (st.headers_seen if direction == "s2c" else st.requested or st.ctype):
            body.partial.add(direction)            # joined (or a gap) inside this body: its start is not ours
        if direction not in body.lost and body.add(direction, ts_ns, payload, self.max_message):
            self._to_grpc(st)
        if direction == "s2c" and st.call.response_ts_ns is None:
            st.call.response_ts_ns = ts_ns
        if flags & _END_STREAM:
            return self._end(st, direction, ts_ns)
        return []

    def _to_grpc(self, st: _Stream) -> None:
        """The evidence says gRPC: the bytes kept so far become messages (each with the timestamp of
        the chunk that completed it), a partial one carries on in the gRPC path."""
        body, st.http = st.http, None
        assert body is not None
        call = st.call
        for direction, _ in _SIDES:
            if direction in body.lost:
                continue
            msgs = call.requests if direction == "c2s" else call.responses
            data, start = body.data[direction], 0
            for end, ts_ns in body.ends[direction]:
                msgs.append(Message(direction, len(msgs), ts_ns, bytes(data[start + PREFIX_LEN:end]),
                                    bool(data[start] & 1)))
                start = end
            st.buf[direction] += data[start:]
        if body.status is not None and not body.status.startswith("2") and call.status is None:
            call.status = int(body.status) if body.status.isdigit() else None   # a proxy answered
            if call.status_message == STATUS_HIDDEN:
                call.status_message = None

    def _end(self, st: _Stream, direction: Direction, ts_ns: int) -> list[Call]:
        st.ended[direction] = True
        if direction == "s2c":
            st.call.end_ts_ns = st.call.end_ts_ns or ts_ns
        if st.ended["s2c"]:
            if not st.ended["c2s"]:             # the request is still open: its frames may still come
                if st.requested or st.ctype:    # its request was seen: wait for them (module docstring)
                    self.held[st.call.stream_id or 0] = ts_ns
                    return []
                self._forget(st)
            if self.held:                       # the connection goes on: calls held past HOLD_NS get no more
                return [self._close(st)] + self._release(ts_ns - HOLD_NS)
            return [self._close(st)]
        return []

    def _reset(self, direction: Direction, ts_ns: int, stream_id: int, error_code: int) -> list[Call]:
        st = self.streams.get(stream_id)
        if st is None:
            return []
        if st.ended["s2c"]:            # held: the response was whole, a reset only stops the request
            return [] if direction == "s2c" else [self._close(st)]   # sent frames still come / the client gave up
        st.call.end_ts_ns = ts_ns
        if st.call.status is None:
            st.call.status_message = f"RST_STREAM error code {error_code}"
        self._forget(st)
        return [self._close(st)]

    def _release(self, before_ns: int) -> list[Call]:
        """Close the held calls whose response ended before `before_ns`: what is still missing of their
        request is not coming (the client stopped after the server's reset, or never ends it)."""
        sids = [sid for sid, ts in self.held.items() if ts < before_ns]
        for sid in sids:
            self._forget(self.streams[sid])
        return [self._close(self.streams[sid]) for sid in sids]

    def _forget(self, st: _Stream) -> None:
        """A stream closing before both ends did: DATA of it still on the way must start no call."""
        self.closed[st.call.stream_id or 0] = None
        if len(self.closed) > _CLOSED_KEPT:
            del self.closed[next(iter(self.closed))]

    def _close(self, st: _Stream) -> Call:
        call = st.call
        body = st.http
        if body is not None and not body.sure and (self.grpc_seen or body.framed()):
            self._to_grpc(st)
            body = None
        sid = call.stream_id or 0
        self.streams.pop(sid, None)
        if self.held:
            self.held.pop(sid, None)
        if call.method_unknown and not (st.requested or st.ctype) and self.gapped and not self.joined:
            _damage(st, "its request headers were lost in a gap")   # the gap's doing: there was no join
        if body is not None:
            self._plain(st, body)
        else:
            if st.damaged:             # said on the call: inspect lists it, replay --compare does not compare it
                why = f"{CALL_DAMAGED}: {', '.join(st.damaged)}"
                call.status_message = why + (f"; {call.status_message}" if call.status_message else "")
            call.kind = _kind(len(call.requests), len(call.responses))
        if call.method_unknown:
            self.unknown_method_calls += 1
        return call

    def _plain(self, st: _Stream, body: _Body) -> None:
        """Make `st`'s call a plain HTTP/2 one (module docstring). What of its bodies was not stored is
        said in HTTP/1's words, first ("body not captured: request, ..." is what replay reads), then
        any other damage; a gap inside a body is said once, as that body not captured."""
        call = st.call
        call.protocol, call.kind = "http2", "request"
        said = {_GAP[d] for d in body.lost}
        if body.status is not None:            # read, so not hidden whatever else the block referred to
            call.status = int(body.status) if body.status.isdigit() else None
            said.add(_HIDDEN_BY_GAP)
            if call.status_message == STATUS_HIDDEN:
                call.status_message = None
        if call.method is not None:
            if body.verb is not None:
                call.method = f"{body.verb} {call.method}"
            else:                              # its :path without its :method is half a name
                call.method, call.method_unknown = None, True
        call.request_metadata = list(body.pseudo) + call.request_metadata
        notes = []
        for direction, side in _SIDES:
            size = body.size[direction]
            if direction in body.lost:
                notes.append(f"{BODY_NOT_CAPTURED}: {side}, an unknown number of bytes missing in a gap")
            elif direction in body.partial:
                notes.append(f"{BODY_NOT_CAPTURED}: {side}, its start was not captured ({size:,} bytes after it)")
            elif not st.ended[direction]:     # reset, or cut off by the end of the capture: not the whole body
                notes.append(f"{BODY_NOT_CAPTURED}: {side}, cut off after {size:,} bytes (no END_STREAM)")
            elif size > self.max_message:
                notes.append(f"{BODY_NOT_CAPTURED}: {side}, {size:,} bytes, over the decoder's "
                             f"{_amount(self.max_message)} cap")
            elif size:
                msgs = call.requests if direction == "c2s" else call.responses
                msgs.append(Message(direction, 0, body.ts[direction], bytes(body.data[direction])))
        damaged = [why for why in st.damaged if why not in said]
        if damaged:
            notes.append(f"{CALL_DAMAGED}: {', '.join(damaged)}")
        if notes:
            call.status_message = "; ".join(notes + ([call.status_message] if call.status_message else []))

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
        self.gapped = True      # a stream whose request headers were in the gap has no method
        for st in self.streams.values():
            st.buf[direction].clear()
            st.skip[direction] = 0
            if st.http is not None and not st.ended[direction]:
                st.http.lose(direction)       # said as its body not captured, if it stays plain
            _damage(st, _GAP[direction])

    def finish(self, ts_ns: int | None = None) -> list[Call]:
        """Calls still open when the flow ended or capture stopped (status None; held ones keep theirs)."""
        return [self._close(st) for st in list(self.streams.values())]


_GAP: dict[str, str] = {"c2s": "bytes lost in a gap (c2s)", "s2c": "bytes lost in a gap (s2c)"}
_HIDDEN_BY_GAP = "its status refers to HPACK entries sent before a gap (s2c), so it is unknown"


def _damage(st: _Stream, why: str) -> None:
    if why not in st.damaged and len(st.damaged) < _MAX_REASONS:
        st.damaged.append(why)


def _amount(n: int) -> str:
    """A byte count as people write a cap: "16 MiB", or exact bytes when it is not whole MiB."""
    return f"{n >> 20} MiB" if n and not n & ((1 << 20) - 1) else f"{n:,} bytes"


def _request_view(decoded: DecodedBlock) -> tuple[str | None, bool, tuple[tuple[str, str], ...], str | None, bool,
                                                   str | None, tuple[tuple[str, str], ...]]:
    """(:path, said gRPC, metadata, ref ordinals, said a content-type, :method, the pseudo-headers a
    plain call keeps) of a request header block; kept on the block, which repeats call after call."""
    headers = decoded.headers
    path = next((v for k, v in headers if k == ":path"), None)
    ctype = next((v for k, v in headers if k == "content-type"), None)
    # An invalid reference leaves the identity incomplete: no ref rather than a wrong group.
    ords = ",".join(map(str, decoded.refs)) if decoded.refs and not decoded.invalid else None
    pseudo = tuple((k, v) for k, v in headers if k in (":method", ":authority"))
    return (path, ctype is not None and ctype.startswith(_GRPC_TYPE),
            tuple((k, v) for k, v in headers if not k.startswith(":")), ords, ctype is not None,
            next((v for k, v in headers if k == ":method"), None), pseudo)


def _response_view(headers: list[tuple[str, str]]) -> tuple[str | None, str | None, tuple[tuple[str, str], ...],
                                                            str | None, tuple[tuple[str, str], ...], bool]:
    """(grpc-status, grpc-message, trailer metadata, :status, metadata, says gRPC) of a response block."""
    meta = tuple((k, v) for k, v in headers if not k.startswith(":"))
    status = next((v for k, v in headers if k == "grpc-status"), None)
    grpc_said = status is not None or any(k == "content-type" and v.startswith(_GRPC_TYPE) for k, v in meta)
    return (status, next((v for k, v in headers if k == "grpc-message"), None),
            tuple((k, v) for k, v in meta if k not in ("grpc-status", "grpc-message")),
            next((v for k, v in headers if k == ":status"), None), meta, grpc_said)


def _kind(n_req: int, n_resp: int) -> str:
    # The wire does not say whether a method is streaming; message counts are the evidence.
    if n_req > 1 and n_resp > 1:
        return "bidi"
    if n_req > 1:
        return "client_stream"
    if n_resp > 1:
        return "server_stream"
    return "unary"
