"""Protocol decoders (HTTP/2 + gRPC, HTTP/1.1, raw TCP), registered by name and picked per flow.

`FlowDecoder` buffers a flow's first bytes until the protocol is clear, then hands everything to the
registered decoder: `detect()` reads the HTTP/2 preface or frames, an HTTP/1 request or status line,
a TLS ClientHello (`tls`: encrypted, no calls), and falls back to raw TCP. It looks at the
reassembled start of each direction, so the verdict is the same however the first bytes were split
into reads (one byte at a time included); it waits while they are a prefix of something it knows.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from capture.decode.base import RawDecoder, StreamDecoder
from capture.decode.h2grpc import H2Decoder
from capture.decode.http1 import Http1Decoder
from capture.decode.tls import TlsDecoder
from capture.recording import Call, Direction
from wire.h2 import PREFACE
from wire.h2 import frame_lengths_plausible as plausible_frames
from wire.registry import Registry

DECODERS: Registry[str, Callable[[int | None, bool], StreamDecoder]] = Registry("protocol decoder", {
    "http2": lambda flow_id, joined: H2Decoder(flow_id, joined),
    "http1": lambda flow_id, joined: Http1Decoder(flow_id, joined),
    "tcp": lambda flow_id, joined: RawDecoder(),
    "tls": lambda flow_id, joined: TlsDecoder(),
})

_HTTP1_REQ = re.compile(rb"^[A-Z]{3,10} \S+ HTTP/1\.[01]\r?\n?")
_HTTP1_RESP = re.compile(rb"^HTTP/1\.[01] \d{3}")
# Every prefix of a request line "METHOD target HTTP/1.x\r\n" (so a read that ended anywhere in it waits)
_PARTIAL_REQ = re.compile(rb"^[A-Z]{1,10}(?: (?:\S*(?: (?:H(?:T(?:T(?:P(?:/(?:1(?:\.(?:[01]\r?)?)?)?)?)?)?)?)?)?)?)?$")
_PARTIAL_RESP = re.compile(rb"^H(?:T(?:T(?:P(?:/(?:1(?:\.(?:[01](?: (?:\d{1,2})?)?)?)?)?)?)?)?)?$")
_DECIDE_AFTER = 64 * 1024   # bytes without a verdict: give up and call it raw TCP
_REQUEST_LINE_MAX = 8192    # a request line still incomplete after this many bytes is not HTTP/1


def _tls_record(data: bytes, hello: int) -> bool | None:
    """Does `data` start a TLS handshake record holding a hello of type `hello` (1: ClientHello, 2:
    ServerHello)? None: too short to say, and what is there fits."""
    want = (0x16, 0x03, None, None, None, hello)
    for i, b in enumerate(data[:6]):
        if i == 2:
            if b > 4:
                return False
        elif want[i] is not None and b != want[i]:
            return False
    return True if len(data) >= 6 else None


def _tls_appdata(chunk: bytes) -> bool:
    """A chunk of a joined connection that starts with a TLS application-data or handshake record."""
    return (len(chunk) >= 5 and chunk[0] in (0x14, 0x15, 0x16, 0x17) and chunk[1] == 0x03 and chunk[2] <= 4
            and int.from_bytes(chunk[3:5], "big") <= (1 << 14) + 2048)


def detect(direction: Direction, data: bytes, joined: bool, chunk: bytes = b"") -> str | None:
    """The protocol of a flow whose first bytes in `direction` are `data` (None: need more).

    `data` is the reassembled start of that direction, so the verdict does not depend on how it was
    split into reads: while `data` is a prefix of something recognisable (the HTTP/2 preface, an
    HTTP/1 request or status line, a TLS ClientHello, a frame header) the answer is None, bounded
    by the line and byte limits above. `chunk` is the latest chunk alone: on a joined flow a chunk
    that parses as whole HTTP/2 frames is the evidence (earlier chunks may have started inside a frame)."""
    if direction == "c2s":
        if PREFACE.startswith(data[:len(PREFACE)]):
            return "http2" if len(data) >= len(PREFACE) else None
        if _HTTP1_REQ.match(data):
            return "http1"
        if len(data) < _REQUEST_LINE_MAX and _PARTIAL_REQ.match(data):
            return None
        hello = _tls_record(data, 1)
        if hello is not False:
            return "tls" if hello else None
    else:
        if _HTTP1_RESP.match(data):
            return "http1"
        if _PARTIAL_RESP.match(data):
            return None
        hello = _tls_record(data, 2)
        if hello is not False and not joined:
            return "tls" if hello else None
        if not joined:
            if len(data) < 9:
                return None                  # maybe a frame header not yet whole
            if plausible_frames(data):
                return "http2"   # an HTTP/2 server may send its SETTINGS before the client's preface
    if joined:
        if plausible_frames(chunk or data):
            return "http2"
        if _tls_appdata(chunk or data):
            return "tls"
        if len(data) < _DECIDE_AFTER:
            return None
    return "tcp"


def detect_flow(first: dict[str, bytearray], joined: bool, direction: Direction, chunk: bytes) -> str | None:
    """The verdict from both directions' first bytes: a protocol either side recognises wins; raw
    TCP only when the client's bytes say so, or the server's alone after _DECIDE_AFTER bytes (a
    server that speaks first is no reason to give up on the client's request)."""
    verdicts: dict[str, str | None] = {}
    for d in ("c2s", "s2c"):
        if first[d]:
            verdicts[d] = detect(d, bytes(first[d]), joined, chunk if d == direction else b"")
    for d in ("c2s", "s2c"):
        v = verdicts.get(d)
        if v is not None and v != "tcp":
            return v
    if verdicts.get("c2s") == "tcp":
        return "tcp"
    if verdicts.get("s2c") == "tcp" and ("c2s" not in verdicts or len(first["s2c"]) >= _DECIDE_AFTER):
        return "tcp" if len(first["s2c"]) >= _DECIDE_AFTER or joined else None
    return None


class _Detected:
    """What `FlowDecoder(calls=False)` keeps once the protocol is known: its name, no decoding."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol

    def feed(self, direction: Direction, ts_ns: int, data: bytes) -> list[Call]:
        return []

    def finish(self, ts_ns: int | None = None) -> list[Call]:
        return []


class FlowDecoder:
    """Pick a decoder from a flow's first bytes, then decode; holds back chunks until it knows.

    With `calls=False` it only detects the protocol (which the chunk masking needs) and decodes
    nothing: the recorder's `--decode at-stop` decodes the stored chunks afterwards."""

    def __init__(self, flow_id: int | None = None, joined: bool = False, calls: bool = True) -> None:
        self.flow_id = flow_id
        self.joined = joined
        self.calls = calls
        self.inner: StreamDecoder | None = None
        self._held: list[tuple[Direction, int, bytes]] = []
        self._first = {"c2s": bytearray(), "s2c": bytearray()}

    @property
    def protocol(self) -> str | None:
        if self.inner is None:
            return None
        if isinstance(self.inner, H2Decoder):
            return "grpc" if self.inner.grpc_seen else "http2"
        return self.inner.protocol

    def feed(self, direction: Direction, ts_ns: int, data: bytes) -> list[Call]:
        if self.inner is not None:
            return self.inner.feed(direction, ts_ns, data)
        self._held.append((direction, ts_ns, data))
        self._first[direction] += data
        name = detect_flow(self._first, self.joined, direction, data)
        if name is None:
            return []
        if not self.calls:
            self.inner = _Detected(name)
            self._held.clear()
            return []
        self.inner = DECODERS[name](self.flow_id, self.joined)
        done: list[Call] = []
        for d, t, b in self._held:
            done += self.inner.feed(d, t, b)
        self._held.clear()
        return done

    @property
    def truncated_messages(self) -> int:
        """Messages too large to keep as messages (their bytes stay in the chunks)."""
        return int(getattr(self.inner, "truncated_messages", 0))

    def gap(self, direction: Direction, nbytes: int | None = None, how: str | None = None) -> None:
        """`nbytes` (None: unknown) are missing before the next ones: resynchronise (or wait to detect
        afresh). Only HTTP/1 uses the length (to step over a gap inside a body of known size) and
        `how` (why the bytes are not there, e.g. "sendfile": said on the call)."""
        if self.inner is None:
            self._held = [h for h in self._held if h[0] != direction]
            self._first[direction].clear()
            self.joined = True
        elif isinstance(self.inner, Http1Decoder):
            self.inner.gap(direction, nbytes, how)
        elif hasattr(self.inner, "gap"):
            self.inner.gap(direction)

    def finish(self, ts_ns: int | None = None) -> list[Call]:
        if self.inner is None:
            self.inner = DECODERS["tcp"](self.flow_id, self.joined) if self.calls else _Detected("tcp")
        return self.inner.finish(ts_ns)
