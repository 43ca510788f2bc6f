"""--workers: shards in separate processes start together and merge into one exact accounting."""

from __future__ import annotations

from pathlib import Path

from replay.engine import ReplayOptions
from replay.stats import CallResult, RunStats
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
    assert rep.workers == 2 and rep.scheduled == n and rep.invariant_ok
    assert rep.rejected == n // 10 and rep.ok == n - n // 10
    assert sorted(r.index for r in results) == list(range(n))
    # both shards contributed their own connections
    assert len({r.connection for r in results}) == 6 and progress
    assert rep.latency_ms["p50"] > 0 and rep.lag_us["max"] >= rep.lag_us["p50"]


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
