"""Which headers and metadata a replayed call carries, seen by real servers on loopback.

End-to-end headers go out as recorded (the HTTP/1 sender used to drop Content-Type and Accept-Encoding);
hop-by-hop ones are the sender's own; trace context is stripped and a marker added unless told
otherwise; --set-header gives shadow credentials, --drop-header removes recorded ones.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from capture.recording import Call, Flow, Message, RecordingWriter
from harness.cli import cli
from replay.engine import ReplayRun
from replay.options import ReplayOptions
from replay.senders.headers import HeaderError, HeaderPolicy
from replay.testing import DECIDE, EchoServer, decision_bytes, snapshot_bytes, write_unary_recording

MS = 1_000_000
BASE = 10_000_000_000
RECORDED = [("Host", "shop.example"), ("Content-Type", "application/json; charset=utf-8"),
            ("Accept-Encoding", "gzip"), ("User-Agent", "shop-client/2"), ("Accept", "application/json"),
            ("Cookie", "<redacted>"), ("Authorization", "[REDACTED]"),
            ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), ("tracestate", "a=1"),
            ("b3", "80f198ee56343ba8-e457b5a2e4d86bd1-1"), ("X-B3-TraceId", "80f198ee56343ba8"),
            ("uber-trace-id", "abc:def:0:1"), ("X-Debug-Id", "42"), ("X-Tenant", "prod"),
            ("Connection", "keep-alive, x-hop"), ("X-Hop", "1"), ("Keep-Alive", "timeout=5"),
            ("Proxy-Authorization", "Basic eA=="), ("Upgrade", "h2c"), ("TE", "gzip"),
            ("Transfer-Encoding", "chunked"), ("Content-Length", "999")]


@pytest.fixture
def gzip_server() -> Iterator[tuple[str, list[dict[str, str]], list[bool]]]:
    """An HTTP/1.1 server that records each request's headers and gzips its answer when asked to."""
    seen: list[dict[str, str]] = []
    gzipped: list[bool] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append({k.lower(): v for k, v in self.headers.items()} | {"_body": body.decode()})
            reply = b'{"ok": true, "padding": "' + b"x" * 200 + b'"}'
            use_gzip = "gzip" in self.headers.get("Accept-Encoding", "")
            gzipped.append(use_gzip)
            if use_gzip:
                reply = gzip.compress(reply)
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            if use_gzip:
                self.send_header("Content-Encoding", "gzip")
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}", seen, gzipped
    server.shutdown()
    server.server_close()
    thread.join(10)


def _recording(path: Path, n: int = 2) -> None:
    with RecordingWriter(path) as w:
        fid = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 8080), protocol="http1"))
        for i in range(n):
            ts = BASE + i * 5 * MS
            w.add_call(Call(protocol="http1", method=f"POST /api/{i}", request_ts_ns=ts, flow_id=fid, kind="request",
                            request_metadata=RECORDED, status=200,
                            requests=[Message("c2s", 0, ts, b'{"n": %d}' % i)]))


def test_http1_replays_end_to_end_headers_and_owns_the_hop_by_hop_ones(tmp_path: Path, gzip_server: tuple) -> None:
    address, seen, gzipped = gzip_server
    _recording(tmp_path / "h.rec")
    rep = ReplayRun(tmp_path / "h.rec", address).run()
    assert rep.ok == 2 and rep.invariant_ok
    assert gzipped == [True, True]  # Accept-Encoding reached the gzip endpoint: it answered compressed
    for i, h in enumerate(seen):
        assert h["content-type"] == "application/json; charset=utf-8"
        assert h["accept-encoding"] == "gzip" and h["user-agent"] == "shop-client/2"
        assert h["accept"] == "application/json" and h["x-tenant"] == "prod" and h["x-debug-id"] == "42"
        assert h["host"] == address                        # the target, not the recorded host
        assert h["content-length"] == str(len(h["_body"])) and h["_body"] == f'{{"n": {i}}}'
        assert h["x-shadowtest-replay"] == "1"
        for gone in ("cookie", "authorization",            # redacted: never replayed
                     "traceparent", "tracestate", "b3", "x-b3-traceid", "uber-trace-id",  # trace context
                     "x-hop", "keep-alive", "proxy-authorization", "upgrade", "te", "transfer-encoding"):
            assert gone not in h, gone
        assert h.get("connection", "keep-alive") == "keep-alive"  # ours (http.server adds none to the request)


def test_cli_header_options_set_drop_keep_trace_and_no_marker(tmp_path: Path, gzip_server: tuple) -> None:
    address, seen, _ = gzip_server
    _recording(tmp_path / "h.rec", n=1)
    res = CliRunner().invoke(cli, ["replay", str(tmp_path / "h.rec"), "--target", address,
                                   "--set-header", "Authorization=Bearer shadow", "--set-header", "x-tenant: shadow",
                                   "--drop-header", "x-debug-*", "--keep-trace-context", "--no-marker"])
    assert res.exit_code == 0, res.output
    (h,) = seen
    assert h["authorization"] == "Bearer shadow" and h["x-tenant"] == "shadow"   # set: replaces the recorded one
    assert "x-debug-id" not in h and "x-shadowtest-replay" not in h
    assert h["traceparent"].startswith("00-0af7") and h["b3"] and h["x-b3-traceid"] and h["uber-trace-id"]
    assert "cookie" not in h  # still redacted: only --set-header could give one


@pytest.mark.parametrize("sender", ["h2", "grpc"])
def test_grpc_metadata_follows_the_same_rules(tmp_path: Path, sender: str) -> None:
    path = tmp_path / "g.rec"
    write_unary_recording(path, [0, MS, 2 * MS])  # metadata: x-replay-test, user-agent, authorization [REDACTED]
    policy = HeaderPolicy.from_options(("authorization=Bearer shadow", "content-type=text/plain"), ("x-replay-*",))
    with EchoServer() as server:
        rep = ReplayRun(path, server.address, ReplayOptions(sender=sender, headers=policy)).run()
    assert rep.ok == 3 and rep.invariant_ok
    for md in server.metadata:
        assert md["authorization"] == "Bearer shadow" and md["x-shadowtest-replay"] == "1"
        assert "x-replay-test" not in md                     # dropped by the glob
        assert md.get("content-type", "application/grpc").startswith("application/grpc")  # gRPC owns it


def test_grpc_trace_context_is_stripped_unless_kept(tmp_path: Path) -> None:
    path = tmp_path / "t.rec"
    with RecordingWriter(path) as w:
        fid = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 50051), protocol="grpc"))
        for i in range(2):
            ts = BASE + i * MS
            w.add_call(Call(protocol="grpc", method=DECIDE, request_ts_ns=ts, flow_id=fid, status=0,
                            request_metadata=[("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
                                              ("x-b3-spanid", "e457b5a2e4d86bd1"), ("x-keep", "yes")],
                            requests=[Message("c2s", 0, ts, snapshot_bytes(i))],
                            responses=[Message("s2c", 0, ts + 1000, decision_bytes(i))]))
    with EchoServer() as server:
        ReplayRun(path, server.address, ReplayOptions(sender="h2")).run()
        ReplayRun(path, server.address, ReplayOptions(sender="h2", headers=HeaderPolicy(keep_trace_context=True))).run()
    stripped, kept = server.metadata[:2], server.metadata[2:]
    assert all("traceparent" not in md and "x-b3-spanid" not in md and md["x-keep"] == "yes" for md in stripped)
    assert all(md["traceparent"].startswith("00-0af7") and md["x-b3-spanid"] for md in kept)


@pytest.mark.parametrize("value", ["", "=x", "bad name=x", "connection=close", "proxy-authorization=x",
                                   ":path=/x", "x-bin=AAAA", "x-a=line\nbreak", "x-c=caf\u00e9", "x-b=" + "v" * 9000])
def test_bad_set_header_values_are_refused(value: str) -> None:
    with pytest.raises(HeaderError):
        HeaderPolicy.from_options((value,))
