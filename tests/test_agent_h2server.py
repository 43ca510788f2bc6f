"""The lean HTTP/2 gRPC server (agent_under_test/h2server.py) against the real grpcio client.

A raw-bytes service on port 0 exercises what the agent's own tests do not reach: unknown methods,
handler failures, deadlines and client cancellation reaching the handler, flow control in both
directions with payloads far beyond the initial windows, the receive size limit, metadata both ways,
graceful and forced shutdown, connection ageing and a client that does not speak HTTP/2.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from agent_under_test.h2server import LeanServer

SERVICE = "test.Bytes"


class Service:
    """Handlers that take and return bytes; what they saw is kept for the assertions."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.started: list[str] = []
        self.peers: list[str] = []
        self.metadata: list[tuple[tuple[str, str], ...]] = []

    async def echo(self, request: bytes, ctx) -> bytes:
        self.peers.append(ctx.peer())
        self.metadata.append(ctx.invocation_metadata())
        ctx.set_trailing_metadata((("echo-len", str(len(request))), ("blob-bin", b"\x00\x01")))
        return request

    async def sleep(self, request: bytes, ctx) -> bytes:
        self.started.append(request.decode())
        try:
            await asyncio.sleep(float(request))
        except asyncio.CancelledError:
            self.cancelled.append(request.decode())
            raise
        return b"slept"

    async def big(self, request: bytes, ctx) -> bytes:
        return bytes(range(256)) * (int(request) // 256)

    async def fail(self, request: bytes, ctx) -> bytes:
        raise ValueError("handler bug")

    async def count(self, requests, ctx) -> bytes:
        total = n = 0
        async for r in requests:
            total, n = total + len(r), n + 1
            await asyncio.sleep(0)
        ctx.set_trailing_metadata((("count", str(n)),))
        return f"{n} {total}".encode()

    async def spray(self, request: bytes, ctx):
        for i in range(int(request)):
            yield i.to_bytes(4, "big") * 25_000  # 100 kB each

    def register(self, server: LeanServer) -> None:
        server.add_registered_method_handlers(SERVICE, {
            "Echo": grpc.unary_unary_rpc_method_handler(self.echo),
            "Sleep": grpc.unary_unary_rpc_method_handler(self.sleep),
            "Big": grpc.unary_unary_rpc_method_handler(self.big),
            "Fail": grpc.unary_unary_rpc_method_handler(self.fail),
            "Count": grpc.stream_unary_rpc_method_handler(self.count),
            "Spray": grpc.unary_stream_rpc_method_handler(self.spray),
        })


class Running:
    def __init__(self, **options) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = Service()
        self.server = LeanServer(**options)
        self.service.register(self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.call(self.server.start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}",
                                             options=[("grpc.max_receive_message_length", 64 << 20)])

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def method(self, name: str, kind: str = "unary_unary"):
        return getattr(self.channel, kind)(f"/{SERVICE}/{name}")

    def close(self) -> None:
        self.channel.close()
        self.call(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def lean() -> Iterator:
    started: list[Running] = []

    def start(**options) -> Running:
        started.append(Running(**options))
        return started[-1]

    yield start
    for r in started:
        r.close()


def test_echo_with_metadata_both_ways(lean) -> None:
    srv = lean()
    reply, call = srv.method("Echo").with_call(b"hello", metadata=(("x-team", "sre"),), timeout=5)
    assert reply == b"hello"
    trailers = dict(call.trailing_metadata())
    assert trailers["echo-len"] == "5" and trailers["blob-bin"] == b"\x00\x01"
    assert ("x-team", "sre") in srv.service.metadata[0]
    assert srv.service.peers[0].startswith("ipv4:127.0.0.1:")
    assert srv.method("Echo")(b"", timeout=5) == b""  # an empty message is still one message


def test_unknown_method_and_handler_failure(lean) -> None:
    srv = lean()
    with pytest.raises(grpc.RpcError) as info:
        srv.channel.unary_unary(f"/{SERVICE}/Nope")(b"x", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "/test.Bytes/Nope" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        srv.method("Fail")(b"x", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNKNOWN and "handler bug" in info.value.details()
    assert srv.method("Echo")(b"still serving", timeout=5) == b"still serving"


def test_deadline_ends_the_call_and_cancels_the_handler(lean) -> None:
    srv = lean()
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        srv.method("Sleep")(b"5", timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 2
    deadline = time.monotonic() + 2
    while not srv.service.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.service.cancelled == ["5"]


def test_client_cancel_reaches_the_handler(lean) -> None:
    srv = lean()
    fut = srv.method("Sleep").future(b"7", timeout=10)
    time.sleep(0.2)
    assert fut.cancel()
    deadline = time.monotonic() + 2
    while not srv.service.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.service.cancelled == ["7"]


def test_flow_control_both_ways_beyond_the_initial_windows(lean) -> None:
    srv = lean()
    assert srv.method("Big")(b"3000000", timeout=20) == bytes(range(256)) * (3_000_000 // 256)
    chunks = [bytes([i % 256]) * 65536 for i in range(200)]  # 13 MB against a 1 MiB stream window
    assert srv.method("Count", "stream_unary")(iter(chunks), timeout=30) == f"200 {200 * 65536}".encode()
    got = list(srv.method("Spray", "unary_stream")(b"60", timeout=30))
    assert [int.from_bytes(g[:4], "big") for g in got] == list(range(60)) and all(len(g) == 100_000 for g in got)


def test_client_streaming_call_answers_with_its_trailing_metadata(lean) -> None:
    srv = lean()
    reply, call = srv.method("Count", "stream_unary").with_call(iter([b"ab", b"c"]), timeout=5)
    assert reply == b"2 3" and dict(call.trailing_metadata())["count"] == "2"


def test_message_over_the_receive_limit_is_resource_exhausted(lean) -> None:
    srv = lean(max_receive_message_length=1000)
    with pytest.raises(grpc.RpcError) as info:
        srv.method("Echo")(b"x" * 5000, timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "5000 vs. 1000" in info.value.details()
    assert srv.method("Echo")(b"x" * 900, timeout=5) == b"x" * 900


def test_graceful_stop_finishes_in_flight_calls_then_refuses(lean) -> None:
    srv = lean()
    fut = srv.method("Sleep").future(b"0.5", timeout=10)
    time.sleep(0.1)
    t0 = time.monotonic()
    srv.call(srv.server.stop(5.0))
    assert fut.result() == b"slept"
    assert time.monotonic() - t0 < 3  # stop returns once the last call is done, not after the grace
    with pytest.raises(grpc.RpcError) as info:
        srv.method("Echo")(b"late", timeout=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stop_after_the_grace_cancels_what_is_left(lean) -> None:
    srv = lean()
    fut = srv.method("Sleep").future(b"30", timeout=60)
    time.sleep(0.1)
    t0 = time.monotonic()
    srv.call(srv.server.stop(0.3))
    with pytest.raises(grpc.RpcError) as info:
        fut.result(timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 3
    assert srv.service.cancelled == ["30"]


def test_connections_are_aged_out_without_failing_calls(lean) -> None:
    srv = lean(max_connection_age_s=0.3, grace_s=1.0)
    echo = srv.method("Echo")
    for _ in range(25):
        assert echo(b"x", timeout=5) == b"x"
        time.sleep(0.05)
    assert len(set(srv.service.peers)) >= 2  # new connections (new client ports) after each GOAWAY


def test_a_client_that_does_not_speak_http2_is_closed(lean) -> None:
    srv = lean()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert b"expected the HTTP/2 preface" in data  # in GOAWAY's debug data, then EOF
    assert srv.method("Echo")(b"ok", timeout=5) == b"ok"


def test_admission_refuses_on_the_headers_before_the_handler_runs(lean) -> None:
    asked: list[str] = []

    def admit(path: str):
        asked.append(path)
        return (8, "busy: retry after 250 ms", (("retry-after-ms", "250"),)) if path.endswith("/Sleep") else None

    srv = lean(admit=admit)
    with pytest.raises(grpc.RpcError) as info:
        srv.method("Sleep")(b"0", timeout=5)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.details() == "busy: retry after 250 ms"
    assert dict(info.value.trailing_metadata())["retry-after-ms"] == "250"
    with pytest.raises(grpc.RpcError):
        srv.method("Sleep")(b"1", timeout=5)
    assert srv.service.started == [] and srv.method("Echo")(b"in", timeout=5) == b"in"
    assert asked == [f"/{SERVICE}/Sleep", f"/{SERVICE}/Sleep", f"/{SERVICE}/Echo"]
    assert not srv.server.connections or all(not c.calls for c in srv.server.connections)  # nothing was kept
