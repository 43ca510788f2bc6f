"""Rapid reset (CVE-2023-44487) against the lean HTTP/2 gRPC server, in the shape the CVE has: complete
requests (HEADERS + DATA with END_STREAM), each reset at once, from a client that reconnects when cut off.

A LeanServer runs in a thread on port 0; the attacker is a raw socket writing frames from wire.h2; a
grpcio channel opened before the flood stands for the host's other, well-behaved clients.
bench/rapid_reset.py measures the same attack's CPU and the latency of normal calls beside it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from agent_under_test.h2server import RESET_BUDGET, LeanServer
from wire import h2
from wire.h2 import ErrorCode, Flag, FrameType
from wire.headers import encode_block

SERVICE = "test.Bytes"
BURST, PER_S = RESET_BUDGET


class Service:
    def __init__(self) -> None:
        self.held = 0   # Hold handlers that started: a reset stream's work that got as far as the handler

    async def echo(self, request: bytes, ctx: object) -> bytes:
        return request

    async def hold(self, request: bytes, ctx: object) -> bytes:
        self.held += 1
        await asyncio.sleep(60)
        return b""


class Running:
    """A LeanServer with Echo and Hold on its own event loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = Service()
        self.server = LeanServer()
        self.server.add_registered_method_handlers(SERVICE, {
            "Echo": grpc.unary_unary_rpc_method_handler(self.service.echo),
            "Hold": grpc.unary_unary_rpc_method_handler(self.service.hold)})
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.echo = self.channel.unary_unary(f"/{SERVICE}/Echo")

    def close(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def srv() -> Iterator[Running]:
    running = Running()
    yield running
    running.close()


def request(sid: int, method: str, body: bytes = b"x") -> bytes:
    """One complete unary request: HEADERS, then DATA with END_STREAM carrying one gRPC message."""
    block = encode_block([(":method", "POST"), (":scheme", "http"), (":path", f"/{SERVICE}/{method}"),
                          (":authority", "127.0.0.1"), ("content-type", "application/grpc"), ("te", "trailers")])
    message = b"\x00" + len(body).to_bytes(4, "big") + body
    return (h2.frame(FrameType.HEADERS, Flag.END_HEADERS, sid, block)
            + h2.frame(FrameType.DATA, Flag.END_STREAM, sid, message))


class Raw:
    """A client on a raw socket: writes frames, reads the server's until what it waits for, within a time."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(h2.PREFACE + h2.settings({}))
        self.buf = b""
        self.goaway: tuple[int, int] | None = None   # (last stream id, error code)
        self.ended: set[int] = set()                  # streams the server ended (END_STREAM on HEADERS)
        self.eof = False

    def send(self, data: bytes) -> bool:
        try:
            self.sock.sendall(data)
        except OSError:  # the server closed after its GOAWAY
            return False
        return True

    def read_until(self, done: Callable[[], bool], max_s: float = 5.0) -> None:
        deadline = time.monotonic() + max_s
        while not self.eof and not done() and time.monotonic() < deadline:
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                self.eof = True
            frames, pos, _ = h2.split(self.buf + data)
            self.buf = (self.buf + data)[pos:]
            for ftype, flags, sid, payload in frames:
                if ftype == FrameType.GOAWAY:
                    last, code = h2.GOAWAY_BODY.unpack_from(payload)
                    self.goaway = (last & h2.MAX_STREAM_ID, code)
                elif ftype == FrameType.HEADERS and flags & Flag.END_STREAM:
                    self.ended.add(sid)

    def close(self) -> None:
        self.sock.close()


def answered(raw: Raw, sids: list[int]) -> Callable[[], bool]:
    """True once the server ended every stream in `sids` (or sent GOAWAY)."""
    return lambda: raw.goaway is not None or raw.ended.issuperset(sids)


def flood(raw: Raw, streams: int, first_sid: int = 1, batch: int = 100) -> None:
    """Complete Hold requests, each reset at once, until the server says GOAWAY or `streams` are written."""
    sid = first_sid
    while sid < first_sid + 2 * streams and raw.goaway is None:
        chunk = b"".join(request(s, "Hold") + h2.rst_stream(s, ErrorCode.CANCEL) for s in range(sid, sid + 2 * batch, 2))
        if not raw.send(chunk):
            break
        sid += 2 * batch
        raw.sock.settimeout(0.001)
        raw.read_until(lambda: raw.goaway is not None, max_s=0.001)
        raw.sock.settimeout(5)
    raw.read_until(lambda: raw.goaway is not None)


def test_complete_requests_reset_at_once_are_cut_off(srv: Running) -> None:
    assert srv.echo(b"warm", timeout=5) == b"warm"   # the host's well-behaved connection, up before the flood
    time.sleep(1.2)   # the host's budget sat full for a while: draining it must not credit that time again
    raw = Raw(srv.port)
    start = time.monotonic()
    flood(raw, 20_000)
    took = time.monotonic() - start
    raw.close()
    assert raw.goaway is not None and raw.goaway[1] == ErrorCode.ENHANCE_YOUR_CALM, \
        f"expected GOAWAY ENHANCE_YOUR_CALM for complete requests reset at once, got {raw.goaway} (eof {raw.eof})"
    accepted = (raw.goaway[0] + 1) // 2
    allowed = BURST + PER_S * took + 100   # the burst, what refilled while the flood ran, one batch of slack
    assert accepted <= allowed, f"expected the cut-off within {allowed:.0f} streams, GOAWAY came after {accepted}"
    assert srv.service.held == 0, f"expected no reset stream's handler to run, {srv.service.held} did"
    assert srv.echo(b"after", timeout=5) == b"after", "the host's other connection must keep working"


def test_reconnecting_does_not_buy_a_new_budget(srv: Running) -> None:
    assert srv.echo(b"warm", timeout=5) == b"warm"
    first = Raw(srv.port)
    flood(first, 20_000)
    first.close()
    assert first.goaway is not None and first.goaway[1] == ErrorCode.ENHANCE_YOUR_CALM, f"got {first.goaway}"
    again = Raw(srv.port)   # the attacker reconnects at once, as it would
    again.send(request(1, "Hold") + h2.rst_stream(1, ErrorCode.CANCEL))
    again.read_until(lambda: again.goaway is not None)
    again.close()
    assert again.goaway == (0, ErrorCode.ENHANCE_YOUR_CALM), \
        f"expected the reconnected flooder refused before any stream (GOAWAY 0 ENHANCE_YOUR_CALM), got {again.goaway}"
    assert srv.echo(b"after", timeout=5) == b"after", "the host's connection from before the flood must keep working"


def test_a_client_whose_calls_are_answered_may_cancel_many(srv: Running) -> None:
    """A busy client cancels calls (deadlines under overload) among many it gets answered: three bursts' worth
    of resets in well under a second, each round after as many answered calls, is never cut off."""
    raw = Raw(srv.port)
    rounds, per_round = 15, 200   # 3,000 resets; without the refunds the cut-off would come near 1,000 + refill
    sid = 1
    start = time.monotonic()
    for _ in range(rounds):
        echoes = list(range(sid, sid + 2 * per_round, 2))
        assert raw.send(b"".join(request(s, "Echo") for s in echoes)), f"closed by the server: {raw.goaway}"
        raw.read_until(answered(raw, echoes))
        held = range(sid + 2 * per_round, sid + 4 * per_round, 2)
        assert raw.send(b"".join(request(s, "Hold") + h2.rst_stream(s, ErrorCode.CANCEL) for s in held)), \
            f"closed by the server: {raw.goaway}"
        sid += 4 * per_round
    raw.sock.sendall(h2.ping(b"rr-fence"))
    raw.sock.settimeout(0.2)
    raw.read_until(lambda: raw.goaway is not None, max_s=0.5)
    took = time.monotonic() - start
    raw.close()
    assert raw.goaway is None, \
        (f"expected no GOAWAY for {rounds * per_round} resets among as many answered calls in {took:.2f} s, "
         f"got {raw.goaway}")
