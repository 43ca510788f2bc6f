"""Damaged files: one line and exit 1, never a traceback; salvage streams with bounded memory and
leaves no stray files; a truncated pcapng is a recorded problem and a non-zero exit."""

from __future__ import annotations

import os
import sqlite3
import struct
import subprocess
import sys
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from capture.recording import Call, Chunk, Flow, Message, RecordingWriter

_CLI = "from harness.cli import main; main()"


def _write(path: Path, calls: int = 3, blob: int = 0) -> None:
    with RecordingWriter(path, meta={"host": "test"}) as w:
        fid = w.add_flow(Flow(src=("127.0.0.1", 40000), dst=("127.0.0.1", 50051)))
        w.add_chunk(Chunk(fid, "c2s", 100, b"hello"))
        for i in range(calls):
            w.add_call(Call(protocol="grpc", method="/a.B/C", request_ts_ns=1000 + i, flow_id=fid,
                            request_metadata=[("x-k", str(i))], status=0,
                            requests=[Message("c2s", 0, 1000 + i, os.urandom(blob) if blob else b"q")],
                            responses=[Message("s2c", 0, 1010 + i, b"r")]))
        w.update_flow(fid, closed_ns=99999, protocol="grpc")


def _sql(path: Path, statement: str) -> None:
    db = sqlite3.connect(path)
    db.execute(statement)
    db.commit()
    db.execute("PRAGMA journal_mode=DELETE")
    db.close()


def _page_size_zero(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[16:18] = b"\x00\x00"
    path.write_bytes(bytes(data))


def _bad_json(path: Path) -> None:
    _sql(path, "UPDATE calls SET request_metadata = '[[\"x-k\", ' WHERE id = 2")


def _bad_timestamp(path: Path) -> None:
    _sql(path, "UPDATE calls SET request_ts_ns = 'yesterday' WHERE id = 2")


def _bad_meta_json(path: Path) -> None:
    _sql(path, "UPDATE meta SET value = '{not json' WHERE key = 'host'")


def _shadowtest(*args: str, tmpdir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **({"TMPDIR": str(tmpdir)} if tmpdir else {}))
    return subprocess.run([sys.executable, "-c", _CLI, *args], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1], env=env)


@pytest.mark.parametrize("damage", [_page_size_zero, _bad_json, _bad_timestamp, _bad_meta_json])
@pytest.mark.parametrize("cmd", ["inspect", "replay"])
def test_damaged_recording_is_one_line_and_exit_1(tmp_path: Path, damage: Callable[[Path], None],
                                                  cmd: str) -> None:
    path = tmp_path / "r.rec"
    _write(path)
    damage(path)
    args = [cmd, str(path)] + (["--target", "127.0.0.1:1", "--dry-run"] if cmd == "replay" else [])
    res = _shadowtest(*args)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "Traceback" not in out, out
    if cmd == "replay":   # inspect may list what it read, and the problem; replay says one line
        assert len(res.stderr.strip().splitlines()) == 1, out
    else:
        assert any(word in out for word in ("damaged", "not a readable", "unreadable")), out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.rec"]


def _cut(path: Path, keep: float) -> None:
    with path.open("r+b") as f:
        f.truncate(int(path.stat().st_size * keep) // 8192 * 8192 + 100)


def test_salvage_streams_with_bounded_memory_and_leaves_no_files(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from capture.salvage import open_salvaged

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    path = tmp_path / "big.rec"
    _write(path, calls=400, blob=64 << 10)          # ~26 MB
    _cut(path, 0.7)
    size = path.stat().st_size
    assert size > 16 << 20
    tracemalloc.start()
    try:
        with open_salvaged(path) as rec:
            assert rec.problems and "damaged" in rec.problems[0]
            n = sum(1 for _ in rec.calls(with_messages=False, batch_size=8))
            # while it is read, the copy alone: no -wal/-shm that a killed reader would leave behind
            assert [p.suffix for p in scratch.iterdir()] == [".rec"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n > 0
    assert peak < 8 << 20, f"peak {peak} bytes for a {size} byte file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.rec", "scratch"]
    assert list(scratch.iterdir()) == []


def test_salvage_of_a_damaged_recording_leaves_no_wal_or_shm(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    _write(path, calls=50, blob=20000)
    _cut(path, 0.6)
    scratch = tmp_path / "scratch"     # where the repaired copy goes (TMPDIR)
    scratch.mkdir()
    res = _shadowtest("inspect", str(path), tmpdir=scratch)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "Traceback" not in out and "reading its intact part" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.rec", "scratch"]
    assert list(scratch.iterdir()) == []




def _block(btype: int, body: bytes) -> bytes:
    body += b"\x00" * (-len(body) % 4)
    n = 12 + len(body)
    return struct.pack("<II", btype, n) + body + struct.pack("<I", n)


def _tcp_frame(src: int, dst: int, seq: int, flags: int, payload: bytes) -> bytes:
    ip_len = 20 + 20 + len(payload)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, ip_len, 0, 0, 64, 6, 0, bytes([127, 0, 0, 1]),
                     bytes([127, 0, 0, 1]))
    tcp = struct.pack("!HHIIBBHHH", src, dst, seq, 0, 5 << 4, flags, 65535, 0, 0)
    return b"\x00" * 12 + b"\x08\x00" + ip + tcp + payload


def _write_pcapng(path: Path, frames: list[bytes]) -> None:
    shb = _block(0x0A0D0D0A, struct.pack("<IHHq", 0x1A2B3C4D, 1, 0, -1))
    idb = _block(1, struct.pack("<HHI", 1, 0, 0))
    epbs = b"".join(_block(6, struct.pack("<IIIII", 0, 0, i, len(f), len(f)) + f) for i, f in enumerate(frames))
    path.write_bytes(shb + idb + epbs)


@pytest.mark.parametrize("cut", [7, 30])
def test_truncated_pcapng_is_a_problem_and_exit_1(tmp_path: Path, cut: int) -> None:
    from capture.pcap_import import import_capture

    frames = [_tcp_frame(40000, 8080, 1000, 0x02, b""),
              _tcp_frame(40000, 8080, 1001, 0x18, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
              _tcp_frame(40000, 8080, 1001 + 27, 0x18, b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")]
    whole = tmp_path / "whole.pcapng"
    _write_pcapng(whole, frames)
    ok = import_capture(str(whole), str(tmp_path / "whole.rec"))
    assert ok.packets == 3 and not ok.all_problems
    cut_file = tmp_path / "cut.pcapng"
    cut_file.write_bytes(whole.read_bytes()[:-cut])
    imported = import_capture(str(cut_file), str(tmp_path / "cut.rec"))
    assert imported.packets == 2
    assert any("truncated" in p for p in imported.all_problems), imported.all_problems
    res = _shadowtest("import", str(cut_file), "-o", str(tmp_path / "cut2.rec"))
    assert res.returncode == 1 and "truncated" in res.stderr and "Traceback" not in res.stderr
