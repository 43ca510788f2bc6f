"""A recording replayed against the reference agent (a real subprocess) accounts for every call."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from capture.recording import Call, Flow, Message, RecordingWriter
from replay.compare import CompareSpec
from replay.engine import ReplayRun
from replay.options import ReplayOptions
from replay.testing import DECIDE, DECIDE_STREAM, snapshot_bytes

MS = 1_000_000
BASE = 10_000_000_000


def _agent_recording(path: Path, n: int) -> int:
    """n unary Decide calls over 3 connections plus one DecideStream of 5 messages."""
    rng = random.Random(5)
    with RecordingWriter(path) as w:
        fids = [w.add_flow(Flow(("127.0.0.1", 41000 + i), ("127.0.0.1", 50051), protocol="grpc")) for i in range(3)]
        t = 0
        for i in range(n):
            t += int(rng.expovariate(1 / (8 * MS)))
            w.add_call(Call(protocol="grpc", method=DECIDE, request_ts_ns=BASE + t, flow_id=fids[i % 3], status=0,
                            requests=[Message("c2s", 0, BASE + t, snapshot_bytes(i, "ACME"))]))
        w.add_call(Call(protocol="grpc", method=DECIDE_STREAM, kind="bidi", request_ts_ns=BASE + 10 * MS,
                        flow_id=fids[0], status=0,
                        requests=[Message("c2s", k, BASE + (10 + 30 * k) * MS, snapshot_bytes(1000 + k))
                                  for k in range(5)]))
    return n + 1


@pytest.mark.slow
def test_replay_against_the_reference_agent_accounts_for_every_call(tmp_path: Path) -> None:
    from agent_under_test.launch import AgentProcess

    n = _agent_recording(tmp_path / "a.rec", 120)
    with AgentProcess(tier="light", device="cpu", metrics_port=-1) as agent:
        rep = ReplayRun(tmp_path / "a.rec", agent.grpc_address,
                        ReplayOptions(compare=CompareSpec("reflection"))).run()
    assert rep.scheduled == n and rep.invariant_ok
    assert rep.ok + rep.rejected == n, rep  # the agent answers or sheds; nothing is lost or errors
    # the recorded status (0) is compared for every call; only shed calls may differ
    assert rep.mismatches["by_method"][DECIDE]["compared"] == n - 1
    assert rep.mismatches["total"] == rep.rejected
