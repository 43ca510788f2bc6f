"""Toxics in virtual time: exact trajectories (when each byte leaves) for a given arrival schedule."""

from __future__ import annotations

import asyncio
import random

from faults.proxy.channel import CLOSE, DATA, EOF, RESET, Chunk
from faults.proxy.toxics import TOXICS, parse_attributes, slice_offsets
from faults.testing import VirtualStub


def run(toxic_type: str, attrs: dict, chunks: list[Chunk], seed: int = 0) -> list[tuple[float, bytes, int]]:
    toxic = TOXICS[toxic_type](parse_attributes(toxic_type, attrs))
    stub = VirtualStub(chunks, seed=seed, state=toxic.new_state())
    asyncio.run(toxic.pipe(stub))
    return stub.sent


def test_latency_waits_delay_minus_age() -> None:
    sent = run("latency", {"latency": 100}, [Chunk(b"a", 0.0), Chunk(b"b", 0.01), Chunk(b"c", 0.5),
                                             Chunk(b"", 0.6, EOF)])
    # b arrived while a was waiting: it leaves 100 ms after ITS arrival, not after a's departure.
    assert sent == [(0.1, b"a", DATA), (0.11, b"b", DATA), (0.6, b"c", DATA), (0.6, b"", EOF)]


def test_latency_jitter_is_seeded() -> None:
    chunks = [Chunk(bytes([i]), i * 1.0) for i in range(5)] + [Chunk(b"", 9.0, EOF)]
    a = run("latency", {"latency": 50, "jitter": 20}, list(chunks), seed=4)
    b = run("latency", {"latency": 50, "jitter": 20}, list(chunks), seed=4)
    assert a == b
    assert all(0.030 <= t - i * 1.0 < 0.070 for i, (t, _, _) in enumerate(a[:5]))


def test_bandwidth_trajectory() -> None:
    # 10 KB/s = 1000 bytes per 100 ms slice: 2500 bytes leave as 1000 @0.1, 1000 @0.2, 500 @0.25.
    sent = run("bandwidth", {"rate": 10}, [Chunk(bytes(2500), 0.0), Chunk(b"", 0.0, EOF)])
    assert [(t, len(d), k) for t, d, k in sent] == [(0.1, 1000, DATA), (0.2, 1000, DATA), (0.25, 500, DATA),
                                                   (0.25, 0, EOF)]


def test_slicer_trajectory() -> None:
    sent = run("slicer", {"average_size": 10, "size_variation": 3, "delay": 1000}, [Chunk(bytes(50), 0.0),
                                                                                 Chunk(b"", 0.0, EOF)], seed=2)
    cuts = slice_offsets(random.Random(2), 50, 10, 3)
    sizes = [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
    assert [len(d) for _, d, k in sent if k == DATA] == sizes
    assert [t for t, _, k in sent if k == DATA] == [round(i * 0.001, 9) for i in range(len(sizes))]


def test_slow_close_delays_only_the_close() -> None:
    sent = run("slow_close", {"delay": 250}, [Chunk(b"x", 0.0), Chunk(b"", 0.5, EOF)])
    assert sent == [(0.0, b"x", DATA), (0.75, b"", EOF)]


def test_reset_peer_after_first_chunk_plus_timeout() -> None:
    sent = run("reset_peer", {"timeout": 200}, [Chunk(b"data", 0.3)])
    assert sent == [(0.5, b"", RESET)]  # the data itself is dropped


def test_limit_data_cuts_at_the_byte_and_closes() -> None:
    sent = run("limit_data", {"bytes": 1500}, [Chunk(bytes(1000), 0.0), Chunk(bytes(1000), 0.1)])
    assert [(t, len(d), k) for t, d, k in sent] == [(0.0, 1000, DATA), (0.1, 500, DATA), (0.1, 0, CLOSE)]
