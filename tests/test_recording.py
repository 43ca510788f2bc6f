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


# -- method groups: calls of joined connections whose method is unknown ------------------------------

D = "/shadowtest.agent.v1.TradingAgent/Decide"


def _write_joined(path: Path) -> tuple[int, int]:
    """Two joined flows: groups hpack:5,4 (3 unary + 1 bidi) and hpack:1,4 on the first, hpack:5,4 on
    the second; a known method with a ref; a call in flight at the join (no ref)."""
    with RecordingWriter(path, meta={"host": "test", "stopped_wall_ns": 1}) as w:
        f1 = w.add_flow(Flow(src=("127.0.0.1", 40000), dst=("127.0.0.1", 50051), joined_midstream=True,
                             protocol="grpc"))
        f2 = w.add_flow(Flow(src=("127.0.0.1", 40001), dst=("127.0.0.1", 50051), joined_midstream=True,
                             protocol="grpc"))
        rows = [(f1, None, None, "unary"), (f1, None, "hpack:5,4", "unary"), (f1, None, "hpack:1,4", "unary"),
                (f1, None, "hpack:5,4", "bidi"), (f2, None, "hpack:5,4", "unary"), (f1, "/a.B/Known", "hpack:4", "unary"),
                (f1, None, "hpack:5,4", "unary"), (f1, None, "hpack:5,4", "unary")]
        for i, (fid, method, ref, kind) in enumerate(rows):
            ts = 1000 + i * 100
            w.add_call(Call(protocol="grpc", method=method, request_ts_ns=ts, flow_id=fid, kind=kind, status=0,
                            method_unknown=method is None, method_ref=ref,
                            requests=[Message("c2s", 0, ts, b"req%d" % i)],
                            responses=[Message("s2c", 0, ts + 10, b"resp%d" % i)]))
    return f1, f2


def test_method_ref_round_trips_and_groups_are_listed_in_order(tmp_path: Path) -> None:
    from capture.recording import MethodGroup

    path = tmp_path / "j.rec"
    f1, f2 = _write_joined(path)
    with Recording(path) as rec:
        assert [c.method_ref for c in rec.calls()] == [None, "hpack:5,4", "hpack:1,4", "hpack:5,4", "hpack:5,4",
                                                       "hpack:4", "hpack:5,4", "hpack:5,4"]
        assert all(c.method_how is None for c in rec.calls())
        assert rec.method_groups() == [
            MethodGroup(f1, "hpack:5,4", "grpc", 4, {"unary": 3, "bidi": 1}, None, None),
            MethodGroup(f1, "hpack:1,4", "grpc", 1, {"unary": 1}, None, None),
            MethodGroup(f2, "hpack:5,4", "grpc", 1, {"unary": 1}, None, None)]
        group = rec.group_calls(f1, "hpack:5,4")
        assert [c.requests[0].data for c in group] == [b"req1", b"req3", b"req6", b"req7"]
        assert [c.responses[0].data for c in group] == [b"resp1", b"resp3", b"resp6", b"resp7"]
        assert [c.request_ts_ns for c in rec.group_calls(f1, "hpack:5,4", limit=2)] == [1100, 1300]
        assert rec.group_calls(f2, "hpack:1,4") == []


def test_method_map_is_upserted_kept_private_and_applied_to_reads(tmp_path: Path) -> None:
    from capture.recording import set_group_methods

    path = tmp_path / "j.rec"
    f1, f2 = _write_joined(path)
    set_group_methods(path, [(f1, "hpack:5,4", "/a.B/Wrong", "--method-map")])
    set_group_methods(path, [(f1, "hpack:5,4", D, "descriptors: unique fit (unary, 3 requests parsed)"),
                             (f2, "hpack:5,4", D, "--method-map")])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with Recording(path) as rec:
        calls = list(rec.calls())
        assert [(c.method, c.method_unknown) for c in calls] == [
            (None, True), (D, True), (None, True), (D, True), (D, True), ("/a.B/Known", False), (D, True), (D, True)]
        assert calls[1].method_how == "descriptors: unique fit (unary, 3 requests parsed)"
        assert calls[4].method_how == "--method-map" and calls[5].method_how is None
        assert [(g.flow_id, g.ref, g.method, g.how) for g in rec.method_groups()] == [
            (f1, "hpack:5,4", D, "descriptors: unique fit (unary, 3 requests parsed)"),
            (f1, "hpack:1,4", None, None), (f2, "hpack:5,4", D, "--method-map")]
        assert {c.method for c in rec.group_calls(f1, "hpack:5,4")} == {D}
        # a reader's own overrides (replay --method-map): without a flow, that ref on every flow; they win
        rec.map_methods({(None, "hpack:1,4"): "/x.Y/Z", (f2, "hpack:5,4"): "/x.Y/Other"})
        assert [(g.ref, g.method, g.how) for g in rec.method_groups()][1:] == [
            ("hpack:1,4", "/x.Y/Z", "--method-map"), ("hpack:5,4", "/x.Y/Other", "--method-map")]
    # the calls table itself is never rewritten
    import sqlite3
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM calls WHERE method IS NULL").fetchone()[0] == 7
    with pytest.raises(ValueError, match="flow_id, ref, method, how"):
        set_group_methods(path, [(f1, "hpack:5,4", "", "x")])
    with pytest.raises(RecordingError, match="no such recording"):
        set_group_methods(tmp_path / "missing.rec", [(f1, "hpack:5,4", D, "x")])


def test_a_copy_keeps_the_map_and_its_calls_unmapped_in_the_table(tmp_path: Path) -> None:
    from capture.record import build_redactor
    from capture.recording import set_group_methods
    from capture.redact_file import redact_recording

    path, copy = tmp_path / "j.rec", tmp_path / "copy.rec"
    f1, _ = _write_joined(path)
    set_group_methods(path, [(f1, "hpack:5,4", D, "--method-map")])
    redact_recording(str(path), str(copy), build_redactor(True, []))
    with Recording(path) as a, Recording(copy) as b:
        assert [(c.method, c.method_ref, c.method_how) for c in a.calls()] == \
               [(c.method, c.method_ref, c.method_how) for c in b.calls()]
        assert [(g.ref, g.calls, g.method) for g in a.method_groups()] == [(g.ref, g.calls, g.method)
                                                                           for g in b.method_groups()]


_OLD_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE flows (id INTEGER PRIMARY KEY, src_addr TEXT NOT NULL, src_port INTEGER NOT NULL,
    dst_addr TEXT NOT NULL, dst_port INTEGER NOT NULL, pid INTEGER, comm TEXT, opened_ns INTEGER, closed_ns INTEGER,
    joined_midstream INTEGER NOT NULL DEFAULT 0, protocol TEXT NOT NULL DEFAULT 'tcp');
CREATE TABLE chunks (id INTEGER PRIMARY KEY, flow_id INTEGER NOT NULL REFERENCES flows(id),
    direction TEXT NOT NULL CHECK (direction IN ('c2s', 's2c')), ts_ns INTEGER NOT NULL, data BLOB NOT NULL);
CREATE TABLE calls (id INTEGER PRIMARY KEY, flow_id INTEGER REFERENCES flows(id), protocol TEXT NOT NULL,
    method TEXT, kind TEXT NOT NULL DEFAULT 'unary', stream_id INTEGER,
    request_metadata TEXT NOT NULL DEFAULT '[]', response_metadata TEXT NOT NULL DEFAULT '[]',
    status INTEGER, status_message TEXT, request_ts_ns INTEGER NOT NULL,
    response_ts_ns INTEGER, end_ts_ns INTEGER, method_unknown INTEGER NOT NULL DEFAULT 0);
CREATE TABLE messages (id INTEGER PRIMARY KEY, call_id INTEGER NOT NULL REFERENCES calls(id),
    direction TEXT NOT NULL CHECK (direction IN ('c2s', 's2c')), seq INTEGER NOT NULL,
    ts_ns INTEGER NOT NULL, data BLOB NOT NULL, compressed INTEGER NOT NULL DEFAULT 0);
INSERT INTO meta VALUES ('schema_version', '1'), ('stopped_wall_ns', '1');
INSERT INTO flows VALUES (1, '127.0.0.1', 40000, '127.0.0.1', 50051, NULL, NULL, 0, NULL, 1, 'grpc');
INSERT INTO calls(flow_id, protocol, method, request_ts_ns, method_unknown) VALUES (1, 'grpc', NULL, 10, 1);
INSERT INTO calls(flow_id, protocol, method, request_ts_ns) VALUES (1, 'grpc', '/a.B/C', 20);
"""


def test_a_file_from_before_method_groups_reads_and_gains_them_when_written(tmp_path: Path) -> None:
    import sqlite3

    from capture.recording import set_group_methods
    from capture.summary import summarize

    path = tmp_path / "old.rec"
    with sqlite3.connect(path) as db:
        db.executescript(_OLD_SCHEMA)
    with Recording(path) as rec:
        assert [(c.method, c.method_ref, c.method_how) for c in rec.calls()] == [(None, None, None),
                                                                                ("/a.B/C", None, None)]
        assert rec.method_groups() == [] and rec.group_calls(1, "hpack:1") == []
        report = summarize(rec)
        # no ref column: every unknown call counts (it cannot be told from one in flight at the join)
        assert report["method_groups"] == [] and report["unresolved_method_calls"] == 1
        assert report["complete"] is False and any("written before method groups" in p for p in report["problems"])
    set_group_methods(path, [(1, "hpack:1", D, "--method-map")])     # creates the map table
    with RecordingWriter(path, existing=True) as w:                   # adds calls.method_ref
        w.add_call(Call(protocol="grpc", method=None, request_ts_ns=30, flow_id=1, method_unknown=True,
                        method_ref="hpack:1"))
    with Recording(path) as rec:
        assert [(c.method, c.method_ref) for c in rec.calls()] == [(None, None), ("/a.B/C", None), (D, "hpack:1")]
        assert [(g.ref, g.calls, g.method) for g in rec.method_groups()] == [("hpack:1", 1, D)]


def test_inspect_says_unknown_methods_are_a_problem_until_every_group_is_named(tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from capture.recording import set_group_methods
    from harness.cli import cli

    path = tmp_path / "j.rec"
    f1, f2 = _write_joined(path)
    res = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    report = json.loads(res.stdout)
    assert res.exit_code == 1 and report["complete"] is False
    assert report["unresolved_method_calls"] == 6 and report["unknown_method_ungrouped"] == 1
    assert report["method_groups"][0] == {"flow": f1, "ref": "hpack:5,4", "protocol": "grpc", "calls": 4,
                                          "kinds": {"unary": 3, "bidi": 1}, "method": None, "how": None}
    (problem,) = [p for p in report["problems"] if "unknown method" in p]
    assert problem.startswith("6 call(s) in 3 method group(s)")
    assert f"shadowtest infer {path} --descriptors X.protoset" in problem and "--method-map FLOW:REF=METHOD" in problem
    plain = CliRunner().invoke(cli, ["inspect", str(path)])
    assert plain.exit_code == 1
    assert f"group flow {f1} hpack:5,4: 4 calls (unary 3, bidi 1) -> unknown" in plain.output
    assert "complete: false" in plain.output
    set_group_methods(path, [(f1, "hpack:5,4", D, "--method-map"), (f1, "hpack:1,4", D, "--method-map")])
    report = json.loads(CliRunner().invoke(cli, ["inspect", str(path), "--json"]).stdout)
    assert report["complete"] is False and report["problems"][0].startswith("1 call(s) in 1 method group(s)")
    set_group_methods(path, [(f2, "hpack:5,4", D, "descriptors: unique fit")])
    res = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    report = json.loads(res.stdout)
    assert res.exit_code == 0 and report["complete"] is True and report["problems"] == []
    assert report["methods"][D] == 6 and report["unresolved_method_calls"] == 0
    plain = CliRunner().invoke(cli, ["inspect", str(path)])
    assert f"group flow {f2} hpack:5,4: 1 calls (unary 1) -> {D} (descriptors: unique fit)" in plain.output


def _damage(path: Path, statement: str) -> None:
    import sqlite3
    db = sqlite3.connect(path)
    db.execute(statement)
    db.commit()
    db.close()


@pytest.mark.parametrize(("statement", "says"), [
    ("UPDATE calls SET request_metadata = '[[\"x-k\", ' WHERE request_ts_ns = 300",
     "request_metadata is not a JSON list of pairs"),
    ("UPDATE calls SET response_metadata = '{\"a\": 1}' WHERE request_ts_ns = 300", "response_metadata"),
    ("UPDATE calls SET request_ts_ns = 'yesterday' WHERE request_ts_ns = 300",
     "request_ts_ns is 'yesterday', not an integer"),
    ("UPDATE messages SET ts_ns = 'soon' WHERE seq = 0 AND direction = 's2c'", "row .* of messages"),
])
def test_a_damaged_row_is_a_corrupt_recording_error_naming_it(tmp_path: Path, statement: str, says: str) -> None:
    """A row without a checksum (a file from before them) whose value cannot be read: a one-line error."""
    path = tmp_path / "r.rec"
    _write_sample(path)
    _damage(path, statement)
    table = statement.split()[1]
    _damage(path, f"UPDATE {table} SET crc = NULL")
    with Recording(path) as rec, pytest.raises(CorruptRecordingError, match=says):
        list(rec.calls())


@pytest.mark.parametrize("statement", [
    "UPDATE calls SET request_metadata = '[[\"x-k\", ' WHERE request_ts_ns = 300",
    "UPDATE calls SET request_metadata = '[[\"x-k\", \"2\"]]' WHERE request_ts_ns = 300",   # plausible
    "UPDATE calls SET request_ts_ns = 'yesterday' WHERE request_ts_ns = 300",
    "UPDATE messages SET data = X'00' WHERE ts_ns = 310",
])
def test_a_row_failing_its_checksum_is_left_out_and_said(tmp_path: Path, statement: str) -> None:
    """Rows carry a CRC: a changed value, plausible or not, is left out (never read as recorded) and the
    reader's problems say how many calls it lost."""
    path = tmp_path / "r.rec"
    _write_sample(path)
    with Recording(path) as rec:
        whole = len(list(rec.calls()))
    _damage(path, statement)
    with Recording(path) as rec:
        assert len(list(rec.calls())) == whole - 1
        assert any("1 call(s) left out" in p and "checksum" in p for p in rec.problems), rec.problems


def test_bad_meta_json_is_a_corrupt_recording_error_and_leaves_no_side_files(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    _write_sample(path)
    _damage(path, "UPDATE meta SET value = '{not json' WHERE key = 'host'")
    with pytest.raises(CorruptRecordingError, match="a meta value is not JSON"):
        Recording(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.rec"]


def test_bad_chunk_timestamp_is_a_corrupt_recording_error(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    _write_sample(path)
    _damage(path, "UPDATE chunks SET ts_ns = 'x' WHERE data = X'776f726c64'")
    with Recording(path) as rec:                       # with its checksum: left out, and said
        assert len(list(rec.chunks())) == rec.count("chunks") - 1
        assert any("1 chunk(s) left out" in p for p in rec.problems), rec.problems
    _damage(path, "UPDATE chunks SET crc = NULL")      # as in a file from before checksums
    with Recording(path) as rec, pytest.raises(CorruptRecordingError, match="of chunks is unreadable"):
        list(rec.chunks())


def test_the_writer_s_fast_row_crcs_equal_the_checker_s() -> None:
    """The writer computes row CRCs in batches without conversions (its values are ints, strs and
    None); the integrity check and readers use the general functions: both must give the same number,
    or every row written would read as damaged."""
    import random

    from capture.rowcrc import (
        call_crc,
        chunk_crc,
        message_crc,
        with_call_crcs,
        with_chunk_crcs,
        with_message_crcs,
    )

    rng = random.Random(9)
    chunks, messages, calls = [], [], []
    for _ in range(300):
        data = rng.randbytes(rng.randint(0, 300))
        flow, ts, seq = rng.randint(1, 1 << 40), rng.randint(0, 1 << 62), rng.randint(0, 9)
        direction = rng.choice(["c2s", "s2c"])
        chunks.append((flow, direction, ts, data))
        messages.append((flow, direction, seq, ts, data, seq % 2))
        calls.append((flow, *(rng.choice([None, rng.randint(-5, 1 << 50), "GET /a?x=é", "[[\"k\", \"v\"]]",
                                           "\udcff", ""]) for _ in range(14))))
    assert [r[-1] for r in with_chunk_crcs(chunks)] == [chunk_crc(*r) for r in chunks]
    assert [r[-1] for r in with_message_crcs(messages)] == [message_crc(*r) for r in messages]
    assert [r[-1] for r in with_call_crcs(calls)] == [call_crc(*r[1:]) for r in calls]
    assert [r[:-1] for r in with_call_crcs(calls)] == calls


def test_writes_from_two_threads_store_each_row_once(tmp_path: Path) -> None:
    # The recorder's decode thread adds calls while another thread sets meta (the recorder does so once
    # its backend is up, after the TLS program loaded): each commit then ran twice at once, and a batch
    # of up to half a second of messages was stored twice, each call given another's answer as well.
    import threading

    w = RecordingWriter(tmp_path / "r.rec", flush_interval_s=0.0)
    fid = w.add_flow(Flow(src=("127.0.0.1", 1), dst=("127.0.0.1", 2), pid=1, comm="t", opened_ns=1))
    stop = threading.Event()

    def meta() -> None:
        i = 0
        while not stop.is_set():
            w.set_meta({"backend_settings": {"n": i}})
            i += 1

    other = threading.Thread(target=meta)
    other.start()
    try:
        for i in range(2000):
            w.add_call(Call(flow_id=fid, protocol="http1", method="GET /x", request_ts_ns=i,
                            requests=[Message("c2s", 0, i, b"q" * 64)], responses=[Message("s2c", 0, i, b"a" * 64)]))
            w.add_chunk_data(fid, "c2s", i, b"x")
    finally:
        stop.set()
        other.join(10)
    w.close()
    with Recording(tmp_path / "r.rec") as r:
        calls = list(r.calls())
        chunks = list(r.chunks(fid))
    assert len(calls) == 2000 and len(chunks) == 2000
    per_call = [(len(c.requests), len(c.responses)) for c in calls]
    assert per_call == [(1, 1)] * 2000, [p for p in per_call if p != (1, 1)][:5]
