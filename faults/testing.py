"""Test helpers for toxics, in the spirit of Toxiproxy's testhelper and trio.testing.

`EchoServer` is a real loopback echo server on port 0. `check_toxic_conformance` is the contract
every toxic must pass, on either stream:

  1. bytes sent before a toxic, while it is active (unless the toxic drops data by design) and
     after it is removed mid-stream all arrive, in order, with nothing lost or doubled;
  2. with the toxic still installed, the stream closes when the peer closes.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from faults.proxy.server import EmbeddedToxiproxy

DROPS_DATA = {"timeout", "reset_peer"}  # these swallow what passes while they are active


class EchoServer:
    """Threaded TCP echo server on 127.0.0.1:0; each connection echoes until the peer closes."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.addr = f"127.0.0.1:{self.port}"
        self.received: list[int] = []  # bytes received per connection (in accept order)
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
                self.received.append(0)
                idx = len(self.received) - 1
            threading.Thread(target=self._echo, args=(conn, idx), daemon=True).start()

    def _echo(self, conn: socket.socket, idx: int) -> None:
        try:
            while data := conn.recv(65536):
                with self._lock:
                    self.received[idx] += len(data)
                conn.sendall(data)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()
        with self._lock:
            for c in self._conns:
                try:
                    c.close()
                except OSError:
                    pass

    def __enter__(self) -> EchoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(listen: str, timeout: float = 10.0) -> socket.socket:
    host, _, port = listen.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_exactly(s: socket.socket, n: int, timeout: float = 10.0) -> bytes:
    """Read `n` bytes (fewer if the stream ends first) within `timeout`."""
    s.settimeout(timeout)
    buf = bytearray()
    while len(buf) < n:
        try:
            data = s.recv(n - len(buf))
        except TimeoutError:
            break
        if not data:
            break
        buf += data
    return bytes(buf)


def wait_closed(s: socket.socket, timeout: float) -> bool:
    """True if the peer closes (EOF or reset) within `timeout`; discards data meanwhile."""
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not s.recv(65536):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True
    return False


def _pattern(tag: int, n: int) -> bytes:
    return bytes((tag + i) % 251 for i in range(n))


def check_toxic_conformance(tp: EmbeddedToxiproxy, upstream: str, toxic_type: str, attributes: dict[str, Any],
                            stream: str = "downstream", close_within: float = 5.0) -> None:
    """Assert the conformance contract (module doc) for one toxic on a fresh proxy; AssertionError if not."""
    name = f"conf-{toxic_type}-{stream}-{time.monotonic_ns()}"
    listen = tp.create_proxy(name, upstream)["listen"]
    try:
        with connect(listen) as s:
            p1, p2, p3 = _pattern(1, 3000), _pattern(2, 3000), _pattern(3, 3000)
            s.sendall(p1)
            assert read_exactly(s, len(p1)) == p1, "data before the toxic was damaged"
            tp.add_toxic(name, toxic_type, attributes, stream=stream, name="t")
            s.sendall(p2)
            time.sleep(0.05)
            tp.remove_toxic(name, "t")
            s.sendall(p3)
            want = p3 if toxic_type in DROPS_DATA else p2 + p3
            got = read_exactly(s, len(want), timeout=10)
            assert got == want, f"{toxic_type}/{stream}: {len(got)} of {len(want)} bytes back, or reordered"
        tp.add_toxic(name, toxic_type, attributes, stream=stream, name="t")
        with connect(listen) as s:
            s.shutdown(socket.SHUT_WR)  # we close; the echo server closes back; that close must reach us
            assert wait_closed(s, close_within), f"{toxic_type}/{stream}: stream did not close after the peer"
    finally:
        tp.delete_proxy(name)


class VirtualStub:
    """A toxic's stub in virtual time: `sleep` advances the clock, chunks arrive at their `t`.

    `sent` records (virtual time, bytes, kind) for each chunk the toxic passes on, so a test can
    assert a toxic's exact trajectory: `asyncio.run(toxic.pipe(stub))`.
    """

    def __init__(self, chunks: list[Any], seed: int = 0, state: Any = None) -> None:
        import random
        from collections import deque

        self.t = 0.0
        self.inbox = deque(chunks)
        self.sent: list[tuple[float, bytes, int]] = []
        self.rng = random.Random(seed)
        self.state = state
        self.pending: Any = None

    async def recv(self) -> Any:
        c = self.inbox.popleft()
        self.t = max(self.t, c.t)  # waiting for a chunk lets time run to its arrival
        self.pending = c
        return c

    async def send(self, chunk: Any, rest: Any = None) -> None:
        self.sent.append((round(self.t, 9), chunk.data, chunk.kind))
        self.pending = rest

    def drop(self) -> None:
        self.pending = None

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)
