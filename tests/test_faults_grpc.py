"""Call-level HTTP/2 toxics: delay or fail a chosen share of gRPC calls on ONE shared connection."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from faults.proxy import EmbeddedToxiproxy

TP_SEED = 11   # the tp fixture's (tests/conftest.py) toxics' randomness


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


@pytest.fixture
def grpc_server() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.method_handlers_generic_handler(
        "test.Echo", {"Ping": grpc.unary_unary_rpc_method_handler(_echo),
                      "Other": grpc.unary_unary_rpc_method_handler(_echo)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture
def channel(tp: EmbeddedToxiproxy, grpc_server: str) -> Iterator[grpc.Channel]:
    listen = tp.create_proxy("g", grpc_server)["listen"]
    with grpc.insecure_channel(listen) as ch:
        grpc.channel_ready_future(ch).result(timeout=10)
        yield ch


def _call(ch: grpc.Channel, method: str, payload: bytes = b"hi") -> tuple[grpc.StatusCode, float]:
    t0 = time.monotonic()
    try:
        out = ch.unary_unary(f"/test.Echo/{method}")(payload, timeout=5)
        assert out == payload
        return grpc.StatusCode.OK, time.monotonic() - t0
    except grpc.RpcError as exc:
        return exc.code(), time.monotonic() - t0


def test_error_share_by_method_on_one_connection(tp: EmbeddedToxiproxy, channel: grpc.Channel) -> None:
    assert _call(channel, "Ping")[0] == grpc.StatusCode.OK
    tp.add_toxic("g", "grpc_error", {"share": 0.3, "status": 14, "method": "test.Echo/Ping",
                                     "message": "chaos"}, stream="upstream")
    codes = [_call(channel, "Ping", bytes(100))[0] for _ in range(100)]
    failed = codes.count(grpc.StatusCode.UNAVAILABLE)
    assert failed + codes.count(grpc.StatusCode.OK) == 100
    assert 15 <= failed <= 45  # share 0.3 of 100 (binomial, > 3 sigma); seeded, so stable
    assert all(_call(channel, "Other")[0] == grpc.StatusCode.OK for _ in range(20))  # other methods untouched
    tp.remove_toxic("g", "grpc_error_upstream")
    assert all(_call(channel, "Ping")[0] == grpc.StatusCode.OK for _ in range(20))
    stats = tp.call_stats("g")
    assert stats["connections"] == 1 and stats["calls_failed"] == failed  # one shared connection throughout


def test_error_status_and_message_reach_the_client(tp: EmbeddedToxiproxy, channel: grpc.Channel) -> None:
    tp.add_toxic("g", "grpc_error", {"status": 8, "message": "resource exhausted by chaos"}, stream="upstream")
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/test.Echo/Ping")(b"x", timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "resource exhausted by chaos"


def test_delay_share_on_one_connection(tp: EmbeddedToxiproxy, channel: grpc.Channel) -> None:
    tp.add_toxic("g", "grpc_delay", {"share": 0.5, "delay": 250}, stream="upstream")
    times = [_call(channel, "Ping")[1] for _ in range(24)]
    slow = [t for t in times if t >= 0.24]
    # Tolerance: a delayed call takes >= 250 ms (10 ms early slack); an undelayed one well under 200 ms.
    assert 4 <= len(slow) <= 20
    assert all(t < 0.2 for t in times if t < 0.24)
    assert tp.call_stats("g")["connections"] == 1


def test_large_messages_and_connection_flow_control_survive_failures(tp: EmbeddedToxiproxy,
                                                                     channel: grpc.Channel) -> None:
    # Dropped request bodies are credited back to the client; without that the window would run dry.
    tp.add_toxic("g", "grpc_error", {"share": 0.5}, stream="upstream")
    big = bytes(200_000)
    codes = [_call(channel, "Ping", big)[0] for _ in range(30)]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
    assert codes.count(grpc.StatusCode.OK) >= 5
    tp.remove_toxic("g", "grpc_error_upstream")
    assert _call(channel, "Ping", big)[0] == grpc.StatusCode.OK
