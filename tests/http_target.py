"""A real HTTP/1.1 JSON service on loopback, and recordings of calls to it (tests/ is on sys.path).

`JsonTarget` answers `POST /orders/N` with the JSON document `order(N)`, optionally changed by
`change(n, doc)`, and keeps the first bytes of every connection it accepted: a test can prove what a
client opened with (an HTTP/2 preface `PRI * HTTP/2.0` is what gRPC reflection would send).
`write_orders` records such calls as a recorder would: raw chunks of both directions (requests padded
with CHUNK-MARK, messages with MSG-MARK) and the decoded calls, committed every `flush_every` calls
(a long recording's pages interleave its tables).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from capture.recording import Call, Chunk, Flow, Message, RecordingWriter

BASE_NS = 10_000_000_000
GAP_NS = 2_000_000
PAD = 600            # bytes of padding in every body: pages fill as in a real recording
H2_PREFACE = b"PRI * HTTP/2.0"


def order(n: int) -> dict[str, Any]:
    return {"id": n, "price": 10, "items": [{"sku": f"sku-{n}", "qty": 1}], "note": "x" * PAD}


def order_body(n: int) -> bytes:
    return json.dumps(order(n)).encode()


def request_body(n: int) -> bytes:
    return json.dumps({"order": n, "pad": "MSG-MARK-" + "r" * PAD}).encode()


class JsonTarget:
    """The service; use as a context manager. `address` is "127.0.0.1:PORT"."""

    def __init__(self, change: Callable[[int, dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self.change = change
        self.first_bytes: list[bytes] = []
        self.paths: list[str] = []
        target = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle(self) -> None:
                try:
                    self.connection.settimeout(5)
                    target.first_bytes.append(self.connection.recv(len(H2_PREFACE), socket.MSG_PEEK))
                except OSError:
                    target.first_bytes.append(b"")
                super().handle()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                target.paths.append(self.path)
                n = int(self.path.rsplit("/", 1)[-1])
                doc = order(n) if target.change is None else target.change(n, order(n))
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> JsonTarget:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _raw_request(n: int) -> bytes:
    # its own filler (CHUNK-MARK): a byte found by that marker lies in a chunk, not in a message
    body = json.dumps({"order": n, "pad": "CHUNK-MARK-" + "c" * PAD}).encode()
    return (f"POST /orders/{n} HTTP/1.1\r\nHost: shop\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _raw_response(n: int) -> bytes:
    body = order_body(n)
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def write_orders(path: Path, calls: int, *, flush_every: int = 10, writer: RecordingWriter | None = None) -> int:
    """Record `calls` POST /orders/N calls (raw chunks and decoded calls) into `path`,
    committing every `flush_every` calls; with `writer`, into that open writer (left open). Returns calls."""
    w = writer or RecordingWriter(path, meta={"host": "test", "backend": "import"}, flush_interval_s=3600)
    fid = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 8080), protocol="http1"))
    for n in range(calls):
        ts = BASE_NS + n * GAP_NS
        w.add_chunk(Chunk(fid, "c2s", ts, _raw_request(n)))
        w.add_chunk(Chunk(fid, "s2c", ts + 1000, _raw_response(n)))
        w.add_call(Call(protocol="http1", method=f"POST /orders/{n}", request_ts_ns=ts, flow_id=fid, kind="request",
                        request_metadata=[("Content-Type", "application/json")], status=200,
                        response_ts_ns=ts + 1000, end_ts_ns=ts + 1000,
                        requests=[Message("c2s", 0, ts, request_body(n))],
                        responses=[Message("s2c", 0, ts + 1000, order_body(n))]))
        if (n + 1) % flush_every == 0:
            w.flush()
    w.update_flow(fid, closed_ns=BASE_NS + calls * GAP_NS)
    if writer is None:
        w.close()
    else:
        w.flush()
    return calls
