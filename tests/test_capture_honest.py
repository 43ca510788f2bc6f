"""Recordings say what they do not hold: gaps, damaged calls, TLS flows (inspect, --strict, export).

Real parts: conversations from a real h2 client/server pair (capture/testing.py), a real ClientHello
from Python's ssl module, the real sink and recording file, the CLI through click, tshark on the export.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from capture.decode.tls import client_hello_sni
from capture.pcap_export import export_file
from capture.record import build_redactor
from capture.recording import CALL_DAMAGED, Flow, Recording, RecordingWriter
from capture.sink import FlowSink
from capture.testing import GrpcCall, h2_conversation
from harness.cli import cli

M = "/shadowtest.agent.v1.TradingAgent/Decide"
PORT = 50051


def _record(path: Path, parts: list[tuple[str, bytes]], gap_before: int | None = None,
            gap_bytes: int | None = 100) -> None:
    """Feed `parts` through the sink; drop part `gap_before` and tell the sink it is a gap."""
    with RecordingWriter(path, meta={"backend": "ebpf"}) as w:
        sink = FlowSink(w, build_redactor(True, []))
        sink.open_flow("k", Flow(src=("127.0.0.1", 40000), dst=("127.0.0.1", PORT), opened_ns=1000))
        for i, (d, data) in enumerate(parts):
            if i == gap_before:
                sink.gap("k", d, gap_bytes if gap_bytes is not None else None)  # type: ignore[arg-type]
                continue
            sink.data("k", d, 10_000 + i * 1000, data)  # type: ignore[arg-type]
        sink.close_flow("k", 10_000 + len(parts) * 1000)
        sink.close(meta={"stopped_wall_ns": time.time_ns()})


def _inspect(path: Path, *flags: str) -> tuple[int, dict]:
    res = CliRunner().invoke(cli, ["inspect", str(path), "--json", *flags])
    return res.exit_code, json.loads(res.output)


def _calls(n: int) -> list[GrpcCall]:
    return [GrpcCall(M, [b"req-%d" % i * 50], [b"resp-%d" % i * 50]) for i in range(n)]


def _gap_index(parts: list[tuple[str, bytes]]) -> int:
    """The largest server write in the middle of the conversation (a response of a call in flight)."""
    mid = [i for i, (d, _) in enumerate(parts) if d == "s2c"][2:-2]
    return max(mid, key=lambda i: len(parts[i][1]))


def test_a_gap_makes_the_recording_incomplete_and_strict_inspect_fail(tmp_path: Path) -> None:
    parts = h2_conversation(_calls(6))
    _record(tmp_path / "whole.rec", parts)
    code, whole = _inspect(tmp_path / "whole.rec", "--strict")
    assert (code, whole["complete"], whole["problems"], whole["gaps"]) == (0, True, [], 0)

    victim = _gap_index(parts)
    _record(tmp_path / "gap.rec", parts, gap_before=victim, gap_bytes=len(parts[victim][1]))
    code, data = _inspect(tmp_path / "gap.rec")
    assert data["complete"] is False and data["gaps"] == 1
    assert any(p.startswith(f"1 gap(s) in 1 flow(s): {len(parts[victim][1]):,} bytes not captured")
               for p in data["problems"]), data["problems"]
    with Recording(tmp_path / "gap.rec") as rec:
        calls = list(rec.calls())
    damaged = [c for c in calls if (c.status_message or "").startswith(CALL_DAMAGED)]
    # each names the gap as its cause: bytes lost while it was open, or a status the gap's HPACK loss hid
    assert damaged and all("gap (s2c)" in (c.status_message or "") for c in damaged)
    assert not any("joined" in (c.status_message or "") for c in calls)   # a gap is not a join
    assert any(p.startswith(f"{len(damaged)} call(s) are damaged") for p in data["problems"]), data["problems"]
    code, _ = _inspect(tmp_path / "gap.rec", "--strict")
    assert code == 1

    res = CliRunner().invoke(cli, ["inspect", str(tmp_path / "gap.rec")])   # the plain text says it too
    assert "complete: false" in res.output and "problem: 1 gap(s) in 1 flow(s)" in res.output


def test_lost_events_and_calls_without_status_are_listed(tmp_path: Path) -> None:
    parts = h2_conversation(_calls(3))
    last_s2c = max(i for i, (d, _) in enumerate(parts) if d == "s2c")
    _record(tmp_path / "cut.rec", parts[:last_s2c])          # the last response never came
    with RecordingWriter(tmp_path / "cut.rec", existing=True) as w:
        w.set_meta({"lost_events": 7, "truncated_events": 2})
    code, data = _inspect(tmp_path / "cut.rec")
    assert code == 0 and data["complete"] is False            # usable, but not complete ...
    code, data = _inspect(tmp_path / "cut.rec", "--strict")
    assert code == 1 and data["complete"] is False            # ... which --strict does not accept
    text = "\n".join(data["problems"])
    assert "7 event(s) lost" in text and "2 syscall(s) moved more than the recorder copies" in text
    assert "1 call(s) have no status" in text


def _client_hello(host: str) -> bytes:
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=host)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_tls_flow_is_shown_as_tls_with_its_server_name_even_split_one_byte_at_a_time(tmp_path: Path) -> None:
    hello = _client_hello("api.example.test")
    assert client_hello_sni(hello) == "api.example.test"
    server = b"\x16\x03\x03\x00\x31\x02" + b"\x00" * 60         # a ServerHello record's start, then more
    parts = [("c2s", hello[i:i + 1]) for i in range(len(hello))] + [("s2c", server), ("c2s", b"\x17\x03\x03\x00\x05abcde")]
    _record(tmp_path / "tls.rec", parts)
    with Recording(tmp_path / "tls.rec") as rec:
        flows = list(rec.flows())
        chunks = b"".join(c.data for c in rec.chunks() if c.direction == "c2s")
    assert [f.protocol for f in flows] == ["tls"]
    assert chunks == hello + b"\x17\x03\x03\x00\x05abcde"        # kept byte for byte (nothing to mask)
    code, data = _inspect(tmp_path / "tls.rec", "--strict")
    assert code == 1 and data["protocols"] == {"tls": 1} and data["calls"] == 0
    assert "1 TLS flow(s) (server names: api.example.test): payload is encrypted, no calls decoded " \
           "(their bytes are kept)" in data["problems"]


@pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark is not installed (Debian package tshark)")
def test_export_shows_the_gap_to_wireshark(tmp_path: Path) -> None:
    parts = h2_conversation(_calls(6))
    victim = _gap_index(parts)
    missing = len(parts[victim][1])
    _record(tmp_path / "gap.rec", parts, gap_before=victim, gap_bytes=missing)
    res = CliRunner().invoke(cli, ["export", str(tmp_path / "gap.rec"), "-o", str(tmp_path / "gap.pcapng")])
    assert res.exit_code == 0 and ", 1 gap(s) marked -> " in res.output, res.output
    out = subprocess.run(["tshark", "-r", str(tmp_path / "gap.pcapng"), "-d", f"tcp.port=={PORT},http2",
                          "-Y", "tcp.analysis.lost_segment", "-T", "fields", "-e", "frame.number",
                          "-e", "tcp.srcport", "-e", "frame.comment"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip().splitlines()
    assert len(out) == 1, out                                  # "previous segment not captured", once
    _, srcport, comment = out[0].split("\t")
    assert int(srcport) == PORT                                 # on the server's side, where the gap is
    assert comment == f"shadowtest: {missing} bytes not captured here (s2c; a gap in the recording)"
    # and the sequence numbers jump by exactly the missing bytes: tshark's relative seq of that segment
    seqs = subprocess.run(["tshark", "-r", str(tmp_path / "gap.pcapng"), "-Y", f"tcp.srcport=={PORT} && tcp.len>0",
                           "-T", "fields", "-e", "tcp.seq", "-e", "tcp.len"],
                          capture_output=True, text=True, timeout=60, check=True).stdout.split()
    pairs = [(int(a), int(b)) for a, b in zip(seqs[::2], seqs[1::2], strict=True)]
    jumps = [nxt[0] - (cur[0] + cur[1]) for cur, nxt in zip(pairs, pairs[1:], strict=False)]
    assert sorted(j for j in jumps if j) == [missing]

    # without the gap nothing is flagged
    _record(tmp_path / "whole.rec", parts)
    export_file(str(tmp_path / "whole.rec"), str(tmp_path / "whole.pcapng"))
    clean = subprocess.run(["tshark", "-r", str(tmp_path / "whole.pcapng"), "-Y", "tcp.analysis.lost_segment"],
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert clean == ""
