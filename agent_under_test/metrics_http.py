"""The agent's HTTP endpoint: /metrics, /events (JSON lines, streamed), /healthz.

    GET /metrics                 Prometheus text exposition (the guard's own CollectorRegistry)
    GET /events?since=SEQ&follow=1   chunked JSON lines: events after SEQ, then new ones as they happen
    GET /events?follow=0         what exists now, then close
    GET /healthz                 "ok"
    POST /threshold?p99_ms=20    change the P99 threshold from the next period on (tests, chaos runs);
                                 only a finite positive number of ms, else 400 and nothing changes
    POST /heap/start?frames=1, GET /heap/growth?top=10, POST /heap/stop
                                 where the Python heap grew since a baseline (heap.py; off until started)

The server is stdlib `ThreadingHTTPServer` in a daemon thread, nothing of it on the request path, and
bounded against hostile or broken clients:
  * at most `MAX_HANDLERS` connections are served at once, one thread each; a connection beyond that
    is answered 503 by the accepting thread and closed (no thread, no queue). A streaming /events
    reader holds its slot for as long as it stays connected.
  * a request (line, headers, body) must arrive within `READ_TIMEOUT_S` in all, and an idle
    keep-alive connection is closed after as long; the connection is then closed without an answer.
  * a response write (an /events chunk too) that cannot finish within `WRITE_TIMEOUT_S` ends the
    connection, so a stalled reader frees its slot.
  * a request body needs a plain Content-Length of at most `MAX_BODY_BYTES` (400, or 413 when larger);
    Transfer-Encoding request bodies are refused (400). Those answers close the connection.
  * client errors never print tracebacks: a dropped or timed-out connection is silent, anything else
    one log line.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from agent_under_test.events import EventLog, to_line
from agent_under_test.heap import TRACER

if TYPE_CHECKING:
    from agent_under_test.metrics import Metrics

MAX_HANDLERS = 64            # connections served at once: a scraper and a few /events readers need far fewer
READ_TIMEOUT_S = 5.0         # a whole request (line, headers, body) is a few hundred bytes: ms, not seconds
WRITE_TIMEOUT_S = 10.0       # a reader that cannot take one response or /events chunk in this long is stalled
MAX_BODY_BYTES = 64 * 1024   # no endpoint reads a body: a bigger one is a mistake or an attack
LINGER_S = 1.0               # closing with unread input resets the connection, which can destroy our answer
HANDLER_THREAD_NAME = "agent-metrics-handler"   # + " <port>": one thread per connection being served
_LINGER_BYTES = 4 * MAX_BODY_BYTES   # what a closing connection may still read before it gives up waiting
_MAX_REFUSED_HELD = 256      # refused connections kept for their linger at once; beyond it the oldest closes
_SWEEP_EVERY_S = 0.05        # how often the accepting thread looks at refused connections (accepts between)
_LISTEN_BACKLOG = 128        # a burst of connects waits in the kernel (not in SYN retries) to be answered
_TEXT = "text/plain; charset=utf-8"
_BUSY_BODY = b"busy: too many connections to the metrics endpoint, retry later\n"
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
         b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%s"
         % (len(_BUSY_BODY), _BUSY_BODY))
_log = logging.getLogger(__name__)


class _BadRequest(Exception):
    """A request the endpoint answers with `status` and a one-line `message`, then closes."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def body_length(headers: Message) -> int:
    """The request body's length: its Content-Length, 0 without one.

    Raises _BadRequest: 400 for a Transfer-Encoding (we frame bodies by length only), for a
    Content-Length that is not a plain non-negative decimal integer, or for repeated, different ones;
    413 for one over MAX_BODY_BYTES."""
    if headers.get("Transfer-Encoding") is not None:
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "Transfer-Encoding request bodies are not supported: "
                          "send Content-Length")
    values = {v.strip() for v in headers.get_all("Content-Length") or []}
    if not values:
        return 0
    if len(values) > 1:
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "conflicting Content-Length headers")
    text = values.pop()
    if not (text.isascii() and text.isdigit()):
        raise _BadRequest(HTTPStatus.BAD_REQUEST, f"Content-Length must be a non-negative integer, "
                          f"got {text[:32]!r}")
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(MAX_BODY_BYTES)) or int(digits) > MAX_BODY_BYTES:
        raise _BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body over {MAX_BODY_BYTES} bytes")
    return int(digits)


def parse_threshold_ms(query: str) -> float:
    """The p99_ms value of a /threshold query string.

    Raises ValueError with a one-line reason when it is missing or not a finite positive number
    (an infinite threshold would keep the P99 alert from ever firing)."""
    values = parse_qs(query).get("p99_ms")
    if not values:
        raise ValueError("p99_ms is missing")
    text = values[0]
    try:
        ms = float(text)
    except ValueError:
        raise ValueError(f"p99_ms={text[:32]!r} is not a number") from None
    if not (math.isfinite(ms) and ms > 0):
        raise ValueError(f"p99_ms={text[:32]!r} is not a finite positive number")
    return ms


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    error_content_type = _TEXT
    error_message_format = "%(code)d %(message)s\n"   # stdlib's own answers (bad request line, ...): one line

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet: no stderr per request
        pass

    def handle_one_request(self) -> None:
        """One request. Its line, headers and body must arrive within the read timeout in all; when they
        do not, the connection is closed without an answer."""
        self.connection.settimeout(self.server.read_timeout_s)
        self.server.deadlines.arm(self.connection, self.server.read_timeout_s)
        try:
            super().handle_one_request()
        finally:
            self.server.deadlines.disarm(self.connection)

    def handle_expect_100(self) -> bool:
        """Invite the body only if we would accept it; else answer 400/413 now and return False."""
        try:
            body_length(self.headers)
        except _BadRequest as exc:
            self._refuse(exc)
            return False
        return super().handle_expect_100()

    def parse_request(self) -> bool:
        """Request line and headers (stdlib), then the body, read and dropped: no endpoint uses it.

        Returns False, the connection to be closed, for a body we cannot frame (answered 400/413),
        or for a request that ended early or missed its deadline (not answered)."""
        if not super().parse_request():
            return False
        try:
            length = body_length(self.headers)
        except _BadRequest as exc:
            self._refuse(exc)
            return False
        complete = len(self.rfile.read(length)) == length if length else True
        if not self.server.deadlines.disarm(self.connection) or not complete:
            self.close_connection = True
            return False
        self.connection.settimeout(self.server.write_timeout_s)
        return True

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/metrics":
            self._send(HTTPStatus.OK, CONTENT_TYPE_LATEST, self.server.metrics.exposition())
        elif url.path == "/healthz":
            self._send(HTTPStatus.OK, _TEXT, b"ok\n")
        elif url.path == "/events":
            self._events(query)
        elif url.path == "/heap/growth":
            self._heap(lambda: TRACER.growth(_int_arg(query, "top", 10)))
        else:
            self._send(HTTPStatus.NOT_FOUND, _TEXT, b"try /metrics, /events, /healthz\n")

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        url = urlsplit(self.path)
        if url.path == "/heap/start":
            self._heap(lambda: TRACER.start(_int_arg(parse_qs(url.query), "frames", 1)))
            return
        if url.path == "/heap/stop":
            self._heap(TRACER.stop)
            return
        if url.path != "/threshold" or self.server.set_threshold is None:
            self._send(HTTPStatus.NOT_FOUND, _TEXT, b"POST /threshold?p99_ms=MS, /heap/start, /heap/stop\n")
            return
        try:
            ms = parse_threshold_ms(url.query)
            self.server.set_threshold(ms)
        except ValueError as exc:
            self._send(HTTPStatus.BAD_REQUEST, _TEXT,
                       f"need ?p99_ms=<finite positive number>: {exc}\n".encode())
            return
        self._send(HTTPStatus.OK, "application/json", b'{"p99_threshold_ms": %s}\n' % repr(ms).encode())

    def _heap(self, what: Callable[[], dict[str, Any]]) -> None:
        """Answer a /heap request: its JSON, or 400 with the one-line reason."""
        try:
            body = json.dumps(what()).encode() + b"\n"
        except ValueError as exc:
            self._send(HTTPStatus.BAD_REQUEST, _TEXT, f"{exc}\n".encode())
            return
        self._send(HTTPStatus.OK, "application/json", body)

    def _send(self, status: HTTPStatus, ctype: str, body: bytes, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, exc: _BadRequest) -> None:
        """Answer a request whose body we cannot frame, then close: what follows it cannot be told from
        a next request. Waits up to LINGER_S for the client to close first (see _linger)."""
        self.close_connection = True
        self._send(exc.status, _TEXT, exc.message.encode() + b"\n", close=True)
        _linger(self.connection, LINGER_S)

    def _events(self, query: dict[str, list[str]]) -> None:
        try:
            since = int(query.get("since", ["0"])[0])
            follow = query.get("follow", ["1"])[0] not in ("0", "false", "no")
        except ValueError:
            self._send(HTTPStatus.BAD_REQUEST, _TEXT, b"since must be an integer\n")
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            self._stream(self.server.events, since, follow)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the reader went away, or stalled past the write timeout: nothing to clean up
        self.close_connection = True

    def _stream(self, log: EventLog, since: int, follow: bool) -> None:
        events = log.since(since)
        while True:
            if events:
                body = b"".join(to_line(e) for e in events)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(body), body))
                self.wfile.flush()
                since = int(events[-1]["seq"])
            if not follow or log.closed or self.server.stopping.is_set():
                return
            events = log.wait_after(since, 0.5)


def _int_arg(query: dict[str, list[str]], name: str, default: int) -> int:
    """An integer query argument (ValueError, one line, when it is not one)."""
    text = query.get(name, [str(default)])[0]
    if not (text.isascii() and text.isdigit() and len(text) <= 6):
        raise ValueError(f"{name} must be a small non-negative integer, got {text[:32]!r}")
    return int(text)


def _linger(sock: socket.socket, seconds: float) -> None:
    """Shut our side, then read and drop what the client still sends until it closes, `seconds` pass or
    _LINGER_BYTES came: closing with unread input would reset the connection and could destroy the
    answer before the client reads it. Socket errors end it quietly."""
    deadline = time.monotonic() + seconds
    left = _LINGER_BYTES
    try:
        sock.shutdown(socket.SHUT_WR)
        while left > 0 and (remaining := deadline - time.monotonic()) > 0:
            sock.settimeout(remaining)
            chunk = sock.recv(min(left, 65536))
            if not chunk:
                return
            left -= len(chunk)
    except OSError:
        return


def _client_done(sock: socket.socket) -> bool:
    """Without waiting: True once the client has closed (or the socket failed); drops what it sent."""
    try:
        for _ in range(_LINGER_BYTES // 65536):
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True   # it keeps sending: stop listening


def _close_drained(sock: socket.socket) -> None:
    """Close a non-blocking socket after dropping the input that has arrived (no reset for it)."""
    _client_done(sock)
    sock.close()


class _Slots:
    """How many connections are being served, up to `limit`. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit, self.busy = limit, 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        """One slot if one is free; False (nothing taken) when all `limit` are busy."""
        with self._lock:
            if self.busy >= self.limit:
                return False
            self.busy += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.busy -= 1


class _Deadlines:
    """Deadlines of requests still arriving. A socket timeout bounds each read, not a request sent a
    byte at a time: the accepting thread calls enforce() on every poll, which shuts overdue sockets and
    so wakes their blocked reads with end-of-file. Thread-safe."""

    def __init__(self) -> None:
        self._due: dict[socket.socket, float] = {}
        self._lock = threading.Lock()

    def arm(self, sock: socket.socket, seconds: float) -> None:
        with self._lock:
            self._due[sock] = time.monotonic() + seconds

    def disarm(self, sock: socket.socket) -> bool:
        """Stop watching `sock`; False when its deadline had passed (it is shut already) or it was unarmed."""
        with self._lock:
            return self._due.pop(sock, None) is not None

    def enforce(self, now: float | None = None) -> None:
        """Shut every socket past its deadline (all of them with now=inf)."""
        now = time.monotonic() if now is None else now
        with self._lock:   # held while shutting: a handler disarms before it closes, so no fd is reused yet
            for sock in [s for s, due in self._due.items() if due <= now]:
                del self._due[sock]
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _Refusals:
    """Connections refused for want of a slot, on the accepting thread only: each gets a 503 and its
    write side shut at once, then is closed when the client closes or after LINGER_S (see _linger);
    at most _MAX_REFUSED_HELD wait, the oldest is closed early."""

    def __init__(self, linger_s: float) -> None:
        self._linger_s = linger_s
        self._held: deque[tuple[float, socket.socket]] = deque()
        self._next_sweep = 0.0

    def refuse(self, sock: socket.socket) -> None:
        """Answer 503 without waiting (a fresh socket's send buffer takes it whole); errors just close."""
        try:
            sock.setblocking(False)
            sock.send(_BUSY)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        if len(self._held) >= _MAX_REFUSED_HELD:
            _close_drained(self._held.popleft()[1])
        self._held.append((time.monotonic() + self._linger_s, sock))

    def sweep(self) -> None:
        """Close those whose client closed or whose linger is over; at most every _SWEEP_EVERY_S."""
        now = time.monotonic()
        if not self._held or now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_EVERY_S
        kept: deque[tuple[float, socket.socket]] = deque()
        for due, sock in self._held:
            if _client_done(sock) or due <= now:
                sock.close()
            else:
                kept.append((due, sock))
        self._held = kept

    def close_all(self) -> None:
        while self._held:
            _close_drained(self._held.popleft()[1])


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = _LISTEN_BACKLOG

    def __init__(self, addr: tuple[str, int], metrics: Metrics, events: EventLog,
                 set_threshold: Callable[[float], None] | None, max_handlers: int, read_timeout_s: float,
                 write_timeout_s: float) -> None:
        self.metrics = metrics
        self.events = events
        self.set_threshold = set_threshold
        self.stopping = threading.Event()
        self.read_timeout_s, self.write_timeout_s = read_timeout_s, write_timeout_s
        self.slots = _Slots(max_handlers)
        self.deadlines = _Deadlines()
        self.refusals = _Refusals(LINGER_S)
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, _Handler)
        self.thread_name = f"{HANDLER_THREAD_NAME} {self.server_address[1]}"

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread of its own while a slot is free; else answer 503 from here."""
        if not self.slots.take():
            self.refusals.refuse(request)
            return
        try:
            threading.Thread(target=self.process_request_thread, args=(request, client_address),
                             name=self.thread_name, daemon=True).start()
        except BaseException:
            self.slots.give()   # no thread: the caller reports and closes the connection
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.give()

    def service_actions(self) -> None:
        """On the accepting thread, between accepts and at least every poll interval."""
        self.deadlines.enforce()
        self.refusals.sweep()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """No tracebacks: a client that went away or stalled is silent, anything else one log line."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            _log.warning("metrics endpoint: %s serving %s: %s", type(exc).__name__, client_address, exc)

    def server_close(self) -> None:
        super().server_close()
        self.refusals.close_all()


class MetricsServer:
    """The endpoint in a daemon thread. `url` is "http://host:port" once started (port 0: any free)."""

    def __init__(self, host: str, port: int, metrics: Metrics, events: EventLog,
                 set_threshold: Callable[[float], None] | None = None, *, max_handlers: int = MAX_HANDLERS,
                 read_timeout_s: float = READ_TIMEOUT_S, write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        """Binds now: OSError when it cannot, ValueError for a bound or timeout that is not positive."""
        if max_handlers < 1 or not (read_timeout_s > 0 and write_timeout_s > 0):
            raise ValueError("max_handlers, read_timeout_s and write_timeout_s must be positive")
        self._server = _Server((host, port), metrics, events, set_threshold, max_handlers, read_timeout_s,
                               write_timeout_s)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="agent-metrics", daemon=True)
        bound_host, bound_port = self._server.server_address[:2]
        self.url = f"http://{_url_host(str(bound_host))}:{bound_port}"
        self.handler_thread_name = self._server.thread_name

    @property
    def active_handlers(self) -> int:
        """Connections being served now, each on its own thread (never more than max_handlers)."""
        return self._server.slots.busy

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and end every streaming reader and every request still arriving; idempotent."""
        self._server.stopping.set()
        self._server.events.close()
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.deadlines.enforce(math.inf)
        self._server.server_close()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
