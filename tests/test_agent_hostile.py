"""The real agent (`shadowtest agent serve`, default lean server, model loaded) against the attacks that
cost it most before hardening: a gzip bomb on Decide (352 MB -> 2.14 GB and 4 s of CPU) and a PING
flood from a client that never reads (+63 MB). tests/test_wire_hostile.py covers every attack on a
bare LeanServer; this proves the agent as users run it is protected the same way, while its own
Decide calls keep succeeding.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import psutil
import pytest
from test_wire_hostile import H2Conn, RssMonitor, T, frame, grpc_message, gzip_bomb

from agent_under_test.launch import AgentProcess
from replay.testing import DECIDE, snapshot_bytes

GROWTH_LIMIT_MB = 40


class AgentTarget:
    """What RssMonitor needs of a server (rss, kill), plus Decide calls through grpcio."""

    def __init__(self, agent: AgentProcess) -> None:
        self.agent = agent
        self.port = int(agent.grpc_address.rsplit(":", 1)[1])
        self.ps = psutil.Process(agent.pid)
        self.channel = grpc.insecure_channel(agent.grpc_address)
        self.decide = self.channel.unary_unary(DECIDE)

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def kill(self) -> None:
        self.agent.stop()


class DecideProber:
    """Normal Decide calls on their own connection every 0.1 s while an attack runs; all must be OK."""

    def __init__(self, target: AgentTarget) -> None:
        self.target, self.ok = target, 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._call()   # connected and answering before the attack starts

    def _call(self) -> None:
        try:
            self.target.decide(snapshot_bytes(self.ok + 1), timeout=5)
            self.ok += 1
        except grpc.RpcError as exc:
            self.failures.append(f"{exc.code()}: {exc.details()}"[:200])

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self._call()

    def __enter__(self) -> DecideProber:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def assert_all_ok(self) -> None:
        self.__exit__()
        self._call()
        assert not self.failures and self.ok >= 3, \
            f"expected every concurrent Decide to succeed, got {self.ok} ok and {self.failures[:3]}"


@pytest.fixture(scope="module")
def agent() -> Iterator[AgentTarget]:
    with AgentProcess(tier="light") as proc:
        target = AgentTarget(proc)
        yield target
        target.channel.close()


def _connect(target: AgentTarget, rcvbuf: int | None = None) -> H2Conn:
    conn = H2Conn(target.port, rcvbuf)
    conn.handshake()
    return conn


def test_gzip_bomb_on_decide_is_refused_without_inflating_it(agent: AgentTarget) -> None:
    path = DECIDE.rsplit("/", 1)
    bomb = gzip_bomb()
    with DecideProber(agent) as prober, RssMonitor(agent) as mon:  # type: ignore[arg-type]
        conn = _connect(agent)
        sid = conn.open("", block=_block(path[0].lstrip("/"), path[1], (("grpc-encoding", "gzip"),)))
        conn.send_data(sid, grpc_message(bomb, 1), end_stream=True)
        sent = time.monotonic()
        conn.wait_for(lambda: conn.answered(sid), 10)
        took = time.monotonic() - sent
    status = conn.status(sid)
    print(f"agent gzip bomb: {conn.describe(sid)} {took:.2f} s after the last byte; {mon.describe()}")
    assert status is not None and status[0] == 8 and "larger than max" in status[1], conn.describe(sid)
    assert took < 2.0, f"expected the refusal within 2 s, it took {took:.1f} s"
    mon.assert_bounded(GROWTH_LIMIT_MB)
    prober.assert_all_ok()
    conn.close()


@pytest.mark.slow
def test_ping_flood_from_a_client_that_never_reads_is_bounded(agent: AgentTarget) -> None:
    batch = frame(T.PING, 0, 0, b"hostile!") * 20_000
    with DecideProber(agent) as prober, RssMonitor(agent) as mon:  # type: ignore[arg-type]
        conn = _connect(agent, rcvbuf=128 << 10)
        sent, t0 = 0, time.monotonic()
        progress = t0
        while sent < 3_000_000 * 17 and conn.ended is None:
            now = time.monotonic()
            if now - t0 > 15 or now - progress > 2:   # time is up, or the agent stopped reading from us
                break
            n = conn.try_send(batch)
            if n:
                sent, progress = sent + n, now
            else:
                time.sleep(0.01)
        conn.wait_for(lambda: conn.goaway() is not None or conn.eof, 3)
    goaway = conn.goaway()
    print(f"agent PING flood: {sent // 17} PINGs taken in {time.monotonic() - t0:.1f} s; "
          f"{conn.describe()}; {mon.describe()}")
    assert sent // 17 < 3_000_000, "expected the agent to stop taking PINGs long before 3 million"
    assert goaway is None or goaway.code == 11, f"expected GOAWAY ENHANCE_YOUR_CALM, got {conn.describe()}"
    mon.assert_bounded(GROWTH_LIMIT_MB)
    prober.assert_all_ok()
    conn.close()


def _block(service: str, method: str, extra: tuple[tuple[str, str], ...]) -> bytes:
    import hpack

    fields = [(":method", "POST"), (":scheme", "http"), (":path", f"/{service}/{method}"),
              (":authority", "127.0.0.1"), ("content-type", "application/grpc"), ("te", "trailers"), *extra]
    return hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in fields], huffman=False)

