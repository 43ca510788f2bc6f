"""The proxy (unprivileged) and pcap (root) backends against a real gRPC server; inspect; damage."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from agent_under_test.proto import agent_pb2
from capture.backends import RecordOptions
from capture.errors import CaptureError
from capture.record import Recorder
from capture.recording import Recording
from harness.cli import cli
from wire.process import spawn

DECIDE = "/shadowtest.agent.v1.TradingAgent/Decide"
STREAM = "/shadowtest.agent.v1.TradingAgent/DecideStream"


def _decide(req: bytes, ctx: grpc.ServicerContext) -> bytes:
    snap = agent_pb2.MarketSnapshot.FromString(req)
    if snap.symbol == "BAD":
        ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "symbol: BAD is not tradable")
    return agent_pb2.Decision(sequence_id=snap.sequence_id, symbol=snap.symbol).SerializeToString()


def _stream(reqs: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
    for r in reqs:
        yield _decide(r, ctx)


@pytest.fixture
def server() -> Iterator[int]:
    """A real TradingAgent-shaped gRPC server on 127.0.0.1, port 0."""
    srv = grpc.server(futures.ThreadPoolExecutor(4))
    handler = grpc.method_handlers_generic_handler("shadowtest.agent.v1.TradingAgent", {
        "Decide": grpc.unary_unary_rpc_method_handler(_decide),
        "DecideStream": grpc.stream_stream_rpc_method_handler(_stream)})
    srv.add_generic_rpc_handlers((handler,))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield port
    srv.stop(0)


def _traffic(port: int, n: int = 20) -> list[bytes]:
    """n unary calls (one rejected), one stream of 3, with auth metadata. Returns request bytes."""
    sent = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        decide, stream = ch.unary_unary(DECIDE), ch.stream_stream(STREAM)
        for i in range(n):
            req = agent_pb2.MarketSnapshot(sequence_id=i, symbol="BAD" if i == 5 else "AAPL").SerializeToString()
            sent.append(req)
            try:
                decide(req, timeout=5, metadata=[("authorization", "Bearer top-secret")])
            except grpc.RpcError:
                pass
        reqs = [agent_pb2.MarketSnapshot(sequence_id=100 + i, symbol="MSFT").SerializeToString() for i in range(3)]
        sent += reqs
        assert len(list(stream(iter(reqs), timeout=5))) == 3
    return sent


def test_proxy_backend_records_calls_in_the_request_path(server: int, tmp_path: Path) -> None:
    out = tmp_path / "proxy.rec"
    with Recorder(RecordOptions(output=str(out), backend="proxy", port=server)) as rec:
        host, port = rec.backend.address  # type: ignore[attr-defined]
        sent = _traffic(port)
    assert rec.result["flows"] == 1 and rec.result["calls"] == 21
    with Recording(out) as r:
        calls = list(r.calls())
        assert r.meta["backend_settings"]["in_request_path"] is True
    assert [m.data for c in calls for m in c.requests] == sent
    bad = [c for c in calls if c.status == 3]
    assert len(bad) == 1 and bad[0].status_message == "symbol: BAD is not tradable"
    stream = [c for c in calls if c.method == STREAM]
    assert stream[0].kind == "bidi" and len(stream[0].responses) == 3
    assert all(dict(c.request_metadata).get("authorization") == "<redacted>" for c in calls if c.method == DECIDE)


def test_inspect_json_has_the_documented_keys(server: int, tmp_path: Path) -> None:
    out = tmp_path / "proxy.rec"
    with Recorder(RecordOptions(output=str(out), backend="proxy", port=server)) as rec:
        _traffic(rec.backend.address[1])  # type: ignore[attr-defined]
    res = CliRunner().invoke(cli, ["inspect", str(out), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["flows"] == 1 and report["calls"] == 21
    assert report["methods"] == {DECIDE: 20, STREAM: 1}
    assert report["lost_events"] == 0 and report["truncated_events"] == 0 and report["unknown_method_calls"] == 0
    assert report["duration_s"] > 0 and report["statuses"] == {"0": 20, "3": 1}
    plain = CliRunner().invoke(cli, ["inspect", str(out)])
    assert plain.exit_code == 0 and f"method {DECIDE}: 20" in plain.output and "rate:" in plain.output


@pytest.mark.root
def test_pcap_backend_captures_live_from_loopback(server: int, tmp_path: Path) -> None:
    out = tmp_path / "pcap.rec"
    with Recorder(RecordOptions(output=str(out), backend="pcap", port=server, interface="lo")) as rec:
        sent = _traffic(server)
        import time
        time.sleep(0.3)
    assert rec.result["calls"] == 21 and rec.result["flows"] == 1
    with Recording(out) as r:
        assert [m.data for c in r.calls() for m in c.requests] == sent


def test_unknown_backend_and_missing_output_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match="expected one of: ebpf, pcap, proxy"):
        Recorder(RecordOptions(output=str(tmp_path / "x.rec"), backend="netflow"))
    res = CliRunner().invoke(cli, ["record", "--port", "1"])
    assert res.exit_code == 2 and "-o/--output" in res.output
    res = CliRunner().invoke(cli, ["record", "--port", "50051", "--print-bpf", "--max-bytes", "65536"])
    assert res.exit_code == 0 and "#define FILTER_PORT 50051" in res.output and "#define CHUNK 65536" in res.output


def test_corrupt_recording_is_salvaged_and_reported(server: int, tmp_path: Path) -> None:
    out = tmp_path / "proxy.rec"
    with Recorder(RecordOptions(output=str(out), backend="proxy", port=server)) as rec:
        _traffic(rec.backend.address[1])  # type: ignore[attr-defined]
    # damage the messages table's pages: calls stay readable, the damage is reported, exit 1
    db = sqlite3.connect(out)
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name='messages'").fetchone()[0]
    page = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    with open(out, "r+b") as f:
        f.seek((root - 1) * page)
        f.write(b"\xff" * page)
    res = CliRunner().invoke(cli, ["inspect", str(out), "--json"])
    assert res.exit_code == 1
    report = json.loads(res.output)
    # a call whose messages may be on the damaged pages is left out (never used half), and counted
    assert report["calls"] == 0 and "21 call(s) left out: their messages are on damaged pages" in report["problems"]
    (tmp_path / "junk.rec").write_bytes(b"not a database" * 100)
    res = CliRunner().invoke(cli, ["inspect", str(tmp_path / "junk.rec")])
    assert res.exit_code == 1 and "not a readable recording" in " ".join(res.output.split())


def test_truncated_recording_is_salvaged_up_to_the_cut(server: int, tmp_path: Path) -> None:
    out = tmp_path / "proxy.rec"
    with Recorder(RecordOptions(output=str(out), backend="proxy", port=server)) as rec:
        _traffic(rec.backend.address[1], n=300)  # type: ignore[attr-defined]
    data = out.read_bytes()
    cut = tmp_path / "cut.rec"
    cut.write_bytes(data[:len(data) * 6 // 10])     # a copy interrupted at 60 %
    res = CliRunner().invoke(cli, ["inspect", str(cut), "--json"])
    assert res.exit_code == 1
    report = json.loads(res.output)
    assert report["problems"][0].startswith("cut off:")
    # what is read is whole: calls whose messages lay past the cut are left out, and counted
    assert report["calls"] < 301 and report["flows"] == 1
    assert any(p.endswith("call(s) left out: their messages are on damaged pages") for p in report["problems"])
    # export refuses it (one line naming --salvage, nothing written); with --salvage it writes the
    # same intact part and says what it lost
    pcap = tmp_path / "cut.pcapng"
    res = CliRunner().invoke(cli, ["export", str(cut), "-o", str(pcap)])
    assert res.exit_code == 1 and "--salvage" in res.output and not pcap.exists()
    res = CliRunner().invoke(cli, ["export", str(cut), "-o", str(pcap), "--salvage"])
    assert res.exit_code == 0 and "lost to damage" in res.output and pcap.stat().st_size > 0


def _call_view(path: Path) -> list[tuple[object, ...]]:
    with Recording(path) as r:
        # grpc-timeout is the time left when the client sent the call: it differs between runs
        return sorted((c.method, c.kind, c.status, c.status_message,
                       tuple(kv for kv in c.request_metadata if kv[0] != "grpc-timeout"),
                       tuple(m.data for m in c.requests), tuple(m.data for m in c.responses)) for c in r.calls())


def _chunk_bytes(path: Path) -> bytes:
    with Recording(path) as r:
        return b"".join(c.data for c in r.chunks())


def test_decode_at_stop_stores_the_same_calls_as_live_and_no_secret(server: int, tmp_path: Path) -> None:
    views = {}
    for mode in ("live", "at-stop"):
        out = tmp_path / f"{mode}.rec"
        with Recorder(RecordOptions(output=str(out), backend="proxy", port=server, decode=mode)) as rec:
            sent = _traffic(rec.backend.address[1])  # type: ignore[attr-defined]
        assert rec.result["calls"] == 21 and rec.result["decode"] == mode
        views[mode] = _call_view(out)
        assert b"top-secret" not in _chunk_bytes(out)          # chunks are masked as they are stored
        with Recording(out) as r:
            assert [m.data for c in r.calls() for m in c.requests] == sent
            assert r.meta.get("calls_decoded") is (True if mode == "at-stop" else None)
    assert views["live"] == views["at-stop"]
    assert all(dict(v[4]).get("authorization") == "<redacted>" for v in views["at-stop"] if v[0] == DECIDE)


def test_killed_at_stop_recorder_leaves_masked_chunks_that_finish_decodes(server: int, tmp_path: Path) -> None:
    out = tmp_path / "kill.rec"
    script = textwrap.dedent(f"""
        import os, signal, time
        import grpc
        from capture.backends import RecordOptions
        from capture.record import Recorder
        rec = Recorder(RecordOptions(output={str(out)!r}, backend="proxy", port={server},
                                     decode="at-stop")).start()
        with grpc.insecure_channel("127.0.0.1:%d" % rec.backend.address[1]) as ch:
            for i in range(5):
                ch.unary_unary({DECIDE!r})(b"", timeout=5, metadata=[("authorization", "Bearer top-secret")])
        time.sleep(1.0)                    # committed: the ticker runs every 0.25 s
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1], timeout=60)
    assert proc.returncode == -9
    with Recording(out) as r:
        assert r.count("calls") == 0 and r.count("chunks") > 0 and r.meta["decode"] == "at-stop"
    assert b"top-secret" not in _chunk_bytes(out)              # safe on disk even though it never stopped
    res = CliRunner().invoke(cli, ["inspect", str(out), "--json"])
    assert "record --finish" in " ".join(json.loads(res.output)["problems"])
    db = sqlite3.connect(out)                                    # as if a decode at stop had been killed
    db.execute("INSERT INTO calls(protocol, request_ts_ns) VALUES ('grpc', 1)")
    db.commit()
    db.close()
    res = CliRunner().invoke(cli, ["record", "--finish", "-o", str(out)])
    assert res.exit_code == 0 and "decoded 5 calls" in res.output
    with Recording(out) as r:
        calls = list(r.calls())
    assert len(calls) == 5 and all(dict(c.request_metadata)["authorization"] == "<redacted>" for c in calls)
    res = CliRunner().invoke(cli, ["record", "--finish", "-o", str(out)])
    assert res.exit_code != 0 and "nothing to finish" in res.output


def test_decode_later_stores_masked_chunks_only_and_finish_gives_the_live_calls(server: int, tmp_path: Path) -> None:
    live, later = tmp_path / "live.rec", tmp_path / "later.rec"
    sent = {}
    for mode, out in (("live", live), ("later", later)):
        with Recorder(RecordOptions(output=str(out), backend="proxy", port=server, decode=mode)) as rec:
            sent[mode] = _traffic(rec.backend.address[1])  # type: ignore[attr-defined]
    assert rec.result["calls"] == 0 and rec.result["calls_decoded"] is False
    assert rec.result["finish"] == f"shadowtest record --finish -o {later}"
    with Recording(later) as r:                                  # stop decoded nothing
        assert r.count("calls") == 0 and r.count("chunks") > 0 and r.meta["calls_decoded"] is False
        assert r.meta["decode"] == "later" and "stopped_wall_ns" in r.meta and r.meta["lost_events"] == 0
    assert b"top-secret" not in _chunk_bytes(later) and (later.stat().st_mode & 0o777) == 0o600
    res = CliRunner().invoke(cli, ["inspect", str(later), "--json"])
    report = json.loads(res.output)
    assert res.exit_code == 1 and report["calls_pending"] and report["calls"] == 0
    assert f"shadowtest record --finish -o {later}" in " ".join(report["problems"])
    res = CliRunner().invoke(cli, ["record", "--finish", "-o", str(later), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["calls"] == 21
    assert _call_view(later) == _call_view(live)
    with Recording(later) as r:
        assert [m.data for c in r.calls() for m in c.requests] == sent["later"]
        assert r.meta["decode"] == "later" and r.meta["calls_decoded"] is True
    res = CliRunner().invoke(cli, ["inspect", str(later), "--json"])
    assert res.exit_code == 0 and not json.loads(res.output)["calls_pending"]
    res = CliRunner().invoke(cli, ["record", "--finish", "-o", str(later)])  # idempotent: refused, file unchanged
    assert res.exit_code == 1 and "nothing to finish" in res.output
    assert _call_view(later) == _call_view(live)


def test_record_cli_decode_later_tells_the_user_how_to_finish(server: int, tmp_path: Path) -> None:
    out = tmp_path / "cli.rec"
    args = ["record", "--backend", "proxy", "--port", str(server), "--duration", "0.3", "--decode", "later", "-o"]
    res = CliRunner().invoke(cli, [*args, str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["finish"] == f"shadowtest record --finish -o {out}"
    res = CliRunner().invoke(cli, [*args, str(out), "--force"])
    assert res.exit_code == 0 and "calls not decoded yet" in res.output
    assert f"run `shadowtest record --finish -o {out}` on any machine" in res.output
    assert "decoded 0 calls" in CliRunner().invoke(cli, ["record", "--finish", "-o", str(out)]).output


@pytest.mark.root
def test_pcap_backend_stops_within_2s_of_sigint_under_load_and_keeps_its_calls(server: int,
                                                                             tmp_path: Path) -> None:
    """Found: under heavy gRPC traffic (a client stream of 50,000 small messages beside unary calls)
    the pcap backend died with `dictionary changed size during iteration`, spun after SIGINT until
    SIGTERM and left 0 calls."""
    import os
    import signal
    import threading
    import time

    out = tmp_path / "load.rec"
    proc = spawn([sys.executable, "-c", "from harness.cli import main; main()", "record",
                  "--backend", "pcap", "--interface", "lo", "--port", str(server), "-o", str(out),
                  "--json"], stdout=(tmp_path / "out.json").open("w"),
                 stderr=(tmp_path / "err.txt").open("w"), cwd=str(Path(__file__).resolve().parents[1]))
    try:
        for _ in range(200):                            # capture is on once the backend's settings are in
            if out.exists() and b"backend_settings" in out.read_bytes() + _wal(out):
                break
            time.sleep(0.05)
        done = {"unary": 0}
        halt = threading.Event()
        channel = grpc.insecure_channel(f"127.0.0.1:{server}")   # one connection, as in the finding

        def unary() -> None:
            decide = channel.unary_unary(DECIDE)
            req = agent_pb2.MarketSnapshot(sequence_id=1, symbol="AAPL").SerializeToString()
            for _ in range(100_000):
                if halt.is_set():
                    return
                decide(req, timeout=5)
                done["unary"] += 1

        def stream() -> None:   # a stream of 50,000 small messages
            reqs = (agent_pb2.MarketSnapshot(sequence_id=i, symbol="MSFT").SerializeToString()
                    for i in range(50_000) if not halt.is_set())
            try:
                for _ in channel.stream_stream(STREAM)(reqs, timeout=60):
                    pass
            except grpc.RpcError:
                pass

        def big() -> None:   # ~1 MB requests and responses
            decide = channel.unary_unary(DECIDE)
            req = agent_pb2.MarketSnapshot(sequence_id=2, symbol="X" * (1 << 20)).SerializeToString()
            for _ in range(4):
                if not halt.is_set():
                    decide(req, timeout=10)

        workers = [threading.Thread(target=f) for f in (unary, stream, big)]
        for w in workers:
            w.start()
        time.sleep(3)
        before = done["unary"]
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(10)
        finally:
            took = time.monotonic() - sent
            halt.set()
            for w in workers:
                w.join(30)
            channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    stdout, stderr = (tmp_path / "out.json").read_text(), (tmp_path / "err.txt").read_text()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert took < 2.0, f"stopped {took:.2f} s after SIGINT"
    result = json.loads(stdout)
    with Recording(out) as r:
        unary_calls = sum(1 for c in r.calls(with_messages=False) if c.method == DECIDE)
    assert before > 50 and result["calls"] > 0
    assert unary_calls >= before // 2, (unary_calls, before, result)


def _wal(path: Path) -> bytes:
    wal = Path(f"{path}-wal")
    try:
        return wal.read_bytes()
    except FileNotFoundError:
        return b""


def test_a_backend_that_fails_to_start_leaves_stop_a_no_op(tmp_path: Path) -> None:
    """Recorder.start closes the file when the backend cannot start; a caller's stop() in a finally must
    not then write to that closed file (it turned a clear start error into a sqlite traceback)."""
    from capture.record import Recorder, RecordOptions

    rec = Recorder(RecordOptions(output=str(tmp_path / "x.rec"), backend="proxy", port=1))

    class Broken:
        def start(self, sink: object) -> None:
            raise RuntimeError("cannot start")

    rec.backend = Broken()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="cannot start"):
        rec.start()
    assert rec.stop() == {}
