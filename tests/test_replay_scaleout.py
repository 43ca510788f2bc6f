"""Scale-out by call: `replay --workers 2` splits the calls of one recorded connection, lists each
worker's share, and merges the histograms exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from replay.stats import CallResult, RunStats, percentiles_ms

MS = 1_000_000
ROOT = Path(__file__).resolve().parents[1]


def test_replay_workers_2_splits_one_connection_and_lists_each_share(tmp_path: Path) -> None:
    from replay.testing import EchoServer, write_unary_recording

    n = write_unary_recording(tmp_path / "r.rec", [i * 2 * MS for i in range(100)], flows=1)
    with EchoServer() as server:
        proc = subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(tmp_path / "r.rec"), "--target",
                               server.address, "--workers", "2", "--json", str(tmp_path / "out.json")],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        received = sorted(s for _, _, s in server.received)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert received == list(range(n))
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["invariant_ok"] and data["scheduled"] == n == data["ok"]
    assert data["scheduled"] == data["sent"] + data["not_sent"]
    shares = data["workers"]
    assert [w["worker"] for w in shares] == [0, 1]
    for w in shares:
        assert 0.3 * n <= w["sent"] <= 0.7 * n, shares
        assert w["scheduled"] == w["sent"] + w["not_sent"] and w["lag_p99_us"] >= 0
    assert sum(w["sent"] for w in shares) == n
    lines = [line for line in proc.stdout.splitlines() if line.startswith("worker ")]
    assert [line.split(":")[0] for line in lines] == ["worker 0", "worker 1"]
    assert f"sent {shares[0]['sent']}," in lines[0] and f"sent {shares[1]['sent']}," in lines[1]


def test_shard_by_connection_keeps_a_connection_on_one_worker(tmp_path: Path) -> None:
    from replay.testing import EchoServer, write_unary_recording

    n = write_unary_recording(tmp_path / "r.rec", [i * 2 * MS for i in range(40)], flows=1)
    with EchoServer() as server:
        proc = subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(tmp_path / "r.rec"), "--target",
                               server.address, "--workers", "2", "--shard-by", "connection", "--json", "-"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        peers = len(server.peers)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert sorted(w["sent"] for w in data["workers"]) == [0, n] and data["invariant_ok"]
    assert peers == 1


def _result(i: int, latency_us: int) -> CallResult:
    return CallResult(i, "/m", "f1", 1, 0, 1000, latency_us * 1000, "ok", "OK")


def test_merged_percentiles_are_the_whole_runs_not_an_average() -> None:
    fast, slow = RunStats(), RunStats()
    whole = RunStats()
    for i in range(990):                     # one worker: 990 fast calls
        fast.add(_result(i, 100 + i % 7))
        whole.add(_result(i, 100 + i % 7))
    for i in range(10):                      # the other: 10 slow ones
        slow.add(_result(1000 + i, 50_000 + i))
        whole.add(_result(1000 + i, 50_000 + i))
    merged = RunStats()
    merged.merge(fast)
    merged.merge(slow)
    assert percentiles_ms(merged.latency) == percentiles_ms(whole.latency)
    # averaging the two workers' p99s would say ~25 ms; the whole run's p99 is a fast call's
    assert percentiles_ms(merged.latency)["p99"] < 1.0 and percentiles_ms(merged.latency)["max"] >= 50.0
