"""--workers: shards (by call) in separate processes start together and merge into one exact accounting."""

from __future__ import annotations

from pathlib import Path

from replay.options import ReplayOptions
from replay.stats import CallResult, RunStats, percentiles_ms
from replay.testing import EchoServer, write_unary_recording
from replay.workers import WorkerPool

MS = 1_000_000


def test_two_workers_send_each_call_once_and_merge(tmp_path: Path) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 3 * MS for i in range(150)], flows=6)
    results: list[CallResult] = []
    progress: list[RunStats] = []
    with EchoServer(reject_every=10) as server:
        pool = WorkerPool(tmp_path / "r.rec", server.address, ReplayOptions(), 2, on_result=results.append,
                          on_progress=progress.append)
        rep = pool.run()
    assert sorted(s for _, _, s in server.received) == list(range(n))
    assert len(rep.workers) == 2 and rep.scheduled == n and rep.invariant_ok
    assert rep.rejected == n // 10 and rep.ok == n - n // 10
    assert sorted(r.index for r in results) == list(range(n))
    # every recorded connection is replayed, its calls spread over both workers
    assert len({r.connection for r in results}) == 6 and progress
    assert rep.latency_ms["p50"] > 0 and rep.lag_us["max"] >= rep.lag_us["p50"]
    assert [w["worker"] for w in rep.workers] == [0, 1]
    assert sum(w["scheduled"] for w in rep.workers) == n and sum(w["ok"] for w in rep.workers) == rep.ok


def test_one_connection_is_split_by_call_and_percentiles_merge_exactly(tmp_path: Path) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 2 * MS for i in range(120)], flows=1)
    results: list[CallResult] = []
    with EchoServer() as server:
        rep = WorkerPool(tmp_path / "r.rec", server.address, ReplayOptions(), 2, on_result=results.append).run()
    assert sorted(s for _, _, s in server.received) == list(range(n))
    assert len(server.peers) >= 2                      # each worker opened its own connection
    shares = {w["worker"]: w for w in rep.workers}
    assert set(shares) == {0, 1} and rep.invariant_ok
    for w in shares.values():
        assert 0.3 * n <= w["sent"] <= 0.7 * n and w["sent"] == w["scheduled"] == w["ok"]
    assert sum(w["sent"] for w in shares.values()) == rep.sent == n
    # the merged percentiles are those of all the calls together (histograms merged, not averaged)
    whole = RunStats()
    for r in results:
        whole.add(r)
    assert rep.latency_ms == percentiles_ms(whole.latency)
    assert rep.latency_from_send_ms == percentiles_ms(whole.from_send)


def test_a_worker_killed_mid_run_breaks_the_invariant(tmp_path: Path) -> None:
    import os
    import signal
    import threading

    write_unary_recording(tmp_path / "r.rec", [i * 10 * MS for i in range(200)], flows=4)  # 2 s
    progress: list[RunStats] = []
    with EchoServer() as server:
        pool = WorkerPool(tmp_path / "r.rec", server.address, ReplayOptions(), 2, on_progress=progress.append)
        killer = threading.Thread(target=lambda: (_wait_for(lambda: len(progress) >= 2),
                                                  os.kill(pool.pids[1], signal.SIGKILL)))
        killer.start()
        rep = pool.run()
        killer.join()
    assert not rep.invariant_ok
    assert any("worker 1 died" in p for p in rep.problems)


def _wait_for(cond: object, timeout_s: float = 20.0) -> None:
    import time
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:  # type: ignore[operator]
        time.sleep(0.02)
