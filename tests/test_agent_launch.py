"""The agent as a real subprocess: ready line, SIGTERM drains in-flight calls, launch errors, the CLI."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import grpc
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'shadowtest[agent]')")

from agent_under_test.errors import LaunchError  # noqa: E402
from agent_under_test.launch import AgentProcess, serve_args  # noqa: E402
from agent_under_test.market import MarketSim  # noqa: E402
from agent_under_test.proto import agent_pb2_grpc  # noqa: E402
from wire.process import spawn


def test_serve_args_maps_options_to_flags() -> None:
    args = serve_args({"port": 0, "tier": "light", "jit": False, "weights": None, "metrics_port": None,
                       "batch_window_ms": 2.5})
    assert args == ["--port", "0", "--tier", "light", "--no-jit", "--metrics-port", "-1", "--batch-window-ms", "2.5"]


def test_sigterm_drains_in_flight_calls() -> None:
    # A fixed 3 s batching window keeps every call in flight when SIGTERM arrives.
    with AgentProcess(tier="light", batch_window_ms=3000, batch_window="fixed", max_batch=64,
                      metrics_port=None) as agent:
        assert agent.ready["event"] == "ready" and agent.ready["pid"] == agent.pid
        assert agent.ready["device"] == "cpu" and agent.ready["metrics"] is None
        sim = MarketSim(random.Random(0))
        with grpc.insecure_channel(agent.grpc_address) as channel:
            stub = agent_pb2_grpc.TradingAgentStub(channel)
            grpc.channel_ready_future(channel).result(timeout=20)  # connected before the calls go out
            futures = [stub.Decide.future(sim.next(i), timeout=20) for i in range(2, 12)]
            time.sleep(1.5)  # they reached the server and wait in the batcher (generous: noisy hosts)
            os.kill(agent.pid, signal.SIGTERM)
            assert [f.result().sequence_id for f in futures] == list(range(2, 12))
            assert agent.proc.wait(15) == 0
        assert "stopping" in agent.log_tail()


def test_launch_error_carries_the_childs_stderr() -> None:
    with pytest.raises(LaunchError) as info:
        AgentProcess(weights="/nonexistent/weights.pt", metrics_port=None).start()
    msg = str(info.value)
    assert "exited with status 1" in msg and "/nonexistent/weights.pt" in msg


def test_cli_serve_writes_ready_file_and_exits_zero_on_sigint(tmp_path) -> None:
    ready = tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "harness.cli", "agent", "serve", "--port", "0", "--metrics-port", "-1",
           "--tier", "light", "--ready-file", str(ready), "--hpack-table-size", "0", "--max-connection-age-s", "30"]
    proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        doc = json.loads(line)
        assert doc == json.loads(ready.read_text())
        assert doc["event"] == "ready" and doc["tier"] == "light" and doc["grpc"].startswith("127.0.0.1:")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_reports_missing_cuda_in_one_line() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the no-CUDA error path cannot be shown")
    out = subprocess.run([sys.executable, "-m", "harness.cli", "agent", "serve", "--port", "0", "--device", "cuda",
                          "--metrics-port", "-1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "--device cuda: no CUDA device" in out.stderr and "Traceback" not in out.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return False


def test_agent_dies_with_a_killed_parent() -> None:
    code = ("from agent_under_test.launch import AgentProcess; import time; "
            "a = AgentProcess(tier='light', metrics_port=None).start(); print(a.pid, flush=True); time.sleep(120)")
    parent = spawn([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=None, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()  # SIGKILL: no __exit__ runs, only PDEATHSIG can stop the agent
        parent.wait(10)
        deadline = time.monotonic() + 20
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_grpc_options_for_capture_and_connection_age() -> None:
    from agent_under_test.config import ServeOptions

    opts = dict(ServeOptions(hpack_table_size=0, max_connection_age_s=30, grace_s=2).grpc_options())
    assert opts["grpc.http2.hpack_table_size.decoder"] == 0 and opts["grpc.http2.hpack_table_size.encoder"] == 0
    assert opts["grpc.max_connection_age_ms"] == 30000 and opts["grpc.max_connection_age_grace_ms"] == 2000
    assert opts["grpc.max_receive_message_length"] > ServeOptions().max_message_bytes  # we validate, not gRPC
    plain = dict(ServeOptions().grpc_options())
    assert "grpc.http2.hpack_table_size.decoder" not in plain and "grpc.max_connection_age_ms" not in plain
    gc = ServeOptions(limiter="gradient", p99_threshold_ms=15, metrics_port=None, tier="light").guard_config()
    assert (gc.limiter, gc.p99_threshold_ms, gc.metrics_port, gc.tier) == ("gradient", 15, None, "light")
