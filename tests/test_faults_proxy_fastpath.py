"""The proxy's fast path: a direction with no toxic (and no call tap) moves bytes socket to socket, and
switches to the chunk/toxic path the moment a toxic is added, and back once the last is removed.

Real client and server threads over loopback, through the real proxy (`EmbeddedToxiproxy`). Which
path carried the bytes is read from the proxy's own counts (`flows`: per direction the mode of its
last read, the bytes each way, the switches), so a proxy that quietly stopped taking the fast path
fails here as surely as one that loses, doubles or reorders a byte at a switch.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from faults.proxy import EmbeddedToxiproxy, flow
from faults.proxy.flow import PIPE_SIZE, READ_MAX
from faults.testing import EchoServer, connect, read_exactly
from tests.polling import wait_for

MIB = 1 << 20


class OneShotServer:
    """Accepts one connection on 127.0.0.1:0 and runs `handler(conn)` on it in a thread."""

    def __init__(self, handler: Callable[[socket.socket], None]) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.error: BaseException | None = None
        self._handler = handler
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.sock.accept()
            with conn:
                conn.settimeout(30)
                self._handler(conn)
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc

    def join(self, timeout: float = 30) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server thread still running"
        self.sock.close()
        if self.error is not None:
            raise self.error


def read_to_eof(s: socket.socket, digest: Any) -> int:
    n = 0
    while data := s.recv(1 << 18):
        digest.update(data)
        n += len(data)
    return n


def send_and_end(s: socket.socket, payload: bytes) -> None:
    s.sendall(payload)
    s.shutdown(socket.SHUT_WR)


def live(tp: EmbeddedToxiproxy, proxy: str) -> dict[str, dict[str, Any]]:
    conns = tp.flows(proxy)["connections"]
    assert len(conns) == 1, conns
    return conns[0]


@pytest.fixture(params=["splice", "copy"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both fast paths: splice for bulk reads where the OS has it, and recv_into/send alone."""
    if request.param == "splice" and not hasattr(os, "splice"):
        pytest.skip("no os.splice here")
    if request.param == "copy":
        monkeypatch.setattr(flow, "SPLICE_AT", 1 << 62)
    return str(request.param)


def test_32_mib_each_way_arrive_identical_by_the_fast_path(tp: EmbeddedToxiproxy, way: str) -> None:
    """Both directions at once, each 32 MiB of random bytes, each ended by a half-close (FIN one way
    while the other still flows): byte-identical at the far end, and all but the first read (the one
    the proxy looks at to detect the protocol) went by the fast path."""
    size = 32 * MIB
    up_payload, down_payload = os.urandom(size), os.urandom(size)
    server_got: dict[str, Any] = {}

    def handler(conn: socket.socket) -> None:
        digest = hashlib.sha256()
        first = conn.recv(1 << 16)          # the client speaks first, so the proxy knows the protocol
        digest.update(first)
        sender = threading.Thread(target=send_and_end, args=(conn, down_payload))
        sender.start()
        server_got["n"] = len(first) + read_to_eof(conn, digest)
        server_got["sha"] = digest.hexdigest()
        sender.join(30)

    server = OneShotServer(handler)
    listen = tp.create_proxy("bulk", server.addr)["listen"]
    with connect(listen, timeout=30) as s:
        sender = threading.Thread(target=send_and_end, args=(s, up_payload))
        sender.start()
        digest = hashlib.sha256()
        client_n = read_to_eof(s, digest)
        sender.join(30)
    server.join()
    assert server_got["n"] == size and server_got["sha"] == hashlib.sha256(up_payload).hexdigest()
    assert client_n == size and digest.hexdigest() == hashlib.sha256(down_payload).hexdigest()
    assert wait_for(lambda: not tp.flows("bulk")["connections"])
    closed = tp.flows("bulk")["closed"]
    assert closed["fast_bytes"] + closed["chunk_bytes"] == 2 * size
    assert closed["chunk_bytes"] <= READ_MAX, closed           # only the detection read
    assert closed["to_chunk"] == 0 and closed["to_fast"] == 2, closed
    if way == "splice":
        assert closed["spliced_bytes"] > 0, closed             # bulk went socket -> pipe -> socket
    else:
        assert closed["spliced_bytes"] == 0, closed
    assert tp.call_stats("bulk")["connections"] == 1


def _ping(s: socket.socket, i: int) -> float:
    msg = struct.pack("!I", i) * 16
    t0 = time.monotonic()
    s.sendall(msg)
    assert read_exactly(s, len(msg)) == msg
    return time.monotonic() - t0


def test_a_latency_toxic_added_mid_stream_delays_what_follows_and_removing_it_returns_to_fast(
        tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    listen = tp.create_proxy("lat", echo.addr)["listen"]
    with connect(listen) as s:
        before = [_ping(s, i) for i in range(20)]
        flows = live(tp, "lat")
        assert flows["upstream"]["mode"] == flows["downstream"]["mode"] == "fast", flows
        assert flows["downstream"]["chunk_bytes"] == 0 and flows["downstream"]["fast_bytes"] == 20 * 64

        tp.add_toxic("lat", "latency", {"latency": 150}, stream="downstream", name="slow")
        during = [_ping(s, 100 + i) for i in range(4)]
        flows = live(tp, "lat")
        assert flows["downstream"]["mode"] == "chunk" and flows["downstream"]["to_chunk"] == 1, flows
        assert flows["downstream"]["chunk_bytes"] == 4 * 64, flows       # every byte after it, through it
        assert flows["upstream"]["mode"] == "fast" and flows["upstream"]["to_chunk"] == 0, flows

        tp.remove_toxic("lat", "slow")
        after = [_ping(s, 200 + i) for i in range(20)]
        flows = live(tp, "lat")
        assert flows["downstream"]["mode"] == "fast" and flows["downstream"]["to_fast"] == 2, flows
        assert flows["downstream"]["chunk_bytes"] == 4 * 64, flows       # nothing more went the slow way
        assert flows["downstream"]["fast_bytes"] == 40 * 64, flows
    assert min(during) >= 0.150 - 0.002                               # the toxic took every byte after it
    assert sorted(before)[10] < 0.1 and sorted(after)[10] < 0.1, (before, after)
    effect = tp.call(lambda c: _effects(c, "lat"))["slow"]
    assert effect["bytes"] == 4 * 64 and effect["bytes_out"] == 4 * 64, effect


async def _effects(c: Any, proxy: str) -> dict[str, Any]:
    return c.get(proxy).effects.to_json()


def test_toxics_added_and_removed_under_a_running_stream_lose_and_reorder_nothing(
        tp: EmbeddedToxiproxy, echo: EchoServer, way: str) -> None:
    """32 MiB streamed through an echo in 256 KiB writes (bulk: the splice reads where there are) while
    a toxic comes and goes on both directions, up to three times: the echo is the stream, byte for
    byte, and each direction went fast -> chunk -> fast."""
    listen = tp.create_proxy("switch", echo.addr)["listen"]
    payload = os.urandom(32 * MIB)
    got = bytearray()
    sent_all = threading.Event()

    with connect(listen, timeout=30) as s:
        def send() -> None:
            view = memoryview(payload)
            for off in range(0, len(payload), 256 * 1024):
                s.sendall(view[off:off + 256 * 1024])
                if off % MIB == 0:
                    time.sleep(0.02)             # paced, so every switch lands mid-stream
            sent_all.set()

        def receive() -> None:
            while len(got) < len(payload):
                data = s.recv(1 << 18)
                if not data:
                    return
                got.extend(data)

        threads = [threading.Thread(target=send), threading.Thread(target=receive)]
        for t in threads:
            t.start()
        rounds = 0
        while not sent_all.is_set() and rounds < 3:
            time.sleep(0.03)
            tp.add_toxic("switch", "latency", {"latency": 5}, stream="upstream", name="u")
            tp.add_toxic("switch", "latency", {"latency": 5}, stream="downstream", name="d")
            time.sleep(0.05)
            tp.remove_toxic("switch", "u")
            tp.remove_toxic("switch", "d")
            rounds += 1
        for t in threads:
            t.join(60)
        s.settimeout(5)
        assert len(got) == len(payload), f"{len(got)} of {len(payload)} bytes came back"
        assert bytes(got) == payload, "the echo differs from the stream (lost, doubled or reordered bytes)"
        flows = live(tp, "switch")
    assert rounds >= 1
    for direction in ("upstream", "downstream"):
        f = flows[direction]
        assert f["fast_bytes"] + f["chunk_bytes"] == len(payload), f
        assert f["fast_bytes"] > 0 and f["chunk_bytes"] > 0, f
        assert f["to_chunk"] >= 1 and f["to_fast"] >= 2, f


def test_a_toxic_removed_while_the_client_is_backed_up_lets_what_it_held_leave_first(
        tp: EmbeddedToxiproxy) -> None:
    """Bulk by the fast path (splice, where there is one), then a toxic while the client reads nothing, so
    the proxy queues for the client; the toxic is removed and the server sends more: the fast path must
    wait behind the queued bytes (never splice past them), and the client reads the stream in order."""
    a, x, y = os.urandom(4 * MIB), os.urandom(4 * MIB), os.urandom(4 * MIB)
    send_x, send_y = threading.Event(), threading.Event()

    def handler(conn: socket.socket) -> None:
        assert conn.recv(1) == b"g"
        conn.sendall(a)
        assert send_x.wait(10)
        conn.sendall(x)
        assert send_y.wait(10)
        conn.sendall(y)
        conn.shutdown(socket.SHUT_WR)

    server = OneShotServer(handler)
    listen = tp.create_proxy("backed", server.addr)["listen"]
    with connect(listen, timeout=30) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.sendall(b"g")
        assert read_exactly(s, len(a), timeout=10) == a
        assert live(tp, "backed")["downstream"]["mode"] == "fast"
        tp.add_toxic("backed", "latency", {"latency": 20}, stream="downstream", name="hold")
        send_x.set()
        time.sleep(0.5)                      # the client reads nothing: the proxy backs up
        tp.remove_toxic("backed", "hold")
        send_y.set()
        got = bytearray()
        while len(got) < len(x) + len(y):    # a slow reader, so the proxy stays backed up a while
            data = s.recv(64 * 1024)
            if not data:
                break
            got.extend(data)
            time.sleep(0.001)
        assert len(got) == len(x) + len(y)
        assert bytes(got) == x + y, "bytes read after the toxic left before (or among) those it held"
        flows = live(tp, "backed")["downstream"]
    assert flows["to_chunk"] == 1 and flows["to_fast"] == 2, flows
    server.join()


def test_half_close_propagates_each_way_on_the_fast_path(tp: EmbeddedToxiproxy) -> None:
    """Client sends and half-closes; the server reads to EOF, then answers and closes: the client gets
    the whole answer, then EOF."""
    request, answer = os.urandom(300_000), os.urandom(500_000)
    seen: dict[str, Any] = {}

    def handler(conn: socket.socket) -> None:
        buf = bytearray()
        while data := conn.recv(1 << 16):
            buf.extend(data)
        seen["request"] = bytes(buf)             # EOF reached the server only after every byte
        time.sleep(0.05)
        conn.sendall(answer)
        conn.shutdown(socket.SHUT_WR)
        seen["rest"] = conn.recv(10)             # the client's side stays half-closed: EOF again

    server = OneShotServer(handler)
    listen = tp.create_proxy("half", server.addr)["listen"]
    with connect(listen) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        assert read_exactly(s, len(answer), timeout=10) == answer    # the other way still flows
        s.settimeout(5)
        assert s.recv(10) == b""
    server.join()
    assert seen["request"] == request and seen["rest"] == b""
    assert wait_for(lambda: not tp.flows("half")["connections"])
    closed = tp.flows("half")["closed"]
    assert closed["to_chunk"] == 0 and closed["fast_bytes"] >= len(answer), closed
    assert tp.call_stats("half")["connections"] == 1


def _rst_close(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def test_a_server_reset_ends_the_client_connection(tp: EmbeddedToxiproxy) -> None:
    """The server answers, then resets: the client gets the answer, then its connection ends (EOF, as
    the proxy has always passed a reset on), and the proxy counts the connection closed."""
    def handler(conn: socket.socket) -> None:
        assert read_exactly(conn, 4) == b"ping"
        conn.sendall(b"pong")
        time.sleep(0.1)
        _rst_close(conn)

    server = OneShotServer(handler)
    listen = tp.create_proxy("rst", server.addr)["listen"]
    with connect(listen) as s:
        s.sendall(b"ping")
        assert read_exactly(s, 4) == b"pong"
        assert live(tp, "rst")["downstream"]["mode"] == "fast"
        s.settimeout(5)
        t0 = time.monotonic()
        assert s.recv(10) == b""
        assert time.monotonic() - t0 < 2.0
    server.join()
    assert wait_for(lambda: not tp.flows("rst")["connections"])
    assert tp.call_stats("rst")["connections"] == 1


def test_a_client_reset_ends_the_server_connection(tp: EmbeddedToxiproxy) -> None:
    """The client resets: the server's connection ends (EOF, as the proxy has always passed it on)."""
    ended = threading.Event()
    last: list[bytes] = []

    def handler(conn: socket.socket) -> None:
        assert read_exactly(conn, 4) == b"ping"
        conn.sendall(b"pong")
        assert read_exactly(conn, 4) == b"more"
        last.append(conn.recv(10))
        ended.set()

    server = OneShotServer(handler)
    listen = tp.create_proxy("crst", server.addr)["listen"]
    s = connect(listen)
    s.sendall(b"ping")
    assert read_exactly(s, 4) == b"pong"
    s.sendall(b"more")                       # the first read detects the protocol; this one goes fast
    assert wait_for(lambda: live(tp, "crst")["upstream"]["fast_bytes"] == 4)
    assert live(tp, "crst")["upstream"]["mode"] == "fast"
    _rst_close(s)
    assert ended.wait(5), "the server's connection did not end after the client's reset"
    server.join()
    assert last == [b""]
    assert wait_for(lambda: not tp.flows("crst")["connections"])
    assert tp.call_stats("crst")["connections"] == 1


def test_a_slow_reader_holds_the_sender_back_on_the_fast_path(tp: EmbeddedToxiproxy, way: str) -> None:
    """Backpressure: while the client does not read, the proxy queues at most one read's worth (one
    splice pipe) and stops reading the server, which is then held back by the kernel's socket buffers
    alone; once the client reads, everything arrives."""
    total = 128 * MIB
    sent = [0]

    def handler(conn: socket.socket) -> None:
        assert conn.recv(1) == b"g"
        block = bytes(1 << 16)
        while sent[0] < total:
            conn.sendall(block)
            sent[0] += len(block)
        conn.shutdown(socket.SHUT_WR)

    server = OneShotServer(handler)
    listen = tp.create_proxy("bp", server.addr)["listen"]
    with connect(listen, timeout=30) as s:
        s.sendall(b"g")
        time.sleep(0.5)                              # nobody reads: the server must be held back
        cpu0 = proxy_cpu_s(tp)
        time.sleep(1.0)
        idle_cpu = proxy_cpu_s(tp) - cpu0
        held = sent[0]
        queued = tp.call(lambda c: _queued(c, "bp"))
        assert queued <= PIPE_SIZE, f"the proxy queued {queued} bytes for a client that reads nothing"
        assert held < 96 * MIB, f"{held} bytes left the server while the client read nothing"
        assert idle_cpu < 0.1, f"the proxy spent {idle_cpu:.2f} s of CPU in 1 s of waiting (spinning on a full socket?)"
        n = read_to_eof(s, hashlib.sha256())
    server.join()
    assert n == total


def proxy_cpu_s(tp: EmbeddedToxiproxy) -> float:
    """CPU seconds the embedded proxy's loop thread has run (Linux's per-thread schedstat)."""
    assert tp._thread is not None
    with open(f"/proc/self/task/{tp._thread.native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


async def _queued(c: Any, proxy: str) -> int:
    return sum(conn.client.queued() for conn in c.get(proxy).connections)
