"""Each toxic measured against a loopback echo server (tolerances stated per test), the conformance
contract every toxic passes, and the pure timing/slicing rules in exact (seeded) form."""

from __future__ import annotations

import random
import socket
import statistics
import time

import pytest

from faults.proxy import EmbeddedToxiproxy
from faults.proxy.toxics import latency_delay, slice_offsets
from faults.testing import EchoServer, check_toxic_conformance, connect, read_exactly, wait_closed

TP_SEED = 3   # the tp fixture's (tests/conftest.py) toxics' randomness


def rtt(s: socket.socket, payload: bytes = b"x" * 10) -> float:
    t0 = time.monotonic()
    s.sendall(payload)
    assert read_exactly(s, len(payload)) == payload
    return time.monotonic() - t0


# --- pure rules, exact ---------------------------------------------------------------------------

def test_latency_delay_is_uniform_within_jitter_and_seeded() -> None:
    a = [latency_delay(random.Random(9), 50, 20) for _ in range(1)]
    b = [latency_delay(random.Random(9), 50, 20) for _ in range(1)]
    assert a == b
    rng = random.Random(1)
    draws = [latency_delay(rng, 50, 20) for _ in range(2000)]
    assert min(draws) >= 0.030 and max(draws) < 0.070
    assert latency_delay(random.Random(1), 50, 0) == 0.050


def test_slice_offsets_follow_toxiproxy_halving() -> None:
    cuts = slice_offsets(random.Random(4), 1000, 100, 20)
    sizes = [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
    assert cuts[0] == 0 and cuts[-1] == 1000 and sum(sizes) == 1000
    assert all(0 < s <= 120 for s in sizes)  # base case: size - average <= variation
    assert cuts == slice_offsets(random.Random(4), 1000, 100, 20)  # same seed, same cuts
    assert slice_offsets(random.Random(4), 80, 100, 20) == [0, 80]
    assert slice_offsets(random.Random(4), 500, 0, 0) == [0, 500]  # average 0: no slicing


# --- measured on loopback --------------------------------------------------------------------------

def test_latency_mean_and_jitter_bounds(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    listen = tp.create_proxy("l", echo.addr)["listen"]
    tp.add_toxic("l", "latency", {"latency": 60, "jitter": 20})
    with connect(listen) as s:
        samples = [rtt(s) for _ in range(25)]
    # Tolerance: never earlier than latency - jitter (2 ms clock slack); lateness comes from the shared
    # host, so the median must sit within 45..90 ms (latency 60 +/- jitter 20, plus 10 ms slack).
    assert min(samples) >= 0.040 - 0.002
    assert 0.045 <= statistics.median(samples) <= 0.090


def test_latency_counts_from_arrival_so_backlog_does_not_add_up(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    listen = tp.create_proxy("b", echo.addr)["listen"]
    tp.add_toxic("b", "latency", {"latency": 100}, stream="upstream")
    with connect(listen) as s:
        t0 = time.monotonic()
        for i in range(20):  # 20 chunks 5 ms apart: each leaves 100 ms after it arrived
            s.sendall(bytes([i]) * 100)
            time.sleep(0.005)
        got = read_exactly(s, 2000)
        took = time.monotonic() - t0
    assert got == b"".join(bytes([i]) * 100 for i in range(20))  # never reordered
    assert took < 0.100 + 0.100 + 0.150  # ~200 ms; a naive per-chunk sleep would take 20 x 100 ms


def test_bandwidth_within_ten_percent(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    listen = tp.create_proxy("bw", echo.addr)["listen"]
    tp.add_toxic("bw", "bandwidth", {"rate": 400})  # 400 KB/s downstream
    payload = bytes(range(256)) * 1600  # 409,600 bytes -> 1.024 s at 400,000 B/s
    with connect(listen) as s:
        t0 = time.monotonic()
        s.sendall(payload)
        got = read_exactly(s, len(payload), timeout=10)
        took = time.monotonic() - t0
    assert got == payload
    expected = len(payload) / 400_000
    assert expected * 0.9 <= took <= expected * 1.1, f"{took:.3f}s vs {expected:.3f}s (10 % tolerance)"


def test_slicer_chunk_sizes(tp: EmbeddedToxiproxy) -> None:
    sizes: list[int] = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    listen = tp.create_proxy("s", f"127.0.0.1:{srv.getsockname()[1]}")["listen"]
    tp.add_toxic("s", "slicer", {"average_size": 100, "size_variation": 20, "delay": 3000}, stream="upstream")
    with srv, connect(listen) as c:
        conn, _ = srv.accept()
        with conn:
            c.sendall(bytes(2000))
            conn.settimeout(5)
            while sum(sizes) < 2000 and (data := conn.recv(65536)):
                sizes.append(len(data))
    # Tolerance: reads may merge pieces on a busy host, so judge the median read, not every read.
    assert sum(sizes) == 2000
    assert len(sizes) >= 8 and statistics.median(sizes) <= 120


def test_limit_data_byte_count(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    listen = tp.create_proxy("ld", echo.addr)["listen"]
    tp.add_toxic("ld", "limit_data", {"bytes": 1000})  # downstream: the echo returns all 1200
    with connect(listen) as s:
        s.sendall(bytes(600))
        time.sleep(0.05)
        s.sendall(bytes(600))
        got = read_exactly(s, 5000, timeout=3)
        assert len(got) == 1000  # exactly the limit, then the connection closes
        assert wait_closed(s, 3)
    assert echo.received == [1200]


def test_reset_peer_gives_a_reset(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    listen = tp.create_proxy("r", echo.addr)["listen"]
    tp.add_toxic("r", "reset_peer", {"timeout": 100})
    with connect(listen) as s:
        t0 = time.monotonic()
        s.sendall(b"hello")
        s.settimeout(5)
        with pytest.raises(ConnectionResetError):
            while s.recv(100):
                pass
        assert time.monotonic() - t0 >= 0.09  # not before the timeout (10 ms tolerance)


def test_timeout_closes_after_its_time_and_passes_nothing(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    listen = tp.create_proxy("t", echo.addr)["listen"]
    tp.add_toxic("t", "timeout", {"timeout": 300})
    with connect(listen) as s:
        t0 = time.monotonic()
        s.sendall(b"hello")
        s.settimeout(5)
        assert s.recv(100) == b""  # no data, then EOF
        took = time.monotonic() - t0
    assert 0.28 <= took <= 1.5  # 300 ms; 20 ms early tolerance, generous late tolerance


def test_slow_close_delays_the_close(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    listen = tp.create_proxy("sc", echo.addr)["listen"]
    tp.add_toxic("sc", "slow_close", {"delay": 300})
    with connect(listen) as s:
        assert rtt(s) < 0.25  # data is not delayed
        t0 = time.monotonic()
        s.shutdown(socket.SHUT_WR)
        assert wait_closed(s, 5)
        assert time.monotonic() - t0 >= 0.28


def test_toxicity_zero_passes_everything_and_is_per_connection(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    listen = tp.create_proxy("tz", echo.addr)["listen"]
    tp.add_toxic("tz", "latency", {"latency": 200}, toxicity=0.0)
    payload = bytes(range(256)) * 40
    for _ in range(3):
        with connect(listen) as s:
            assert rtt(s, payload) < 0.15
    tp.update_toxic("tz", "latency_downstream", toxicity=0.5)
    slow = []
    for _ in range(12):
        with connect(listen) as s:
            first, second = rtt(s), rtt(s)
            slow.append(first > 0.15)
            assert (first > 0.15) == (second > 0.15)  # decided once per connection
    assert 0 < sum(slow) < 12  # seeded draw: some connections get it, some do not


@pytest.mark.parametrize("stream", ["downstream", "upstream"])
@pytest.mark.parametrize("toxic,attrs", [
    ("noop", {}),
    ("latency", {"latency": 20, "jitter": 5}),
    ("bandwidth", {"rate": 2000}),
    ("slow_close", {"delay": 100}),
    ("timeout", {"timeout": 0}),
    ("reset_peer", {"timeout": 1500}),
    ("slicer", {"average_size": 64, "size_variation": 16, "delay": 100}),
    ("limit_data", {"bytes": 1_000_000}),
])
def test_every_toxic_conforms(tp: EmbeddedToxiproxy, echo: EchoServer, toxic: str, attrs: dict, stream: str) -> None:
    check_toxic_conformance(tp, echo.addr, toxic, attrs, stream=stream)
