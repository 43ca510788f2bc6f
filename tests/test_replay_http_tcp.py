"""HTTP/1.1 and raw TCP senders against real stdlib servers on loopback."""

from __future__ import annotations

import socketserver
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from capture.recording import Call, Chunk, Flow, Message, RecordingWriter
from replay.engine import ReplayRun

MS = 1_000_000
BASE = 10_000_000_000


@pytest.fixture
def http_server() -> Iterator[tuple[str, list[tuple[str, str, bytes, str]]]]:
    seen: list[tuple[str, str, bytes, str]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append((self.command, self.path, body, self.headers.get("X-Trace", "")))
            code = 429 if self.path == "/busy" else 200
            reply = b"ok:" + body
            self.send_response(code)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def test_http1_requests_replayed_with_headers_and_bodies(tmp_path: Path, http_server: tuple) -> None:
    address, seen = http_server
    with RecordingWriter(tmp_path / "h.rec") as w:
        fid = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 8080), protocol="http1"))
        for i, (line, body) in enumerate([("POST /orders", b"a=1"), ("GET /health", b""), ("GET /busy", b"")]):
            ts = BASE + i * 5 * MS
            w.add_call(Call(protocol="http1", method=line, request_ts_ns=ts, flow_id=fid, kind="request",
                            request_metadata=[("X-Trace", f"t{i}"), ("Connection", "keep-alive"),
                                              ("Cookie", "<redacted>")], status=200,
                            requests=[Message("c2s", 0, ts, body)] if body else []))
    rep = ReplayRun(tmp_path / "h.rec", address).run()
    assert seen == [("POST", "/orders", b"a=1", "t0"), ("GET", "/health", b"", "t1"), ("GET", "/busy", b"", "t2")]
    assert rep.ok == 2 and rep.rejected == 1 and rep.invariant_ok


def test_raw_tcp_flow_chunks_keep_their_gaps(tmp_path: Path) -> None:
    arrivals: list[tuple[int, bytes]] = []

    class Echo(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            while data := self.request.recv(65536):
                arrivals.append((time.monotonic_ns(), data))
                self.request.sendall(data.upper())

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with RecordingWriter(tmp_path / "t.rec") as w:
            fid = w.add_flow(Flow(("127.0.0.1", 40001), ("127.0.0.1", 7000), protocol="tcp"))
            for gap, data in [(0, b"hello "), (150, b"raw "), (300, b"tcp")]:
                w.add_chunk(Chunk(fid, "c2s", BASE + gap * MS, data))
                w.add_chunk(Chunk(fid, "s2c", BASE + gap * MS + 1000, data.upper()))
        rep = ReplayRun(tmp_path / "t.rec", f"127.0.0.1:{server.server_address[1]}").run()
    finally:
        server.shutdown()
        server.server_close()
    assert b"".join(d for _, d in arrivals) == b"hello raw tcp"
    assert rep.ok == 1 and rep.scheduled == 1 and rep.invariant_ok
    # Measure between the 2nd and 3rd sends: the 1st may be late behind connection set-up on a busy
    # host (open loop then sends it at once, so it can share a segment with the 2nd).
    raw_at = next(t for t, d in arrivals if d.endswith(b"raw "))
    tcp_at = next(t for t, d in arrivals if d == b"tcp")
    gap_ms = (tcp_at - raw_at) / MS
    assert 150 - 60 < gap_ms < 150 + 150  # tolerance: -60/+150 ms on a shared, noisy host


_NGINX_CONF = """
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/body;
    server {{
        listen 127.0.0.1:{port};
        location = /health {{ return 204; }}
        location = /same {{ return 304; }}
        location / {{ return 200 "ok $request_uri\\n"; }}
    }}
}}
"""


def test_bodyless_answers_do_not_stall_a_keep_alive_connection(tmp_path: Path) -> None:
    # nginx answers 204 and 304 with no Content-Length (RFC 9112: they never have a body). Read as a
    # body that runs to the close, every call behind one on the connection waited out its timeout.
    from tests.nginx import NGINX, PREAMBLE, running_nginx

    if NGINX is None:
        pytest.skip("needs nginx (apt-get install nginx; scripts/setup.sh does)")
    d = tmp_path / "nginx"
    d.mkdir()
    lines = [("GET /health", 204), ("GET /same", 304), ("GET /a", 200), ("HEAD /b", 200)] * 5
    with RecordingWriter(tmp_path / "h.rec") as w:
        fid = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 8080), protocol="http1"))
        for i, (line, status) in enumerate(lines):
            w.add_call(Call(protocol="http1", method=line, request_ts_ns=BASE + i * 5 * MS, flow_id=fid,
                            kind="request", status=status))
    with running_nginx(d, lambda port: PREAMBLE.format(d=d) + _NGINX_CONF.format(d=d, port=port)) as port:
        t0 = time.monotonic()
        rep = ReplayRun(tmp_path / "h.rec", f"127.0.0.1:{port}").run()
        took = time.monotonic() - t0
    assert rep.ok == len(lines) and rep.timeouts == 0 and rep.invariant_ok
    assert took < 3.0, took       # 20 calls 5 ms apart: no call waited for a close that never came
    assert len((d / "access.log").read_text().splitlines()) == len(lines)
