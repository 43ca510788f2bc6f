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


# --- our own pcap/pcapng framing (capture/pcapfile.py) against scapy's, which import used before ---

_TS0 = 1_700_000_000_123_456_789      # digits below the microsecond: a resolution mix-up shows


def _traffic() -> list[tuple[int, bytes]]:
    """_segments' connection, its packets 1.000333 ms apart from _TS0 (nanoseconds)."""
    return [(_TS0 + i * 1_000_333, frame) for i, (_, frame) in enumerate(_segments(calls=8, mss=150))]


def _eth(frame: bytes) -> bytes:
    return b"\0" * 12 + b"\x08\x00" + frame


def _scapy_framed(path: Path) -> list[tuple[int, int, bytes]]:
    """The reference: (linktype, ts ns, frame) as scapy's raw readers frame the file (import's reader
    until capture/pcapfile.py, with the same timestamp arithmetic and snap length)."""
    from scapy.utils import RawPcapReader

    out = []
    reader = RawPcapReader(str(path))
    try:
        while True:
            try:
                data, meta = reader._read_packet(size=1 << 18)
            except EOFError:
                return out
            if hasattr(meta, "tshigh"):
                out.append((meta.linktype, ((meta.tshigh << 32) | meta.tslow) * 10**9 // meta.tsresol, data))
            else:
                scale = 1 if reader.nano else 1000
                out.append((reader.linktype, meta.sec * 10**9 + meta.usec * scale, data))
    finally:
        reader.close()


def _fast_framed(path: Path) -> tuple[list[tuple[int, int, bytes]], list[str]]:
    from capture.pcapfile import read_packets

    problems: list[str] = []
    return list(read_packets(str(path), problems)), problems


def _dump(path: Path) -> dict[str, object]:
    """Every row of every table, and the meta but for when and from which file it was written."""
    import sqlite3

    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        out: dict[str, object] = {t: db.execute(f"SELECT * FROM {t} ORDER BY rowid").fetchall()
                                  for t in tables if t != "meta"}
        out["meta"] = {k: v for k, v in db.execute("SELECT key, value FROM meta")
                       if k not in ("created_wall_ns", "source")}
        return out
    finally:
        db.close()


def _write_scapy_pcap(path: Path, pkts: list[tuple[int, bytes]], *, nano: bool, endian: str) -> None:
    from scapy.utils import PcapWriter

    with PcapWriter(str(path), linktype=1, nano=nano, endianness=endian) as w:
        w.write_header(None)
        for ts, frame in pkts:
            w.write_packet(_eth(frame), sec=ts // 10**9, usec=ts % 10**9 if nano else ts % 10**9 // 1000)


def _write_scapy_pcapng(path: Path, pkts: list[tuple[int, bytes]]) -> None:
    """Two interfaces of different link types (Ethernet on eth0, raw IPv4 on lo: every other packet),
    EPB options (comment, direction flags) on some packets; microsecond resolution (scapy's)."""
    from decimal import Decimal

    from scapy.layers.inet import IP
    from scapy.layers.l2 import Ether
    from scapy.packet import Packet
    from scapy.utils import PcapNgWriter

    with PcapNgWriter(str(path)) as w:
        for i, (ts, frame) in enumerate(pkts):
            p: Packet = Ether(_eth(frame)) if i % 2 else IP(frame)
            p.sniffed_on = "eth0" if i % 2 else "lo"
            if i % 3 == 0:
                p.comments = [b"packet %d" % i]
                p.direction = 1 + i % 2
            if not i:
                w.write_header(p)      # the section and interface 0 (unused: packets name lo and eth0)
            w.write_packet(p, sec=Decimal(ts) / 10**9)   # exact: int(Decimal * 10**6), no float rounding


def _expected(pkts: list[tuple[int, bytes]], resolution_ns: int, raw_every_other: bool = False,
              raw_linktype: int = 101) -> list[tuple[int, int, bytes]]:
    """What a reader must give for `pkts` written at `resolution_ns` (timestamps cut to it)."""
    return [(raw_linktype, ts // resolution_ns * resolution_ns, frame) if raw_every_other and i % 2 == 0
            else (1, ts // resolution_ns * resolution_ns, _eth(frame)) for i, (ts, frame) in enumerate(pkts)]


def _tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        pytest.skip(f"{name} is not installed (not on PATH nor in /usr/bin): apt-get install {name}")
    return path


def _written(kind: str, tmp_path: Path, pkts: list[tuple[int, bytes]]) -> tuple[Path, list[tuple[int, int, bytes]]]:
    """A capture of `pkts` written by `kind`, and the packets a correct reader gives for it."""
    path = tmp_path / f"{kind}.cap"
    if kind.startswith("scapy-pcap"):
        nano, endian = "nano" in kind, ">" if kind.endswith("-be") else "<"
        _write_scapy_pcap(path, pkts, nano=nano, endian=endian)
        return path, _expected(pkts, 1 if nano else 1000)
    if kind == "scapy-pcapng":
        _write_scapy_pcapng(path, pkts)
        return path, _expected(pkts, 1000, raw_every_other=True, raw_linktype=228)
    source = tmp_path / f"{kind}.source.pcap"
    _write_pcap(source, pkts, ethernet=True)                  # nanosecond pcap
    if kind.startswith("tcpdump"):
        nano = kind == "tcpdump-nano"
        subprocess.run([_tool("tcpdump"), *(["--time-stamp-precision", "nano"] if nano else []),
                        "-r", str(source), "-w", str(path)], check=True, capture_output=True, timeout=60)
        return path, _expected(pkts, 1 if nano else 1000)
    assert kind == "mergecap-pcapng"        # two interfaces: the Ethernet file and a raw IP one, nanoseconds
    raw = tmp_path / "raw.pcap"
    _write_pcap(raw, [(ts + 500, frame) for ts, frame in pkts])
    subprocess.run([_tool("mergecap"), "-F", "pcapng", "-w", str(path), str(source), str(raw)], check=True,
                   capture_output=True, timeout=60)
    both = sorted([(ts, 1, _eth(frame)) for ts, frame in pkts] + [(ts + 500, 101, frame) for ts, frame in pkts])
    return path, [(lt, ts, frame) for ts, lt, frame in both]


WRITERS = ["scapy-pcap-us", "scapy-pcap-nano", "scapy-pcap-us-be", "scapy-pcap-nano-be", "scapy-pcapng",
           "tcpdump-us", "tcpdump-nano", "mergecap-pcapng"]


@pytest.mark.parametrize("chunk", [None, 61])
@pytest.mark.parametrize("kind", WRITERS)
def test_own_framing_reads_what_scapy_reads_and_imports_the_same_recording(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, chunk: int | None) -> None:
    """Captures written by scapy (pcap: both byte orders, micro- and nanoseconds; pcapng: two interfaces
    of different link types, EPB options), tcpdump and mergecap: our reader gives exactly the packets
    written (link type, timestamp to the file's resolution, bytes) and exactly what scapy's readers gave;
    the recordings imported through either are identical row for row. `chunk`: reads of 61 bytes, so
    every record straddles a read."""
    import capture.pcap_import
    import capture.pcapfile

    if chunk:
        monkeypatch.setattr(capture.pcapfile, "CHUNK", chunk)
    pkts = _traffic()
    path, expected = _written(kind, tmp_path, pkts)
    got, problems = _fast_framed(path)
    assert problems == []
    assert got == expected
    assert got == _scapy_framed(path)
    ours = import_capture(str(path), str(tmp_path / "ours.rec"))
    monkeypatch.setattr(capture.pcap_import, "read_packets", lambda p, problems, progress=None: iter(_scapy_framed(Path(p))))
    theirs = import_capture(str(path), str(tmp_path / "scapy.rec"))
    assert ours.as_dict() == theirs.as_dict()
    assert ours.sink.calls == 8        # (mergecap: the same connection twice over, the copies retransmissions)
    assert _dump(tmp_path / "ours.rec") == _dump(tmp_path / "scapy.rec")


def _pcapng_block(btype: int, body: bytes, endian: str = "<") -> bytes:
    body += b"\0" * (-len(body) % 4)
    return struct.pack(endian + "II", btype, 12 + len(body)) + body + struct.pack(endian + "I", 12 + len(body))


def _shb(endian: str = "<") -> bytes:
    return _pcapng_block(0x0A0D0D0A, struct.pack(endian + "IHHq", 0x1A2B3C4D, 1, 0, -1), endian)


def _idb(linktype: int, tsresol: int | None = None, endian: str = "<", snaplen: int = 0) -> bytes:
    opts = b""
    if tsresol is not None:
        opts = struct.pack(endian + "HHB3x", 9, 1, tsresol) + struct.pack(endian + "HH", 0, 0)
    return _pcapng_block(1, struct.pack(endian + "HHI", linktype, 0, snaplen) + opts, endian)


def _epb(intid: int, units: int, frame: bytes, endian: str = "<") -> bytes:
    return _pcapng_block(6, struct.pack(endian + "IIIII", intid, units >> 32, units & 0xFFFFFFFF, len(frame),
                                        len(frame)) + frame, endian)


@pytest.mark.parametrize("tsresol, units_per_s", [(9, 10**9), (6, 10**6), (3, 10**3), (0x80 | 20, 2**20),
                                                   (0x80 | 30, 2**30)])
def test_pcapng_if_tsresol_powers_of_ten_and_two_give_the_right_timestamps(tmp_path: Path, tsresol: int,
                                                                         units_per_s: int) -> None:
    pkts = _traffic()
    units = [ts * units_per_s // 10**9 for ts, _ in pkts]
    path = tmp_path / "r.pcapng"
    path.write_bytes(_shb() + _idb(101, tsresol) + b"".join(_epb(0, u, f) for u, (_, f) in zip(units, pkts, strict=True)))
    got, problems = _fast_framed(path)
    assert problems == []
    assert [ts for _, ts, _ in got] == [u * 10**9 // units_per_s for u in units]
    if units_per_s == 10**9:
        assert [ts for _, ts, _ in got] == [ts for ts, _ in pkts]          # nanoseconds: exact
    assert all(abs(ts - want) < 10**9 // min(units_per_s, 10**9) + 1 for (_, ts, _), (want, _) in zip(got, pkts, strict=True))
    assert got == _scapy_framed(path)
    res = import_capture(str(path), str(tmp_path / "r.rec"))
    assert res.sink.calls == 8 and not res.all_problems
    with Recording(tmp_path / "r.rec") as rec:
        assert rec.meta["started_wall_ns"] == got[0][1]


@pytest.mark.parametrize("endian", ["<", ">"])
def test_nanosecond_pcap_in_both_byte_orders_keeps_every_nanosecond(tmp_path: Path, endian: str) -> None:
    pkts = _traffic()
    path = tmp_path / "ns.pcap"
    with open(path, "wb") as f:
        f.write(struct.pack(endian + "IHHiIII", 0xA1B23C4D, 2, 4, 0, 0, 262144, 101))
        for ts, frame in pkts:
            f.write(struct.pack(endian + "IIII", ts // 10**9, ts % 10**9, len(frame), len(frame)) + frame)
    got, problems = _fast_framed(path)
    assert problems == [] and got == [(101, ts, frame) for ts, frame in pkts] == _scapy_framed(path)
    res = import_capture(str(path), str(tmp_path / "ns.rec"))
    with Recording(tmp_path / "ns.rec") as rec:
        assert rec.meta["started_wall_ns"] == _TS0 and res.sink.calls == 8
        assert [c.request_ts_ns for c in rec.calls()][0] % 1000 != 0     # below the microsecond, kept


def test_pcapng_sections_each_with_their_own_byte_order_interfaces_and_resolution(tmp_path: Path) -> None:
    """Three sections: little-endian Ethernet in microseconds; big-endian with two interfaces (an unused
    one, then raw IP in nanoseconds) and statistics/unknown blocks to skip; little-endian again with a
    power-of-two resolution and a Simple Packet Block (no timestamp: the previous packet's). Interface
    ids start again at 0 in every section. (scapy misread this file: it kept the first section's
    interfaces and could not stamp the SPB.)"""
    pkts = _traffic()
    a, b, c = pkts[:10], pkts[10:20], pkts[20:]
    isb = _pcapng_block(5, struct.pack("<III", 0, 0, 0))           # interface statistics: skipped
    custom = _pcapng_block(0x00000BAD, b"vendor data")               # custom block: skipped
    data = _shb("<") + _idb(1) + isb + b"".join(_epb(0, ts // 1000, _eth(f)) for ts, f in a)
    data += _shb(">") + _idb(1, endian=">") + _idb(101, 9, endian=">") + _pcapng_block(5, bytes(12), ">")
    data += b"".join(_epb(1, ts, f, ">") for ts, f in b)
    data += _shb("<") + custom + _idb(101, 0x80 | 24)
    data += b"".join(_epb(0, ts * 2**24 // 10**9, f) for ts, f in c[:-1])
    spb_frame = c[-1][1]
    data += _pcapng_block(3, struct.pack("<I", len(spb_frame)) + spb_frame)
    path = tmp_path / "sections.pcapng"
    path.write_bytes(data)
    got, problems = _fast_framed(path)
    assert problems == []
    last_c = (c[-2][0] * 2**24 // 10**9) * 10**9 // 2**24
    assert got == ([(1, ts // 1000 * 1000, _eth(f)) for ts, f in a] + [(101, ts, f) for ts, f in b]
                   + [(101, (ts * 2**24 // 10**9) * 10**9 // 2**24, f) for ts, f in c[:-1]]
                   + [(101, last_c, spb_frame)])
    res = import_capture(str(path), str(tmp_path / "s.rec"))
    assert res.packets == len(pkts) and res.sink.calls == 8 and not res.all_problems


def test_packets_of_an_interface_never_described_are_skipped_as_scapy_did(tmp_path: Path) -> None:
    pkts = _traffic()
    path = tmp_path / "r.pcapng"
    path.write_bytes(_shb() + _idb(101) + b"".join(_epb(i % 2 * 7, ts // 1000, f) for i, (ts, f) in enumerate(pkts)))
    got, problems = _fast_framed(path)
    assert problems == [] and got == _scapy_framed(path) and len(got) == (len(pkts) + 1) // 2


def _cut_cases(tmp_path: Path) -> dict[str, tuple[Path, int, str]]:
    """name -> (file, packets before the damage, the problem's start)."""
    pkts = _traffic()[:6]
    pcap = tmp_path / "whole.pcap"
    _write_pcap(pcap, pkts)
    data = pcap.read_bytes()
    rec3 = 24 + sum(16 + len(f) for _, f in pkts[:3])          # where the 4th record starts
    ng = _shb() + _idb(101, 9) + b"".join(_epb(0, ts, f) for ts, f in pkts)
    ng3 = len(_shb() + _idb(101, 9)) + sum(len(_epb(0, ts, f)) for ts, f in pkts[:3])
    cases = {
        "pcap-cut-in-record-header": (data[:rec3 + 9], 3, "the file ends inside a record after 3 whole packets "
                                      "(truncated capture); imported the 3 packets before it"),
        "pcap-cut-in-packet": (data[:rec3 + 16 + 5], 3, "the file ends inside packet 4 (truncated capture); "
                               "imported the 3 whole packets before it"),
        "pcap-absurd-length": (data[:rec3 + 8] + struct.pack("<I", 0xFFFFFFF0) + data[rec3 + 12:], 3,
                               "the file ends inside packet 4 (truncated capture)"),
        "pcap-1-byte-after-last": (data + b"\0", 6, "the file ends inside a record after 6 whole packets"),
        "pcapng-cut-in-block": (ng[:ng3 + 30], 3, "the file ends inside a record after 3 whole packets "
                                "(truncated capture); imported the 3 packets before it"),
        "pcapng-cut-in-block-header": (ng[:ng3 + 6], 3, "the file ends inside a record after 3 whole packets"),
        "pcapng-absurd-length": (ng[:ng3 + 4] + struct.pack("<I", 0xFFFFFFF0) + ng[ng3 + 8:], 3,
                                 "the file ends inside a record after 3 whole packets"),
        "pcapng-trailer-differs": (ng[:ng3] + _epb(0, 5, b"x" * 40)[:-4] + struct.pack("<I", 999) + ng[ng3:], 3,
                                   "stopped at packet 4: damaged data (the block at byte"),
        "pcapng-length-below-12": (ng[:ng3 + 4] + struct.pack("<I", 8) + ng[ng3 + 8:], 3,
                                   "stopped at packet 4: damaged data (a block length of 8 at byte"),
    }
    out = {}
    for name, (content, before, problem) in cases.items():
        path = tmp_path / f"{name}.{'pcapng' if name.startswith('pcapng') else 'pcap'}"
        path.write_bytes(content)
        out[name] = (path, before, problem)
    return out


CUTS = ["pcap-cut-in-record-header", "pcap-cut-in-packet", "pcap-absurd-length", "pcap-1-byte-after-last",
        "pcapng-cut-in-block", "pcapng-cut-in-block-header", "pcapng-absurd-length", "pcapng-trailer-differs",
        "pcapng-length-below-12"]


@pytest.mark.parametrize("case", CUTS)
def test_cut_and_damaged_captures_stop_there_with_the_same_words(tmp_path: Path, case: str) -> None:
    """Truncated and damaged files: the packets before the damage, exactly (scapy's, too), and the
    problem in the words import has always used (a cut: "the file ends inside ..."; a length that
    cannot be: "stopped at packet N: damaged data (...)"); without --salvage, exit 1 and no file."""
    path, before, problem = _cut_cases(tmp_path)[case]
    got, problems = _fast_framed(path)
    assert len(got) == before and len(problems) == 1 and problems[0].startswith(problem), problems
    assert got == _scapy_framed(path)[:before]
    res = import_capture(str(path), str(tmp_path / "salvaged.rec"))
    assert res.packets == before and res.problems == problems
    cli_res = CliRunner().invoke(cli, ["import", str(path), "-o", str(tmp_path / "strict.rec")])
    assert cli_res.exit_code == 1 and "Traceback" not in cli_res.output and "--salvage" in cli_res.output
    assert problem.split(" (")[0] in " ".join(cli_res.output.split()) and not (tmp_path / "strict.rec").exists()


@pytest.mark.parametrize("content, why", [
    (struct.pack("<I", 0xA1B2C3D4) + b"\0" * 10, "its pcap header is cut short"),
    (b"\x0a\x0d\x0d\x0a" + b"\0" * 8, "its section header block at byte 0 has no byte-order magic"),
    (_shb()[:20], "its section header block is cut short"),
    (_shb()[:-4] + b"\0\0\0\0", "its section header block at byte 0 has length 28 at its start and 0 at its end"),
    (_pcapng_block(0x0A0D0D0A, struct.pack("<IHHq", 0x1A2B3C4D, 2, 0, -1)), "pcapng version 2"),
])
def test_unreadable_file_headers_are_not_a_capture(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "bad.pcap"
    path.write_bytes(content)
    with pytest.raises(PcapError, match="not a pcap or pcapng file") as info:
        _fast_framed(path)
    assert why in str(info.value)
    result = CliRunner().invoke(cli, ["import", str(path), "-o", str(tmp_path / "b.rec"), "--salvage"])
    assert result.exit_code == 1 and "not a pcap or pcapng file" in " ".join(result.output.split())
    assert "Traceback" not in result.output and not (tmp_path / "b.rec").exists()


def test_a_large_capture_is_read_in_chunks_not_whole(tmp_path: Path) -> None:
    """9 MiB of full-size frames: read with at most 3 MiB in memory (1 MiB reads)."""
    import tracemalloc

    frame = _ip_tcp(CLIENT, SERVER, 1, 0, 0x18, b"z" * 1400)
    pkts = [(_TS0 + i, frame) for i in range(6600)]
    path = tmp_path / "big.pcap"
    _write_pcap(path, pkts)
    assert path.stat().st_size > 9 << 20
    tracemalloc.start()
    try:
        from capture.pcapfile import read_packets

        problems: list[str] = []
        n = sum(1 for lt, ts, f in read_packets(str(path), problems) if f == frame and lt == 101)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == len(pkts) and problems == []
    assert peak < 3 << 20, f"peak {peak} bytes reading a {path.stat().st_size}-byte file"


@pytest.mark.parametrize("chunk", [None, 40])
def test_a_pcap_record_longer_than_any_snap_length_is_damage_wherever_it_falls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int | None) -> None:
    """A record header whose length is garbage (1 MiB, in a file that has that many bytes after it):
    damage at that packet whether or not the record lies wholly in the window read."""
    import capture.pcapfile

    if chunk:
        monkeypatch.setattr(capture.pcapfile, "CHUNK", chunk)
    pkts = _traffic()[:4]
    path = tmp_path / "garbage.pcap"
    _write_pcap(path, pkts)
    data = bytearray(path.read_bytes())
    at = 24 + sum(16 + len(f) for _, f in pkts[:2])
    data[at + 8:at + 12] = struct.pack("<I", 1 << 20)
    path.write_bytes(bytes(data) + b"\0" * (2 << 20))
    got, problems = _fast_framed(path)
    assert len(got) == 2 and problems == [f"stopped at packet 3: damaged data (a record of {1 << 20} bytes at byte "
                                          f"{at}, more than the file's snap length 262144); imported what came before"]


@pytest.mark.parametrize("linktype", [1, 101, 113])     # Ethernet, raw IP, Linux cooked
def test_parse_gives_the_segment_and_address_text_ipaddress_would(linktype: int) -> None:
    """The fast parse (struct reads, cached address text, fields set directly) against the plain
    construction: the same Segment, equal and of the same type, IPv6 written as ipaddress writes it
    (an IPv4-mapped address as its IPv4 text) and the address cache not mixing up IPv4 and IPv6."""
    import ipaddress

    from capture.packets import parse

    pairs = [("10.0.0.1", "10.0.0.2"), ("2001:db8::1", "fe80::2"), ("::1.2.3.4", "::1"), ("::ffff:10.0.0.1", "::"),
             ("2001:db8:0:0:1:0:0:1", "1:2:3:4:5:6:7:8")]
    for a, b in pairs:
        ethertype = b"\x86\xdd" if ":" in a else b"\x08\x00"
        data = {1: bytes(12) + ethertype, 101: b"", 113: bytes(14) + ethertype}[linktype]
        data += _ip_tcp((a, 40001), (b, 50051), 7, 9, 0x18, b"payload")
        text = [str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)
                for ip in (ipaddress.ip_address(a), ipaddress.ip_address(b))]
        for _ in range(2):          # the second time from the cache
            seg = parse(linktype, data)
            assert seg == Segment((text[0], 40001), (text[1], 50051), 7, 9, 0x18, b"payload")
            assert type(seg) is Segment and vars(seg) == vars(Segment((text[0], 40001), (text[1], 50051), 7, 9,
                                                                      0x18, b"payload"))
    assert parse(1, _eth(_ip_tcp(CLIENT, SERVER, 1, 0, 0x18, b"x"))[:30]) is None     # cut inside the IP header
