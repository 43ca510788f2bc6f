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
