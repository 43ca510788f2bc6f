"""The agent's metrics endpoint against hostile clients: bounded threads, read/write deadlines, body
framing and /threshold validation. A real server on 127.0.0.1, port 0; every socket loop is bounded in
count and time, and every socket is closed."""

from __future__ import annotations

import http.client
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from agent_under_test.hooks import GuardConfig
from agent_under_test.metrics_http import MetricsServer
from agent_under_test.protection import ProtectionGuard
from tests.polling import wait_for

HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"   # the blank line that would end the headers never comes
SLACK_S = 2.0   # generous: the machine is shared
Serve = Callable[..., MetricsServer]   # the `serve` fixture: start a server with these limits
Capfd = pytest.CaptureFixture[str]


@pytest.fixture
def guard() -> ProtectionGuard:
    return ProtectionGuard(GuardConfig(period_s=3600.0))   # no endpoint of its own, never started


@pytest.fixture
def serve(guard: ProtectionGuard) -> Iterator[Serve]:
    servers: list[MetricsServer] = []

    def start(**limits: float) -> MetricsServer:
        server = MetricsServer("127.0.0.1", 0, guard.metrics, guard.events, guard.set_threshold,
                               **limits)  # type: ignore[arg-type]
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def address(server: MetricsServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def handler_threads(server: MetricsServer) -> int:
    return sum(t.name == server.handler_thread_name for t in threading.enumerate())


def connect(server: MetricsServer, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(address(server), timeout=5)
    if data:
        sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """What arrives within `timeout_s`, and whether the server closed the connection by then."""
    received, deadline = b"", time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return received, True
        if not chunk:
            return received, True
        received += chunk
    return received, False


def get(server: MetricsServer, path: str, method: str = "GET") -> tuple[int, bytes]:
    host, port = address(server)
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def threshold_gauge(server: MetricsServer) -> float:
    status, body = get(server, "/metrics")
    assert status == 200
    match = re.search(rb"^agent_p99_threshold_seconds (\S+)$", body, re.MULTILINE)
    assert match is not None
    return float(match.group(1))


def test_half_sent_requests_are_bounded_refused_with_503_then_timed_out_and_closed(serve: Serve,
                                                                                   capfd: Capfd) -> None:
    bound, read_timeout_s = 16, 2.0
    server = serve(max_handlers=bound, read_timeout_s=read_timeout_s)
    baseline = threading.active_count()
    holders: list[socket.socket] = []
    refused: list[socket.socket] = []
    try:
        holders = [connect(server, HALF_SENT) for _ in range(bound)]
        assert wait_for(lambda: server.active_handlers == bound, SLACK_S)
        most_handlers, most_threads = 0, 0
        for _ in range(300 - bound):
            refused.append(connect(server, HALF_SENT))
            most_handlers = max(most_handlers, handler_threads(server))
            most_threads = max(most_threads, threading.active_count())
        assert most_handlers == bound and most_threads <= baseline + bound + 2
        start = time.monotonic()
        assert get(server, "/healthz") == (503, b"busy: too many connections to the metrics endpoint, "
                                                b"retry later\n")
        assert time.monotonic() - start < 1.0   # answered by the accepting thread, not queued
        for sock in refused:                    # each refused connection got its 503 and was closed
            answer, closed = read_until_closed(sock, SLACK_S)
            assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and closed
        for sock in holders:                    # the deadline closes the half-sent ones, unanswered
            assert read_until_closed(sock, read_timeout_s + SLACK_S) == (b"", True)
        assert wait_for(lambda: handler_threads(server) == 0 and server.active_handlers == 0, SLACK_S)
        assert get(server, "/healthz") == (200, b"ok\n")
    finally:
        for sock in holders + refused:
            sock.close()
    assert "Traceback" not in capfd.readouterr().err


def test_a_request_dribbled_a_byte_at_a_time_is_cut_at_its_deadline(serve: Serve, capfd: Capfd) -> None:
    # Each byte comes well within the per-read socket timeout: only the whole-request deadline stops it.
    server = serve(read_timeout_s=0.5)
    with connect(server, b"GET /healthz HTTP/1.1\r\nX-Pad: ") as sock:
        start, closed_after = time.monotonic(), None
        for _ in range(50):                     # 50 x 0.1 s at most
            try:
                sock.send(b"a")
                sock.settimeout(0.1)
                if sock.recv(100) == b"":
                    closed_after = time.monotonic() - start
                    break
            except TimeoutError:
                continue
            except OSError:                     # reset: closed as well
                closed_after = time.monotonic() - start
                break
    assert closed_after is not None and 0.4 <= closed_after < 0.5 + SLACK_S
    assert wait_for(lambda: handler_threads(server) == 0, SLACK_S)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize(("headers", "status"), [
    (b"Content-Length: -1\r\n", b"400 Bad Request"),
    (b"Content-Length: abc\r\n", b"400 Bad Request"),
    (b"Content-Length: 1e3\r\n", b"400 Bad Request"),
    (b"Content-Length: 5\r\nContent-Length: 6\r\n", b"400 Bad Request"),
    (b"Content-Length: 99999999999999999999999\r\n", b"413 Request Entity Too Large"),
    (b"Content-Length: 65537\r\n", b"413 Request Entity Too Large"),
    (b"Content-Length: 99999999\r\nExpect: 100-continue\r\n", b"413 Request Entity Too Large"),
    (b"Transfer-Encoding: chunked\r\n", b"400 Bad Request"),
])
def test_a_body_that_cannot_be_framed_is_refused_promptly_and_closed(serve: Serve, guard: ProtectionGuard,
                                                                     capfd: Capfd, headers: bytes,
                                                                     status: bytes) -> None:
    server = serve()
    before = guard.config.p99_threshold_ms
    request = b"POST /threshold?p99_ms=7 HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    start = time.monotonic()
    with connect(server, request) as sock:
        answer, closed = read_until_closed(sock, SLACK_S)
    assert time.monotonic() - start < SLACK_S and closed
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 " + status + b"\r\n") and b"\r\nConnection: close" in head
    assert body.count(b"\n") == 1 and body.endswith(b"\n") and b"100 Continue" not in answer
    assert wait_for(lambda: handler_threads(server) == 0, SLACK_S)
    assert before != 7.0 and guard.config.p99_threshold_ms == before     # the request was never run
    assert threshold_gauge(server) == before / 1000.0
    assert "Traceback" not in capfd.readouterr().err


def test_a_body_within_the_cap_is_read_and_the_connection_kept(serve: Serve) -> None:
    server = serve()
    body = b"x" * 1000
    request = (b"POST /threshold?p99_ms=30 HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
               b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % (len(body), body))
    with connect(server, request) as sock:
        answer, closed = read_until_closed(sock, SLACK_S)
    assert closed and answer.count(b"HTTP/1.1 200 OK\r\n") == 2 and answer.endswith(b"\r\n\r\nok\n")
    assert threshold_gauge(server) == 0.030


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400", "-1", "0", "x", ""])
def test_threshold_takes_only_finite_positive_numbers(serve: Serve, guard: ProtectionGuard,
                                                      value: str) -> None:
    server = serve()
    before = guard.config.p99_threshold_ms
    status, body = get(server, f"/threshold?p99_ms={value}", "POST")
    assert status == 400 and body.startswith(b"need ?p99_ms=<finite positive number>: ")
    assert body.count(b"\n") == 1 and body.endswith(b"\n")
    assert guard.config.p99_threshold_ms == before and threshold_gauge(server) == before / 1000.0
    assert get(server, "/threshold?p99_ms=12.5", "POST") == (200, b'{"p99_threshold_ms": 12.5}\n')
    assert guard.config.p99_threshold_ms == 12.5 and threshold_gauge(server) == 0.0125


def test_the_guard_itself_refuses_an_infinite_threshold(guard: ProtectionGuard) -> None:
    before = guard.config.p99_threshold_ms
    for bad in (math.inf, math.nan, 0.0, -5.0):
        with pytest.raises(ValueError, match="finite positive"):
            guard.set_threshold(bad)
    assert guard.config.p99_threshold_ms == before


def test_a_stalled_events_reader_is_dropped_at_the_write_timeout(serve: Serve, guard: ProtectionGuard,
                                                                 capfd: Capfd) -> None:
    server = serve(write_timeout_s=0.5)
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # small, so the server's writes stall
        sock.settimeout(5)
        sock.connect(address(server))
        sock.sendall(b"GET /events?since=0 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert wait_for(lambda: server.active_handlers == 1, SLACK_S)
        for _ in range(200):                    # ~12 MB, more than both socket buffers hold: never read
            guard.events.emit("period", {"pad": "x" * 60_000})
        assert wait_for(lambda: handler_threads(server) == 0 and server.active_handlers == 0, 0.5 + 5.0)
    finally:
        sock.close()
    assert get(server, "/healthz") == (200, b"ok\n")
    assert "Traceback" not in capfd.readouterr().err
