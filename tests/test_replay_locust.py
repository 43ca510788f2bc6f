"""Locust integration: real Locust masters and workers (subprocesses) on loopback replay a recording
through shadowtest's engine, split by call, with shadowtest's own accounting on the master."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from capture.recording import Call, Flow, RecordingWriter
from harness.commands.locust import locustfile
from replay.testing import EchoServer, write_unary_recording
from wire.process import free_port, spawn

MS = 1_000_000
ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = locustfile()
TIMEOUT_S = 60



def _locust(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None,
            wrapper: bool = False) -> subprocess.Popen[str]:
    head = [sys.executable, "-m", "harness.cli", "locust"] if wrapper else [sys.executable, "-m", "locust", "-f",
                                                                              LOCUSTFILE]
    return spawn([*head, *args], cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                 env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _finish(master: subprocess.Popen[str], *others: subprocess.Popen[str]) -> str:
    try:
        out, _ = master.communicate(timeout=TIMEOUT_S)
    finally:
        for p in (master, *others):
            if p.poll() is None:
                p.kill()
            p.wait(10)
    return out


def _worker(port: int, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return _locust("--worker", "--master-host", "127.0.0.1", "--master-port", str(port), cwd=cwd, env=env)


def _master(port: int, workers: int, host: str, *extra: str, cwd: Path = ROOT,
            wrapper: bool = False) -> subprocess.Popen[str]:
    return _locust("--master", "--headless", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
                   "--expect-workers", str(workers), "-u", str(workers), "-r", "10", "--host", host,
                   "--only-summary", *extra, cwd=cwd, wrapper=wrapper)


def test_master_and_two_workers_split_one_connection_by_call(tmp_path: Path) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 5 * MS for i in range(120)], flows=1)
    port = free_port()
    wtmp = tmp_path / "worker-tmp"
    wtmp.mkdir()
    with EchoServer() as server:
        # the master through the installed entry point; the recording is only on the master's side:
        # it reaches the workers as Locust messages
        master = _master(port, 2, server.address, "--run-time", "40s", "--shadow-recording", str(tmp_path / "r.rec"),
                         "--shadow-start-delay", "1.5", "--shadow-json", str(tmp_path / "acc.json"),
                         "--csv", str(tmp_path / "st"), wrapper=True)
        workers = [_worker(port, env={"TMPDIR": str(wtmp)}) for _ in range(2)]
        out = _finish(master, *workers)
        received = sorted(s for _, _, s in server.received)
        peers = len(server.peers)
    assert master.returncode == 0, out[-3000:]
    assert received == list(range(n)), out[-3000:]
    assert peers >= 2  # each worker's engine opened its own connection for the one recorded connection
    acc = json.loads((tmp_path / "acc.json").read_text())
    assert acc["passed"] and acc["invariant_ok"] and acc["cut_off"] == 0
    assert acc["scheduled"] == n == acc["ok"] == acc["sent"]
    shares = acc["workers"]
    assert [w["worker"] for w in shares] == [0, 1] and all(w["complete"] for w in shares)
    for w in shares:
        assert 0.3 * n <= w["sent"] <= 0.7 * n, shares
    assert sum(w["sent"] for w in shares) == n
    assert "shadowtest: worker 0: scheduled" in out and "shadowtest: worker 1: scheduled" in out
    with open(tmp_path / "st_stats.csv") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    assert int(rows["Aggregated"]["Request Count"]) == n  # every call also in Locust's statistics
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    assert not list(wtmp.iterdir())  # the workers removed their copy of the recording
    assert "Traceback" not in out


def test_two_workers_cut_short_report_their_final_counts_and_exit_1(tmp_path: Path) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 20 * MS for i in range(150)], flows=1)   # 3 s of calls
    port = free_port()
    with EchoServer() as server:
        master = _master(port, 2, server.address, "--run-time", "2s", "--shadow-recording", str(tmp_path / "r.rec"),
                         "--shadow-start-delay", "1", "--shadow-json", str(tmp_path / "acc.json"))
        workers = [_worker(port) for _ in range(2)]
        out = _finish(master, *workers)
        received = len(server.received)
    assert master.returncode == 1, out[-3000:]
    acc = json.loads((tmp_path / "acc.json").read_text())
    shares = acc["workers"]
    # the master asked the workers to stop: their final counts came, with the unsent calls counted
    assert all(w["complete"] for w in shares) and len(shares) == 2, shares
    assert 0 < acc["cut_off"] == sum(w["cut_off"] for w in shares) < n
    assert acc["ok"] > 0 and all(w["sent"] > 0 for w in shares)
    assert acc["ok"] + acc["rejected"] + sum(acc["errors"].values()) + acc["timeouts"] + acc["not_sent"] \
        + acc["cut_off"] == acc["scheduled"] == n
    assert acc["ok"] <= received <= acc["sent"]
    assert f"run cut short: {acc['cut_off']} of {n} calls cut off by the run time" in out
    assert "Traceback" not in out


@pytest.fixture
def http_server() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def _http1_recording(path: Path, count: int, gap_ms: int) -> None:
    base = 10_000_000_000
    with RecordingWriter(path) as w:
        fid = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 8080), protocol="http1"))
        for i in range(count):
            ts = base + i * gap_ms * MS
            w.add_call(Call(protocol="http1", method=f"GET /item/{i}", request_ts_ns=ts, flow_id=fid, kind="request",
                            request_metadata=[("Connection", "keep-alive")], status=200,
                            requests=[]))


def test_http1_run_cut_short_by_the_run_time_exits_non_zero_with_the_count(tmp_path: Path,
                                                                           http_server: tuple) -> None:
    address, seen = http_server
    _http1_recording(tmp_path / "h.rec", 200, 20)          # 4 s of calls; the run time allows ~1.5 s
    proc = _locust("--headless", "-u", "1", "-r", "1", "--run-time", "2s", "--host", address, "--only-summary",
                   "--shadow-recording", str(tmp_path / "h.rec"), "--shadow-start-delay", "0.5",
                   "--shadow-json", str(tmp_path / "acc.json"))
    out = _finish(proc)
    assert proc.returncode == 1, out[-3000:]
    acc = json.loads((tmp_path / "acc.json").read_text())
    assert acc["scheduled"] == 200 and acc["cut_off"] > 0 and acc["ok"] > 0
    assert acc["ok"] + acc["rejected"] + sum(acc["errors"].values()) + acc["timeouts"] + acc["not_sent"] \
        + acc["cut_off"] == 200
    # HTTP/1 requests, in order; a call in flight when the run time ended reached the server but has no outcome
    assert acc["ok"] <= len(seen) <= acc["sent"] and seen == [f"/item/{i}" for i in range(len(seen))]
    assert f"run cut short: {acc['cut_off']} of 200 calls cut off by the run time" in out
    assert "Traceback" not in out


def test_worker_without_the_recording_is_one_line_on_the_master_and_exit_1(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "w").mkdir()
    write_unary_recording(tmp_path / "m" / "r.rec", [i * 5 * MS for i in range(20)])
    port = free_port()
    with EchoServer() as server:
        # the path is relative: the master (in m/) has it, the worker (in w/) does not
        master = _master(port, 1, server.address, "--run-time", "30s", "--shadow-recording", "r.rec",
                         "--shadow-recording-on-workers", "--shadow-start-delay", "0.5", cwd=tmp_path / "m")
        worker = _worker(port, cwd=tmp_path / "w")
        out = _finish(master, worker)
        worker_out = worker.stdout.read() if worker.stdout else ""
    assert master.returncode == 1, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("shadowtest: worker 0: cannot open recording r.rec")]
    assert len(lines) == 1 and "no such file on this worker" in lines[0], out[-3000:]
    assert "shadowtest: FAILED: worker 0: cannot open recording" in out and "20 of 20 calls never replayed" in out
    assert "Traceback" not in out + worker_out


def test_target_not_allowed_is_refused_with_one_line(tmp_path: Path) -> None:
    write_unary_recording(tmp_path / "r.rec", [0, MS])
    proc = _locust("--headless", "-u", "1", "--run-time", "5s", "--host", "10.255.255.1:50051",
                   "--shadow-recording", str(tmp_path / "r.rec"))
    out = _finish(proc)
    assert proc.returncode == 2, out
    refusals = [line for line in out.splitlines() if line.startswith("shadowtest: ")]
    assert refusals == ["shadowtest: refusing to replay to 10.255.255.1:50051 (10.255.255.1): not loopback and not "
                        "allowed; pass --shadow-allow-target 10.255.255.1 if this is really a shadow environment"]
    assert "Traceback" not in out


def test_entry_point_help_lists_the_shadow_options() -> None:
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "locust", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    for opt in ("--shadow-recording", "--shadow-recording-on-workers", "--shadow-speed", "--shadow-sender",
                "--shadow-allow-target", "--shadow-json", "--master", "--expect-workers", "--print-locustfile"):
        assert opt in proc.stdout
    # ours, not Locust's usage line: this command's name, its own option and examples first
    assert proc.stdout.startswith("Usage: shadowtest locust") and "Usage: locust" not in proc.stdout
    path = subprocess.run([sys.executable, "-m", "harness.cli", "locust", "--print-locustfile"], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S).stdout.strip()
    import replay
    assert Path(path) == Path(replay.__file__).parent / "locust_user.py" and Path(path).is_file()


def test_locust_user_never_imports_the_asyncio_engine() -> None:
    code = ("import sys, replay.locust_user; "
            "bad = [m for m in ('replay.engine', 'replay.clock', 'replay.workers', 'replay.senders.grpc') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
