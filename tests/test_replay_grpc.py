"""Replay against real gRPC servers on loopback: accounting, rejection, death, streams, truncation.

The tests that exercise the sender run with both: `grpc` (grpcio) and `h2` (the lean sender, what
`--sender auto` picks for gRPC)."""

from __future__ import annotations

import random
import shutil
import threading
import time
from pathlib import Path

import pytest

from replay.engine import ReplayRun
from replay.options import ReplayOptions
from replay.schedule import ScheduleOptions
from replay.testing import DECIDE_STREAM, EchoServer, write_stream_recording, write_unary_recording

MS = 1_000_000
SENDERS = pytest.mark.parametrize("sender", ["grpc", "h2"])


@SENDERS
def test_every_call_accounted_and_received_once(tmp_path: Path, sender: str) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 5 * MS for i in range(60)], flows=3)
    with EchoServer(reject_every=7) as server:
        rep = ReplayRun(tmp_path / "r.rec", server.address, ReplayOptions(sender=sender)).run()
    seqs = sorted(s for _, _, s in server.received)
    assert seqs == list(range(n))
    assert rep.scheduled == n and rep.invariant_ok
    assert rep.rejected == n // 7 and rep.ok == n - n // 7 and rep.sent == n
    # recorded metadata is replayed minus hop-by-hop and redacted keys
    assert sorted(int(md["x-replay-test"]) for md in server.metadata) == list(range(n))
    assert not any("authorization" in md for md in server.metadata)
    assert len(server.peers) == 3  # one TCP connection per recorded connection


@SENDERS
def test_target_dying_mid_run_becomes_counted_errors_and_ends_on_time(tmp_path: Path, sender: str) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 10 * MS for i in range(100)])  # 1 s of traffic
    server = EchoServer().__enter__()
    threading.Timer(0.4, server.kill).start()
    started = time.monotonic()
    try:
        rep = ReplayRun(tmp_path / "r.rec", server.address, ReplayOptions(sender=sender, timeout_s=1.0)).run()
    finally:
        server.__exit__()
    elapsed = time.monotonic() - started
    assert rep.invariant_ok and rep.scheduled == n
    assert rep.ok >= 10 and rep.error_count + rep.timeouts >= 30
    if sender == "h2":  # it reports the lost connection as UNAVAILABLE itself
        assert rep.errors.get("UNAVAILABLE", 0) >= 30
    assert set(rep.errors) <= {"UNAVAILABLE", "CANCELLED", "UNKNOWN"}
    assert elapsed < 1.0 + 3.0  # tolerance: schedule 1 s + per-call timeout 1 s + 1 s slack for a noisy host


@SENDERS
def test_stream_messages_arrive_in_order_at_their_offsets(tmp_path: Path, sender: str) -> None:
    offsets = [0, 100 * MS, 150 * MS, 400 * MS]
    write_stream_recording(tmp_path / "s.rec", offsets)
    with EchoServer() as server:
        rep = ReplayRun(tmp_path / "s.rec", server.address, ReplayOptions(sender=sender)).run()
    assert rep.ok == 1 and rep.invariant_ok
    assert [(m, s) for _, m, s in server.received] == [("DecideStream", i) for i in range(4)]
    t0 = server.received[0][0]
    for (t, _, _), want in zip(server.received, offsets, strict=True):
        assert abs((t - t0) - want) < 50 * MS  # tolerance 50 ms: a shared, noisy 2-core host
    assert DECIDE_STREAM.endswith("DecideStream")


@SENDERS
def test_slow_target_turns_into_timeouts_not_a_slower_schedule(tmp_path: Path, sender: str) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 20 * MS for i in range(10)])
    with EchoServer(delay_s=0.5) as server:
        rep = ReplayRun(tmp_path / "r.rec", server.address, ReplayOptions(sender=sender, timeout_s=0.1)).run()
        arrivals = [t for t, _, _ in server.received]
    assert rep.timeouts == n and rep.invariant_ok
    # open loop: the 10 sends span ~180 ms even though each call takes 500 ms
    assert (arrivals[-1] - arrivals[0]) / MS < 180 + 150  # tolerance 150 ms


def test_damaged_recording_replays_what_it_holds_and_says_so(tmp_path: Path) -> None:
    write_unary_recording(tmp_path / "full.rec", [i * MS for i in range(400)])
    cut = tmp_path / "cut.rec"
    shutil.copy(tmp_path / "full.rec", cut)
    size = cut.stat().st_size
    start = int(size * 0.9) // 4096 * 4096
    with open(cut, "r+b") as f:  # the tail of the file overwritten (a disk error, a cut-off copy)
        f.seek(start)
        f.write(random.Random(1).randbytes(size - start))
    with EchoServer() as server:
        rep = ReplayRun(cut, server.address).run()
    assert rep.problems and "damaged" in rep.problems[0]
    assert 0 < rep.sent < 400 and rep.ok == rep.sent and rep.invariant_ok
    assert rep.not_sent == rep.not_sent_reasons.get("no_request_in_recording", 0)
    assert len(server.received) == rep.sent


def test_client_and_server_streaming_kinds(tmp_path: Path) -> None:
    from capture.recording import Call, Flow, Message, RecordingWriter
    from replay.compare import CompareSpec
    from replay.testing import SERVICE, snapshot_bytes

    base = 10_000_000_000
    with RecordingWriter(tmp_path / "k.rec") as w:
        fid = w.add_flow(Flow(("127.0.0.1", 41001), ("127.0.0.1", 50051), protocol="grpc"))
        w.add_call(Call(protocol="grpc", method=f"/{SERVICE}/Collect", kind="client_stream", request_ts_ns=base,
                        flow_id=fid, status=0, requests=[Message("c2s", i, base + i * 20 * MS, snapshot_bytes(i))
                                                         for i in range(3)],
                        responses=[Message("s2c", 0, base + 70 * MS, b"3")]))
        w.add_call(Call(protocol="grpc", method=f"/{SERVICE}/Fanout", kind="server_stream",
                        request_ts_ns=base + 10 * MS, flow_id=fid, status=0,
                        requests=[Message("c2s", 0, base + 10 * MS, snapshot_bytes(7))]))
    with EchoServer() as server:
        rep = ReplayRun(tmp_path / "k.rec", server.address, ReplayOptions(compare=CompareSpec("bytes"))).run()
    assert rep.ok == 2 and rep.invariant_ok and rep.mismatches["total"] == 0
    assert sorted((m, s) for _, m, s in server.received) == [("Collect", 0), ("Collect", 1), ("Collect", 2),
                                                             ("Fanout", 7)]


def test_recording_cut_off_by_a_killed_recorder_replays_and_says_so(tmp_path: Path) -> None:
    """The recorder SIGKILLed mid-run: the file opens (WAL), the last calls have no outcome."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "killed.rec"
    script = textwrap.dedent(f"""
        import os, signal, time
        from capture.recording import Call, Message, RecordingWriter
        from replay.testing import DECIDE, snapshot_bytes
        w = RecordingWriter({str(path)!r}, flush_interval_s=0.05)
        for i in range(40):
            ts = 10_000_000_000 + i * 2_000_000
            done = i < 30  # the last ten calls were still open when the recorder died
            w.add_call(Call(protocol="grpc", method=DECIDE, request_ts_ns=ts, status=0 if done else None,
                            requests=[Message("c2s", 0, ts, snapshot_bytes(i))]))
        time.sleep(0.1)
        w.add_call(Call(protocol="grpc", method=DECIDE, request_ts_ns=20_000_000_000, status=None,
                        requests=[Message("c2s", 0, 20_000_000_000, snapshot_bytes(40))]))  # commits
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1])
    assert proc.returncode == -signal.SIGKILL and os.path.exists(path)
    with EchoServer() as server:
        rep = ReplayRun(path, server.address, ReplayOptions(schedule=ScheduleOptions(window=(0, 1)))).run()
    assert rep.ok == rep.scheduled == 40 and rep.invariant_ok and len(server.received) == 40
    assert any("10 calls were recorded without their outcome" in p for p in rep.problems)
