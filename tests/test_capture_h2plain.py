"""HTTP/2 is HTTP/2; gRPC is one use of it: plain HTTP/2 recorded, inspected and replayed as what it is.

1. The decoder alone (no root): a call is gRPC when its request says content-type application/grpc*
   (or, where HPACK hid that, when the connection said gRPC or its DATA parse exactly as gRPC
   messages); otherwise its DATA are one HTTP body per direction, stored whole, with the :status
   (200 included) and "VERB /path" as HTTP/1 calls have them. Oversized bodies are not stored and the
   call quotes their real size; after a gap calls say the gap, never a join.
2. The h2 sender alone (no root): plain calls to a real nginx (cleartext h2c and TLS with ALPN h2)
   go out as recorded and their outcomes are exactly the http1 sender's for the same responses.
3. Real traffic (root + eBPF): nginx `listen ... http2` (h2c) driven by nghttp and h2load, and the
   same server over TLS driven by curl --http2, recorded; every call's method, path, status and body
   length equal nginx's access log, bodies equal the files, `inspect` complete. The h2c recording
   replayed with the h2 sender into a fresh nginx: its log shows the same requests (a PUT's body
   written to disk byte for byte), 2xx ok, the 404s HTTP_404 errors, nothing not sent.

Only 127.0.0.1; nginx, nghttp, h2load, curl and openssl are Debian's (scripts/setup.sh installs them).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import hpack
import pytest

from capture.decode import FlowDecoder
from capture.decode.h2grpc import HOLD_NS, H2Decoder
from capture.ebpf.tls import find_libssl
from capture.recording import BODY_NOT_CAPTURED, STATUS_HIDDEN, Call, Direction, Recording, call_damage
from capture.summary import summarize
from capture.testing import HpackConnection
from replay.engine import ReplayRun
from replay.options import ReplayOptions
from replay.schedule import PlannedCall, PlannedMessage
from replay.senders import SendOutcome, get_sender
from replay.senders.tls import TlsConfig
from replay.stats import CallResult
from tests.nginx import NGINX, PREAMBLE, TEMP_PATHS, make_cert, running_nginx
from wire.h2 import PREFACE, SETTINGS_ACK, ErrorCode, data_frames, headers, rst_stream, settings

M = "/shadowtest.agent.v1.TradingAgent/Decide"
Parts = list[tuple[Direction, bytes]]


# ---- 1. the decoder alone ---------------------------------------------------------------------------------

class PlainConnection:
    """One HTTP/2 connection's bytes call by call, from `hpack` encoders the test holds (as a client's and a
    server's), each frame its own chunk: a body of N bytes arrives as N/frame DATA frames."""

    def __init__(self) -> None:
        self.client, self.server = hpack.Encoder(), hpack.Encoder()
        self.sid = 1

    @staticmethod
    def preface() -> Parts:
        return [("c2s", PREFACE + settings({})), ("s2c", settings({}) + SETTINGS_ACK), ("c2s", SETTINGS_ACK)]

    def call(self, verb: str, path: str, body: bytes = b"", status: int = 200, answer: bytes = b"", *,
             request_type: str | None = None, response_type: str = "text/plain", frame: int = 16384,
             extra: Sequence[tuple[str, str]] = ()) -> Parts:
        sid, self.sid = self.sid, self.sid + 2
        req = [(":method", verb), (":scheme", "http"), (":path", path), (":authority", "example.test")]
        req += [("content-type", request_type)] if request_type else []
        out: Parts = [("c2s", headers(sid, self.client.encode(req + list(extra)), 16384, end_stream=not body))]
        out += [("c2s", f) for f in _frames(sid, body, frame)]
        resp = [(":status", str(status)), ("content-type", response_type)]
        out.append(("s2c", headers(sid, self.server.encode(resp), 16384, end_stream=not answer)))
        return out + [("s2c", f) for f in _frames(sid, answer, frame)]


def _frames(sid: int, payload: bytes, size: int) -> list[bytes]:
    """`payload` as DATA frames of at most `size` bytes, END_STREAM on the last, one bytes object each."""
    pieces = [payload[i:i + size] for i in range(0, len(payload), size)]
    return [data_frames(sid, p, size, end_stream=i == len(pieces) - 1) for i, p in enumerate(pieces)]


def _decode(parts: Parts, joined: bool = False) -> tuple[list[Call], FlowDecoder]:
    dec = FlowDecoder(flow_id=1, joined=joined)
    calls: list[Call] = []
    for i, (direction, data) in enumerate(parts):
        calls += dec.feed(direction, 1000 + i * 10, data)
    return calls + dec.finish(), dec


def _bodies(call: Call) -> tuple[list[bytes], list[bytes]]:
    return [m.data for m in call.requests], [m.data for m in call.responses]


def test_plain_bodies_are_stored_whole_across_many_data_frames_with_status_and_verb() -> None:
    page = random.Random(1).randbytes(100_000)        # 7 DATA frames; random bytes: no text to lean on
    item = b'{"name": "widget", "tags": ["a", "b"]}'
    conn = PlainConnection()
    parts = (conn.preface() + conn.call("GET", "/files/page.bin?v=2", answer=page)
             + conn.call("POST", "/items", item, 201, b"created\n", request_type="application/json", frame=10)
             + conn.call("GET", "/missing", status=404, answer=b"not found\n")
             + conn.call("HEAD", "/files/page.bin", extra=[("x-trace", "t1")]))
    for chunks in (parts, [(d, data[i:i + 7]) for d, data in parts for i in range(0, len(data), 7)]):
        calls, dec = _decode(chunks)
        assert dec.protocol == "http2"
        assert [(c.protocol, c.kind, c.method, c.status, c.status_message) for c in calls] == [
            ("http2", "request", "GET /files/page.bin?v=2", 200, None), ("http2", "request", "POST /items", 201, None),
            ("http2", "request", "GET /missing", 404, None), ("http2", "request", "HEAD /files/page.bin", 200, None)]
        assert [_bodies(c) for c in calls] == [([], [page]), ([item], [b"created\n"]), ([], [b"not found\n"]),
                                               ([], [])]
        assert all(m.seq == 0 for c in calls for m in c.requests + c.responses)
    get, post = calls[0], calls[1]
    # the body's timestamp is the chunk that completed it (its last DATA frame), as for HTTP/1
    assert get.responses[0].ts_ns == get.end_ts_ns and post.requests[0].ts_ns < post.response_ts_ns
    # :method and :authority are kept where HTTP/1 keeps Host; the end-to-end headers as they came
    assert post.request_metadata[:2] == [(":method", "POST"), (":authority", "example.test")]
    assert ("content-type", "application/json") in post.request_metadata
    assert ("x-trace", "t1") in calls[3].request_metadata


def test_grpc_stays_grpc_beside_plain_calls_on_one_connection() -> None:
    conn = HpackConnection()
    parts = conn.preface()
    parts += conn.call(M, [b"x" * 40_000, b"y"], [b"z"], metadata=[("x-id", "1")])       # a message over 3 frames
    parts += conn.call("/api/items", [b'{"n": 1}'], [b"\x00\x00\x00\x00\x03abc"], grpc=False)   # JSON, not gRPC
    parts += conn.call(M, [b"q"], [], status=5)
    calls, dec = _decode(parts)
    assert dec.protocol == "grpc"                     # the connection carries gRPC; each call is what it said
    assert [(c.protocol, c.method, c.kind, c.status) for c in calls] == [
        ("grpc", M, "client_stream", 0), ("http2", "POST /api/items", "request", 200), ("grpc", M, "unary", 5)]
    # gRPC: messages without their prefixes, the :status 200 of a failed call is not its status
    assert _bodies(calls[0]) == ([b"x" * 40_000, b"y"], [b"z"])
    # plain: the body whole, even when it happens to look like a gRPC prefix
    assert _bodies(calls[1]) == ([b'{"n": 1}'], [b"\x00\x00\x00\x00\x03abc"])
    assert ("x-id", "1") in calls[0].request_metadata and not any(k.startswith(":") for k, _ in
                                                                   calls[0].request_metadata)


def _joined(before: Callable[[HpackConnection], None], after: Callable[[HpackConnection], Parts]) -> list[Call]:
    """Calls whose bytes a recorder joining after `before` saw: every header `before` sent is in the
    peers' HPACK tables, so the joined decoder cannot read those fields."""
    conn = HpackConnection()
    conn.preface()
    before(conn)
    calls, _ = _decode(after(conn), joined=True)
    return calls


def test_a_joined_connection_whose_bodies_are_grpc_framed_stays_grpc() -> None:
    # content-type, te, :status, grpc-status: all pre-join entries, so no header says gRPC after the join
    calls = _joined(lambda c: [c.call("/new.Svc/Warm") for _ in range(2)],
                    lambda c: c.call("/new.Svc/New", [b"a", b"bb" * 9000], [b"c"]) + c.call("/new.Svc/New", [b""], [b"d"]))
    assert [(c.protocol, c.method, c.kind) for c in calls] == [("grpc", "/new.Svc/New", "client_stream"),
                                                                 ("grpc", "/new.Svc/New", "unary")]
    assert [_bodies(c) for c in calls] == [([b"a", b"bb" * 9000], [b"c"]), ([b""], [b"d"])]
    # each message keeps the timestamp of the chunk that completed it, as on the gRPC path
    first = calls[0]
    assert first.requests[0].ts_ns < first.requests[1].ts_ns < first.responses[0].ts_ns
    assert [c.status_message for c in calls] == [STATUS_HIDDEN] * 2     # grpc-status 0 was a pre-join entry


def test_a_joined_connection_whose_bodies_are_not_grpc_framed_is_plain() -> None:
    text, binary = b"hello from nginx", b"\x00\x00\x00\x00\x09abc"      # the second: a prefix that overstates
    calls = _joined(lambda c: [c.call("/api/warm", [b"{}"], [b"{}"], grpc=False) for _ in range(2)],
                    lambda c: (c.call("/api/text", [b"{}"], [text], grpc=False)
                               + c.call("/api/bin", [binary], [b"ok"], grpc=False)
                               + c.call("/api/begun", [b'{"in": "flight"}'], [b"late"], grpc=False)[1:]))
    assert [(c.protocol, c.method, c.status, _bodies(c)) for c in calls] == [
        ("http2", "POST /api/text", 200, ([b"{}"], [text])), ("http2", "POST /api/bin", 200, ([binary], [b"ok"])),
        ("http2", None, 200, ([], [b"late"]))]
    # the last one's request HEADERS came before the join: its body may have begun there too, so it is not
    # stored as if whole (the response, whose headers were seen, is)
    assert calls[2].status_message == f"{BODY_NOT_CAPTURED}: request, its start was not captured (16 bytes after it)"


def test_an_oversized_body_is_not_stored_and_the_call_quotes_its_real_size(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = PlainConnection()
    four_mb = random.Random(2).randbytes(4 << 20)
    calls, _ = _decode(conn.preface() + conn.call("GET", "/four", answer=four_mb))
    # 4 MiB is under the 16 MiB cap: stored whole (it used to be read as a gRPC prefix "over the cap")
    assert [(c.status, c.status_message, _bodies(c)) for c in calls] == [(200, None, ([], [four_mb]))]

    monkeypatch.setattr(H2Decoder, "max_message", 1000)
    conn = PlainConnection()
    parts = (conn.preface() + conn.call("GET", "/big", answer=b"r" * 4000, frame=1500)
             + conn.call("PUT", "/up", b"q" * 2500, 201, b"done", frame=999)
             + conn.call("GET", "/small", answer=b"s" * 1000))
    big, up, small = _decode(parts)[0]
    assert (big.status, big.responses, big.status_message) == (
        200, [], f"{BODY_NOT_CAPTURED}: response, 4,000 bytes, over the decoder's 1,000 bytes cap")
    # a request body not stored comes first in the message: replay reads it and never sends the request
    assert (up.status, up.requests, [m.data for m in up.responses]) == (201, [], [b"done"])
    assert up.status_message == f"{BODY_NOT_CAPTURED}: request, 2,500 bytes, over the decoder's 1,000 bytes cap"
    assert call_damage(up.status, up.status_message, up.protocol) == up.status_message
    assert (small.status_message, _bodies(small)) == (None, ([], [b"s" * 1000]))      # at the cap: kept
    # a gRPC message over the cap quotes its size too
    grpc = HpackConnection()
    calls, _ = _decode(grpc.preface() + grpc.call(M, [b"x" * 5000], [b"ok"]))
    assert calls[0].status_message == "damaged: a c2s message of 5,000 bytes, over the 1,000 bytes cap, was not stored; ok"


def _feed(dec: FlowDecoder, parts: Parts, ts: int) -> list[Call]:
    return [c for i, (d, data) in enumerate(parts) for c in dec.feed(d, ts + i, data)]


def test_after_a_gap_calls_say_it_was_the_gap_not_a_join() -> None:
    conn = HpackConnection()
    dec = FlowDecoder(flow_id=1)
    calls = _feed(dec, conn.preface() + conn.call(M) + conn.call(M), 1000)   # the server indexed grpc-status 0
    lost = conn.call(M, [b"in-flight"])               # its request HEADERS fall in a client-side gap
    dec.gap("c2s")
    calls += _feed(dec, lost[1:], 2100)
    dec.gap("s2c")                                    # the server's table starts afresh: grpc-status 0 is unreadable
    calls += _feed(dec, conn.call(M, [b"after"]), 3000)
    calls += dec.finish()
    assert dec.inner.joined is False                  # type: ignore[union-attr]
    _, _, in_flight, after = calls
    assert (in_flight.method, in_flight.status, in_flight.status_message) == (
        None, 0, "damaged: its request headers were lost in a gap; ok")
    # the client's table restarted at its gap too: the method is a group named by the gap ("hpack@1:")
    assert (after.method, after.status) == (None, None) and (after.method_ref or "").startswith("hpack@1:")
    assert after.status_message == ("damaged: its status refers to HPACK entries sent before a gap (s2c), "
                                    "so it is unknown")
    assert all("join" not in (c.status_message or "") for c in calls)
    # joined, the same trailers are the join's doing, as before
    joined = _joined(lambda c: [c.call(M) for _ in range(2)], lambda c: c.call("/new.Svc/N"))
    assert [c.status_message for c in joined] == [STATUS_HIDDEN]


def test_a_gap_inside_a_plain_request_body_is_said_as_that_body_not_captured() -> None:
    conn = PlainConnection()
    dec = FlowDecoder(flow_id=1)
    cut = conn.call("PUT", "/up", b"p" * 5000, 201, b"ok", frame=1000)
    calls = _feed(dec, conn.preface() + cut[:3], 1000)
    dec.gap("c2s")
    calls += _feed(dec, cut[4:], 2000) + dec.finish()
    assert [(c.method, c.status, c.requests, c.status_message) for c in calls] == [
        ("PUT /up", 201, [], f"{BODY_NOT_CAPTURED}: request, an unknown number of bytes missing in a gap")]


def test_a_request_body_that_follows_the_response_belongs_to_its_call() -> None:
    """nginx answers `return 201` without reading the request body and resets the stream (NO_ERROR); the
    body the client had already sent arrives after both. It is the request's, whole; nothing else is made
    of it. The same for a gRPC client's message after the server's trailers (the old decoder made each
    such message a call of its own, without method or status)."""
    conn, rst = PlainConnection(), rst_stream(1, ErrorCode.NO_ERROR)
    post = conn.call("POST", "/post", b"name=widget", 201, b"created\n", request_type="text/plain")
    head, data, answer = post[0], post[1], post[2:]
    calls, _ = _decode(conn.preface() + [head] + answer + [("s2c", rst), data])
    assert [(c.method, c.status, c.status_message, _bodies(c)) for c in calls] == [
        ("POST /post", 201, None, ([b"name=widget"], [b"created\n"]))]
    grpc = HpackConnection()
    early = grpc.call(M, [b"late"], [], status=3)     # trailers-only answer before the request's message
    calls, _ = _decode(grpc.preface() + [early[0]] + early[2:] + [early[1]])
    assert [(c.method, c.status, [m.data for m in c.requests]) for c in calls] == [(M, 3, [b"late"])]


def test_a_request_never_finished_is_cut_off_after_the_hold_and_said_so() -> None:
    conn = PlainConnection()
    post = conn.call("POST", "/post", b"x" * 3000, 201, b"created\n", frame=1000)
    dec = FlowDecoder(flow_id=1)
    calls = _feed(dec, conn.preface() + post[:2] + post[4:], 1000)       # the first 1000 body bytes, the answer
    assert calls == []                                # held: the rest of its body may still come
    later = conn.call("GET", "/next", answer=b"n")
    calls = _feed(dec, later, 2000 + HOLD_NS)       # the next call ends after the hold: that releases it
    assert [(c.method, c.status, c.requests, c.status_message) for c in calls] == [
        ("GET /next", 200, [], None),
        ("POST /post", 201, [], f"{BODY_NOT_CAPTURED}: request, cut off after 1,000 bytes (no END_STREAM)")]
    assert _feed(dec, post[2:4], 9_000_000_000) == [] and dec.finish() == []   # its last frames: no call


# ---- nginx serving plain HTTP/2 ------------------------------------------------------------------------------

needs_nginx = pytest.mark.skipif(NGINX is None or shutil.which("openssl") is None,
                                 reason="needs nginx and openssl (apt-get install nginx openssl; scripts/setup.sh does)")
FILES = {"1k.bin": 1024, "100k.bin": 100 * 1024, "1m.bin": 1 << 20}   # 1 MiB: 64 DATA frames of 16 KiB
HELLO = b"hello from nginx\n"
POST_BODY = b"name=widget&colour=blue\n" * 100
PUT_BODY = random.Random(7).randbytes(70_000)      # over HTTP/2's initial 65,535-byte window: flow control
# One line per request; x-test is a header the clients send (replayed as recorded), the marker the replay's.
LOG_FORMAT = "$request_method $request_uri $status $body_bytes_sent $http_x_test $http_x_shadowtest_replay"
CONF = PREAMBLE + """http {{
    log_format st '{log_format}';
    access_log {d}/access.log st;
    # Off: nginx's HTTP/2 would send file bodies with sendfile, which no recorder can read (the body is
    # then "not captured", as test_capture_nginx shows for HTTP/1); here every body is to be recorded.
    sendfile off;
    default_type application/octet-stream;
{temp_paths}
    server {{
        listen 127.0.0.1:{port} {ssl}http2;
{tls}
        root {d}/www;
        location = /hello {{ return 200 "hello from nginx\\n"; }}
        location = /post {{ return 201 "created\\n"; }}
        location = /busy {{ return 429 "slow down\\n"; }}
        location = /down {{ return 503 "unavailable\\n"; }}
        location /up/ {{ dav_methods PUT; create_full_put_path on; }}
    }}
}}
"""
TLS_LINES = "        ssl_certificate {d}/cert.pem;\n        ssl_certificate_key {d}/key.pem;"


@dataclass(frozen=True)
class Site:
    """A running nginx: its port, directory, and TLS certificate (None: cleartext h2c)."""

    port: int
    dir: Path
    cert: Path | None

    @property
    def base(self) -> str:
        return f"{'https' if self.cert else 'http'}://127.0.0.1:{self.port}"

    def log(self) -> list[tuple[str, str, int, int, str, str]]:
        """(method, request URI, status, body bytes sent, x-test, replay marker) of every request logged."""
        out = []
        for line in (self.dir / "access.log").read_text().splitlines():
            method, uri, status, sent, x_test, marker = line.split(" ")
            out.append((method, uri, int(status), int(sent), x_test, marker))
        return out

    def file(self, name: str) -> bytes:
        return (self.dir / "www" / name).read_bytes()


@contextlib.contextmanager
def serving(d: Path, tls: bool) -> Iterator[Site]:
    """nginx with CONF in `d` (files made from a fixed seed, so two sites serve the same bytes)."""
    rng = random.Random(3)
    (d / "www" / "up").mkdir(parents=True, exist_ok=True)
    for name, size in FILES.items():
        (d / "www" / name).write_bytes(rng.randbytes(size))
    cert = make_cert(d) if tls else None
    conf = CONF.format(d=d, log_format=LOG_FORMAT, temp_paths=TEMP_PATHS.format(d=d), port="{port}",
                       ssl="ssl " if tls else "", tls=TLS_LINES.format(d=d) if tls else "")
    with running_nginx(d, lambda port: conf.replace("{port}", str(port))) as port:
        yield Site(port, d, cert)


# ---- 2. the h2 sender alone -------------------------------------------------------------------------------------

def _planned(protocol: str, index: int, method: str, body: bytes = b"", x_test: str = "") -> PlannedCall:
    """A call as a recording of `protocol` holds it: HTTP/2 keeps :method/:authority, HTTP/1 Host."""
    verb = method.split(" ")[0]
    where = [(":method", verb), (":authority", "prod.example")] if protocol == "http2" else [("host", "prod.example")]
    return PlannedCall(index, 0, f"c-{protocol}", protocol, method, "request",
                       [PlannedMessage(0, body)] if body else [],
                       metadata=where + [("x-test", x_test or protocol), ("user-agent", "recorded/1"),
                                         ("connection" if protocol == "http1" else "te", "keep-alive")])


def _send(sender: str, site: Site, calls: list[PlannedCall], timeout_s: float = 10.0) -> list[SendOutcome]:
    """The calls one after another through a fresh sender (one connection), as the engine would."""
    async def go() -> list[SendOutcome]:
        s = get_sender(sender, f"127.0.0.1:{site.port}", tls=TlsConfig(ca=str(site.cert)) if site.cert else None)
        try:
            return [await s.call(p, _released(p), timeout_s) for p in calls]
        finally:
            await s.close()
    return asyncio.run(go())


async def _released(planned: PlannedCall):  # noqa: ANN202 - an async generator of the call's messages
    for m in planned.messages:
        yield m


CALLS = [("GET /hello", b""), ("GET /1k.bin", b""), ("POST /post", POST_BODY), ("PUT /up/{p}.bin", PUT_BODY),
         ("GET /missing", b""), ("GET /busy", b""), ("DELETE /down", b""), ("HEAD /100k.bin", b""),
         ("GET /1m.bin?v=1", b"")]


@needs_nginx
@pytest.mark.parametrize("tls", [False, True], ids=["h2c", "tls-alpn-h2"])
def test_h2_sender_replays_plain_calls_as_recorded_with_the_http1_senders_outcomes(tmp_path: Path, tls: bool) -> None:
    with serving(tmp_path, tls) as site:
        h2 = _send("h2", site, [_planned("http2", i, m.format(p="h2"), b) for i, (m, b) in enumerate(CALLS)])
        # over TLS nginx also speaks HTTP/1.1 (ALPN): the same requests through the http1 sender
        h1 = _send("http1", site, [_planned("http1", i, m.format(p="h1"), b) for i, (m, b) in enumerate(CALLS)]) \
            if tls else None
        log, files = site.log(), {n: site.file(n) for n in FILES}
        uploaded = site.file("up/h2.bin")
    assert [(o.outcome, o.code, o.status) for o in h2] == [
        ("ok", "OK", 200), ("ok", "OK", 200), ("ok", "OK", 201), ("ok", "OK", 201), ("error", "HTTP_404", 404),
        ("rejected", "HTTP_429", 429), ("error", "HTTP_503", 503), ("ok", "OK", 200), ("ok", "OK", 200)]
    assert [o.responses for o in h2[:3]] == [[HELLO], [files["1k.bin"]], [b"created\n"]]
    assert h2[7].responses == [b""] and h2[8].responses == [files["1m.bin"]]   # HEAD: no body
    assert uploaded == PUT_BODY                       # the body went out raw (no gRPC prefix), whole
    # nginx saw each request as recorded: method, path, the recorded end-to-end header, the replay marker
    sent = [(m, u, s, x, r) for m, u, s, _, x, r in log if x == "http2"]
    assert sent == [(m.split(" ")[0], m.split(" ")[1].format(p="h2"), o.status, "http2", "1")
                    for (m, _), o in zip(CALLS, h2, strict=True)]
    if h1 is not None:                                # one classification of HTTP statuses for both senders
        assert [(o.outcome, o.code, o.status, o.responses) for o in h2] == \
               [(o.outcome, o.code, o.status, o.responses) for o in h1]


def test_a_plain_calls_transport_failures_are_said_as_the_http1_sender_says_them() -> None:
    """Not in gRPC's terms (DEADLINE_EXCEEDED, UNAVAILABLE, a gRPC status number): TIMEOUT, CONNECTION."""
    import socket

    plain = _planned("http2", 0, "GET /hello")
    with socket.socket() as mute:                     # accepts (the kernel does), never says a word
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        site = Site(mute.getsockname()[1], Path("."), None)
        (timeout,) = _send("h2", site, [plain], timeout_s=0.3)
    (refused,) = _send("h2", site, [plain])          # nothing listens there now
    assert (timeout.outcome, timeout.code, timeout.status) == ("timeout", "TIMEOUT", None)
    assert (refused.outcome, refused.code, refused.status) == ("connection_error", "CONNECTION", None)
    assert "cannot connect" in refused.detail


# ---- 3. real traffic recorded with eBPF, inspected, replayed ---------------------------------------------------

TOOLS = ("nghttp", "h2load", "curl")
RECORDED = (pytest.mark.root, pytest.mark.ebpf, needs_nginx,
            pytest.mark.skipif(any(shutil.which(t) is None for t in TOOLS),
                               reason="needs nghttp, h2load (nghttp2-client) and curl; scripts/setup.sh installs them"))


def recorded_traffic(test: Callable[..., None]) -> Callable[..., None]:
    """The marks of a test that records real traffic: root, eBPF, nginx and the HTTP/2 clients."""
    for mark in RECORDED:
        test = mark(test)
    return test


Line = tuple[str, str, int, int, str]               # method, request URI, status, body bytes, x-test


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{cmd[0]} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-2000:]}"


def _h2c_traffic(site: Site, d: Path) -> None:
    """nghttp: six GETs as streams of one connection, a POST, a PUT; h2load: two connections of GETs.
    (curl 7.88's --http2-prior-knowledge fails on its second request against nginx's h2c: not used here.)"""
    (d / "post.txt").write_bytes(POST_BODY)
    (d / "put.bin").write_bytes(PUT_BODY)
    urls = [f"{site.base}{p}" for p in ("/hello", "/hello?x=1", "/1k.bin", "/100k.bin", "/1m.bin", "/missing")]
    _run(["nghttp", "-n", "-H", "x-test: nghttp", *urls])
    _run(["nghttp", "-n", "-H", "x-test: post", "-H", "content-type: text/plain", "-d", str(d / "post.txt"),
          f"{site.base}/post"])
    _run(["nghttp", "-n", "-H", ":method: PUT", "-H", "x-test: put", "-d", str(d / "put.bin"), f"{site.base}/up/put.bin"])
    _run(["h2load", "-n", "24", "-c", "2", "-m", "4", "-H", "x-test: h2load",
          *[f"{site.base}{p}" for p in ("/hello", "/1k.bin", "/100k.bin", "/missing")]])


def _tls_traffic(site: Site, d: Path) -> None:
    """curl over TLS, HTTP/2 by ALPN: four GETs on one connection, a POST, a PUT (-T)."""
    (d / "post.txt").write_bytes(POST_BODY)
    (d / "put.bin").write_bytes(PUT_BODY)
    curl = ["curl", "-sS", "--http2", "--cacert", str(site.cert), "-H", "x-test: curl"]
    paths = ("/hello", "/1k.bin", "/100k.bin", "/missing")
    _run([*curl, *[a for p in paths for a in ("-o", "/dev/null", f"{site.base}{p}")]])
    _run([*curl, "-o", "/dev/null", "-H", "content-type: text/plain", "--data-binary", f"@{d / 'post.txt'}",
          f"{site.base}/post"])
    _run([*curl, "-o", "/dev/null", "-T", str(d / "put.bin"), f"{site.base}/up/put.bin"])


@dataclass(frozen=True)
class Recorded:
    path: Path
    log: list[Line]
    calls: list[Call]
    files: dict[str, bytes]
    summary: dict[str, object]


def _record(d: Path, tls: bool, traffic: Callable[[Site, Path], None]) -> Recorded:
    """Serve, record the server's port with the eBPF backend while `traffic` runs, read the file back."""
    from capture.backends import RecordOptions  # bcc is imported only where a recorder runs
    from capture.record import Recorder

    out = d / "h2.rec"
    with serving(d, tls) as site:
        rec = Recorder(RecordOptions(output=str(out), backend="ebpf", port=site.port)).start()
        try:
            traffic(site, d)
            time.sleep(0.3)                            # the last syscalls reach the ring buffer
        finally:
            rec.stop()
    # read once nginx has stopped: it logs a request after answering it, so a log read at once may lack
    # the last one
    log, files = site.log(), {n: site.file(n) for n in FILES}
    with Recording(out) as r:
        calls = sorted(r.calls(), key=lambda c: c.request_ts_ns)
        summary = summarize(r)
    return Recorded(out, [line[:5] for line in log], calls, files, summary)


def _x_test(call: Call) -> str:
    return next((v for k, v in call.request_metadata if k == "x-test"), "-")


def _as_logged(call: Call) -> Line:
    verb, _, uri = (call.method or "? ?").partition(" ")
    return verb, uri, call.status or 0, sum(len(m.data) for m in call.responses), _x_test(call)


def _same_as_nginx_log(rec: Recorded) -> None:
    """Every recorded call is one of nginx's log lines and the other way round; bodies are the files'."""
    assert collections.Counter(_as_logged(c) for c in rec.calls) == collections.Counter(rec.log)
    assert {c.protocol for c in rec.calls} == {"http2"} and {c.kind for c in rec.calls} == {"request"}
    for call in rec.calls:
        path, body = (call.method or "").split(" ")[1], b"".join(m.data for m in call.responses)
        if path.lstrip("/") in rec.files:
            assert body == rec.files[path.lstrip("/")], path
    assert {c.responses[0].data for c in rec.calls if c.method and c.method.startswith("GET /hello")} == {HELLO}
    post = next(c for c in rec.calls if c.method == "POST /post")
    put = next(c for c in rec.calls if c.method == "PUT /up/put.bin")
    assert ([m.data for m in post.requests], [m.data for m in put.requests]) == ([POST_BODY], [PUT_BODY])
    assert ("content-type", "text/plain") in post.request_metadata
    summary = rec.summary
    assert (summary["complete"], summary["problems"]) == (True, [])   # inspect: nothing missing, nothing unknown
    assert set(summary["protocols"]) == {"http2"}                     # type: ignore[arg-type]


@pytest.fixture(scope="module")
def h2c(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    return _record(tmp_path_factory.mktemp("h2c"), False, _h2c_traffic)


@recorded_traffic
def test_h2c_nginx_recorded_equals_its_access_log(h2c: Recorded) -> None:
    assert len(h2c.calls) == 6 + 1 + 1 + 24
    _same_as_nginx_log(h2c)


@recorded_traffic
def test_h2c_recording_replayed_with_the_h2_sender_gives_nginx_the_same_requests(h2c: Recorded,
                                                                                  tmp_path: Path) -> None:
    results: list[CallResult] = []
    with serving(tmp_path, tls=False) as fresh:
        report = ReplayRun(h2c.path, f"127.0.0.1:{fresh.port}", ReplayOptions(), on_result=results.append).run()
    log, uploaded = fresh.log(), fresh.file("up/put.bin")       # nginx stopped: every request logged
    assert collections.Counter(line[:5] for line in log) == collections.Counter(h2c.log)
    assert {line[5] for line in log} == {"1"}          # every request carries the replay marker
    assert uploaded == PUT_BODY
    statuses = collections.Counter(c.status for c in h2c.calls)
    assert (report.not_sent, report.ok, report.errors) == (0, len(h2c.calls) - statuses[404],
                                                           {"HTTP_404": statuses[404]})
    assert collections.Counter((r.method, r.outcome) for r in results) == collections.Counter(
        (c.method, "error" if c.status == 404 else "ok") for c in h2c.calls)


@recorded_traffic
@pytest.mark.skipif(find_libssl() is None, reason="no system libssl.so.3 (the TLS capture reads its plaintext)")
def test_tls_alpn_h2_recorded_equals_its_access_log_and_replays_over_tls(tmp_path: Path) -> None:
    (tmp_path / "rec").mkdir()
    rec = _record(tmp_path / "rec", True, _tls_traffic)
    assert len(rec.calls) == 4 + 1 + 1
    _same_as_nginx_log(rec)
    (tmp_path / "fresh").mkdir()
    with serving(tmp_path / "fresh", tls=True) as fresh:
        assert fresh.cert is not None
        report = ReplayRun(rec.path, f"127.0.0.1:{fresh.port}", ReplayOptions(tls=TlsConfig(ca=str(fresh.cert)))).run()
    log, uploaded = fresh.log(), fresh.file("up/put.bin")       # nginx stopped: every request logged
    assert collections.Counter(line[:5] for line in log) == collections.Counter(rec.log)
    assert uploaded == PUT_BODY and (report.not_sent, report.ok, report.errors) == (0, 5, {"HTTP_404": 1})
