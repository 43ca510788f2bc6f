"""The traffic generator: seeded schedules (exact), realistic snapshots, open-loop runs against a real server."""

from __future__ import annotations

import base64
import json
import os
import random
import stat
import subprocess
import sys
import threading
import time

import pytest

from agent_under_test.arrivals import bursty, poisson
from agent_under_test.errors import TrafficError
from agent_under_test.market import MarketSim, make_snapshot
from agent_under_test.proto import agent_pb2
from agent_under_test.snapshot import parse_snapshot
from agent_under_test.traffic import DECIDE, run_traffic


def test_poisson_schedule_is_seeded_and_exact() -> None:
    got = list(poisson(10.0, 0.5, random.Random(42)))
    rng = random.Random(42)
    expected, t = [], rng.expovariate(10.0)
    while t < 0.5:
        expected.append(t)
        t += rng.expovariate(10.0)
    assert got == expected and len(got) > 0


def test_schedules_hold_their_mean_rate() -> None:
    for pattern in (poisson, bursty):
        times = list(pattern(1000.0, 30.0, random.Random(7)))
        assert times == sorted(times) and times[-1] < 30.0
        assert 1000 * 30 * 0.93 < len(times) < 1000 * 30 * 1.07, pattern.__name__  # 7%: a 30 s sample


def test_bursty_is_burstier_than_poisson() -> None:
    def per_100ms_var(times: list[float]) -> float:
        counts = [0] * 300
        for t in times:
            counts[int(t * 10)] += 1
        mean = sum(counts) / len(counts)
        return sum((c - mean) ** 2 for c in counts) / len(counts) / mean  # index of dispersion
    assert per_100ms_var(list(bursty(500, 30, random.Random(1)))) > 3 * per_100ms_var(list(poisson(500, 30, random.Random(1))))


def test_make_snapshot_is_deterministic_and_valid() -> None:
    a = make_snapshot(random.Random(5), 9, "NVDA", mid=250.0, ts_ns=10**18, position=40)
    b = make_snapshot(random.Random(5), 9, "NVDA", mid=250.0, ts_ns=10**18, position=40)
    assert a.SerializeToString() == b.SerializeToString()
    snap = parse_snapshot(a)
    assert len(a.levels) == 10 and len(a.ticks) == 16 and snap.position == 40
    assert [t.ts_ns for t in a.ticks] == sorted(t.ts_ns for t in a.ticks) and a.ticks[-1].ts_ns == 10**18
    assert abs(0.5 * (a.levels[0].bid_price + a.levels[0].ask_price) - 250.0) < 0.1


def test_market_sim_walks_prices_per_symbol() -> None:
    sim = MarketSim(random.Random(1), ["AAPL", "MSFT"])
    mids = [0.5 * (s.levels[0].bid_price + s.levels[0].ask_price) for s in (sim.next(i, "AAPL") for i in range(50))]
    assert len(set(mids)) > 40 and max(mids) / min(mids) < 1.1  # moves, but like a price, not noise


def test_bad_options_raise_traffic_error() -> None:
    with pytest.raises(TrafficError, match="--rate"):
        run_traffic("127.0.0.1:1", 0, 1)
    with pytest.raises(TrafficError, match="HOST:PORT"):
        run_traffic("nowhere", 10, 1)
    with pytest.raises(TrafficError, match="--pattern"):
        run_traffic("127.0.0.1:1", 10, 1, pattern="sine")


@pytest.fixture(scope="module")
def agent():
    pytest.importorskip("torch", reason="needs torch (pip install 'shadowtest[agent]')")
    from agent_under_test.launch import AgentProcess

    with AgentProcess(tier="light", metrics_port=None) as proc:
        yield proc


def test_open_loop_run_reports_and_logs_exact_bytes(agent, tmp_path) -> None:
    log = tmp_path / "sent.jsonl"
    report = run_traffic(agent.grpc_address, 200, 1.5, seed=3, stream_share=0.3, log_sent=str(log))
    assert report.errors == {} and report.ok == report.sent > 200
    assert 120 < report.achieved_rate < 300  # Poisson over 1.5 s; generous for a noisy host
    assert report.by_method["DecideStream"] > 0 and report.by_method["Decide"] > 0
    assert report.p50_ms is not None and report.p50_ms <= report.p95_ms <= report.p99_ms
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == report.sent
    by_seq = {r.sequence_id: r for r in report.results}
    for line in lines:
        msg = agent_pb2.MarketSnapshot.FromString(base64.b64decode(line["request_b64"]))
        res = by_seq[line["sequence_id"]]
        assert msg.sequence_id == line["sequence_id"] and line["t_ns"] == res.sent_ns
        assert line["method"] == res.method and (line["stream"] is None) == (res.method == DECIDE)
        assert res.intended_ns <= res.sent_ns < res.done_ns
    # The same seed sends the same requests, timestamps aside.
    first_run = lines[0]["request_b64"]
    run_traffic(agent.grpc_address, 200, 0.2, seed=3, stream_share=0.3, log_sent=str(log))
    second_run = json.loads(log.read_text().splitlines()[0])["request_b64"]
    assert _without_times(first_run) == _without_times(second_run)


def _without_times(b64: str) -> agent_pb2.MarketSnapshot:
    msg = agent_pb2.MarketSnapshot.FromString(base64.b64decode(b64))
    msg.ts_ns = 0
    for tick in msg.ticks:
        tick.ts_ns = 0
    return msg


def test_stop_event_ends_a_long_run_early(agent) -> None:
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    start = time.monotonic()
    report = run_traffic(agent.grpc_address, 100, 60, seed=1, stop=stop)
    assert time.monotonic() - start < 10 and 10 < report.sent < 200


def test_cli_traffic_prints_json(agent, tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "harness.cli", "traffic", "--target", agent.grpc_address, "--rate", "100",
                          "--duration", "1", "--pattern", "bursty", "--seed", "4", "--json", "-"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["pattern"] == "bursty" and doc["seed"] == 4 and doc["ok"] == doc["sent"] > 0 and "results" not in doc


def test_cli_traffic_unreachable_target_is_one_red_line() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        out = subprocess.run([sys.executable, "-m", "harness.cli", "traffic", "--target", f"127.0.0.1:{port}",
                              "--rate", "10", "--duration", "1", "--connect-timeout", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot connect" in out.stderr and "Traceback" not in out.stderr


def test_refused_streams_are_counted_by_code_and_reopened() -> None:
    pytest.importorskip("torch", reason="needs torch (pip install 'shadowtest[agent]')")
    from test_agent_server import RecordingGuard, ServerThread

    from agent_under_test.engine import load_engine

    guard = RecordingGuard(refuse=0.1)  # every call and every stream open is refused
    st = ServerThread(load_engine("cpu", None, 0, 1), guard)
    try:
        report = run_traffic(st.ready["grpc"], 200, 0.5, seed=2, stream_share=0.5, streams=2)
    finally:
        st.close()
    assert report.ok == 0 and report.errors == {"RESOURCE_EXHAUSTED": report.sent}
    assert report.by_method["DecideStream"] > 0
    assert guard.admits.count("/shadowtest.agent.v1.TradingAgent/DecideStream") > 2  # lanes reopened
