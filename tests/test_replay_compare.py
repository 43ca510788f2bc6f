"""Response comparison against recorded responses: reflection, field paths, ignores, status, bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.compare import CompareSpec, field_diff
from replay.engine import ReplayRun
from replay.errors import CompareError
from replay.options import ReplayOptions
from replay.testing import DECIDE, EchoServer, write_unary_recording

MS = 1_000_000


def _replay(path: Path, server: EchoServer, spec: CompareSpec) -> dict:
    rep = ReplayRun(path, server.address, ReplayOptions(compare=spec)).run()
    assert rep.invariant_ok
    return rep.mismatches


def test_fields_by_reflection_with_and_without_ignores(tmp_path: Path) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 2 * MS for i in range(20)])
    with EchoServer(reflection=True) as server:
        noisy = _replay(tmp_path / "r.rec", server, CompareSpec("reflection"))
        quiet = _replay(tmp_path / "r.rec", server, CompareSpec("reflection", ignore=["server_latency_ns"]))
    # the echo server answers a random server_latency_ns; everything else matches the recording
    assert noisy["by_method"][DECIDE] == {"compared": n, "mismatched": n, "fields": {"server_latency_ns": n},
                                          "not_comparable": 0, "why": {}}
    assert quiet["total"] == 0 and quiet["by_method"][DECIDE]["compared"] == n


def test_a_damaged_recorded_call_is_not_comparable_never_a_match(tmp_path: Path) -> None:
    """A call the recording holds damaged (open during a gap, its response lost) or without a status is
    counted apart, with why: not compared, so never counted as a match."""
    import sqlite3
    n = write_unary_recording(tmp_path / "r.rec", [i * 2 * MS for i in range(10)])
    db = sqlite3.connect(tmp_path / "r.rec")
    db.execute("UPDATE calls SET status_message = 'damaged: bytes lost in a gap (s2c)' WHERE id = 3")
    db.execute("DELETE FROM messages WHERE call_id = 3 AND direction = 's2c'")   # its response was lost
    db.execute("UPDATE calls SET status = NULL WHERE id = 6")
    # these edits stand for what the decoder writes for such calls, not for bytes damaged on disk:
    # without their checksums the reader takes the rows as written
    db.execute("UPDATE calls SET crc = NULL WHERE id IN (3, 6)")
    db.commit()
    db.close()
    with EchoServer(reflection=True) as server:
        got = _replay(tmp_path / "r.rec", server, CompareSpec("reflection", ignore=["server_latency_ns"]))
    entry = got["by_method"][DECIDE]
    assert (entry["compared"], entry["mismatched"], entry["not_comparable"]) == (n - 2, 0, 2)
    assert entry["why"] == {"damaged: bytes lost in a gap (s2c)": 1, "no status recorded": 1}
    assert got["not_comparable"] == 2 and got["total"] == 0


def test_status_and_bytes_only(tmp_path: Path) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 2 * MS for i in range(20)])
    with EchoServer(reject_every=5) as server:
        summary = _replay(tmp_path / "r.rec", server, CompareSpec("bytes"))
    fields = summary["by_method"][DECIDE]["fields"]
    assert fields == {"status": n // 5, "bytes": n - n // 5}


def test_reflection_missing_is_a_clear_error(tmp_path: Path) -> None:
    write_unary_recording(tmp_path / "r.rec", [0])
    with EchoServer() as server, pytest.raises(CompareError, match="reflection"):
        ReplayRun(tmp_path / "r.rec", server.address, ReplayOptions(compare=CompareSpec("reflection"))).run()


def test_field_diff_recurses_and_indexes_repeated() -> None:
    from agent_under_test.proto import agent_pb2
    a = agent_pb2.Decision(sequence_id=1, stages=[agent_pb2.StageTiming(stage="parse", ns=1)])
    b = agent_pb2.Decision(sequence_id=2, stages=[agent_pb2.StageTiming(stage="parse", ns=5),
                                                  agent_pb2.StageTiming(stage="risk", ns=1)])
    assert field_diff(a, b) == ["sequence_id", "stages[len]", "stages[0].ns"]
