"""Call-level HTTP toxics on HTTP/1.1 (`http_error`, `http_delay`) and the proxy's upstream-leg timing,
against a real Debian nginx, with curl and raw pipelined sockets as the clients.

nginx answers every path with `METHOD URI` and logs `URI|STATUS` per request it served: the log is the
server's own word on which requests reached it.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from faults.proxy import EmbeddedToxiproxy
from faults.proxy.h2tap import LEG_LOG_ENV
from harness.checks.truth import read_leg_log
from tests.nginx import NGINX, PREAMBLE, TEMP_PATHS, running_nginx

pytestmark = pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; scripts/setup.sh does)")
CURL = shutil.which("curl")

_CONF = PREAMBLE + """
http {{
    log_format calls '$request_uri|$status';
    access_log {d}/access.log calls;""" + TEMP_PATHS + """    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 10000;
        location /missing {{ return 404 "gone $request_uri\\n"; }}
        location / {{ return 200 "$request_method $request_uri\\n"; }}
    }}
}}
"""


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    d = tmp_path / "nginx"
    d.mkdir()
    with running_nginx(d, lambda port: _CONF.format(d=d, port=port)) as port:
        yield port, d / "access.log"


def _served(log: Path) -> list[tuple[str, str]]:
    return [tuple(line.split("|")) for line in log.read_text().splitlines()]  # type: ignore[misc]


def _curl(listen: str, paths: list[str]) -> list[tuple[int, float, int]]:
    """(status, seconds, connections opened) per path, all fetched by ONE curl on keep-alive."""
    assert CURL is not None
    urls = [arg for p in paths for arg in ("-o", "/dev/null", f"http://{listen}{p}")]
    out = subprocess.run([CURL, "-s", "-w", "%{http_code} %{time_total} %{num_connects}\\n",
                          "--max-time", "20", *urls], capture_output=True, text=True, timeout=60)
    rows = [line.split() for line in out.stdout.splitlines()]
    assert len(rows) == len(paths), out.stderr
    return [(int(a), float(b), int(c)) for a, b, c in rows]


@pytest.mark.skipif(CURL is None, reason="needs curl")
def test_http_error_fails_a_share_of_one_path_and_nginx_never_sees_those(tp: EmbeddedToxiproxy,
                                                                         nginx: tuple[int, Path]) -> None:
    port, log = nginx
    listen = tp.create_proxy("web", f"127.0.0.1:{port}")["listen"]
    tp.add_toxic("web", "http_error", {"status": 503, "share": 0.2, "path": "/api", "body": "chaos"},
                 stream="upstream")
    paths = [f"/api/{i}" if i % 5 else f"/static/{i}" for i in range(500)]   # 400 /api, 100 /static
    got = _curl(listen, paths)
    assert sum(c for _, _, c in got) == 1                 # one keep-alive connection carried them all
    api = [(p, s) for p, (s, _, _) in zip(paths, got, strict=True) if p.startswith("/api")]
    failed = [p for p, s in api if s == 503]
    assert all(s in (200, 503) for _, s in api)
    assert 0.15 <= len(failed) / len(api) <= 0.25, len(failed)
    assert all(s == 200 for p, (s, _, _) in zip(paths, got, strict=True) if p.startswith("/static"))
    # nginx served exactly the requests the proxy did not fail, in order; the failed ones never reached it.
    served = _served(log)
    assert [u for u, _ in served] == [p for p, (s, _, _) in zip(paths, got, strict=True) if s == 200]
    assert not set(failed) & {u for u, _ in served}
    stats = tp.call_stats("web")
    assert stats["calls_failed"] == len(failed) and stats["calls_seen"] == 500


@pytest.mark.skipif(CURL is None, reason="needs curl")
def test_http_delay_moves_only_the_chosen_requests_and_not_the_upstream_leg(
        tp: EmbeddedToxiproxy, nginx: tuple[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    legs_file = tmp_path / "legs.log"
    monkeypatch.setenv(LEG_LOG_ENV, str(legs_file))
    port, _ = nginx
    listen = tp.create_proxy("web", f"127.0.0.1:{port}")["listen"]
    tp.add_toxic("web", "http_delay", {"delay": 150, "jitter": 20, "method": "GET", "path": "/search*"},
                 stream="upstream")
    paths = [p for i in range(15) for p in (f"/search?q={i}", f"/static/{i}", f"/missing/{i}")]
    got = _curl(listen, paths)
    took = {kind: [t for p, (_, t, _) in zip(paths, got, strict=True) if p.startswith(kind)]
            for kind in ("/search", "/static", "/missing")}
    assert min(took["/search"]) >= 0.125                       # 150 +/- 20 ms, on every chosen request
    assert statistics.median(took["/static"]) < 0.05 and statistics.median(took["/missing"]) < 0.05
    # The leg is the server's side of the proxy: one line per request, none holding the proxy's delay.
    deadline = time.monotonic() + 2      # the proxy's thread writes the last line as curl exits
    while len(legs := read_leg_log(legs_file, 0.0)) < len(paths) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(legs) == len(paths)
    assert max(done - sent for sent, done, _ in legs) < 0.1
    # Served: 1 for nginx's 200s, 0 for its 404s (in request order: search, static, missing, ...).
    assert [served for _, _, served in legs] == [True, True, False] * 15
    assert tp.call_stats("web")["calls_delayed"] == 15


def _responses(sock: socket.socket, methods: list[str]) -> list[tuple[int, bytes, bytes]]:
    """Read one response per request method from a pipelined socket: (status, head, body)."""
    buf = b""
    out = []
    sock.settimeout(10)
    for method in methods:
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            assert data, f"connection closed after {len(out)} responses"
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        length = 0 if method == "HEAD" else int(next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(buf) < length:
            data = sock.recv(65536)
            assert data
            buf += data
        out.append((int(head.split(b" ")[1]), head, buf[:length]))
        buf = buf[length:]
    return out


def test_pipelined_requests_keep_their_order_through_every_http_fault(tp: EmbeddedToxiproxy,
                                                                      nginx: tuple[int, Path]) -> None:
    port, log = nginx
    host, lport = tp.create_proxy("web", f"127.0.0.1:{port}")["listen"].rsplit(":", 1)
    tp.add_toxic("web", "http_error", {"status": 429, "share": 0.5, "path": "/api", "body": "slow down"},
                 stream="upstream")
    tp.add_toxic("web", "http_delay", {"delay": 60, "jitter": 40, "path": "/static"}, stream="upstream")
    tp.add_toxic("web", "http_delay", {"delay": 30, "header": "x-canary: b*"}, stream="upstream", name="canary")
    requests, expect = [], []
    for i in range(60):
        kind = i % 5
        if kind == 0:
            requests.append(b"GET /api/%d HTTP/1.1\r\nHost: t\r\n\r\n" % i)
            expect.append(("GET", f"/api/{i}"))
        elif kind == 1:      # chunked body, split oddly
            requests.append(b"POST /api/%d HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                            b"3;x=1\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\nX-Trailer: 1\r\n\r\n" % i)
            expect.append(("POST", f"/api/{i}"))
        elif kind == 2:
            requests.append(b"HEAD /static/%d HTTP/1.1\r\nHost: t\r\n\r\n" % i)
            expect.append(("HEAD", f"/static/{i}"))
        elif kind == 3:
            body = b"x" * (100 + i)
            requests.append(b"PUT /static/%d HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (i, len(body), body))
            expect.append(("PUT", f"/static/{i}"))
        else:
            requests.append(b"GET /other/%d HTTP/1.1\r\nHost: t\r\nX-Canary: blue\r\n\r\n" % i)
            expect.append(("GET", f"/other/{i}"))
    wire = b"".join(requests)
    with socket.create_connection((host, int(lport))) as sock:
        for k in range(0, len(wire), 777):           # requests cut at arbitrary places
            sock.sendall(wire[k:k + 777])
        got = _responses(sock, [m for m, _ in expect])
    failed = []
    for (method, uri), (status, head, body) in zip(expect, got, strict=True):
        if status == 429:
            assert uri.startswith("/api") and b"x-shadowtest-fault: http_error" in head and body == b"slow down"
            failed.append(uri)
        else:
            assert status == 200 and b"x-shadowtest-fault" not in head
            assert body == (b"" if method == "HEAD" else f"{method} {uri}\n".encode()), (uri, body)
    assert 4 <= len(failed) <= 20                      # half of the 24 /api requests, seeded
    served = [u for u, _ in _served(log)]
    assert served == [u for _, u in expect if u not in failed]
    stats = tp.call_stats("web")
    assert stats == {"connections": 1, "calls_seen": 60, "calls_delayed": 36, "calls_failed": len(failed),
                     "calls_cut": 0}


def test_an_injected_answer_that_ends_the_connection_closes_it(tp: EmbeddedToxiproxy, nginx: tuple[int, Path]) -> None:
    port, log = nginx
    host, lport = tp.create_proxy("web", f"127.0.0.1:{port}")["listen"].rsplit(":", 1)
    tp.add_toxic("web", "http_error", {"status": 500, "path": "/api"}, stream="upstream")
    # HTTP/1.0 without keep-alive, and a client that waits for 100-continue: the answer closes the connection.
    for request in (b"GET /api/1 HTTP/1.0\r\n\r\n",
                    b"POST /api/2 HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"):
        with socket.create_connection((host, int(lport))) as sock:
            sock.sendall(request)
            sock.settimeout(5)
            data = b""
            while chunk := sock.recv(4096):
                data += chunk
        assert data.split(b"\r\n")[0].endswith(b" 500 Internal Server Error")
        assert b"connection: close" in data and data.endswith(b"\r\n\r\n")
    assert _served(log) == []


def test_an_upgrade_turns_the_tap_off_and_the_bytes_pass_untouched(tp: EmbeddedToxiproxy,
                                                                  nginx: tuple[int, Path]) -> None:
    port, log = nginx
    host, lport = tp.create_proxy("web", f"127.0.0.1:{port}")["listen"].rsplit(":", 1)
    tp.add_toxic("web", "http_error", {"status": 503}, stream="upstream")
    with socket.create_connection((host, int(lport))) as sock:
        # nginx does not upgrade a plain location: it answers 200 and the connection goes on, untapped.
        sock.sendall(b"GET /ws/1 HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
                     b"GET /ws/2 HTTP/1.1\r\nHost: t\r\n\r\n")
        got = _responses(sock, ["GET", "GET"])
    assert [s for s, _, _ in got] == [200, 200]
    assert [u for u, _ in _served(log)] == ["/ws/1", "/ws/2"]


class _Sink:
    """A TCP server that keeps every byte each connection sent it, until the client closes."""

    def __init__(self) -> None:
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.got: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            data = b""
            with conn:
                while chunk := conn.recv(1 << 16):
                    data += chunk
            self.got.append(data)

    def close(self) -> None:
        self.sock.close()


HOSTILE = [
    b"GET /a HTTP/1.1\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n",                       # head over 64 KiB
    b"POST /a HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",            # conflicting lengths
    b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",         # bad chunk size
    b"POST /a HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n\x1f\x8b\x08\x00",                 # no framing we know
    b"GET /a HTTP/1.1\r\n\r\n\x00\xff\xfe garbage \r\n\r\n\x16\x03\x01",                     # binary after a request
    b"GET /\r\n\r\nGET /a HTTP/1.1\r\n\r\n",                                                 # HTTP/0.9 line
    b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcdeXX0\r\n\r\n",          # data not ended by CRLF
    b"GET /a HTTP/1.1\r\nBad Header\r\n\r\n",                                                # a field without a colon
]


@pytest.mark.parametrize("wire", HOSTILE, ids=range(len(HOSTILE)))
def test_bytes_the_tap_cannot_frame_reach_the_server_unchanged(tp: EmbeddedToxiproxy, wire: bytes) -> None:
    sink = _Sink()
    try:
        host, lport = tp.create_proxy("raw", sink.address)["listen"].rsplit(":", 1)
        tp.add_toxic("raw", "http_error", {"path": "/never"}, stream="upstream")
        tp.add_toxic("raw", "http_delay", {"delay": 5}, stream="upstream")
        with socket.create_connection((host, int(lport))) as sock:
            for k in range(0, len(wire), 1000):
                sock.sendall(wire[k:k + 1000])
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(5)
            assert sock.recv(10) == b""                 # the sink never answers; the proxy passed EOF on
        deadline = time.monotonic() + 5
        while not sink.got and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sink.got == [wire]
    finally:
        sink.close()


def test_a_delayed_upload_over_the_memory_bound_is_released_early() -> None:
    import asyncio

    from faults.proxy import h1tap
    from faults.proxy.calls import rule_of

    async def run() -> tuple[int, int, float]:
        up: list[bytes] = []
        tap = h1tap.H1Tap(up.append, lambda b: None, lambda: [rule_of("http_delay", {"delay": 60_000})],
                          __import__("random").Random(1))
        body = b"u" * (h1tap.MAX_HELD + (1 << 20))
        t0 = time.monotonic()
        tap.feed_up(b"PUT /big HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body))
        for k in range(0, len(body), 1 << 16):
            tap.feed_up(body[k:k + (1 << 16)])
        return sum(map(len, up)), tap.calls_cut, time.monotonic() - t0

    sent, cut, took = asyncio.run(run())
    assert cut == 1 and took < 5            # not held for the minute asked
    assert sent == len(b"PUT /big HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (h1tap.MAX_HELD + (1 << 20))) \
        + h1tap.MAX_HELD + (1 << 20)
