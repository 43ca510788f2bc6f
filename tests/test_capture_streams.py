"""The eBPF recorder's records, as the kernel would write them, through the loader into a real sink:
every record a full ring lost becomes a gap of its exact size where it was, and no HTTP/1 call is ever
paired with another request's response. No root needed: the records are built here (EvHdr is the
program's own header), which lets each loss land exactly where a test wants it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from capture.backends import RecordOptions
from capture.ebpf.loader import EV_CLOSE, EV_DATA, EV_OPEN, EbpfBackend, EvHdr, SockInfo
from capture.ebpf.streams import Streams
from capture.record import build_redactor
from capture.recording import Call, Recording, RecordingWriter, call_damage
from capture.sink import FlowSink

TGID, FD = 4242, 7
BODY = bytes(range(256)) * 64          # 16 KiB


class Wire:
    """One server-side connection's syscalls as DATA records with the kernel's positions."""

    def __init__(self, backend: EbpfBackend) -> None:
        self.backend = backend
        self.pos = {0: 0, 1: 0}          # read, written (as the socket map counts them)
        self.ts = 1_000

    def _send(self, h: EvHdr, payload: bytes = b"") -> None:
        self.ts += 1_000
        h.ts_ns, h.tgid, h.fd = self.ts, TGID, FD
        self.backend._handle(bytes(h) + payload)     # the decode thread's entry point

    def open(self) -> None:
        si = SockInfo(family=2, is_server=1, lport=8080, rport=40000)
        ctypes.memmove(si.laddr, bytes([127, 0, 0, 1]), 4)
        ctypes.memmove(si.raddr, bytes([127, 0, 0, 1]), 4)
        self.pos = {0: 0, 1: 0}
        h = EvHdr(type=EV_OPEN)
        h.si = si
        self._send(h)

    def syscall(self, write: bool, data: bytes, lost: bool = False) -> None:
        """One read (client bytes) or write (server bytes); `lost`: its record never reached user space."""
        start = self.pos[int(write)]
        self.pos[int(write)] += len(data)
        if lost:
            self.ts += 1_000
            return
        h = EvHdr(type=EV_DATA, pos=start, len=len(data), total=len(data), is_write=int(write))
        self._send(h, data)

    def close(self, lost: bool = False) -> None:
        if lost:
            return
        h = EvHdr(type=EV_CLOSE)
        h.si = SockInfo(rd=self.pos[0], wr=self.pos[1])
        self._send(h)


def _recorder(path: Path) -> tuple[EbpfBackend, FlowSink, RecordingWriter]:
    writer = RecordingWriter(path)
    sink = FlowSink(writer, build_redactor(True, []))
    backend = EbpfBackend(RecordOptions(output=str(path), port=8080))
    backend.sink = sink
    backend._streams = Streams(sink, backend._max_bytes)
    return backend, sink, writer


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body


def _calls(path: Path) -> list[Call]:
    with Recording(path) as rec:
        return sorted(rec.calls(), key=lambda c: c.request_ts_ns)


def _finish(backend: EbpfBackend, sink: FlowSink, writer: RecordingWriter) -> None:
    backend._streams.flush(force=True)
    sink.close()
    writer.close()


def test_a_lost_record_inside_a_body_is_a_gap_of_its_size_and_the_next_calls_still_pair(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    backend, sink, writer = _recorder(path)
    wire = Wire(backend)
    wire.open()
    first = _ok(BODY * 2)
    wire.syscall(False, _get("/a"))
    wire.syscall(True, first[:100])
    wire.syscall(True, first[100:9000], lost=True)         # a record the full ring dropped
    wire.syscall(True, first[9000:])
    wire.syscall(False, _get("/b"))
    wire.syscall(True, _ok(b"bee"))
    wire.close()
    _finish(backend, sink, writer)
    calls = _calls(path)
    assert [(c.method, c.status) for c in calls] == [("GET /a", 200), ("GET /b", 200)]
    assert calls[0].status_message is not None and "8900 bytes missing in a gap" in calls[0].status_message
    assert [m.data for m in calls[1].responses] == [b"bee"]
    with Recording(path) as rec:
        assert [(g[1], g[3]) for g in rec.gaps()] == [("s2c", 8900)]


def test_a_lost_response_head_stops_the_pairing_instead_of_pairing_the_next_response(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    backend, sink, writer = _recorder(path)
    wire = Wire(backend)
    wire.open()
    for p in ("/a", "/b", "/c"):
        wire.syscall(False, _get(p))
    wire.syscall(True, _ok(BODY), lost=True)                # /a's whole answer
    wire.syscall(True, _ok(b"b-body"), lost=True)           # and /b's
    wire.syscall(True, _ok(b"c-body"))
    wire.close()
    _finish(backend, sink, writer)
    calls = _calls(path)
    # without the gap, /a would have been stored with /c's answer
    assert [c.method for c in calls] == ["GET /a", "GET /b", "GET /c"]
    assert all(c.status is None and not c.responses for c in calls)
    assert all(call_damage(c.status, c.status_message, c.protocol) for c in calls)


def test_records_lost_at_the_end_are_a_gap_from_the_close_s_final_positions(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    backend, sink, writer = _recorder(path)
    wire = Wire(backend)
    wire.open()
    answer = _ok(BODY)
    wire.syscall(False, _get("/a"))
    wire.syscall(True, answer[:500])
    wire.syscall(True, answer[500:], lost=True)
    wire.close()
    _finish(backend, sink, writer)
    with Recording(path) as rec:
        assert [(g[1], g[3]) for g in rec.gaps()] == [("s2c", len(answer) - 500)]
    (call,) = _calls(path)
    assert call.status == 200 and not call.responses and "missing in a gap" in (call.status_message or "")


def test_a_lost_close_leaves_the_old_connection_ending_in_a_gap_and_the_new_one_starting_at_zero(
        tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    backend, sink, writer = _recorder(path)
    wire = Wire(backend)
    wire.open()
    wire.syscall(False, _get("/a"))
    wire.syscall(True, _ok(b"a-body"))
    wire.syscall(False, _get("/b"))
    wire.close(lost=True)                                   # ... its CLOSE lost
    wire.open()                                             # the fd's next connection
    wire.syscall(False, _get("/c"))
    wire.syscall(False, _get("/d"))
    # /c's answer is lost; it is as long as the old connection's last answer, so /d's answer starts
    # where the old connection's stream had got to: only a fresh start at 0 sees the loss
    wire.syscall(True, _ok(b"c-body"), lost=True)
    wire.syscall(True, _ok(b"d-body"))
    wire.close()
    _finish(backend, sink, writer)
    calls = _calls(path)
    assert [(c.method, c.status) for c in calls] == [("GET /a", 200), ("GET /b", None), ("GET /c", None),
                                                     ("GET /d", None)]
    assert all("outcome unknown" in (c.status_message or "") for c in calls[1:])
    with Recording(path) as rec:
        flows = list(rec.flows())
        gaps = rec.gaps()
    assert len(flows) == 2
    assert sorted((g[0], g[1], g[3]) for g in gaps) == [(flows[0].id, "c2s", None), (flows[0].id, "s2c", None),
                                                       (flows[1].id, "s2c", len(_ok(b"c-body")))]


def test_records_lost_inside_one_large_syscall_split_it_around_a_gap(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    backend, sink, writer = _recorder(path)
    wire = Wire(backend)
    wire.open()
    answer = _ok(BODY * 8)                                  # 128 KiB in one write: records of 64 KiB
    wire.syscall(False, _get("/a"))
    start = wire.pos[1]
    wire.pos[1] += len(answer)
    chunk = 65536
    for off in range(0, len(answer), chunk):
        if off == chunk:
            continue                                        # the second record lost
        piece = answer[off:off + chunk]
        h = EvHdr(type=EV_DATA, pos=start, len=len(piece), total=len(answer), offset=off, is_write=1)
        h.ts_ns, h.tgid, h.fd = 5_000_000, TGID, FD         # one syscall: one time for all its records
        backend._handle(bytes(h) + piece)
    wire.syscall(False, _get("/b"))
    wire.syscall(True, _ok(b"bee"))
    wire.close()
    _finish(backend, sink, writer)
    with Recording(path) as rec:
        assert [(g[1], g[3]) for g in rec.gaps()] == [("s2c", chunk)]
    calls = _calls(path)
    assert [(c.method, c.status) for c in calls] == [("GET /a", 200), ("GET /b", 200)]
    assert "missing in a gap" in (calls[0].status_message or "")
    assert [m.data for m in calls[1].responses] == [b"bee"]

