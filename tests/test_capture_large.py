"""Large writes and zero-copy sends with the eBPF recorder (root + bcc; CI runs these).

* gRPC calls of all four kinds carrying 1 MB and 4 MiB messages (grpcio on both ends, limits raised):
  every message byte-identical in the recording, and the same calls as `import` of tcpdump's capture of
  the same traffic.
* A body over `--max-bytes` in one syscall: recorded up to the cap, counted as truncated, said on the
  call, and the next call on the connection still pairs.
* sendfile and splice: the bytes are accounted (length, time, flow), never stored, and the HTTP/1
  call keeps its head and status with "not captured: sendfile, N bytes".
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from capture.backends import RecordOptions
from capture.pcap_import import import_capture
from capture.record import Recorder
from capture.recording import Call, Recording
from wire.process import spawn

pytestmark = [pytest.mark.root, pytest.mark.ebpf]

SERVICE = "test.Big"
LIMIT = 16 << 20
SIZES = (1_000_000, 4 << 20)
_OPTS = [("grpc.max_send_message_length", LIMIT), ("grpc.max_receive_message_length", LIMIT)]


def _flip(b: bytes) -> bytes:
    return b[::-1]


def _unary(req: bytes, ctx: grpc.ServicerContext) -> bytes:
    return _flip(req)


def _server_stream(req: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
    yield _flip(req)
    yield req


def _client_stream(reqs: Iterator[bytes], ctx: grpc.ServicerContext) -> bytes:
    return _flip(list(reqs)[-1])


def _bidi(reqs: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
    for r in reqs:
        yield _flip(r)


def _digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]


def _key(c: Call) -> tuple[str | None, tuple[str, ...], tuple[str, ...], int | None]:
    return (c.method, tuple(_digest(m.data) for m in c.requests), tuple(_digest(m.data) for m in c.responses),
            c.status)


@pytest.fixture(scope="module")
def grpc_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    d = tmp_path_factory.mktemp("large")
    srv = grpc.server(futures.ThreadPoolExecutor(4), options=_OPTS)
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(_server_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(_client_stream),
        "Bidi": grpc.stream_stream_rpc_method_handler(_bidi)}),))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    out, pcap = d / "big.rec", d / "big.pcap"
    tcpdump = spawn(["tcpdump", "-i", "lo", "-U", "-B", "65536", "-w", str(pcap), f"tcp port {port}"],
                    stderr=subprocess.PIPE)
    try:
        assert tcpdump.stderr is not None
        tcpdump.stderr.readline()            # "listening on lo ...": capturing from here on
        expected: list[tuple[str, list[bytes], list[bytes]]] = []
        with Recorder(RecordOptions(output=str(out), port=port)) as rec:
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=_OPTS) as ch:
                for size in SIZES:
                    a, b = os.urandom(size), os.urandom(size)
                    m = f"/{SERVICE}/"
                    got = ch.unary_unary(m + "Unary")(a, timeout=60)
                    expected.append((m + "Unary", [a], [got]))
                    got_s = list(ch.unary_stream(m + "ServerStream")(b, timeout=60))
                    expected.append((m + "ServerStream", [b], got_s))
                    got = ch.stream_unary(m + "ClientStream")(iter([a, b]), timeout=60)
                    expected.append((m + "ClientStream", [a, b], [got]))
                    got_s = list(ch.stream_stream(m + "Bidi")(iter([b, a]), timeout=60))
                    expected.append((m + "Bidi", [b, a], got_s))
            time.sleep(0.5)                  # the last syscalls reach the ring and the poller
        yield {"out": out, "pcap": pcap, "expected": expected, "result": rec.result or {}, "port": port, "dir": d}
    finally:
        if tcpdump.poll() is None:
            tcpdump.send_signal(signal.SIGINT)
            tcpdump.wait(10)
        srv.stop(0)


@pytest.mark.slow
def test_large_grpc_messages_of_every_call_kind_are_recorded_byte_identical(grpc_run: dict) -> None:
    expected = grpc_run["expected"]
    # the server answered as it should: the client got what the handlers make
    assert [len(r) for _m, _q, r in expected] == [1, 2, 1, 2] * len(SIZES)
    with Recording(grpc_run["out"]) as r:
        calls = [c for c in r.calls() if c.method and c.method.startswith(f"/{SERVICE}/")]
    want = Counter((m, tuple(map(_digest, q)), tuple(map(_digest, resp)), 0) for m, q, resp in expected)
    assert Counter(_key(c) for c in calls) == want
    result = grpc_run["result"]
    assert result["lost_events"] == 0 and result["truncated_events"] == 0 and result["gaps"] == 0
    assert result["truncated_messages"] == 0


@pytest.mark.slow
def test_tcpdump_capture_of_the_large_messages_imports_as_the_same_calls(grpc_run: dict) -> None:
    imported = grpc_run["dir"] / "imported.rec"
    import_capture(str(grpc_run["pcap"]), str(imported), port=grpc_run["port"])
    with Recording(imported) as r:
        from_pcap = Counter(_key(c) for c in r.calls() if c.method and c.method.startswith(f"/{SERVICE}/"))
    with Recording(grpc_run["out"]) as r:
        from_ebpf = Counter(_key(c) for c in r.calls() if c.method and c.method.startswith(f"/{SERVICE}/"))
    assert from_pcap == from_ebpf and sum(from_ebpf.values()) == 4 * len(SIZES)


# ---- HTTP/1 by a server of the test's own: over the cap, sendfile, splice ----

_GET = b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n"
_GET2 = b"GET /small HTTP/1.1\r\nHost: t\r\n\r\n"
_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def _serve_once(*handlers: Callable[[socket.socket], None]) -> tuple[int, threading.Thread, dict]:
    """One connection per handler, one after the other, on 127.0.0.1 (blocking sockets); start the
    thread after the recorder (an accept already waiting when the program attached is not traced)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    seen: dict = {}

    def serve() -> None:
        try:
            with listener:
                for handler in handlers:
                    with listener.accept()[0] as conn:
                        handler(conn)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            seen["error"] = repr(exc)

    return listener.getsockname()[1], threading.Thread(target=serve, daemon=True), seen


def _read_response(c: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        part = c.recv(1)
        assert part, "server closed early"
        head += part
    n = int([ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")][0].split(b":")[1])
    body = b""
    while len(body) < n:
        part = c.recv(n - len(body))
        assert part, "server closed early"
        body += part
    return head + body


def _client(port: int, requests: list[bytes]) -> list[bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        out = []
        for req in requests:
            c.sendall(req)
            out.append(_read_response(c))
        return out


def _calls(path: Path) -> tuple[list[Call], dict]:
    with Recording(path) as r:
        return sorted(r.calls(), key=lambda c: c.request_ts_ns), dict(r.meta)


@pytest.mark.parametrize("decode", ["live", "at-stop"])
def test_sendfile_splice_and_over_the_cap_bodies_are_said_on_their_calls_and_pairing_holds(tmp_path: Path,
                                                                                          decode: str) -> None:
    """One keep-alive connection: a body by sendfile, a small one, a body by splice, a 200 KB body in one
    send() over a 64 KiB --max-bytes, a small one. sendfile/splice bytes are accounted, never stored;
    the capped body keeps its first 64 KiB; every call keeps its status and says what is missing."""
    file_body, pipe_body, big_body = os.urandom(300_000), os.urandom(40_000), os.urandom(200_000)
    (tmp_path / "f.bin").write_bytes(file_body)
    head1 = b"HTTP/1.1 200 OK\r\nContent-Length: 300000\r\n\r\n"
    head2 = b"HTTP/1.1 200 OK\r\nContent-Length: 40000\r\n\r\n"
    head3 = b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n"
    get3 = b"GET /spliced HTTP/1.1\r\nHost: t\r\n\r\n"
    get4 = b"GET /capped HTTP/1.1\r\nHost: t\r\n\r\n"

    def handler(conn: socket.socket) -> None:
        assert conn.recv(len(_GET), socket.MSG_WAITALL) == _GET
        conn.sendall(head1)
        with (tmp_path / "f.bin").open("rb") as f:
            sent = 0
            while sent < len(file_body):
                sent += os.sendfile(conn.fileno(), f.fileno(), sent, len(file_body) - sent)
        assert conn.recv(len(_GET2), socket.MSG_WAITALL) == _GET2
        conn.sendall(_OK)
        assert conn.recv(len(get3), socket.MSG_WAITALL) == get3
        conn.sendall(head2)
        r, w = os.pipe()
        try:
            os.write(w, pipe_body)
            moved = 0
            while moved < len(pipe_body):
                moved += os.splice(r, conn.fileno(), len(pipe_body) - moved)
        finally:
            os.close(r)
            os.close(w)
        assert conn.recv(len(get4), socket.MSG_WAITALL) == get4
        conn.sendall(head3 + big_body)              # one send() of 200 KB: over the 64 KiB cap
        assert conn.recv(len(_GET2), socket.MSG_WAITALL) == _GET2
        conn.sendall(_OK)

    def cut_short(conn: socket.socket) -> None:       # a download that ends early: 100 KB of 300 KB
        assert conn.recv(len(_GET), socket.MSG_WAITALL) == _GET
        conn.sendall(head1)
        with (tmp_path / "f.bin").open("rb") as f:
            os.sendfile(conn.fileno(), f.fileno(), 0, 100_000)

    port, server, seen = _serve_once(handler, cut_short)
    out = tmp_path / f"zc-{decode}.rec"
    with Recorder(RecordOptions(output=str(out), port=port, decode=decode, max_bytes=65536)) as rec:
        server.start()
        got = _client(port, [_GET, _GET2, get3, get4, _GET2])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(_GET)
            short = b""
            while part := c.recv(65536):
                short += part
        server.join(10)
        time.sleep(0.3)
    assert "error" not in seen, seen["error"]
    assert got == [head1 + file_body, _OK, head2 + pipe_body, head3 + big_body, _OK]
    assert short == head1 + file_body[:100_000]
    result = rec.result or {}
    assert result["not_captured_bytes"] == len(file_body) + len(pipe_body) + 100_000
    assert result["lost_events"] == 0 and result["truncated_events"] == 1
    calls, meta = _calls(out)
    # the download cut short: its head and status kept, what went by sendfile and what never came said
    cut = [c for c in calls if c.flow_id != calls[0].flow_id]
    assert [(c.method, c.status, c.status_message) for c in cut] == [
        ("GET /big", 200, "body not captured: response, not captured: sendfile, 100000 bytes; "
                          "the connection closed 200000 bytes before its end")]
    calls = [c for c in calls if c.flow_id == calls[0].flow_id]
    assert [(c.method, c.status) for c in calls] == [("GET /big", 200), ("GET /small", 200), ("GET /spliced", 200),
                                                     ("GET /capped", 200), ("GET /small", 200)]
    assert calls[0].status_message == "body not captured: response, not captured: sendfile, 300000 bytes"
    assert calls[2].status_message == "body not captured: response, not captured: splice, 40000 bytes"
    missing = len(head3) + len(big_body) - 65536
    assert calls[3].status_message == f"body not captured: response, {missing} bytes missing in a gap"
    assert calls[0].responses == calls[2].responses == calls[3].responses == []
    assert [m.data for m in calls[1].responses] == [m.data for m in calls[4].responses] == [b"ok"]
    (flow_id,) = {c.flow_id for c in calls}
    assert sorted(meta["not_captured_by_flow"]) == sorted([[flow_id, "s2c", "sendfile", len(file_body), 1],
                                                           [flow_id, "s2c", "splice", len(pipe_body), 1],
                                                           [cut[0].flow_id, "s2c", "sendfile", 100_000, 1]])
    if decode == "live":   # the response ends when its last body byte went, not when the next request came
        assert calls[0].end_ts_ns is not None and calls[0].end_ts_ns < calls[1].request_ts_ns
    with Recording(out) as r:
        s2c = b"".join(c.data for c in r.chunks() if c.direction == "s2c" and c.flow_id == flow_id)
    # heads and small bodies whole, the capped body's first 64 KiB byte for byte, nothing of the others
    assert s2c == head1 + _OK + head2 + (head3 + big_body)[:65536] + _OK
