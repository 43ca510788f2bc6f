"""Locust integration: a real master and two workers on localhost replay every scheduled call once."""

from __future__ import annotations

import csv
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from replay.testing import EchoServer, write_unary_recording

MS = 1_000_000
ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = str(ROOT / "replay" / "locust_user.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _locust(*args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_master_and_two_workers_replay_each_call_exactly_once(tmp_path: Path) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 10 * MS for i in range(80)], flows=4)
    port = _free_port()
    with EchoServer() as server:
        master = _locust("--master", "--headless", "--master-bind-host", "127.0.0.1", "--master-bind-port",
                         str(port), "--expect-workers", "2", "-u", "2", "-r", "10", "--run-time", "6s",
                         "--host", server.address, "--shadow-recording", str(tmp_path / "r.rec"),
                         "--shadow-start-delay", "0.5", "--csv", str(tmp_path / "st"), "--only-summary")
        workers = [_locust("--worker", "--master-host", "127.0.0.1", "--master-port", str(port))
                   for _ in range(2)]
        try:
            out, _ = master.communicate(timeout=60)
        finally:
            for p in (master, *workers):
                if p.poll() is None:
                    p.kill()
                p.wait(10)
        received = sorted(s for _, _, s in server.received)
    assert received == list(range(n)), out.decode()[-2000:]
    with open(tmp_path / "st_stats.csv") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    assert int(rows["Aggregated"]["Request Count"]) == n
    assert int(rows["Aggregated"]["Failure Count"]) == 0


def test_locust_user_never_imports_the_asyncio_engine() -> None:
    code = ("import sys, replay.locust_user; "
            "bad = [m for m in ('replay.engine', 'replay.clock', 'replay.workers', 'replay.senders.grpc') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
