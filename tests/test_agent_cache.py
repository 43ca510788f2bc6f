"""The agent's response cache (agent_under_test/cache.py): local and Redis tiers, similarity, TTLs,
stale-while-revalidate, the Redis circuit breaker, its metrics, events and the DependencySlow alert.

Unit tests drive the cache logic on a FakeClock with exact trajectories; the rest run real agent
processes against a real redis-server started here (stopped with SIGSTOP for "slow", killed for "gone").
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from agent_under_test import similarity
from agent_under_test.cache import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    AskRedis,
    CacheSettings,
    Circuit,
    Entry,
    LocalTier,
    Probe,
    ResponseCache,
    match_rows,
    pack_entry,
    probe_for,
    unpack_entry,
)
from agent_under_test.errors import ServeError
from agent_under_test.features import build_features
from agent_under_test.hooks import GuardConfig
from agent_under_test.launch import AgentProcess
from agent_under_test.market import MarketSim, make_snapshot
from agent_under_test.protection import ProtectionGuard
from agent_under_test.proto import agent_pb2, agent_pb2_grpc
from agent_under_test.snapshot import parse_snapshot
from wire.clock import FakeClock
from wire.process import end_child, free_port, spawn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broken_agent import broken  # noqa: E402

REDIS_SERVER = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server on PATH (apt-get install redis-server)")
TS = 1_700_000_000_000_000_000
AGENT = {"device": "cpu", "tier": "light", "limiter": "off"}
BUDGET_S = 0.2   # no call may take longer, Redis slow or gone (on a loaded 2-core machine)


# -- helpers --------------------------------------------------------------------------------------------

class Recorded:
    """Cache hooks that keep what they are told (a plain recorder, not a mock)."""

    def __init__(self) -> None:
        self.results: list[str] = []
        self.ops: list[tuple[str, str | None]] = []
        self.circuit: list[tuple[str, str]] = []

    def on_cache(self, result: str) -> None:
        self.results.append(result)

    def on_dependency(self, dependency: str, op: str, seconds: float, error: str | None) -> None:
        self.ops.append((op, error))

    def on_circuit(self, dependency: str, old: str, new: str) -> None:
        self.circuit.append((old, new))


def unit(*values: float) -> bytes:
    """A unit vector as the cache keeps one: float32 bytes."""
    v = np.array(values, dtype=np.float64)
    return (v / np.linalg.norm(v)).astype("<f4").tobytes()


def vec(v: bytes) -> np.ndarray:
    return np.frombuffer(v, dtype="<f4")


def snapshot(seed: int, seq: int = 1, symbol: str = "ACME", position: float = 0.0) -> agent_pb2.MarketSnapshot:
    return make_snapshot(random.Random(seed), seq, symbol, ts_ns=TS, position=position)


def features(msg: agent_pb2.MarketSnapshot) -> Any:
    return build_features(parse_snapshot(msg, 65536))



class RedisServer:
    """A throwaway redis-server on a free loopback port; stop()/cont() (SIGSTOP/SIGCONT), kill(), restart()."""

    def __init__(self) -> None:
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="shadowtest-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        assert REDIS_SERVER is not None
        self.proc = spawn([REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                           "--appendonly", "no", "--dir", self._dir.name])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        self._dir.cleanup()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


class Client:
    """A blocking gRPC client of one agent, plus its /metrics and /events."""

    def __init__(self, agent: AgentProcess) -> None:
        self.agent = agent
        self.channel = grpc.insecure_channel(agent.grpc_address)
        self.stub = agent_pb2_grpc.TradingAgentStub(self.channel)

    def decide(self, msg: agent_pb2.MarketSnapshot, timeout: float = 10.0) -> tuple[agent_pb2.Decision, float]:
        start = time.perf_counter()
        out = self.stub.Decide(msg, timeout=timeout)
        return out, time.perf_counter() - start

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.agent.metrics_url}/metrics", timeout=10) as r:
            return r.read().decode()

    def sample(self, series: str) -> float:
        for line in self.metrics().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        raise AssertionError(f"{series} not exported")

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.agent.metrics_url}/events?follow=0", timeout=10) as r:
            events = [json.loads(line) for line in r.read().decode().splitlines()]
        return [e for e in events if kind is None or e["type"] == kind]

    def circuit(self) -> list[str]:
        return [e["to"] for e in self.events("circuit")]

    def wait_for(self, what: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; events: {self.events()[-8:]}")
            time.sleep(0.05)

    def close(self) -> None:
        self.channel.close()


def misses(n: int, client: Client, seed: int, budget_s: float = BUDGET_S) -> list[float]:
    """`n` calls, each a book never seen before of a symbol never seen before (so each looks in Redis:
    a bucket the agent has read is held in its near copy); asserts each is answered in budget."""
    took = []
    for i in range(n):
        symbol = f"Z{seed}N{i}"
        sim = MarketSim(random.Random(seed * 1000 + i), symbols=[symbol])
        out, seconds = client.decide(sim.next(10_000 + i, ts_ns=TS + i))
        assert out.sequence_id == 10_000 + i and out.symbol == symbol
        assert seconds < budget_s, f"call {i} took {seconds * 1000:.1f} ms"
        took.append(seconds)
    return took


# -- unit: matching, tiers, TTLs (FakeClock) ------------------------------------------------------------

def test_local_tier_keeps_the_newest_per_bucket_and_evicts_the_least_recently_used_bucket():
    tier = LocalTier(max_entries=4, per_bucket=2)
    entries = {name: Entry(unit(1, i), (0.0,), "full", 0.0) for i, name in enumerate("abcde")}
    tier.put("k1", entries["a"])
    tier.put("k1", entries["b"])
    tier.put("k1", entries["c"])             # k1 holds c, b: a (its oldest) goes
    assert len(tier) == 2
    assert tier.find(Probe("k1", entries["a"].vector), 0.9999, 0.0, 10.0) is None
    assert tier.find(Probe("k1", entries["b"].vector), 0.9999, 0.0, 10.0) is entries["b"]
    tier.put("k2", entries["d"])
    tier.put("k3", entries["e"])             # 4 entries: k1 (2), k2, k3
    assert len(tier) == 4
    tier.find(Probe("k1", entries["c"].vector), 0.9999, 0.0, 10.0)   # k1 used: k2 is now the oldest
    tier.put("k4", Entry(unit(0, 1), (0.0,), "full", 0.0))           # 5 > 4: k2 goes
    assert len(tier) == 4
    assert tier.find(Probe("k2", entries["d"].vector), 0.5, 0.0, 10.0) is None
    assert tier.find(Probe("k1", entries["c"].vector), 0.9999, 0.0, 10.0) is entries["c"]
    tier.put("k1", Entry(bytes(bytearray(entries["c"].vector)), (1.0,), "light", 1.0))   # same vector: replaced, not added
    assert len(tier) == 4 and tier.find(Probe("k1", entries["c"].vector), 0.9999, 0.0, 10.0).output == (1.0,)


def test_similarity_threshold_is_inclusive_and_picks_the_best_entry():
    cache = ResponseCache(CacheSettings(mode="local", threshold=0.85), Recorded(), FakeClock.at(1000.0))
    base = Probe("ACME|2|0", unit(1, 0))
    cache.store(base, (1.0,) * 5, "full")
    near = Probe("ACME|2|0", unit(0.86, (1 - 0.86 ** 2) ** 0.5))   # cosine 0.86
    far = Probe("ACME|2|0", unit(0.84, (1 - 0.84 ** 2) ** 0.5))    # cosine 0.84
    other_bucket = Probe("ACME|2|1", unit(1, 0))

    async def run() -> list[str | None]:
        out = []
        for p in (base, near, far, other_bucket):
            hit = await cache.lookup(p)
            out.append(hit.source if hit else None)
        return out

    assert asyncio.run(run()) == ["local", "local", None, None]
    assert cache.hooks.results == ["hit_local", "hit_local", "miss", "miss"]   # type: ignore[attr-defined]


def test_probe_matches_the_same_book_not_another_one_and_buckets_by_symbol_depth_and_position():
    a, b = snapshot(1), snapshot(2)
    pa = probe_for("ACME", 0.0, features(a))
    assert pa.key == "ACME|10|0"
    assert float(np.dot(vec(pa.vector), vec(probe_for("ACME", 0.0, features(snapshot(1, seq=99))).vector))) \
        == pytest.approx(1.0)
    assert float(np.dot(vec(pa.vector), vec(probe_for("ACME", 0.0, features(b)).vector))) < 0.85
    assert probe_for("ACME", 260.0, features(snapshot(1, position=260.0))).key == "ACME|10|3"
    assert probe_for("OTHER", 0.0, features(a)).key == "OTHER|10|0"


def test_ttls_fresh_then_stale_then_gone():
    clock = FakeClock.at(1000.0)
    hooks = Recorded()
    cache = ResponseCache(CacheSettings(mode="local", local_ttl_s=60, redis_ttl_s=3600), hooks, clock)
    probe = Probe("ACME|2|0", unit(1, 2))
    cache.store(probe, (0.5,) * 5, "light")
    seen = []

    async def look() -> None:
        hit = await cache.lookup(probe)
        seen.append(hit.source if hit else None)

    for step in (59.9, 0.1, 3000.0, 539.9, 0.1):   # ages 59.9, 60, 3060, 3599.9, 3600
        clock.advance(step)
        asyncio.run(look())
    assert seen == ["local", "stale", "stale", "stale", None]
    assert hooks.results == ["hit_local", "stale", "stale", "stale", "miss"]


def test_a_stale_entry_is_refreshed_once_through_the_slow_path():
    clock = FakeClock.at(1000.0)
    cache = ResponseCache(CacheSettings(mode="local", local_ttl_s=1, redis_ttl_s=10), Recorded(), clock)
    probe = Probe("ACME|2|0", unit(3, 1))
    old = cache.store(probe, (0.0,) * 5, "full")
    clock.advance(2)
    computed: list[int] = []

    async def run() -> list[str | None]:
        release = asyncio.Event()

        async def slow_path() -> tuple[tuple[float, ...], str]:
            computed.append(1)
            await release.wait()
            return (1.0,) * 5, "light"

        sources = []
        for _ in range(3):                       # three stale hits while the refresh runs: one refresh
            hit = await cache.lookup(probe)
            assert hit is not None and hit.entry is old
            sources.append(hit.source)
            cache.revalidate(probe, hit.entry, slow_path)
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*cache.refreshes)
        hit = await cache.lookup(probe)
        assert hit is not None and hit.entry.output == (1.0,) * 5 and hit.entry.tier == "light"
        sources.append(hit.source)
        return sources

    assert asyncio.run(run()) == ["stale", "stale", "stale", "local"]
    assert computed == [1] and len(cache.local) == 1


def test_entries_survive_the_trip_through_redis_bytes_and_garbage_is_not_an_entry():
    entry = Entry(unit(1, 2, 3), (0.1, -0.2, 0.3, 0.4, 0.5), "light", 1234.5)
    back = unpack_entry(pack_entry(entry))
    assert back is not None and back.output == entry.output and back.tier == "light" and back.written == 1234.5
    assert back.vector == entry.vector
    assert unpack_entry(b"nonsense") is None
    rows = [b"nonsense", pack_entry(Entry(unit(1, 2), (9.0,), "full", 0.0)),   # another length: skipped
            pack_entry(Entry(unit(1, 2, 4), (1.0,), "full", 2000.0)), pack_entry(entry)]
    found = match_rows(rows, entry.vector, 0.85, 2000.0, 3600.0)
    assert found is not None and found.output == entry.output and found.tier == "light"
    assert match_rows(rows, entry.vector, 0.85, 1234.5 + 3600.0, 3600.0) is not None    # the other one, still young
    assert match_rows(rows, entry.vector, 0.999, 1234.5 + 3600.0, 3600.0) is None      # the best is too old
    impostor = b"\xff" * 3 + entry.vector        # ends with the very vector, but is no entry: passed over
    found = match_rows([impostor, *rows[1:]], entry.vector, 0.85, 2000.0, 3600.0)
    assert found is not None and found.output == entry.output
    longer = pack_entry(Entry(unit(0, 0, 0, *np.frombuffer(entry.vector, "<f4")), (7.0,), "full", 2000.0))
    assert match_rows([longer], entry.vector, 0.5, 2000.0, 3600.0) is None   # its tail matches; its length not


# -- unit: the circuit breaker --------------------------------------------------------------------------

def test_circuit_opens_after_n_failures_half_opens_once_and_closes_on_success():
    clock = FakeClock.at(1000.0)
    moves: list[tuple[str, str]] = []
    c = Circuit(3, 2.0, clock, lambda old, new: moves.append((old, new)))
    trajectory = []
    for outcome in ("fail", "fail", "ok", "fail", "fail", "fail"):   # a success resets the count
        assert c.allow()
        c.success() if outcome == "ok" else c.failure()
        trajectory.append(c.state)
    assert trajectory == [CLOSED, CLOSED, CLOSED, CLOSED, CLOSED, OPEN]
    clock.advance(1.999)
    assert not c.allow() and c.state == OPEN
    clock.advance(0.001)
    assert c.allow() and c.state == HALF_OPEN          # the probe
    assert not c.allow()                               # ... only one at a time
    c.failure()                                        # probe failed: open again, for another open_s
    assert c.state == OPEN and not c.allow()
    clock.advance(2.0)
    assert c.allow() and c.state == HALF_OPEN
    c.abandon()                                        # probe cancelled: the next call probes
    assert c.allow()
    c.success()
    assert c.state == CLOSED and c.allow() and c.allow()
    assert moves == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]


@pytest.mark.parametrize(("settings", "message"), [
    (CacheSettings(mode="redis"), "--cache redis needs --redis-url (e.g. redis://127.0.0.1:6379/0)"),
    (CacheSettings(mode="redis", redis_url="http://x"), "--redis-url http://x: must start with redis:// or unix://"),
    (CacheSettings(mode="local", threshold=1.5), "--cache-threshold 1.5: must be in (0, 1] (a cosine similarity)"),
    (CacheSettings(mode="local", threshold=0), "--cache-threshold 0: must be in (0, 1] (a cosine similarity)"),
    (CacheSettings(mode="local", local_ttl_s=0), "--cache-local-ttl-s 0: must be a positive number"),
    (CacheSettings(mode="local", local_ttl_s=60, redis_ttl_s=10),
     "--cache-redis-ttl-s 10 is shorter than --cache-local-ttl-s 60: the hard TTL must be at least the soft one"),
    (CacheSettings(mode="local", redis_timeout_ms=-1), "--redis-timeout-ms -1: must be a positive number"),
    (CacheSettings(mode="local", circuit_failures=0), "--circuit-failures 0: must be at least 1"),
    (CacheSettings(mode="local", circuit_open_s=float("nan")), "--circuit-open-s nan: must be a positive number"),
])
def test_bad_cache_settings_are_one_line_errors(settings: CacheSettings, message: str):
    with pytest.raises(ServeError) as info:
        settings.validate()
    assert str(info.value) == message


# -- unit: the guard's metrics, circuit events and DependencySlow ---------------------------------------

def test_guard_turns_dependency_reports_into_metrics_events_and_dependency_slow():
    clock = FakeClock.at(1000.0)
    g = ProtectionGuard(GuardConfig(alert_periods=2, resolve_periods=2, min_samples=3, dependency_threshold_ms=10), clock)
    states = []
    plan = ["fast", "slow", "slow", "open", "fast", "fast", "few"]
    for period in plan:
        if period == "open":
            g.on_circuit("redis", "closed", "open")
            g.on_circuit("redis", "open", "half_open")
            g.on_circuit("redis", "half_open", "closed")
        n = 2 if period == "few" else 5
        for _ in range(n):
            g.on_dependency("redis", "get", 0.012 if period == "slow" else 0.001, None)
        clock.advance(1.0)
        g.tick()
        states.append(g.alert_state("DependencySlow"))
    assert states == ["inactive", "pending", "firing", "firing", "firing", "inactive", "inactive"]
    alerts = [(e["from"], e["to"], e["period"]) for e in g.events.since(0, "alert") if e["alert"] == "DependencySlow"]
    assert alerts == [("inactive", "pending", 2), ("pending", "firing", 3), ("firing", "inactive", 6)]
    circuit = [(e["dependency"], e["from"], e["to"]) for e in g.events.since(0, "circuit")]
    assert circuit == [("redis", "closed", "open"), ("redis", "open", "half_open"), ("redis", "half_open", "closed")]
    g.on_dependency("redis", "set", 0.005, "timeout")
    g.on_circuit("redis", "closed", "open")
    g.on_cache("miss")
    text = g.metrics.exposition().decode()
    assert 'agent_dependency_circuit_state{dependency="redis"} 2.0' in text
    assert 'agent_dependency_errors_total{dependency="redis",kind="timeout",op="set"} 1.0' in text
    assert 'agent_dependency_seconds_count{dependency="redis",op="get"} 32.0' in text
    assert 'agent_dependency_seconds_bucket{dependency="redis",le="0.01",op="get"} 22.0' in text
    assert 'agent_cache_total{result="miss"} 1.0' in text
    assert 'agent_alert_firing{alert="DependencySlow"} 0.0' in text


def test_an_open_circuit_keeps_dependency_slow_breaching_until_it_closes():
    clock = FakeClock.at(1000.0)
    g = ProtectionGuard(GuardConfig(alert_periods=2, resolve_periods=1, min_samples=1), clock)
    g.on_circuit("redis", "closed", "open")
    states = []
    for _ in range(3):                      # no operations at all: open is what breaches
        clock.advance(1.0)
        g.tick()
        states.append(g.alert_state("DependencySlow"))
    g.on_circuit("redis", "open", "half_open")
    g.on_circuit("redis", "half_open", "closed")
    g.on_dependency("redis", "get", 0.001, None)
    for _ in range(2):                      # the period it closed in had it open: still breaching
        clock.advance(1.0)
        g.tick()
        states.append(g.alert_state("DependencySlow"))
    assert states == ["pending", "firing", "firing", "firing", "firing"]
    g.on_dependency("redis", "get", 0.001, None)
    clock.advance(1.0)
    g.tick()
    assert g.alert_state("DependencySlow") == "inactive"


# -- real agents ----------------------------------------------------------------------------------------

def test_cache_off_changes_nothing_and_local_answers_repeats_with_their_own_sequence_id():
    with AgentProcess(**AGENT) as off, AgentProcess(cache="local", **AGENT) as on:
        plain, cached = Client(off), Client(on)
        msg = snapshot(7)
        a, _ = plain.decide(msg)
        b, _ = plain.decide(msg)
        assert a.cache == "" and b.cache == "" and a.batch_size >= 1 and b.batch_size >= 1
        assert [s.stage for s in a.stages] == ["parse", "features", "queue", "strategy", "risk", "order"]
        assert "agent_cache_total{result=\"miss\"} 0.0" in plain.metrics()
        first, _ = cached.decide(msg)
        assert first.cache == "" and first.batch_size >= 1
        assert [s.stage for s in first.stages] == ["parse", "features", "cache", "queue", "strategy", "risk", "order"]
        for field in ("side", "price", "size", "confidence", "tier", "reason"):   # same model, same answer
            assert getattr(first, field) == getattr(a, field)
        for seq in (41, 42):
            msg.sequence_id = seq
            hit, _ = cached.decide(msg)
            assert (hit.cache, hit.sequence_id, hit.symbol, hit.batch_size) == ("local", seq, "ACME", 0)
            assert (hit.side, hit.price, hit.size, hit.tier) == (first.side, first.price, first.size, first.tier)
            assert [s.stage for s in hit.stages] == ["parse", "features", "cache", "risk", "order"]
        other = snapshot(7, seq=43, symbol="OTHER")        # same book, another symbol: its own answer
        out, _ = cached.decide(other)
        assert (out.cache, out.symbol, out.sequence_id) == ("", "OTHER", 43)
        assert cached.sample('agent_cache_total{result="hit_local"}') == 2.0
        assert cached.sample('agent_cache_total{result="miss"}') == 2.0
        plain.close()
        cached.close()


@needs_redis
def test_a_second_agent_hits_what_the_first_cached_in_redis(redis_server: RedisServer):
    opts = {"cache": "redis", "redis_url": redis_server.url, **AGENT}
    with AgentProcess(**opts) as one, AgentProcess(**opts) as two:
        a, b = Client(one), Client(two)
        msg = snapshot(11, seq=5)
        computed, _ = a.decide(msg)
        assert computed.cache == ""
        a.wait_for(lambda: a.sample('agent_dependency_seconds_count{dependency="redis",op="set"}') >= 1)
        msg.sequence_id = 6
        shared, _ = b.decide(msg)
        assert (shared.cache, shared.sequence_id, shared.symbol) == ("redis", 6, "ACME")
        assert (shared.side, shared.price, shared.size, shared.tier) == (computed.side, computed.price, computed.size,
                                                                          computed.tier)
        msg.sequence_id = 7
        assert b.decide(msg)[0].cache == "local"           # now in b's own tier
        assert b.sample('agent_cache_total{result="hit_redis"}') == 1.0
        assert b.sample('agent_dependency_circuit_state{dependency="redis"}') == 0.0
        a.close()
        b.close()


@needs_redis
def test_slow_then_gone_redis_costs_calls_at_most_the_budget_and_the_circuit_opens_and_closes(
        redis_server: RedisServer):
    opts = {"cache": "redis", "redis_url": redis_server.url, "redis_timeout_ms": 5, "circuit_failures": 3,
            "circuit_open_s": 1.0, "period_s": 0.5, "alert_periods": 2, "resolve_periods": 2, "min_samples": 1, **AGENT}
    with AgentProcess(**opts) as agent, AgentProcess(**opts) as writer:
        c, w = Client(agent), Client(writer)
        misses(3, c, seed=1)
        redis_server.pause()                               # slow: accepts, never answers
        try:
            took = misses(8, c, seed=2)
            assert sorted(took)[len(took) // 2] < 0.1
            assert c.circuit() == ["open"]
            assert c.sample('agent_dependency_circuit_state{dependency="redis"}') == 2.0
            assert sum(c.sample(f'agent_dependency_errors_total{{dependency="redis",kind="timeout",op="{op}"}}')
                       for op in ("get", "set", "ping")) >= 3   # writes and health PINGs count too
            c.wait_for(lambda: any(e["alert"] == "DependencySlow" and e["to"] == "firing"
                                   for e in c.events("alert")))
        finally:
            redis_server.resume()
        time.sleep(1.1)                                    # past circuit_open_s: the next call probes
        misses(2, c, seed=3)
        assert c.circuit() == ["open", "half_open", "closed"]
        assert c.sample('agent_dependency_circuit_state{dependency="redis"}') == 0.0
        msg = snapshot(21, seq=1)
        w.decide(msg)                                      # the other agent caches it in Redis ...
        c.wait_for(lambda: w.sample('agent_dependency_seconds_count{dependency="redis",op="set"}') >= 1)
        msg.sequence_id = 2
        assert c.decide(msg)[0].cache == "redis"           # ... and hits resume
        for round_ in range(40):                           # healthy periods (with Redis operations) resolve it
            if any(e["alert"] == "DependencySlow" and e["to"] == "inactive" for e in c.events("alert")):
                break
            misses(2, c, seed=100 + round_)
            time.sleep(0.1)
        else:
            raise AssertionError(f"DependencySlow never resolved: {c.events('alert')}")
        redis_server.kill()                                # gone: connection refused
        misses(6, c, seed=4)
        assert c.circuit()[-1] == "open"
        assert sum(c.sample(f'agent_dependency_errors_total{{dependency="redis",kind="error",op="{op}"}}')
                   for op in ("get", "set")) >= 1
        msg.sequence_id = 3
        assert c.decide(msg)[0].cache == "local"           # the local tier works on
        metrics = c.metrics()
        for series in ('agent_dependency_seconds_bucket{dependency="redis",le="0.0001",op="get"}',
                       'agent_dependency_seconds_bucket{dependency="redis",le="0.05",op="set"}',
                       'agent_dependency_errors_total{dependency="redis",kind="error",op="set"}',
                       'agent_cache_total{result="stale"}', 'agent_alert_firing{alert="DependencySlow"}'):
            assert series in metrics
        c.close()
        w.close()


def test_agent_starts_with_redis_down_and_a_stale_answer_is_refreshed_once():
    opts = {"cache": "redis", "redis_url": f"redis://127.0.0.1:{free_port()}/0", "cache_local_ttl_s": 1.0,
            "circuit_open_s": 60, **AGENT}
    with AgentProcess(**opts) as agent:
        c = Client(agent)
        assert c.circuit() == ["open"] and agent.ready["cache"] == "redis"
        assert agent.ready["cache_kernel"] == similarity.KERNEL   # what serves is said at start
        msg = snapshot(31, seq=1)
        assert c.decide(msg)[0].cache == ""
        assert c.decide(msg)[0].cache == "local"
        passes = c.sample("agent_batch_size_count")
        time.sleep(1.1)
        with ThreadPoolExecutor(4) as pool:                # stale hits at once: every one answers, one refresh
            outs = list(pool.map(lambda i: c.decide(snapshot(31, seq=100 + i))[0], range(4)))
        assert {o.sequence_id for o in outs} == {100, 101, 102, 103}
        assert "stale" in {o.cache for o in outs} and {o.cache for o in outs} <= {"stale", "local"}
        c.wait_for(lambda: c.sample("agent_batch_size_count") == passes + 1)
        assert c.decide(msg)[0].cache == "local"
        time.sleep(0.3)
        assert c.sample("agent_batch_size_count") == passes + 1
        assert c.sample('agent_dependency_seconds_count{dependency="redis",op="get"}') == 0   # never tried: open
        c.close()


def test_bad_cache_flags_fail_in_one_line_before_the_model_loads():
    cases = [(["--cache", "redis"], "error: --cache redis needs --redis-url (e.g. redis://127.0.0.1:6379/0)"),
             (["--cache", "local", "--cache-threshold", "2"],
              "error: --cache-threshold 2: must be in (0, 1] (a cosine similarity)"),
             (["--dependency-threshold-ms", "0"], "error: --dependency-threshold-ms 0: must be a positive number")]
    for flags, line in cases:
        out = subprocess.run([sys.executable, "-m", "agent_under_test", "serve", "--port", "0", "--metrics-port", "-1",
                              "--device", "cpu", *flags], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and out.stderr.strip() == line, out.stderr
    out = subprocess.run([sys.executable, "-m", "agent_under_test", "serve", "--cache", "disk"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "'disk' is not one of 'off', 'local', 'redis'" in out.stderr


# -- broken agents: each defect shows -------------------------------------------------------------------

@needs_redis
@pytest.mark.slow
def test_broken_agents_show_their_cache_defects(redis_server: RedisServer):
    opts = {"cache": "redis", "redis_url": redis_server.url, "circuit_failures": 3, "circuit_open_s": 0.5,
            "period_s": 0.5, "alert_periods": 2, "min_samples": 1, **AGENT}
    with broken("cache_blocks")(**opts) as blocks, broken("circuit_stuck")(**opts) as stuck, \
            broken("dependency_alert_never")(**opts) as quiet:
        clients = [Client(a) for a in (blocks, stuck, quiet)]
        for c in clients:
            misses(2, c, seed=5)
        redis_server.pause()
        try:
            with pytest.raises(grpc.RpcError) as info:     # cache_blocks: the call waits on the stopped Redis
                clients[0].decide(snapshot(41), timeout=1.0)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for c in clients[1:]:
                misses(5, c, seed=6)
                assert c.circuit()[:1] == ["open"] and c.circuit()[-1] == "open"   # (health PINGs probe it)
            time.sleep(1.5)                                # three periods with the circuit open
        finally:
            redis_server.resume()
        assert not any(e["alert"] == "DependencySlow" for e in clients[2].events("alert"))
        assert any(e["alert"] == "DependencySlow" and e["to"] == "firing" for e in clients[1].events("alert"))
        clients[2].wait_for(lambda: clients[2].circuit()[-1] == "closed")   # the quiet one recovers ...
        assert clients[2].circuit()[-2:] == ["half_open", "closed"]
        misses(3, clients[2], seed=7)
        misses(3, clients[1], seed=7)
        assert clients[1].circuit() == ["open"]                          # ... the stuck one never tries again
        assert clients[1].sample('agent_dependency_circuit_state{dependency="redis"}') == 2.0
        for c in clients:
            c.close()


# -- the miss path's cost (issue 27): what the cheaper code must still do ------------------------------

@pytest.mark.parametrize("levels", [1, 3, 10])
def test_probe_is_the_centred_unit_vector_of_the_features(levels: int):
    feats = features(make_snapshot(random.Random(levels), 1, "ACME", ts_ns=TS, levels=levels))
    x = feats.x.astype(np.float64)
    want = (x - x.mean(axis=0)).ravel() if levels > 1 else x.ravel()
    want /= np.linalg.norm(want)
    before = feats.x.copy()
    got = vec(probe_for("ACME", 0.0, feats).vector)
    assert got.shape == (levels * x.shape[1],)
    assert np.abs(got - want).max() < 1e-6
    assert float(np.dot(got, got)) == pytest.approx(1.0, abs=1e-6)
    assert np.array_equal(feats.x, before)               # the features stay as they were


def test_a_store_after_a_miss_still_replaces_the_same_book_stored_meanwhile():
    clock = FakeClock.at(1000.0)
    cache = ResponseCache(CacheSettings(mode="local"), Recorded(), clock)
    cache.store(Probe("ACME|2|0", unit(0, 1)), (0.0,) * 5, "full")
    first, second = Probe("ACME|2|0", unit(1, 0)), Probe("ACME|2|0", unit(1, 0))   # one book, two calls

    async def run() -> None:
        assert await cache.lookup(first) is None and await cache.lookup(second) is None
        cache.store(second, (2.0,) * 5, "full")              # the other call's answer lands first ...
        cache.store(first, (1.0,) * 5, "full")               # ... so this store must still find it
        hit = await cache.lookup(Probe("ACME|2|0", unit(1, 0)))
        assert hit is not None and hit.entry.output == (1.0,) * 5
        assert len(cache.local) == 2
        fresh = Probe("NEW|2|0", unit(1, 1))                 # a bucket that did not exist at the lookup ...
        assert await cache.lookup(fresh) is None
        cache.store(Probe("NEW|2|0", unit(1, 1)), (3.0,) * 5, "full")   # ... and does by the store
        cache.store(fresh, (4.0,) * 5, "full")
        hit = await cache.lookup(Probe("NEW|2|0", unit(1, 1)))
        assert hit is not None and hit.entry.output == (4.0,) * 5 and len(cache.local) == 3

    asyncio.run(run())


def test_a_full_bucket_drops_its_oldest_whichever_way_a_store_comes():
    cache = ResponseCache(CacheSettings(mode="local", threshold=0.9999), Recorded(), FakeClock.at(1000.0),
                          LocalTier(max_entries=100, per_bucket=3))
    vectors = [unit(1, i, 0) for i in range(5)] + [unit(0, 1, i) for i in range(1, 3)]

    async def run() -> list[float | None]:
        for i, v in enumerate(vectors):
            probe = Probe("ACME|3|0", v)
            if i % 2:                                         # every other store follows its own miss
                assert await cache.lookup(probe) is None
            cache.store(probe, (float(i),) * 5, "full")
        out = []
        for v in vectors:
            hit = await cache.lookup(Probe("ACME|3|0", v))
            out.append(hit.entry.output[0] if hit and float(np.dot(vec(hit.entry.vector), vec(v))) > 0.999999 else None)
        return out

    assert asyncio.run(run()) == [None, None, None, None, 4.0, 5.0, 6.0]
    assert len(cache.local) == 3


def test_resp_replies_split_anywhere_reach_the_sends_that_wait_for_them_in_order():
    from agent_under_test.resp import RedisReplyError, RespConnection, command

    replies = (b"*3\r\n$3\r\nabc\r\n$0\r\n\r\n$-1\r\n", b":7\r\n", b"+OK\r\n-ERR wrong type\r\n:1\r\n", b"*0\r\n")

    async def run() -> list[object]:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            _, conn = await asyncio.get_running_loop().create_connection(RespConnection, sock=ours)
            lrange = conn.send(command("LRANGE", "k", 0, 31), 1, 0.0)
            abandoned = conn.send(command("LPUSH", "k", b"v"), 1, 0.0)
            batch = conn.send(command("LTRIM", "k", 0, 1) + command("LPUSH", "j", 1) + command("EXPIRE", "k", 9), 3, 0.0)
            empty = conn.send(command("LRANGE", "none", 0, 31), 1, 0.0)
            abandoned.cancel()                                 # its reply must still be read, and dropped
            data = b"".join(replies)
            for i in range(len(data)):                         # one byte at a time
                theirs.sendall(data[i:i + 1])
                await asyncio.sleep(0)
            out = [await lrange, await asyncio.gather(batch, return_exceptions=True), await empty]
            assert theirs.recv(4096).startswith(b"*4\r\n$6\r\nLRANGE\r\n$1\r\nk\r\n$1\r\n0\r\n$2\r\n31\r\n")
            conn.close()
            await asyncio.sleep(0)
            assert isinstance(out[1][0], RedisReplyError) and "wrong type" in str(out[1][0])
            return [out[0], out[2]]

    assert asyncio.run(run()) == [[b"abc", b"", None], []]


@pytest.mark.parametrize("reply", [b"$99999999\r\n" + b"x" * (5 << 20),   # a bulk string over the bound
                                   b"*1\r\n" * 10 + b":1\r\n",            # arrays nested 10 deep
                                   b"|0\r\n" * 10 + b":1\r\n",            # a chain of RESP3 attributes
                                   b"?what\r\n"])                           # not RESP
def test_a_hostile_reply_fails_the_waiting_send_and_closes_the_connection(reply: bytes) -> None:
    from agent_under_test.resp import RespConnection, command

    async def run() -> BaseException | object:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            _, conn = await asyncio.get_running_loop().create_connection(RespConnection, sock=ours)
            waiting = conn.send(command("LRANGE", "k", 0, 31), 1, 0.0)
            theirs.setblocking(False)
            view = memoryview(reply)
            while view and not conn.lost:
                try:
                    view = view[theirs.send(view[:1 << 16]):]
                except BlockingIOError:
                    pass
                await asyncio.sleep(0)
            for _ in range(100):
                if conn.lost:
                    break
                await asyncio.sleep(0.01)
            assert conn.lost, "the connection stays open on a hostile reply"
            assert len(conn._buf) <= 5 << 20
            return (await asyncio.gather(waiting, return_exceptions=True))[0]

    assert isinstance(asyncio.run(run()), ConnectionError)


@needs_redis
def test_redis_tier_keeps_one_connection_through_abandoned_lookups_and_batches_its_writes(
        redis_server: RedisServer):
    from agent_under_test.cache import Circuit, RedisTier

    hooks = Recorded()
    clock = FakeClock.at(1000.0)
    entries = [Entry(unit(1, i), (float(i),) * 5, "light", clock.wall()) for i in range(4)]

    async def run() -> None:
        # No near copy: every lookup here is a round trip (the copy has its own test).
        tier = RedisTier(redis_server.url, 0.05, 3600.0, Circuit(100, 1.0, clock), hooks, tracking=False,
                         health_s=None)
        assert await tier.start(1.0)
        conn = tier._conn
        for i, entry in enumerate(entries):                    # four writes within the linger: one round trip
            tier.put(f"K{i % 2}", entry)
        assert tier._writer is not None
        await tier._writer
        assert hooks.ops == [("set", None)]
        redis_server.pause()
        try:
            assert await tier.find(Probe("K0", entries[0].vector), 0.99, clock.wall()) is None   # abandoned
        finally:
            redis_server.resume()
        found = await tier.find(Probe("K1", entries[1].vector), 0.99, clock.wall())
        assert found is not None and found.output == entries[1].output   # its own reply, not the abandoned one's
        found = await tier.find(Probe("K0", entries[2].vector), 0.99, clock.wall())
        assert found is not None and found.output == entries[2].output
        assert await tier.find(Probe("K0", entries[1].vector), 0.99, clock.wall()) is None      # not in K0
        assert tier._conn is conn                              # no reconnect after the abandoned lookup
        assert hooks.ops == [("set", None), ("get", "timeout"), ("get", None), ("get", None), ("get", None)]
        await tier.close()

    asyncio.run(run())


@pytest.mark.parametrize(("url", "want"), [
    ("redis://127.0.0.1:6380/2", dict(host="127.0.0.1", port=6380, db=2)),
    ("redis://cache.internal", dict(host="cache.internal", port=6379, db=0)),
    ("redis://:s%40cret@h:1/3", dict(host="h", port=1, db=3, password="s@cret")),
    ("redis://ops:pw@h?db=4", dict(host="h", db=4, username="ops", password="pw")),
    ("unix:///run/redis/redis.sock?db=5", dict(path="/run/redis/redis.sock", db=5)),
    ("unix://:pw@/tmp/r.sock", dict(path="/tmp/r.sock", password="pw")),
])
def test_redis_urls_parse_as_redis_clients_read_them(url: str, want: dict[str, Any]):
    from agent_under_test.resp import RedisAddress, parse_url

    assert parse_url(url) == RedisAddress(**want)


@pytest.mark.parametrize(("url", "message"), [
    ("redis://h:notaport/0", "--redis-url redis://h:notaport/0: bad port"),
    ("redis://h/zero", "--redis-url redis://h/zero: the database must be a number, not 'zero'"),
    ("redis://h/1?db=2", "--redis-url redis://h/1?db=2: the database is named twice (path and ?db=)"),
    ("redis://h/1?ssl=true", "--redis-url redis://h/1?ssl=true: unknown option 'ssl' (only db=N)"),
    ("unix://", "--redis-url unix://: unix:// needs the socket's path (unix:///run/redis.sock)"),
])
def test_a_bad_redis_url_is_a_one_line_error(url: str, message: str):
    with pytest.raises(ServeError) as info:
        CacheSettings(mode="redis", redis_url=url).validate()
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@needs_redis
def test_redis_tier_logs_in_and_selects_its_database_over_a_unix_socket(tmp_path: Path):
    """The connection's own AUTH and SELECT against a real redis-server that wants a password and
    listens on a unix socket only: what the tier writes lands in the database the URL names."""
    from agent_under_test.cache import Circuit, RedisTier

    assert REDIS_SERVER is not None
    sock = tmp_path / "redis.sock"
    proc = spawn([REDIS_SERVER, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
                  "--requirepass", "p@ss word", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)])
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
        clock = FakeClock.at(1000.0)
        entry = Entry(unit(1, 0), (1.0,) * 5, "light", clock.wall())

        async def run(url: str) -> tuple[bool, Entry | None]:
            tier = RedisTier(url, 0.5, 3600.0, Circuit(100, 1.0, clock), Recorded())
            try:
                if not await tier.start(2.0):
                    return False, None
                tier.put("K", entry)
                assert tier._writer is not None
                await tier._writer
                return True, await tier.find(Probe("K", entry.vector), 0.99, clock.wall())
            finally:
                await tier.close()

        ok, found = asyncio.run(run(f"unix://:p%40ss%20word@{sock}?db=2"))
        assert ok and found is not None and found.output == entry.output
        assert asyncio.run(run(f"unix://:wrong@{sock}?db=2")) == (False, None)   # AUTH refused: circuit open
        with socket.socket(socket.AF_UNIX) as s:            # the key is in db 2, not in db 0
            s.connect(str(sock))
            s.sendall(b"AUTH \"p@ss word\"\r\nSELECT 2\r\nDBSIZE\r\nSELECT 0\r\nDBSIZE\r\n")
            got = b""
            while got.count(b"\r\n") < 5:
                got += s.recv(4096)
        assert got.split(b"\r\n")[:5] == [b"+OK", b"+OK", b":1", b"+OK", b":0"]
    finally:
        end_child(proc)


def test_a_local_only_cache_answers_and_reports_the_same_without_an_await():
    clock = FakeClock.at(1000.0)
    caches = [ResponseCache(CacheSettings(mode="local", local_ttl_s=1, redis_ttl_s=10), Recorded(), clock)
              for _ in range(2)]
    for cache in caches:
        cache.store(Probe("ACME|2|0", unit(1, 0)), (1.0,) * 5, "full")
    probes = [unit(1, 0), unit(0, 1), unit(1, 0)]
    sync, awaited = caches[0], caches[1]
    got = []
    for i, v in enumerate(probes):
        clock.advance(0.6 * i)                             # the third is stale
        a = sync.lookup_now(Probe("ACME|2|0", v))
        assert not isinstance(a, AskRedis)                 # no Redis tier: never a round trip
        b = asyncio.run(awaited.lookup(Probe("ACME|2|0", v)))
        got.append((a.source if a else None, b.source if b else None))
    assert got == [("local", "local"), (None, None), ("stale", "stale")]
    assert sync.hooks.results == awaited.hooks.results == ["hit_local", "miss", "stale"]   # type: ignore[attr-defined]


# -- the Redis tier's near copy (client tracking) -------------------------------------------------------

async def _invalidated(tier: Any, key: bytes) -> None:
    """Wait, bounded, for Redis's invalidation of `key` to reach `tier` (it is pushed as the change is made)."""
    deadline = time.monotonic() + 5
    while key in tier._near:
        assert time.monotonic() < deadline, f"no invalidation of {key!r} came"
        await asyncio.sleep(0.002)


def _redis_command(port: int, *args: bytes) -> bytes:
    """One command over a plain socket: a client that shares no code with the tier."""
    from agent_under_test.resp import command
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(command(*args))
        return s.recv(4096)


@needs_redis
def test_the_near_copy_answers_lookups_without_a_round_trip_until_redis_says_the_bucket_changed(
        redis_server: RedisServer):
    from agent_under_test.cache import KEY_PREFIX, Circuit, RedisTier

    hooks = Recorded()
    clock = FakeClock.at(1000.0)
    e = [Entry(unit(1, i), (float(i),) * 5, "light", clock.wall()) for i in range(4)]
    key = (KEY_PREFIX + "K").encode()

    def gets() -> int:
        return sum(op == "get" for op, _ in hooks.ops)

    async def run() -> None:
        tier = RedisTier(redis_server.url, 0.5, 3600.0, Circuit(100, 1.0, clock), hooks, health_s=None)
        other = RedisTier(redis_server.url, 0.5, 3600.0, Circuit(100, 1.0, clock), Recorded(),   # another agent
                          health_s=None)
        try:
            assert await tier.start(1.0) and await other.start(1.0)
            assert tier.tracking_active

            def find(i: int) -> Awaitable[Entry | None]:
                return tier.find(Probe("K", e[i].vector), 0.99, clock.wall())

            assert await find(0) is None and gets() == 1          # a round trip: the (empty) bucket is kept
            assert await find(0) is None and gets() == 1          # the copy answers
            tier.put("K", e[0])                                    # our own write invalidates nothing
            assert tier._writer is not None                        # (NOLOOP) and is not in the copy: the
            await tier._writer                                     # local tier holds our own entries
            assert key in tier._near and await find(0) is None and gets() == 1 and tier.near_reads == 2

            other.put("K", e[1])                                   # another agent's write to the bucket
            assert other._writer is not None
            await other._writer
            await _invalidated(tier, key)
            assert (await find(1)).output == e[1].output and gets() == 2   # read again: it is there  # type: ignore[union-attr]
            assert (await find(0)).output == e[0].output and gets() == 2   # and ours, from the copy  # type: ignore[union-attr]
            assert tier.find_near(Probe("K", e[1].vector), 0.99, clock.wall()) is not None   # no await

            assert _redis_command(redis_server.port, b"LPUSH", b"elsewhere", b"x") == b":1\r\n"
            assert _redis_command(redis_server.port, b"DEL", key) == b":1\r\n"   # a plain client deletes it
            await _invalidated(tier, key)
            assert await find(0) is None and gets() == 3
            assert await find(1) is None and gets() == 3

            other.put("K", e[2])
            await other._writer
            await _invalidated(tier, key)
            assert await find(2) is not None and gets() == 4
            assert await find(2) is not None and gets() == 4
            tier.circuit.open()                                    # the copy serves only a closed circuit
            assert isinstance(tier.find_near(Probe("K", e[2].vector), 0.99, clock.wall()), AskRedis)
            tier.circuit.success()

            assert _redis_command(redis_server.port, b"FLUSHALL") == b"+OK\r\n"   # a flush drops everything
            await _invalidated(tier, key)
            assert await find(2) is None and gets() == 5

            redis_server.kill()                                    # gone: no copy, no tracking
            deadline = time.monotonic() + 5
            while tier.tracking_active:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert not tier._near
            assert await find(2) is None and hooks.ops[-1] == ("get", "error")
        finally:
            await tier.close()
            await other.close()

    asyncio.run(run())


@needs_redis
def test_a_redis_that_refuses_client_tracking_still_serves_and_every_miss_asks_it(tmp_path: Path):
    """Least privilege: an ACL without the CLIENT command (HELLO 3 is allowed, so the connection speaks
    RESP3 from then on). The tier says it has no copy, and every lookup is a round trip that still hits."""
    from agent_under_test.cache import Circuit, RedisTier

    assert REDIS_SERVER is not None
    port = free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text("user default on nopass ~* &* +@all -client\n")   # (a conf line: the command line splits it)
    proc = spawn([REDIS_SERVER, str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                  "--appendonly", "no", "--dir", str(tmp_path)])
    hooks = Recorded()
    clock = FakeClock.at(1000.0)
    entry = Entry(unit(1, 2), (2.0,) * 5, "light", clock.wall())

    async def run() -> None:
        tier = RedisTier(f"redis://127.0.0.1:{port}/0", 0.5, 3600.0, Circuit(100, 1.0, clock), hooks, health_s=None)
        try:
            deadline = time.monotonic() + 10
            while not await tier.start(0.5):
                assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
                tier.circuit.success()
                await asyncio.sleep(0.05)
            assert not tier.tracking_active
            tier.put("K", entry)
            assert tier._writer is not None
            await tier._writer
            for _ in range(2):
                found = await tier.find(Probe("K", entry.vector), 0.99, clock.wall())
                assert found is not None and found.output == entry.output
            assert [op for op, error in hooks.ops if error is None] == ["set", "get", "get"]
            assert tier.near_reads == 0
        finally:
            await tier.close()

    try:
        asyncio.run(run())
        assert _redis_command(port, b"CLIENT", b"ID").startswith(b"-NOPERM")   # the ACL did refuse it
    finally:
        end_child(proc)


def test_resp3_replies_and_pushes_are_read_in_stream_order() -> None:
    """RESP3 types reach the sends that wait for them; pushes go to on_push, between them, in order; a
    send's `then` sees its reply before anything read after it."""
    from agent_under_test.resp import RedisReplyError, RespConnection, command

    invalidate = b">2\r\n$10\r\ninvalidate\r\n*1\r\n$1\r\nk\r\n"
    data = (b"%2\r\n+proto\r\n:3\r\n+modules\r\n*0\r\n" + invalidate + b"_\r\n" + b"#t\r\n" + b",1.5\r\n"
            + b">2\r\n$10\r\ninvalidate\r\n_\r\n" + b"(12345678901234567890\r\n" + b"=7\r\ntxt:abc\r\n"
            + b"~2\r\n:1\r\n:2\r\n" + b"|1\r\n+ttl\r\n:3\r\n:9\r\n" + b"!9\r\nERR blob!\r\n")
    seen: list[object] = []

    async def run() -> list[object]:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            _, conn = await asyncio.get_running_loop().create_connection(RespConnection, sock=ours)
            conn.on_push = lambda push: seen.append(("push", list(push)))
            sends = [conn.send(command("X"), 1, 0.0, then=lambda c, reply, i=i: seen.append((i, reply)))
                     for i in range(9)]
            for i in range(len(data)):                        # one byte at a time
                theirs.sendall(data[i:i + 1])
                await asyncio.sleep(0)
            out = await asyncio.gather(*sends, return_exceptions=True)
            conn.close()
            return out

    out = asyncio.run(run())
    assert out[:8] == [[b"proto", 3, b"modules", []], None, True, 1.5, 12345678901234567890, b"txt:abc", [1, 2], 9]
    assert isinstance(out[8], RedisReplyError) and str(out[8]) == "ERR blob!"
    assert seen[:3] == [(0, [b"proto", 3, b"modules", []]), ("push", [b"invalidate", [b"k"]]), (1, None)]
    assert seen[4:6] == [(3, 1.5), ("push", [b"invalidate", None])]
    assert [s[0] for s in seen] == [0, "push", 1, 2, 3, "push", 4, 5, 6, 7]   # no `then` for an error reply


@needs_redis
def test_health_pings_measure_an_idle_redis_open_the_circuit_when_it_stalls_and_close_it_when_it_answers(
        redis_server: RedisServer):
    """No lookup, no write: the idle PINGs alone give DependencySlow its operations, open the circuit on a
    stopped Redis and, as the half-open probe, close it again once Redis answers."""
    from agent_under_test.cache import Circuit, RedisTier
    from wire.clock import MonotonicClock

    hooks = Recorded()

    async def wait(what: Any, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, f"timed out: {hooks.ops[-5:]} {hooks.circuit}"
            await asyncio.sleep(0.01)

    async def run() -> None:
        circuit = Circuit(3, 0.3, MonotonicClock(), lambda old, new: hooks.on_circuit("redis", old, new))
        tier = RedisTier(redis_server.url, 0.02, 3600.0, circuit, hooks, health_s=0.01, idle_health_s=0.01)
        try:
            assert await tier.start(1.0)
            await asyncio.sleep(0.3)
            pings = [e for op, e in hooks.ops if op == "ping"]
            assert 10 <= len(pings) <= 31 and set(pings) == {None}   # ~one per 10 ms of quiet, no more
            redis_server.pause()
            try:
                await wait(lambda: hooks.circuit == [("closed", "open")])
                assert ("ping", "timeout") in hooks.ops
            finally:
                redis_server.resume()
            await wait(lambda: hooks.circuit[-1] == ("half_open", "closed"))
            assert hooks.circuit == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]
        finally:
            await tier.close()
        assert tier._health is not None and tier._health.done()

    asyncio.run(run())


@needs_redis
def test_health_pings_ride_on_lookups_one_per_quiet_interval_and_none_without_them(redis_server: RedisServer):
    """While lookups come, the PINGs go out from them (tick), one per `health_s` of quiet, not from a
    timer (whose wake-up from idle costs more CPU than the PING); without lookups only the idle timer's."""
    from agent_under_test.cache import Circuit, RedisTier
    from wire.clock import MonotonicClock

    hooks = Recorded()

    async def run() -> None:
        tier = RedisTier(redis_server.url, 0.5, 3600.0, Circuit(3, 1.0, MonotonicClock()), hooks,
                         health_s=0.02, idle_health_s=60.0)
        try:
            assert await tier.start(1.0)
            start = len(hooks.ops)
            await asyncio.sleep(0.3)                     # no lookups: the idle timer is 60 s away
            assert hooks.ops[start:] == []
            began = time.monotonic()
            while time.monotonic() - began < 0.4:        # lookups every ~2 ms for 0.4 s
                tier.tick()
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.05)
            pings = [e for op, e in hooks.ops[start:] if op == "ping"]
            assert set(pings) == {None} and 10 <= len(pings) <= 21   # ~one per 20 ms of quiet, never more
            tier._last_sent = time.monotonic()
            tier.tick()                                  # something went to Redis just now: no PING
            await asyncio.sleep(0.05)
            assert len([op for op, _ in hooks.ops[start:] if op == "ping"]) == len(pings)
        finally:
            await tier.close()

    asyncio.run(run())


@needs_redis
def test_writes_linger_for_company_and_a_later_put_or_a_full_batch_sends_them_without_the_timer(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch):
    """A lone write waits the linger; a put WRITE_EARLY_S into it, or one that fills a batch, sends what
    waits at once, in one round trip (while calls flow, the linger's timer never wakes the loop)."""
    from agent_under_test import cache as cache_mod
    from agent_under_test.cache import Circuit, Entry, RedisTier
    from wire.clock import MonotonicClock

    monkeypatch.setattr(cache_mod, "WRITE_LINGER_S", 30.0)   # the timer would fire long after the test
    monkeypatch.setattr(cache_mod, "WRITE_EARLY_S", 0.05)
    monkeypatch.setattr(cache_mod, "WRITE_BATCH", 4)
    hooks = Recorded()
    entry = Entry(b"\x00" * 8, (1.0,), "light", time.time())

    def llen(key: str) -> bytes:
        return _redis_command(redis_server.port, b"LLEN", (cache_mod.KEY_PREFIX + key).encode())

    async def run() -> None:
        tier = RedisTier(redis_server.url, 0.5, 3600.0, Circuit(3, 1.0, MonotonicClock()), hooks, health_s=None)
        try:
            assert await tier.start(1.0)
            tier.put("early|1|0", entry)
            await asyncio.sleep(0.2)                         # alone, it lingers
            assert [op for op, _ in hooks.ops].count("set") == 0 and tier._writer is not None
            tier.put("early|1|0", entry)                     # 0.2 s > WRITE_EARLY_S into the linger: sent now
            await asyncio.wait_for(tier._writer, 5.0)
            assert [op for op, _ in hooks.ops].count("set") == 1
            assert llen("early|1|0") == b":2\r\n"
            for i in range(4):                               # a full batch goes at once, however young
                tier.put(f"full|{i}|0", entry)
            await asyncio.wait_for(tier._writer, 5.0)
            assert [op for op, _ in hooks.ops].count("set") == 2
            assert [llen(f"full|{i}|0") for i in range(4)] == [b":1\r\n"] * 4
        finally:
            await tier.close()

    asyncio.run(run())


def test_a_write_batch_s_one_line_replies_are_counted_in_runs_split_anywhere_and_the_next_sends_keep_theirs():
    """A batch's replies but its last are counted in runs (not parsed one by one): wherever the stream
    splits, each send gets its own last reply, an error in a batch fails only that batch, and the
    replies that follow a batch in the same read (its last, the next sends') are not swallowed."""
    from agent_under_test.resp import RedisReplyError, RespConnection

    data = (b":1\r\n+OK\r\n:1\r\n:2\r\n+OK\r\n:9\r\n"    # a batch of six (LPUSH, LTRIM, EXPIRE x 2): its last is 9
            b"+PONG\r\n"                                 # a PING
            b":1\r\n-ERR wrong type\r\n:1\r\n"           # a batch of three with an error in it
            b"*1\r\n$1\r\nx\r\n"                         # a lookup
            b":5\r\n+OK\r\n:1\r\n")                      # a batch of three: 1

    async def run(split: int) -> list[object]:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            _, conn = await asyncio.get_running_loop().create_connection(RespConnection, sock=ours)
            sends = [conn.send(b"", 6, 0.0), conn.send(b"", 1, 0.0), conn.send(b"", 3, 0.0),
                     conn.send(b"", 1, 0.0), conn.send(b"", 3, 0.0)]
            for part in (data[:split], data[split:]):
                if part:
                    theirs.sendall(part)
                    await asyncio.sleep(0.001)
            out = await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 5.0)
            conn.close()
            await asyncio.sleep(0)
            return [type(o).__name__ if isinstance(o, RedisReplyError) else o for o in out]

    for split in range(len(data) + 1):
        assert asyncio.run(run(split)) == [9, b"PONG", "RedisReplyError", [b"x"], 1], f"split at {split}"
