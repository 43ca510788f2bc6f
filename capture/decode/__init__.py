"""Protocol decoders (HTTP/2 + gRPC, HTTP/1.1, raw TCP), registered by name and picked per flow.

`FlowDecoder` buffers a flow's first bytes until the protocol is clear, then hands everything to the
registered decoder: `detect()` reads the HTTP/2 preface or frames, an HTTP/1 request or status line,
and falls back to raw TCP.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from capture.decode.base import RawDecoder, StreamDecoder
from capture.decode.h2grpc import H2Decoder
from capture.decode.http1 import Http1Decoder
from capture.recording import Call, Direction
from wire.h2 import PREFACE
from wire.h2 import frame_lengths_plausible as plausible_frames

DECODERS: dict[str, Callable[[int | None, bool], StreamDecoder]] = {
    "http2": lambda flow_id, joined: H2Decoder(flow_id, joined),
    "http1": lambda flow_id, joined: Http1Decoder(flow_id, joined),
    "tcp": lambda flow_id, joined: RawDecoder(),
}

_HTTP1_REQ = re.compile(rb"^[A-Z]{3,10} \S+ HTTP/1\.[01]\r?\n?")
_HTTP1_RESP = re.compile(rb"^HTTP/1\.[01] \d{3}")
_PARTIAL_REQ = re.compile(rb"^[A-Z]{1,10}( \S*)?( H[TP/1.]*)?$")
_DECIDE_AFTER = 64 * 1024   # bytes without a verdict: give up and call it raw TCP


def detect(direction: Direction, data: bytes, joined: bool, chunk: bytes = b"") -> str | None:
    """The protocol of a flow whose first bytes in `direction` are `data` (None: need more).

    `chunk` is the latest chunk alone: on a joined flow a chunk that parses as whole HTTP/2 frames
    is the evidence (earlier chunks may have started inside a frame)."""
    if direction == "c2s":
        if PREFACE.startswith(data[:len(PREFACE)]):
            return "http2" if len(data) >= len(PREFACE) else None
        if _HTTP1_REQ.match(data):
            return "http1"
        if _PARTIAL_REQ.match(data) and len(data) < 8192:
            return None
    else:
        if _HTTP1_RESP.match(data):
            return "http1"
        if b"HTTP/1."[:len(data)] == data[:7] and len(data) < 12:
            return None
        if plausible_frames(chunk or data):
            return "http2"   # an HTTP/2 server may send its SETTINGS before the client's preface
    if joined:
        if plausible_frames(chunk or data):
            return "http2"
        if len(data) < _DECIDE_AFTER:
            return None
    return "tcp"


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
        name = detect(direction, bytes(self._first[direction]), self.joined, data)
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
