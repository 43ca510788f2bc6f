"""pcap/pcapng import (reassembly: out of order, retransmissions, gaps; damage) and pcapng export."""

from __future__ import annotations

import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from capture.errors import PcapError
from capture.packets import Segment
from capture.pcap_export import _ip_tcp, export_file
from capture.pcap_import import import_capture
from capture.recording import Recording
from capture.testing import GrpcCall, h2_conversation
from harness.cli import cli

M = "/shadowtest.agent.v1.TradingAgent/Decide"
CLIENT, SERVER = ("10.0.0.1", 40001), ("10.0.0.2", 50051)


def _segments(calls: int = 6, mss: int = 200) -> list[tuple[int, bytes]]:
    """(ts_ns, raw IPv4 frame) for a whole connection: handshake, data in mss pieces, FINs."""
    parts = h2_conversation([GrpcCall(M, [b"req-%d" % i * 20], [b"resp-%d" % i]) for i in range(calls)])
    seq = {"c2s": 100, "s2c": 900}
    ts = 1_700_000_000_000_000_000
    out = [(ts, _ip_tcp(CLIENT, SERVER, 99, 0, 0x02, b"")), (ts + 1, _ip_tcp(SERVER, CLIENT, 899, 100, 0x12, b""))]
    for direction, data in parts:
        src, dst = (CLIENT, SERVER) if direction == "c2s" else (SERVER, CLIENT)
        for i in range(0, len(data), mss):
            ts += 1000
            out.append((ts, _ip_tcp(src, dst, seq[direction], 0, 0x18, data[i:i + mss])))
            seq[direction] += len(data[i:i + mss])
    out.append((ts + 1000, _ip_tcp(CLIENT, SERVER, seq["c2s"], 0, 0x11, b"")))
    out.append((ts + 2000, _ip_tcp(SERVER, CLIENT, seq["s2c"], 0, 0x11, b"")))
    return out


def _write_pcap(path: Path, packets: list[tuple[int, bytes]], ethernet: bool = False) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B23C4D, 2, 4, 0, 0, 262144, 1 if ethernet else 101))  # ns pcap
        for ts, frame in packets:
            if ethernet:
                frame = b"\0" * 12 + b"\x08\x00" + frame
            f.write(struct.pack("<IIII", ts // 10**9, ts % 10**9, len(frame), len(frame)) + frame)


def _requests(path: Path) -> list[bytes]:
    with Recording(path) as rec:
        return [m.data for c in rec.calls() for m in c.requests]


def test_import_in_order_capture_yields_every_call_with_capture_timestamps(tmp_path: Path) -> None:
    pkts = _segments()
    _write_pcap(tmp_path / "a.pcap", pkts, ethernet=True)
    res = import_capture(str(tmp_path / "a.pcap"), str(tmp_path / "a.rec"))
    assert res.packets == len(pkts) and res.sink.calls == 6 and res.reassembly.gaps == 0
    assert _requests(tmp_path / "a.rec") == [b"req-%d" % i * 20 for i in range(6)]
    with Recording(tmp_path / "a.rec") as rec:
        flow = next(rec.flows())
        assert (flow.src, flow.dst, flow.joined_midstream) == (CLIENT, SERVER, False)
        assert flow.closed_ns is not None
        assert rec.meta["started_wall_ns"] == pkts[0][0]


def test_out_of_order_and_retransmitted_segments_reassemble_exactly(tmp_path: Path) -> None:
    pkts = _segments()
    rng = random.Random(7)
    body = pkts[2:-2]
    swapped = body[:]
    for i in range(0, len(swapped) - 1, 3):          # local reordering, as on a real network
        swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
    dupes = [p for p in swapped if rng.random() < 0.3]
    mixed = pkts[:2] + swapped[:len(swapped) // 2] + dupes + swapped[len(swapped) // 2:] + pkts[-2:]
    _write_pcap(tmp_path / "b.pcap", mixed)
    res = import_capture(str(tmp_path / "b.pcap"), str(tmp_path / "b.rec"))
    assert res.reassembly.out_of_order > 0 and res.reassembly.retransmitted >= len(dupes) // 2
    assert res.reassembly.gaps == 0
    assert _requests(tmp_path / "b.rec") == [b"req-%d" % i * 20 for i in range(6)]


def test_missing_segment_is_reported_as_a_gap_and_later_calls_survive(tmp_path: Path) -> None:
    pkts = _segments(calls=6)
    # drop one c2s data segment in the middle of the conversation
    victim = next(i for i in range(len(pkts) // 2, len(pkts)) if pkts[i][1][12:16] == bytes([10, 0, 0, 1])
                  and len(pkts[i][1]) > 40)
    _write_pcap(tmp_path / "c.pcap", pkts[:victim] + pkts[victim + 1:])
    res = import_capture(str(tmp_path / "c.pcap"), str(tmp_path / "c.rec"))
    assert res.reassembly.gaps == 1 and res.reassembly.gap_bytes > 0
    assert "gap of" in res.as_dict()["problems"][0]
    got = _requests(tmp_path / "c.rec")
    assert b"req-5" * 20 in got and len(got) < 6 + 1


def test_truncated_capture_is_salvaged_and_said_so(tmp_path: Path) -> None:
    _write_pcap(tmp_path / "d.pcap", _segments())
    data = (tmp_path / "d.pcap").read_bytes()
    (tmp_path / "cut.pcap").write_bytes(data[:len(data) * 2 // 3])
    result = CliRunner().invoke(cli, ["import", str(tmp_path / "cut.pcap"), "-o", str(tmp_path / "cut.rec")])
    assert result.exit_code == 1                      # damaged: nothing written without --salvage
    assert "ends inside packet" in result.output and "truncated" in result.output and "--salvage" in result.output
    assert not (tmp_path / "cut.rec").exists()
    result = CliRunner().invoke(cli, ["import", str(tmp_path / "cut.pcap"), "-o", str(tmp_path / "cut.rec"),
                                      "--salvage"])
    assert result.exit_code == 0 and "truncated" in result.output and "partial" in result.output, result.output
    assert 0 < len(_requests(tmp_path / "cut.rec")) < 6
    inspected = CliRunner().invoke(cli, ["inspect", str(tmp_path / "cut.rec"), "--json"])
    assert inspected.exit_code == 1 and '"complete": false' in inspected.output   # the recording says it


def test_not_a_capture_gives_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "junk.pcap").write_bytes(b"this is not a capture file at all" * 10)
    with pytest.raises(PcapError, match="not a pcap or pcapng"):
        import_capture(str(tmp_path / "junk.pcap"), str(tmp_path / "j.rec"))
    result = CliRunner().invoke(cli, ["import", str(tmp_path / "missing.pcap"), "-o", str(tmp_path / "m.rec")])
    assert result.exit_code == 1 and "no such capture file" in " ".join(result.output.split())
    assert not (tmp_path / "m.rec").exists() and not (tmp_path / "j.rec").exists()


def test_export_round_trips_through_import(tmp_path: Path) -> None:
    _write_pcap(tmp_path / "a.pcap", _segments())
    import_capture(str(tmp_path / "a.pcap"), str(tmp_path / "a.rec"))
    counts = export_file(str(tmp_path / "a.rec"), str(tmp_path / "a.pcapng"))
    assert counts["flows"] == 1 and counts["packets"] > counts["chunks"]
    import_capture(str(tmp_path / "a.pcapng"), str(tmp_path / "again.rec"))
    assert _requests(tmp_path / "again.rec") == _requests(tmp_path / "a.rec")
    with Recording(tmp_path / "a.rec") as a, Recording(tmp_path / "again.rec") as b:
        assert [c.request_ts_ns for c in a.calls()] == [c.request_ts_ns for c in b.calls()]


@pytest.mark.skipif(shutil.which("tshark") is None, reason="needs tshark (apt-get install tshark)")
def test_tshark_dissects_the_export_as_the_same_grpc_calls_and_times(tmp_path: Path) -> None:
    _write_pcap(tmp_path / "a.pcap", _segments())
    import_capture(str(tmp_path / "a.pcap"), str(tmp_path / "a.rec"))
    export_file(str(tmp_path / "a.rec"), str(tmp_path / "a.pcapng"))
    out = subprocess.run(["tshark", "-r", str(tmp_path / "a.pcapng"), "-d", "tcp.port==50051,http2",
                          "-Y", "http2.headers.path", "-T", "fields", "-e", "frame.time_epoch",
                          "-e", "http2.headers.path"], capture_output=True, text=True, timeout=60, check=True)
    rows = [line.split("\t") for line in out.stdout.splitlines() if line.strip()]
    with Recording(tmp_path / "a.rec") as rec:
        calls = list(rec.calls())
    assert [r[1] for r in rows] == [M] * len(calls)
    # the frame carrying each request's HEADERS has the call's own request time (ns precision)
    assert [round(float(r[0]) * 1e6) for r in rows] == [round(c.request_ts_ns / 1e3) for c in calls]


class _ListSink:
    """What a Reassembler delivers, per direction; enough of FlowSink for these tests."""

    def __init__(self) -> None:
        self.bytes: dict[object, bytearray] = {}
        self.gaps = 0

    def open_flow(self, key: object, flow: object) -> int:
        return 0

    def data(self, key: object, direction: str, ts_ns: int, data: bytes) -> None:
        self.bytes.setdefault((key, direction), bytearray()).extend(data)

    def gap(self, key: object, direction: str, nbytes: int) -> None:
        self.gaps += 1

    def close_flow(self, key: object, ts_ns: int | None) -> None:
        pass


def _seg(port: int, seq: int, flags: int, payload: bytes = b"") -> Segment:
    return Segment(("127.0.0.1", port), ("127.0.0.1", 50051), seq, 0, flags, payload)


def test_many_small_out_of_order_segments_reassemble_in_linear_time() -> None:
    """Found: each delivery scanned every held segment (min over the dict): a burst of small segments
    behind one hole (a client stream of 50,000 small messages, frames the kernel dropped) cost O(n^2)
    and the capture thread fell minutes behind."""
    import time
    from typing import cast

    from capture.reassembly import Reassembler
    from capture.sink import FlowSink

    sink = _ListSink()
    r = Reassembler(cast(FlowSink, sink), {50051})
    n = 8000
    r.feed(_seg(40000, 999, 0x02), 0)
    start = time.perf_counter()
    for i in reversed(range(1, n)):   # everything but the first byte, last first
        r.feed(_seg(40000, 1000 + i, 0x18, bytes([i % 251])), i)
    r.feed(_seg(40000, 1000, 0x18, bytes([0])), n)
    elapsed = time.perf_counter() - start
    (got,) = sink.bytes.values()
    assert bytes(got) == bytes(i % 251 for i in range(n)) and sink.gaps == 0
    assert r.stats.out_of_order == n - 1
    assert elapsed < 1.0, f"{n} held segments took {elapsed:.1f} s"


def test_reassembler_fed_and_finished_from_two_threads() -> None:
    """Found: `RuntimeError: dictionary changed size during iteration`. The live backend's stop() called
    finish() from the main thread after its join timed out, while the capture thread (behind, see
    above) still fed segments: finish's scan of the held segments raced the feed adding to them."""
    import sys
    import threading
    from typing import cast

    from capture.reassembly import Reassembler
    from capture.sink import FlowSink

    sink = _ListSink()
    r = Reassembler(cast(FlowSink, sink), {50051})
    errors: list[BaseException] = []
    flows, per_flow = 10, 3000
    stop = threading.Event()

    def feed() -> None:   # the capture thread: out-of-order segments on many flows
        try:
            for f in range(flows):
                r.feed(_seg(41000 + f, 999, 0x02), 0)
                for i in reversed(range(per_flow)):
                    r.feed(_seg(41000 + f, 1000 + 2 * i, 0x18, b"ab"), i)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            stop.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        t = threading.Thread(target=feed)
        t.start()
        for _ in range(100_000):   # the main thread: stop() -> finish(), again and again
            if stop.wait(0.002):
                break
            try:
                r.finish()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                break
        t.join(30)
    finally:
        sys.setswitchinterval(old)
    assert not errors, repr(errors[0])
    r.finish()
    # every byte either delivered once or skipped as a gap (finish() mid-stream declares the holes)
    assert sum(len(b) for b in sink.bytes.values()) + r.stats.gap_bytes == flows * per_flow * 2


def test_import_masks_header_lines_split_across_tcp_segments(tmp_path: Path) -> None:
    """A cookie and a token whose header lines are cut into 5-byte segments: masked on the
    reassembled stream, the calls still decoded."""
    token, cookie = b"QWERTYUIOPASDFGHJKLZ", b"MNBVCXZLKJHGFDSAPOIU"
    req = b"GET /a HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token + b"\r\nCookie: s=" + cookie + b"\r\n\r\n"
    resp = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    ts, seq = 1_700_000_000_000_000_000, {"c2s": 100, "s2c": 900}
    client, server = ("10.0.0.1", 40001), ("10.0.0.2", 8080)
    pkts = [(ts, _ip_tcp(client, server, 99, 0, 0x02, b"")), (ts + 1, _ip_tcp(server, client, 899, 100, 0x12, b""))]
    for direction, data in (("c2s", req), ("s2c", resp)):
        src, dst = (client, server) if direction == "c2s" else (server, client)
        for i in range(0, len(data), 5):
            ts += 1000
            pkts.append((ts, _ip_tcp(src, dst, seq[direction], 0, 0x18, data[i:i + 5])))
            seq[direction] += len(data[i:i + 5])
    _write_pcap(tmp_path / "h1.pcap", pkts)
    import_capture(str(tmp_path / "h1.pcap"), str(tmp_path / "h1.rec"))
    raw = (tmp_path / "h1.rec").read_bytes()
    with Recording(tmp_path / "h1.rec") as rec:
        [call] = list(rec.calls())
        raw += b"".join(c.data for c in rec.chunks())
    for secret in (token, cookie):
        assert not any(secret[i:i + 6] in raw for i in range(len(secret) - 5))
    assert (call.method, call.status) == ("GET /a", 200)
    assert dict(call.request_metadata)["cookie"] == dict(call.request_metadata)["authorization"] == "<redacted>"
