"""The recording file: round trip, permissions, streaming order, crash safety, corruption."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from capture.errors import CorruptRecordingError, RecordingError
from capture.recording import Call, Chunk, Flow, Message, Recording, RecordingWriter


def _write_sample(path: Path) -> None:
    with RecordingWriter(path, meta={"host": "test"}) as w:
        fid = w.add_flow(Flow(src=("127.0.0.1", 40000), dst=("127.0.0.1", 50051), pid=7, comm="agent"))
        w.add_chunk(Chunk(fid, "c2s", 100, b"hello"))
        w.add_chunk(Chunk(fid, "s2c", 150, b"world"))
        for i, ts in enumerate((300, 200)):
            w.add_call(Call(protocol="grpc", method="/a.B/C", request_ts_ns=ts, flow_id=fid,
                            request_metadata=[("x-k", str(i))], status=0,
                            requests=[Message("c2s", 0, ts, b"req%d" % i)],
                            responses=[Message("s2c", 0, ts + 10, b"resp%d" % i)]))
        w.update_flow(fid, closed_ns=999, protocol="grpc")


def test_round_trip_in_time_order(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    _write_sample(path)
    with Recording(path) as rec:
        assert rec.meta["host"] == "test" and rec.meta["schema_version"] == 1
        calls = list(rec.calls())
        assert [c.request_ts_ns for c in calls] == [200, 300]
        assert calls[0].requests[0].data == b"req1" and calls[0].responses[0].data == b"resp1"
        assert calls[0].request_metadata == [("x-k", "1")]
        (flow,) = list(rec.flows())
        assert flow.closed_ns == 999 and flow.protocol == "grpc" and flow.src == ("127.0.0.1", 40000)
        assert [c.data for c in rec.chunks()] == [b"hello", b"world"]
        assert rec.time_range_ns() == (200, 300)


def test_created_private_and_never_clobbered(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    _write_sample(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(RecordingError, match="already exists"):
        RecordingWriter(path)


def test_not_a_recording_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "junk.rec"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(CorruptRecordingError, match="not a readable recording"):
        Recording(path)
    with pytest.raises(RecordingError, match="no such recording"):
        Recording(tmp_path / "missing.rec")


def test_sigkill_leaves_a_readable_file(tmp_path: Path) -> None:
    path = tmp_path / "k.rec"
    script = textwrap.dedent(f"""
        import os, signal, time
        from capture.recording import Call, RecordingWriter
        w = RecordingWriter({str(path)!r}, flush_interval_s=0.2)
        for i in range(50):
            w.add_call(Call(protocol="grpc", method="/a.B/C", request_ts_ns=i))
            time.sleep(0.01)
        time.sleep(0.3)
        w.add_call(Call(protocol="grpc", method="/a.B/C", request_ts_ns=1000))  # triggers a commit
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1])
    assert proc.returncode == -9
    with Recording(path) as rec:
        assert rec.count("calls") == 51



def test_summary_reports_accepted_connections_whose_client_end_is_unknown(tmp_path: Path) -> None:
    from capture.summary import summarize

    path = tmp_path / "peers.rec"
    with RecordingWriter(path, meta={"host": "test", "accepted_peer_unknown": 2}):
        pass
    with Recording(path) as rec:
        problems = summarize(rec)["problems"]
    assert any(p.startswith("2 accepted connection(s) kept with client 0.0.0.0:0") for p in problems)
    clean = tmp_path / "clean.rec"
    with RecordingWriter(clean, meta={"host": "test"}):
        pass
    with Recording(clean) as rec:
        assert not any("0.0.0.0:0" in p for p in summarize(rec)["problems"])
