"""Damaged files never pass: cuts and flipped bytes through every command that reads a recording.

Each damage (a copy cut at several offsets; one byte flipped in the header, in a mid-file page, in a
chunk's payload, in a message's payload, in the WAL of a recorder that never closed) is run through
inspect, replay, replay --compare, export, redact and infer against a real HTTP/1 service. Without
--salvage none exits 0 and none writes an output; with it the loss is stated, and replay counts the
calls lost as not sent (damaged_recording) so that scheduled = ok + ... + not_sent still holds and the
run fails unless --max-not-sent-pct accepts the loss. Cut captures through import likewise.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from http_target import JsonTarget, write_orders  # tests/ is on sys.path under pytest

from capture.pcap_export import export_file
from capture.recording import RecordingWriter
from harness.cli import cli

CALLS = 120
SALVAGE_HINT = "--salvage"


def _page_size(path: Path) -> int:
    size = struct.unpack(">H", path.read_bytes()[16:18])[0]
    return 65536 if size == 1 else size


def _cut(fraction: float, into_page: int = 0) -> Callable[[Path], None]:
    def cut(path: Path) -> None:
        page = _page_size(path)
        with path.open("r+b") as f:
            f.truncate(int(path.stat().st_size * fraction) // page * page + into_page)
    return cut


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _flip_header(path: Path) -> None:
    _flip(path, 31)                  # the header's page count: the file no longer matches it


def _flip_mid_page(path: Path) -> None:
    """The type byte of the b-tree page nearest the middle of the file: its structure is damaged."""
    data, page = path.read_bytes(), _page_size(path)
    pages = len(data) // page
    middle = min(range(1, pages), key=lambda i: abs(i - pages // 2) if data[i * page] in (2, 5, 10, 13) else pages)
    _flip(path, middle * page)


def _flip_marker(marker: bytes) -> Callable[[Path], None]:
    def flip(path: Path) -> None:
        data = path.read_bytes()
        at = data.find(marker, len(data) // 2)
        assert at > 0, marker
        _flip(path, at + 3)          # a payload byte: SQLite's structure is untouched
    return flip


DAMAGES: dict[str, Callable[[Path], None]] = {
    "cut-at-30%": _cut(0.3),
    "cut-at-55%-mid-page": _cut(0.55, 1000),
    "cut-at-85%": _cut(0.85),
    "flip-header": _flip_header,
    "flip-mid-file-page": _flip_mid_page,
    "flip-in-a-chunk": _flip_marker(b"CHUNK-MARK"),
    "flip-in-a-message": _flip_marker(b"MSG-MARK"),
}
WAL = "flip-in-the-wal"
# damages whose loss no count can tell (SQLite drops every commit after a damaged WAL frame)
UNKNOWN_LOSS = {WAL}
# calls each damage costs this recording (its layout is fixed: calls' pages are early, chunks' and
# messages' spread over the file, so a cut at 30 % or 55 % takes every call, one at 85 % some; a chunk
# or the header's page count damaged costs no call: replay sends calls from their messages)
LOST = {"cut-at-30%": CALLS, "cut-at-55%-mid-page": CALLS, "cut-at-85%": 27, "flip-header": 0,
        "flip-mid-file-page": 0, "flip-in-a-chunk": 0, "flip-in-a-message": 1}


@pytest.fixture
def target() -> Iterator[JsonTarget]:
    with JsonTarget() as t:
        yield t


def _damaged(tmp_path: Path, damage: str) -> Path:
    path = tmp_path / "r.rec"
    if damage == WAL:
        return _with_damaged_wal(tmp_path, path)
    write_orders(path, CALLS)
    DAMAGES[damage](path)
    return path


def _with_damaged_wal(tmp_path: Path, path: Path) -> Path:
    """A recorder that never closed (its last commits in the WAL), copied, one byte of a middle WAL frame flipped."""
    live = tmp_path / "live" / "r.rec"
    live.parent.mkdir()
    writer = RecordingWriter(live, meta={"host": "test", "backend": "import"}, flush_interval_s=3600)
    try:
        write_orders(live, CALLS, writer=writer)
        shutil.copyfile(live, path)
        shutil.copyfile(f"{live}-wal", f"{path}-wal")
    finally:
        writer.close()
    shutil.rmtree(live.parent)
    wal = Path(f"{path}-wal")
    page = struct.unpack(">I", wal.read_bytes()[8:12])[0]
    frames = (wal.stat().st_size - 32) // (24 + page)
    _flip(wal, 32 + (frames // 2) * (24 + page) + 24 + page // 2)
    return path


def _cli(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def _commands(path: Path, out: Path, target: str) -> dict[str, list[str]]:
    return {
        "replay": ["replay", str(path), "--target", target, "--speed", "20", "--json", str(out.with_suffix(".json"))],
        "compare": ["replay", str(path), "--target", target, "--speed", "20", "--compare",
                    "--json", str(out.with_suffix(".json"))],
        "export": ["export", str(path), "-o", str(out)],
        "redact": ["redact", str(path), "-o", str(out), "--rule", "header:x-secret"],
        "infer": ["infer", str(path), "--descriptors", "agent_under_test.proto.agent_pb2"],
    }


ALL_DAMAGES = [*DAMAGES, WAL]


@pytest.mark.parametrize("damage", ALL_DAMAGES)
def test_inspect_says_every_damage(tmp_path: Path, damage: str) -> None:
    path = _damaged(tmp_path, damage)
    res = _cli("inspect", str(path), "--json")
    assert res.exit_code == 1, res.output
    report = json.loads(res.stdout)
    assert report["complete"] is False and report["problems"], report["problems"]


@pytest.mark.parametrize("command", ["replay", "compare", "export", "redact", "infer"])
@pytest.mark.parametrize("damage", ALL_DAMAGES)
def test_without_salvage_nothing_passes_and_nothing_is_written(tmp_path: Path, target: JsonTarget, damage: str,
                                                               command: str) -> None:
    path = _damaged(tmp_path, damage)
    out = tmp_path / "out.data"
    before = sorted(p.name for p in tmp_path.iterdir())
    res = _cli(*_commands(path, out, target.address)[command])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and SALVAGE_HINT in res.stderr, res.output
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr          # one line
    assert target.paths == [] and target.first_bytes == []               # nothing was sent
    assert not out.exists()
    if command in ("replay", "compare"):       # --json is written on an error exit too, with the error
        report = json.loads(out.with_suffix(".json").read_text())
        assert report["passed"] is False and SALVAGE_HINT in report["error"], report
        out.with_suffix(".json").unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == before      # the damaged file, and nothing else


def _salvaged_replay(path: Path, target: JsonTarget, *extra: str) -> tuple[Result, dict]:
    out = path.with_suffix(".json")
    res = _cli("replay", str(path), "--target", target.address, "--speed", "20", "--salvage", "--json", str(out),
               *extra)
    return res, json.loads(out.read_text())


@pytest.mark.parametrize("damage", ALL_DAMAGES)
def test_replay_salvage_counts_the_calls_lost_and_fails_unless_allowed(tmp_path: Path, target: JsonTarget,
                                                                      damage: str) -> None:
    path = _damaged(tmp_path, damage)
    res, report = _salvaged_replay(path, target)
    lost = report["not_sent_reasons"].get("damaged_recording", 0)
    assert report["invariant_ok"] and report["problems"], report
    assert report["ok"] == len(target.paths) == CALLS - LOST[damage] if damage not in UNKNOWN_LOSS else True
    if damage in UNKNOWN_LOSS:
        assert report["ok"] == len(target.paths) > 0          # the WAL's intact commits were replayed
        assert any("an unknown number of calls lost to damage" in p for p in report["problems"]), report["problems"]
        assert res.exit_code == 1 and not report["passed"], res.output
    elif not LOST[damage]:                                 # damage that cost no call: stated, and it passes
        assert lost == 0 and report["scheduled"] == CALLS and res.exit_code == 0, res.output
        assert any("0 calls lost to damage" in p for p in report["problems"]), report["problems"]
        return
    else:
        # every recorded call is accounted for: replayed, or lost to the damage and said so
        assert lost == LOST[damage] and report["scheduled"] == CALLS == report["ok"] + lost, report
        assert any(f"{lost} call" in p and "lost to damage" in p for p in report["problems"]), report["problems"]
        assert res.exit_code == 1 and any("lost to damage" in f for f in report["failures"]), report["failures"]
        assert "verdict: FAILED" in res.stdout and "damaged_recording" in res.stdout
    nothing_left = ("--min-ok", "0") if report["ok"] == 0 else ()    # else "no call succeeded" fails it
    allowed, report = _salvaged_replay(path, target, "--max-not-sent-pct", "100", *nothing_left)
    assert allowed.exit_code == 0 and report["passed"], allowed.output


@pytest.mark.parametrize("damage", ALL_DAMAGES)
def test_export_redact_infer_salvage_state_the_loss(tmp_path: Path, damage: str) -> None:
    path = _damaged(tmp_path, damage)
    loss = "an unknown number of calls lost to damage" if damage in UNKNOWN_LOSS else "lost to damage"
    exported = _cli("export", str(path), "-o", str(tmp_path / "x.pcapng"), "--salvage")
    assert exported.exit_code == 0 and loss in exported.stdout and (tmp_path / "x.pcapng").exists(), exported.output
    redacted = _cli("redact", str(path), "-o", str(tmp_path / "safe.rec"), "--rule", "header:x-secret", "--salvage")
    assert redacted.exit_code == 0 and loss in redacted.stdout, redacted.output
    inferred = _cli("infer", str(path), "--descriptors", "agent_under_test.proto.agent_pb2", "--salvage")
    assert loss in inferred.output, inferred.output
    # the copy says it is partial: inspect calls it incomplete, replay refuses it without --salvage
    copy = _cli("inspect", str(tmp_path / "safe.rec"), "--json")
    report = json.loads(copy.stdout)
    assert copy.exit_code == 1 and report["complete"] is False
    assert any("written with --salvage" in p for p in report["problems"]), report["problems"]
    refused = _cli("replay", str(tmp_path / "safe.rec"), "--target", "127.0.0.1:1", "--dry-run")
    assert refused.exit_code == 1 and SALVAGE_HINT in refused.stderr, refused.output


def test_an_intact_recording_passes_every_command_and_its_copies_are_complete(tmp_path: Path,
                                                                             target: JsonTarget) -> None:
    path = tmp_path / "r.rec"
    write_orders(path, CALLS)
    assert _cli("inspect", str(path), "--strict").exit_code == 0
    res = _cli("replay", str(path), "--target", target.address, "--speed", "20", "--compare")
    assert res.exit_code == 0 and len(target.paths) == CALLS, res.output
    assert _cli("export", str(path), "-o", str(tmp_path / "x.pcapng")).exit_code == 0
    assert _cli("redact", str(path), "-o", str(tmp_path / "safe.rec"), "--rule", "header:x-secret").exit_code == 0
    assert _cli("inspect", str(tmp_path / "safe.rec"), "--strict").exit_code == 0
    imported = _cli("import", str(tmp_path / "x.pcapng"), "--port", "8080", "-o", str(tmp_path / "back.rec"))
    assert imported.exit_code == 0, imported.output
    assert _cli("inspect", str(tmp_path / "back.rec"), "--strict").exit_code == 0


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    """A pcapng of the recording's traffic (export, the real path), whole."""
    write_orders(tmp_path / "src.rec", 40)
    export_file(str(tmp_path / "src.rec"), str(tmp_path / "whole.pcapng"))
    return tmp_path / "whole.pcapng"


@pytest.mark.parametrize("keep", [10, 40, 0.3, 0.5, 0.75, 0.99])
def test_import_of_a_cut_capture_writes_nothing_without_salvage(tmp_path: Path, capture: Path,
                                                                keep: float) -> None:
    data = capture.read_bytes()
    cut = tmp_path / "cut.pcapng"
    cut.write_bytes(data[:int(len(data) * keep) if keep < 1 else int(keep)])
    out = tmp_path / "cut.rec"
    refused = _cli("import", str(cut), "--port", "8080", "-o", str(out))
    assert refused.exit_code == 1 and "Traceback" not in refused.output, refused.output
    assert not out.exists() and not any(p.name.startswith(".cut.rec") for p in tmp_path.iterdir())
    salvaged = _cli("import", str(cut), "--port", "8080", "-o", str(out), "--salvage")
    if keep < 1:                    # packets before the cut: kept, and the recording says it is partial
        assert salvaged.exit_code == 0 and "partial" in salvaged.stderr, salvaged.output
        report = json.loads(_cli("inspect", str(out), "--json").stdout)
        assert report["complete"] is False and any("truncated" in p for p in report["problems"]), report
        assert _cli("replay", str(out), "--target", "127.0.0.1:1", "--dry-run").exit_code == 1
    else:                           # cut inside the file's own header: nothing to import, nothing written
        assert salvaged.exit_code == 1 and not out.exists(), salvaged.output


def test_a_failed_import_leaves_no_file_and_force_never_leaves_a_half_one(tmp_path: Path, capture: Path) -> None:
    (tmp_path / "junk.pcapng").write_bytes(capture.read_bytes()[:4] + b"\x00" * 8)   # a magic, then nothing
    res = _cli("import", str(tmp_path / "junk.pcapng"), "-o", str(tmp_path / "j.rec"))
    assert res.exit_code == 1 and not (tmp_path / "j.rec").exists(), res.output
    (tmp_path / "keep.rec").write_bytes(b"not ours to overwrite")
    res = _cli("import", str(capture), "-o", str(tmp_path / "keep.rec"))
    assert res.exit_code == 1 and (tmp_path / "keep.rec").read_bytes() == b"not ours to overwrite"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.pcapng", "keep.rec", "src.rec", "whole.pcapng"]


def test_the_check_costs_about_a_second_per_100k_calls_and_finds_one_flipped_byte(tmp_path: Path) -> None:
    """Bounded cost (a cheap check, run by every command): 5,000 calls here; the 100,000-call figure is in
    docs/capture.md. One byte flipped in one message of 5,000 calls is found."""
    import time

    from capture.integrity import check

    path = tmp_path / "big.rec"
    write_orders(path, 5000, flush_every=500)
    started = time.monotonic()
    assert check(path).intact
    elapsed = time.monotonic() - started
    assert elapsed < 5.0, elapsed
    _flip_marker(b"MSG-MARK")(path)
    found = check(path)
    assert found.damage == ["1 call(s) have a message that fails its checksum (bytes damaged on disk)"], found


def test_rows_written_is_kept_at_every_commit(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    writer = RecordingWriter(path, flush_interval_s=3600)
    try:
        write_orders(path, 30, flush_every=10, writer=writer)
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        written = json.loads(db.execute("SELECT value FROM meta WHERE key = 'rows_written'").fetchone()[0])
        db.close()
    finally:
        writer.close()
    assert written == {"chunks": 60, "calls": 30, "messages": 60}
    assert os.stat(path).st_mode & 0o777 == 0o600
