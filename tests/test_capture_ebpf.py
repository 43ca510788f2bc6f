"""The eBPF recorder against the real agent and traffic generator (root + bcc; CI runs these).

One recorded run (module fixture) is checked several ways: byte-identical requests against the
generator's --log-sent, responses, zero loss, stream order, tcpdump+import and export+tshark.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from agent_under_test.launch import AgentProcess
from agent_under_test.proto import agent_pb2
from agent_under_test.traffic import run_traffic
from capture.backends import RecordOptions
from capture.pcap_export import export_file
from capture.pcap_import import import_capture
from capture.record import Recorder
from capture.recording import Flow, Recording
from capture.summary import summarize
from wire.process import spawn

pytestmark = [pytest.mark.root, pytest.mark.ebpf]
DECIDE = "/shadowtest.agent.v1.TradingAgent/Decide"
STREAM = "/shadowtest.agent.v1.TradingAgent/DecideStream"


def _port(light_agent: AgentProcess) -> int:
    return int(light_agent.grpc_address.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def run(light_agent: AgentProcess, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Record 3 s of traffic with eBPF while tcpdump captures the same port."""
    d = tmp_path_factory.mktemp("ebpf")
    out, log, pcap = d / "prod.rec", d / "sent.jsonl", d / "prod.pcap"
    tcpdump = None
    if shutil.which("tcpdump"):
        tcpdump = spawn(["tcpdump", "-i", "lo", "-U", "-w", str(pcap), f"tcp port {_port(light_agent)}"])
    # the default --max-bytes (8 MiB per syscall): gRPC's batched reads under bursts are kept whole
    rec = Recorder(RecordOptions(output=str(out), port=_port(light_agent))).start()
    try:
        report = run_traffic(light_agent.grpc_address, 250, 3.0, seed=3, stream_share=0.2, log_sent=str(log))
        time.sleep(0.3)   # the last responses' syscalls reach the ring buffer
    finally:
        stats = rec.stop()
        if tcpdump:
            tcpdump.send_signal(signal.SIGINT)
            tcpdump.wait(10)
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    return {"out": out, "sent": sent, "stats": stats, "pcap": pcap if tcpdump else None, "report": report}


def _requests(path: Path) -> Counter[tuple[str | None, bytes]]:
    with Recording(path) as rec:
        return Counter((c.method, m.data) for c in rec.calls() for m in c.requests)


def test_every_sent_call_is_recorded_with_its_method_and_identical_bytes(run: dict) -> None:
    recorded = _requests(run["out"])
    sent = Counter((s["method"], base64.b64decode(s["request_b64"])) for s in run["sent"])
    assert len(run["sent"]) > 500
    assert recorded == sent                  # every message, byte for byte, under its own method
    stats = run["stats"]
    assert stats["lost_events"] == 0 and stats["truncated_events"] == 0
    with Recording(run["out"]) as rec:
        calls = list(rec.calls())
        assert rec.meta["lost_events"] == 0 and rec.meta["filters"]["side"] == "server"
        flows = list(rec.flows())
    unary = [c for c in calls if c.method == DECIDE]
    assert len(unary) == sum(1 for s in run["sent"] if s["method"] == DECIDE)
    # responses are there too, with the status the client saw (OK, or e.g. an overload rejection)
    codes = {r.sequence_id: r.code for r in run["report"].results if r.method == DECIDE}
    for c in unary:
        seq = agent_pb2.MarketSnapshot.FromString(c.requests[0].data).sequence_id
        assert (c.status == 0) == (codes[seq] == "OK"), (seq, c.status, codes[seq])
        if c.status == 0:
            assert agent_pb2.Decision.FromString(c.responses[0].data).sequence_id == seq
    assert all(f.protocol == "grpc" and not f.joined_midstream and f.comm for f in flows)


def test_streaming_calls_keep_message_order_and_timestamps(run: dict) -> None:
    with Recording(run["out"]) as rec:
        streams = [c for c in rec.calls() if c.method == STREAM]
    assert streams and all(c.kind == "bidi" for c in streams)
    sent_order = {}
    for s in run["sent"]:
        if s["method"] == STREAM:
            sent_order.setdefault(s["stream"], []).append(s["sequence_id"])
    got = sorted([agent_pb2.MarketSnapshot.FromString(m.data).sequence_id for m in c.requests] for c in streams)
    assert got == sorted(sent_order.values())
    for c in streams:
        ts = [m.ts_ns for m in c.requests]
        assert ts == sorted(ts) and c.request_ts_ns <= ts[0]
        answers = [agent_pb2.Decision.FromString(m.data).sequence_id for m in c.responses]
        assert sorted(answers) == sorted(agent_pb2.MarketSnapshot.FromString(m.data).sequence_id for m in c.requests)


def test_tcpdump_capture_of_the_same_traffic_imports_as_the_same_calls(run: dict, tmp_path: Path) -> None:
    if run["pcap"] is None:
        pytest.skip("needs tcpdump (apt-get install tcpdump)")
    res = import_capture(str(run["pcap"]), str(tmp_path / "imported.rec"))
    assert res.reassembly.gaps == 0 and not res.problems
    assert _requests(tmp_path / "imported.rec") == _requests(run["out"])


@pytest.mark.skipif(shutil.which("tshark") is None, reason="needs tshark (apt-get install tshark)")
def test_export_is_dissected_by_tshark_as_the_same_grpc_calls(run: dict, light_agent: AgentProcess,
                                                              tmp_path: Path) -> None:
    export_file(str(run["out"]), str(tmp_path / "prod.pcapng"))
    out = subprocess.run(["tshark", "-r", str(tmp_path / "prod.pcapng"), "-d", f"tcp.port=={_port(light_agent)},http2",
                          "-Y", "http2.headers.path", "-T", "fields", "-e", "http2.headers.path"],
                         capture_output=True, text=True, timeout=120, check=True)
    paths = Counter(p for line in out.stdout.splitlines() for p in line.split(",") if p)
    with Recording(run["out"]) as rec:
        assert paths == Counter(c.method for c in rec.calls())


def test_connection_open_before_capture_is_joined_marked_and_counted(light_agent: AgentProcess, tmp_path: Path) -> None:
    import grpc

    channel = grpc.insecure_channel(light_agent.grpc_address)
    decide = channel.unary_unary(DECIDE)
    snap = agent_pb2.MarketSnapshot(sequence_id=1, symbol="X", levels=[agent_pb2.BookLevel(
        bid_price=99.9, bid_size=1, ask_price=100.1, ask_size=1)])
    try:
        decide(snap.SerializeToString(), timeout=10)          # the connection exists before capture
        with Recorder(RecordOptions(output=str(tmp_path / "j.rec"), port=_port(light_agent))) as rec:
            for i in range(2, 7):
                snap.sequence_id = i
                decide(snap.SerializeToString(), timeout=10)
            time.sleep(0.3)
    finally:
        channel.close()
    assert rec.result["joined_flows"] == 1
    with Recording(tmp_path / "j.rec") as r:
        flows = list(r.flows())
        calls = list(r.calls())
    assert [f.joined_midstream for f in flows] == [True]
    # counted, not dropped: every request is there byte for byte, even where HPACK hid the method
    got = [agent_pb2.MarketSnapshot.FromString(c.requests[0].data).sequence_id for c in calls]
    assert got == [2, 3, 4, 5, 6]
    assert all(c.method == DECIDE or (c.method is None and c.method_unknown) for c in calls)
    assert rec.result["unknown_method_calls"] == sum(c.method_unknown for c in calls)


def test_pid_filter_keeps_other_processes_out_in_kernel(light_agent: AgentProcess, tmp_path: Path) -> None:
    with Recorder(RecordOptions(output=str(tmp_path / "p.rec"), port=_port(light_agent), pid=1)) as rec:
        run_traffic(light_agent.grpc_address, 100, 0.5, seed=1, stream_share=0.0)
    assert rec.result["flows"] == 0 and rec.result["bytes"] == 0


def test_payload_over_max_bytes_is_counted_as_truncated_never_silent(light_agent: AgentProcess, tmp_path: Path) -> None:
    with Recorder(RecordOptions(output=str(tmp_path / "t.rec"), port=_port(light_agent), max_bytes=1024)) as rec:
        run_traffic(light_agent.grpc_address, 50, 0.5, seed=1, stream_share=0.0, levels=40, ticks=100)
        time.sleep(0.3)
    assert rec.result["truncated_events"] > 0
    with Recording(tmp_path / "t.rec") as r:
        assert r.meta["truncated_events"] == rec.result["truncated_events"]


def _record_cli(port: int, out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = spawn([sys.executable, "-m", "harness.cli", "record", "--port", str(port), "-o", str(out)],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:     # ready once the backend settings are in the file's meta
        if out.exists() and proc.poll() is None:
            try:
                with Recording(out) as r:
                    if "backend_settings" in r.meta:
                        return proc
            except Exception:  # noqa: BLE001 - the file is being created
                pass
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read().decode() if proc.stderr else "record exited")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("record did not start within 60 s")


def test_record_command_stops_cleanly_on_sigint_and_survives_sigkill(light_agent: AgentProcess, tmp_path: Path) -> None:
    proc = _record_cli(_port(light_agent), tmp_path / "int.rec")
    first = run_traffic(light_agent.grpc_address, 100, 0.5, seed=2, stream_share=0.0)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and b"recorded" in stdout
    with Recording(tmp_path / "int.rec") as r:
        assert "stopped_wall_ns" in r.meta and r.count("calls") == first.sent

    proc = _record_cli(_port(light_agent), tmp_path / "kill.rec")
    report = run_traffic(light_agent.grpc_address, 100, 1.0, seed=4, stream_share=0.0)
    time.sleep(1.2)               # everything sent is more than a second old at the kill
    proc.kill()
    proc.wait(10)
    with Recording(tmp_path / "kill.rec") as r:
        assert "stopped_wall_ns" not in r.meta       # it never finished, yet it opens and reads
        assert r.count("calls") == report.sent


def test_client_side_records_the_callers_connections_with_both_ends(light_agent: AgentProcess, tmp_path: Path) -> None:
    log = tmp_path / "sent.jsonl"
    with Recorder(RecordOptions(output=str(tmp_path / "c.rec"), port=_port(light_agent), side="client")) as rec:
        run_traffic(light_agent.grpc_address, 100, 1.0, seed=5, stream_share=0.2, log_sent=str(log))
        time.sleep(0.3)
    sent = Counter((s["method"], base64.b64decode(s["request_b64"]))
                   for s in map(json.loads, log.read_text().splitlines()))
    assert _requests(tmp_path / "c.rec") == sent and rec.result["lost_events"] == 0
    with Recording(tmp_path / "c.rec") as r:
        (flow,) = list(r.flows())
    assert flow.pid == os.getpid() and flow.src[0] == "127.0.0.1" and flow.src[1] > 0
    assert flow.dst == ("127.0.0.1", _port(light_agent))


def test_decode_at_stop_records_every_sent_call_with_identical_bytes(light_agent: AgentProcess, tmp_path: Path) -> None:
    out, log = tmp_path / "stop.rec", tmp_path / "sent.jsonl"
    with Recorder(RecordOptions(output=str(out), port=_port(light_agent), decode="at-stop")) as rec:
        run_traffic(light_agent.grpc_address, 150, 1.0, seed=6, stream_share=0.2, log_sent=str(log))
        time.sleep(0.3)
        assert rec.stats.calls == 0          # nothing decoded while recording
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    assert _requests(out) == Counter((s["method"], base64.b64decode(s["request_b64"])) for s in sent)
    assert rec.result["calls"] > 0 and rec.result["lost_events"] == 0


def test_decode_later_leaves_chunks_that_finish_decodes_into_every_sent_call(light_agent: AgentProcess,
                                                                             tmp_path: Path) -> None:
    from capture.record import finish_recording

    out, log = tmp_path / "later.rec", tmp_path / "sent.jsonl"
    with Recorder(RecordOptions(output=str(out), port=_port(light_agent), decode="later")) as rec:
        run_traffic(light_agent.grpc_address, 150, 1.0, seed=7, stream_share=0.2, log_sent=str(log))
        time.sleep(0.3)
    assert rec.result["calls"] == 0 and rec.result["lost_events"] == 0 and rec.result["calls_decoded"] is False
    with Recording(out) as r:                       # stop decoded nothing: chunks, flows and counters only
        assert r.count("calls") == 0 and r.count("chunks") > 0 and r.meta["calls_decoded"] is False
    assert (out.stat().st_mode & 0o777) == 0o600
    assert finish_recording(str(out))["calls"] > 0
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    assert _requests(out) == Counter((s["method"], base64.b64decode(s["request_b64"])) for s in sent)


_UVLOOP_ECHO = """
import asyncio, sys, uvloop
async def echo(reader, writer):
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_server(echo, "127.0.0.1", int(sys.argv[1]))
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
uvloop.run(main())
"""


def _echo_clients(port: int, long_lived: int, short: int) -> dict[int, bytes]:
    """Client port -> bytes sent (and echoed). The long-lived connections stay open past the
    recorder's next look at its ring (>= 100 ms); the short ones close at once, so they are gone
    from /proc by then."""
    import socket

    sent: dict[int, bytes] = {}
    held = []
    for i in range(long_lived):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        msg = f"long-lived {i} ".encode() * (i + 1)
        s.sendall(msg)
        assert s.recv(65536) == msg
        sent[s.getsockname()[1]] = msg
        held.append(s)
    for i in range(short):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            msg = f"short {i} ".encode() + bytes([0, 255, i])
            s.sendall(msg)
            assert s.recv(65536) == msg
            sent[s.getsockname()[1]] = msg
    time.sleep(0.3)
    for s in held:
        s.close()
    time.sleep(0.3)
    return sent


def _echo_flows(path: Path, port: int, pid: int) -> tuple[dict[int, bytes], dict]:
    """Client port -> bytes of each recorded flow (checked: echoed back, right server, own pid)."""
    with Recording(path) as r:
        flows = list(r.flows())
        chunks = list(r.chunks())
        meta = r.meta
    got = {}
    for f in flows:
        assert f.src[0] == "127.0.0.1" and f.dst == ("127.0.0.1", port) and f.pid == pid and not f.joined_midstream
        c2s = b"".join(c.data for c in chunks if c.flow_id == f.id and c.direction == "c2s")
        assert c2s == b"".join(c.data for c in chunks if c.flow_id == f.id and c.direction == "s2c")
        got[f.src[1]] = c2s
    return got, meta


def test_uvloop_server_accepting_without_an_address_is_recorded_with_its_peers(tmp_path: Path) -> None:
    """libuv accepts with accept4(fd, NULL, NULL, flags): the listener (found in /proc at start)
    says the port; the peer comes from /proc for a connection still open when the recorder looks,
    from the close for one closed before that."""
    pytest.importorskip("uvloop")
    server = spawn([sys.executable, "-c", _UVLOOP_ECHO, "0"], stdout=subprocess.PIPE, stderr=None, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with Recorder(RecordOptions(output=str(tmp_path / "uv.rec"), port=port)) as rec:
            sent = _echo_clients(port, long_lived=3, short=5)
    finally:
        server.kill()
        server.wait(10)
    got, meta = _echo_flows(tmp_path / "uv.rec", port, server.pid)
    assert got == sent                               # every connection, its own client port, exact bytes
    assert meta["accepted_peer_unknown"] == 0 and rec.result["lost_events"] == 0
    assert meta["accepted_without_address"]["peer_from_proc"] >= 1
    assert meta["accepted_without_address"]["peer_from_close"] >= 1


def test_uvloop_server_started_after_the_recorder_is_learnt_from_its_listen(tmp_path: Path) -> None:
    import socket

    pytest.importorskip("uvloop")
    with socket.socket() as probe:       # a free port, known before the server exists
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with Recorder(RecordOptions(output=str(tmp_path / "late.rec"), port=port)) as rec:
        server = spawn([sys.executable, "-c", _UVLOOP_ECHO, str(port)], stdout=subprocess.PIPE, stderr=None, text=True)
        try:
            assert server.stdout is not None and int(server.stdout.readline()) == port
            sent = _echo_clients(port, long_lived=1, short=2)
        finally:
            server.kill()
            server.wait(10)
    got, meta = _echo_flows(tmp_path / "late.rec", port, server.pid)
    assert got == sent and meta["accepted_peer_unknown"] == 0 and rec.result["lost_events"] == 0


# ---- receive flags: a read that discards (MSG_TRUNC) or only peeks (MSG_PEEK) is not data received ----

_H1 = b"POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 50\r\n\r\n"
_BODY1 = bytes(range(65, 115))          # 50 bytes, none of them zero
_H2 = b"POST /upload2 HTTP/1.1\r\nHost: t\r\nContent-Length: 40\r\n\r\n"
_BODY2 = b"y" * 40
_AFTER = b"POST /after HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello"
_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
_TOO_LARGE = b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n"


def _one_connection_server(handler: Callable[[socket.socket, dict], None]) -> tuple[int, threading.Thread, dict]:
    """A server of the test's own on 127.0.0.1 (blocking sockets: MSG_WAITALL then waits, which a socket
    with a timeout, non-blocking underneath, would not). Start the thread after the recorder: an accept
    already waiting when the program attached is not traced."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    seen: dict = {}

    def serve() -> None:
        try:
            with listener, listener.accept()[0] as conn:
                handler(conn, seen)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            seen["error"] = repr(exc)

    return listener.getsockname()[1], threading.Thread(target=serve, daemon=True), seen


def _exchange(port: int, steps: list[tuple[bytes, bytes]]) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        for request, response in steps:
            c.sendall(request)
            got = b""
            while len(got) < len(response):
                part = c.recv(len(response) - len(got))
                assert part, "server closed early"
                got += part
            assert got == response


def _flow_bytes(path: Path) -> tuple[Flow, bytes, bytes, dict, list, dict]:
    with Recording(path) as r:
        (flow,) = list(r.flows())
        chunks = list(r.chunks())
        calls = list(r.calls())
        meta = r.meta
        summary = summarize(r)
    c2s = b"".join(c.data for c in chunks if c.direction == "c2s")
    s2c = b"".join(c.data for c in chunks if c.direction == "s2c")
    return flow, c2s, s2c, meta, calls, summary


@pytest.mark.parametrize("decode", ["live", "at-stop"])
def test_body_discarded_with_msg_trunc_is_counted_as_skipped_bytes_never_stored(tmp_path: Path,
                                                                                decode: str) -> None:
    """recv(fd, buf, n, MSG_TRUNC) on TCP drops n bytes without copying (tcp(7)): the buffer keeps
    what it held, which the recorder must not store. Both receive syscalls: recvfrom (recv_into) and
    recvmsg."""

    def handler(conn: socket.socket, seen: dict) -> None:
        assert conn.recv(len(_H1), socket.MSG_WAITALL) == _H1             # recvfrom, a normal read
        buf = bytearray(len(_BODY1))
        seen["dropped1"] = conn.recv_into(buf, len(_BODY1), socket.MSG_TRUNC | socket.MSG_WAITALL)
        seen["buf1"] = bytes(buf)
        conn.sendall(_TOO_LARGE)
        assert conn.recv(len(_H2), socket.MSG_WAITALL) == _H2
        data, _anc, _flags, _addr = conn.recvmsg(len(_BODY2), 0, socket.MSG_TRUNC | socket.MSG_WAITALL)
        seen["dropped2"] = len(data)
        conn.sendall(_TOO_LARGE)
        seen["after"] = conn.recv(len(_AFTER), socket.MSG_WAITALL)        # read as usual after the discards
        conn.sendall(_OK)

    port, server, seen = _one_connection_server(handler)
    out = tmp_path / f"trunc-{decode}.rec"
    with Recorder(RecordOptions(output=str(out), port=port, decode=decode)) as rec:
        server.start()
        _exchange(port, [(_H1 + _BODY1, _TOO_LARGE), (_H2 + _BODY2, _TOO_LARGE), (_AFTER, _OK)])
        server.join(10)
        time.sleep(0.3)
    assert "error" not in seen, seen["error"]
    # what the kernel did: every byte dropped, none copied (the zeros the old recorder stored)
    assert seen["dropped1"] == 50 and seen["buf1"] == bytes(50) and seen["dropped2"] == 40
    assert seen["after"] == _AFTER

    result = rec.result or {}
    flow, c2s, s2c, meta, calls, summary = _flow_bytes(out)
    assert c2s == _H1 + _H2 + _AFTER                 # exactly what the server read into its buffers
    assert s2c == _TOO_LARGE + _TOO_LARGE + _OK
    assert result["discarded_bytes"] == 90 and result["discarded_reads"] == 2
    assert result["lost_events"] == 0 and result["truncated_events"] == 0
    assert meta["discarded_bytes"] == 90 and meta["discarded_by_flow"] == [[flow.id, "c2s", 90, 2]]
    assert [p for p in summary["problems"] if "MSG_TRUNC" in p] == [
        f"90 bytes discarded by the application with MSG_TRUNC on flow {flow.id} (c2s, 2 read(s)): not captured "
        "(a gap in the recording; the decoders resynchronised after it)"]
    # the decoder stepped over each discard inside its Content-Length body: every request is a call,
    # each paired with its own response; the two cut bodies are not stored and the calls say so.
    assert [(c.method, c.status) for c in calls] == [("POST /upload", 413), ("POST /upload2", 413),
                                                     ("POST /after", 200)]
    assert [c.status_message for c in calls[:2]] == [
        "body not captured: request, 50 bytes missing in a gap",
        "body not captured: request, 40 bytes missing in a gap"]
    assert [c.requests for c in calls[:2]] == [[], []]
    after = calls[2]
    assert [m.data for m in after.requests] == [b"hello"] and [m.data for m in after.responses] == [b"ok"]
    assert "2 HTTP call(s) have a body that was not captured" in " ".join(summary["problems"])
    assert not any(bytes(8) in m.data for c in calls for m in c.requests)


def test_peeked_bytes_are_recorded_once_by_the_read_that_consumes_them(tmp_path: Path) -> None:
    """MSG_PEEK returns bytes without consuming them (recvfrom and recvmsg; with MSG_TRUNC too, which
    then copies nothing and drops nothing): only the real read that follows is data."""
    req = b"GET /peek HTTP/1.1\r\nHost: t\r\n\r\n"
    req2 = b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"

    def handler(conn: socket.socket, seen: dict) -> None:
        seen["peek"] = conn.recv(len(req), socket.MSG_PEEK | socket.MSG_WAITALL)          # recvfrom
        seen["peek_msg"] = conn.recvmsg(len(req), 0, socket.MSG_PEEK)[0]                   # recvmsg
        buf = bytearray(len(req))
        seen["peek_trunc"] = conn.recv_into(buf, len(req), socket.MSG_PEEK | socket.MSG_TRUNC)
        seen["read"] = conn.recv(len(req), socket.MSG_WAITALL)
        conn.sendall(_OK)
        seen["peek2"] = conn.recv(len(req2), socket.MSG_PEEK | socket.MSG_WAITALL)
        seen["read2"] = conn.recvmsg(len(req2), 0, socket.MSG_WAITALL)[0]                  # recvmsg, consuming
        conn.sendall(_OK)

    port, server, seen = _one_connection_server(handler)
    out = tmp_path / "peek.rec"
    with Recorder(RecordOptions(output=str(out), port=port)) as rec:
        server.start()
        _exchange(port, [(req, _OK), (req2, _OK)])
        server.join(10)
        time.sleep(0.3)
    assert "error" not in seen, seen["error"]
    assert seen["peek"] == seen["peek_msg"] == seen["read"] == req and seen["peek_trunc"] == len(req)
    assert seen["peek2"] == seen["read2"] == req2

    result = rec.result or {}
    _flow, c2s, s2c, meta, calls, summary = _flow_bytes(out)
    assert c2s == req + req2 and s2c == _OK + _OK      # once each, not once per peek
    assert result["discarded_bytes"] == 0 and meta["discarded_by_flow"] == [] and result["gaps"] == 0
    assert not [p for p in summary["problems"] if "MSG_TRUNC" in p]
    assert [(c.method, [m.data for m in c.requests], c.status) for c in calls] == [
        ("GET /peek", [], 200), ("POST /p", [b"abc"], 200)]
