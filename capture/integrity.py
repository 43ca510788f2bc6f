"""Is a recording whole? The check every command runs before it uses a file.

    header  SQLite's magic and page size, the file's length against the header's page count
            (a copy cut short)
    WAL     the checksum of every frame of FILE-wal: SQLite silently ignores a damaged frame and every
            commit after it, so a flipped byte there loses data without an error
    SQLite  PRAGMA quick_check: every page of every table and index (structure, not values)
    rows    the CRC-32 of every chunk, message and call row (capture/rowcrc.py): a byte flipped in
            a payload or a header value reads back as a plausible, wrong value otherwise
    meta    a file written from a damaged source (`import` of a cut capture, `--salvage`) says so

`replay`, `export`, `redact`, `infer` and `replay --compare` refuse a file with any problem unless
given `--salvage` (`open_for`); `inspect` lists the problems. Measured on a 100,000-call recording
(275 MB, in the page cache, this 2-core host): quick_check ~0.25 s, the row checksums ~0.3 s.

With `--salvage` a command reads what is intact (`capture.salvage.open_salvaged`) and says how many
calls that cost: `calls_lost` compares the calls the writer committed (`meta.rows_written`, kept at
every commit) with those that read back intact.
"""

from __future__ import annotations

import functools
import json
import operator
import os
import sqlite3
import struct
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from capture.errors import CorruptRecordingError, RecordingError
from capture.recording import Recording
from capture.rowcrc import CALL_COLUMNS, CHUNK_COLUMNS, MESSAGE_COLUMNS, register

_MAGIC = b"SQLite format 3\x00"
_HEADER = 100
_WAL_HEADER = 32
_FRAME_HEADER = 24
_WAL_MAGIC = 0x377F0682            # | 1: checksums over big-endian words
_MASK = 0xFFFFFFFF
_QUICK_CHECK_LINES = 5             # SQLite's own report: the first few lines say enough
_CRC_SQL = {
    "chunks": f"SELECT count(*) FROM chunks WHERE crc IS NOT NULL AND st_chunk_crc({', '.join(CHUNK_COLUMNS)}) != crc",
    "messages": ("SELECT count(DISTINCT call_id) FROM messages WHERE crc IS NOT NULL"
                 f" AND st_message_crc({', '.join(MESSAGE_COLUMNS)}) != crc"),
    "calls": f"SELECT count(*) FROM calls WHERE crc IS NOT NULL AND st_call_crc({', '.join(CALL_COLUMNS)}) != crc",
}
_CRC_WORDS = {"chunks": "chunk(s) fail their checksum", "messages": "call(s) have a message that fails its checksum",
              "calls": "call(s) fail their checksum"}


@dataclass
class Integrity:
    """What `check` found, one line per problem: `damage` to this file (header, WAL, pages, rows),
    `inherited` loss its meta states (written from a damaged capture or with --salvage). `wal_damaged`:
    read it through a copy (opening the file itself would fold the WAL's intact part in and delete the
    rest). `loss_unknown`: calls may be missing that no count can tell (lost WAL commits, a cut capture)."""

    path: str
    damage: list[str] = field(default_factory=list)
    inherited: list[str] = field(default_factory=list)
    wal_damaged: bool = False
    pages_damaged: bool = False     # the header, a page or the file's length: SQLite's structure
    loss_unknown: bool = False

    @property
    def problems(self) -> list[str]:
        return self.damage + self.inherited

    @property
    def writable(self) -> bool:
        """Whether writing into the file (infer's method map) is safe: its pages and WAL are sound (rows
        failing their checksum are left out by readers; writing beside them harms nothing)."""
        return not self.wal_damaged and not self.pages_damaged

    @property
    def intact(self) -> bool:
        return not self.problems

    def refusal(self, command: str) -> str:
        """The one line a command prints when it refuses the file."""
        more = f" (and {len(self.problems) - 1} more problem(s): `shadowtest inspect` lists them)" \
            if len(self.problems) > 1 else ""
        return (f"{self.path} is damaged: {self.problems[0]}{more}; {command} refuses a damaged recording: "
                "pass --salvage to use its intact part (the calls lost are counted and reported)")


def check(path: str | os.PathLike[str]) -> Integrity:
    """Check `path` (see the module docstring). Raises RecordingError when it does not exist."""
    path = Path(path)
    if not path.exists():
        raise RecordingError(f"{path}: no such recording")
    found = Integrity(str(path))
    wal = Path(f"{path}-wal")
    wal_frames = _wal_problems(wal, found)
    header = _header_problems(path, has_wal=wal_frames > 0)
    found.damage += header
    found.pages_damaged = bool(header)
    if header or found.wal_damaged:
        return found        # opening it would read past the cut, or fold a damaged WAL into the file
    _sqlite_problems(path, found)
    return found


def require_intact(path: str | os.PathLike[str], command: str) -> Integrity:
    """`check(path)`, raising CorruptRecordingError (one line naming --salvage) when it is damaged."""
    found = check(path)
    if not found.intact:
        raise CorruptRecordingError(found.refusal(command))
    return found


def open_for(path: str | os.PathLike[str], command: str, *, salvage: bool) -> tuple[Recording, Integrity]:
    """The recording a command may use: intact, or with `salvage` its intact part (the caller states
    `calls_lost`). Without `salvage` a damaged file raises CorruptRecordingError naming --salvage."""
    from capture.salvage import open_salvaged

    found = check(path)
    if found.intact:
        return Recording(path), found
    if not salvage:
        raise CorruptRecordingError(found.refusal(command))
    return open_salvaged(path, wal_damaged=found.wal_damaged), found


def calls_lost(rec: Recording, found: Integrity | None = None) -> int | None:
    """How many calls `rec` lost to damage: those its writer committed (meta.rows_written) minus those
    that read back intact, plus what an earlier salvage already lost. None when that cannot be told
    (a file from before rows_written, lost WAL commits, a capture cut short). Reads every call."""
    written = (rec.meta.get("rows_written") or {}).get("calls")
    earlier = (rec.meta.get("salvaged") or {}).get("calls_lost", 0)
    if not isinstance(written, int) or earlier is None or (found is not None and found.loss_unknown):
        return None
    intact = sum(1 for _ in rec.calls())
    return max(0, written - intact) + int(earlier)


def loss_text(lost: int | None) -> str:
    """"12 calls lost to damage" / "an unknown number of calls lost to damage"."""
    return "an unknown number of calls lost to damage" if lost is None else \
        f"{lost} call{'' if lost == 1 else 's'} lost to damage"


# ---- header ------------------------------------------------------------------------------------------
def _header_problems(path: Path, *, has_wal: bool) -> list[str]:
    with path.open("rb") as f:
        head = f.read(_HEADER)
        size = os.fstat(f.fileno()).st_size
    if len(head) < _HEADER or not head.startswith(_MAGIC):
        return [f"not a recording: no SQLite header ({size} bytes)"]
    page = struct.unpack(">H", head[16:18])[0]
    page = 65536 if page == 1 else page
    if page < 512 or page & (page - 1):
        return [f"its header is damaged: page size {page} is not one SQLite allows"]
    if size % page:
        return [f"cut off: its {size:,} bytes are not a whole number of its {page:,}-byte pages"]
    pages, change, valid_for = struct.unpack(">I", head[28:32])[0], head[24:28], head[92:96]
    # With a WAL (a recorder killed mid-run) the file may lag its header until the WAL is folded in.
    if pages and change == valid_for and not has_wal and pages != size // page:
        if pages > size // page:
            return [f"cut off (or its header damaged): its header says {pages:,} pages of {page:,} bytes, the file "
                    f"holds {size // page:,}"]
        return [f"its header is damaged: it says {pages:,} pages, the file holds {size // page:,}"]
    return []


# ---- WAL ---------------------------------------------------------------------------------------------
def _wal_problems(wal: Path, found: Integrity) -> int:
    """Check FILE-wal's frames; returns how many whole frames it holds (0: none or no WAL)."""
    try:
        data_size = wal.stat().st_size
    except FileNotFoundError:
        return 0
    if data_size == 0:
        return 0
    with wal.open("rb") as f:
        head = f.read(_WAL_HEADER)
        problem, frames = _scan_wal(f, head, data_size)
    if problem:
        found.damage.append(f"its WAL ({wal.name}) {problem}")
        found.wal_damaged = found.loss_unknown = True
    return frames


def _scan_wal(f: object, head: bytes, size: int) -> tuple[str | None, int]:
    """(what is wrong or None, whole frames) for a WAL whose first bytes are `head`; `f` is at frame 1."""
    if len(head) < _WAL_HEADER:
        return "is cut off inside its header: its commits are lost", 0
    magic, _, page, _, salt1, salt2, ck1, ck2 = struct.unpack(">8I", head)
    if magic & ~1 != _WAL_MAGIC or page < 512 or page & (page - 1):
        return "has a damaged header: SQLite ignores it and every commit in it", 0
    big = bool(magic & 1)
    if _checksum(head[:24], 0, 0, big) != (ck1, ck2):
        return "has a damaged header (its checksum fails): SQLite ignores every commit in it", 0
    frame_size = _FRAME_HEADER + page
    frames = (size - _WAL_HEADER) // frame_size
    s = (ck1, ck2)
    for n in range(1, frames + 1):
        frame = f.read(frame_size)                                         # type: ignore[attr-defined]
        fh = struct.unpack(">6I", frame[:_FRAME_HEADER])
        if (fh[2], fh[3]) != (salt1, salt2):
            return None, frames          # a frame of an earlier generation: the WAL ends before it
        s = _checksum(frame[:8] + frame[_FRAME_HEADER:], *s, big)
        if s != (fh[4], fh[5]):
            return (f"is damaged at frame {n} of {frames} (its checksum fails): SQLite ignores it and every "
                    "commit after it"), frames
    tail = (size - _WAL_HEADER) % frame_size
    if tail:
        rest = f.read(_FRAME_HEADER)                                       # type: ignore[attr-defined]
        if len(rest) < _FRAME_HEADER or struct.unpack(">6I", rest)[2:4] == (salt1, salt2):
            return f"is cut off inside frame {frames + 1}: that commit is lost", frames
    return None, frames


@functools.lru_cache(maxsize=8)
def _coefficients(pairs: int) -> tuple[tuple[int, int, int, int], list[int], list[int], list[int], list[int]]:
    """SQLite's WAL checksum is linear: one step is v' = M v + (x0, x0 + x1) with M = [[1, 1], [1, 2]]
    (mod 2^32), so `pairs` steps are M^pairs v plus a weighted sum of the words. The weights, computed
    once per frame size, turn a frame's checksum into four C-level dot products instead of a Python
    loop over its 1,025 word pairs."""
    powers = [(1, 0, 0, 1)]                     # M^j as (a, b, c, d)
    for _ in range(pairs):
        a, b, c, d = powers[-1]
        powers.append(((a + b) & _MASK, (a + 2 * b) & _MASK, (c + d) & _MASK, (c + 2 * d) & _MASK))
    a0, a1, b0, b1 = [], [], [], []
    for k in range(pairs):
        a, b, c, d = powers[pairs - 1 - k]
        a0.append((a + b) & _MASK)
        a1.append(b)
        b0.append((c + d) & _MASK)
        b1.append(d)
    return powers[pairs], a0, a1, b0, b1


def _checksum(data: bytes, s0: int, s1: int, big: bool) -> tuple[int, int]:
    """SQLite's WAL checksum of `data` (a multiple of 8 bytes) continued from (s0, s1)."""
    words = array("I", data)
    if big != (struct.pack("=I", 1) == struct.pack(">I", 1)):
        words.byteswap()
    (pa, pb, pc, pd), a0, a1, b0, b1 = _coefficients(len(words) // 2)
    x0, x1 = words[0::2], words[1::2]
    n0 = pa * s0 + pb * s1 + sum(map(operator.mul, a0, x0)) + sum(map(operator.mul, a1, x1))
    n1 = pc * s0 + pd * s1 + sum(map(operator.mul, b0, x0)) + sum(map(operator.mul, b1, x1))
    return n0 & _MASK, n1 & _MASK


# ---- SQLite structure, row checksums, what the file says of itself -------------------------------------
def _sqlite_problems(path: Path, found: Integrity) -> None:
    try:
        db = sqlite3.connect(path)    # read-write, as Recording: a killed recorder's WAL is folded in
    except sqlite3.Error as exc:
        found.damage.append(f"not a readable recording ({exc})")
        found.pages_damaged = True
        return
    try:
        _structure(db, found)
        if not found.damage:
            _rows(db, found)
            _meta(db, found)
    except sqlite3.DatabaseError as exc:
        found.damage.append(f"not a readable recording ({exc})")
        found.pages_damaged = True
    finally:
        db.close()


def _structure(db: sqlite3.Connection, found: Integrity) -> None:
    lines = [str(r[0]) for r in db.execute(f"PRAGMA quick_check({_QUICK_CHECK_LINES})")]
    if lines != ["ok"]:
        found.damage.append(f"SQLite finds damaged pages ({'; '.join(lines)})")
        found.pages_damaged = True


def _rows(db: sqlite3.Connection, found: Integrity) -> None:
    register(db)
    for table, sql in _CRC_SQL.items():
        if "crc" not in {str(r[1]) for r in db.execute(f"PRAGMA table_info({table})")}:
            continue                  # a file from before row checksums: its values cannot be checked
        bad = int(db.execute(sql).fetchone()[0])
        if bad:
            found.damage.append(f"{bad} {_CRC_WORDS[table]} (bytes damaged on disk)")


def _meta(db: sqlite3.Connection, found: Integrity) -> None:
    meta = {}
    for key, value in db.execute("SELECT key, value FROM meta WHERE key IN ('import_problems', 'salvaged')"):
        try:
            meta[key] = json.loads(value)
        except ValueError:
            found.damage.append(f"its meta value {key} is not JSON")
    found.inherited += inherited_loss(meta)
    salvaged = meta.get("salvaged")
    found.loss_unknown = bool(meta.get("import_problems")) or (
        isinstance(salvaged, dict) and salvaged.get("calls_lost") is None)


def inherited_loss(meta: dict[str, object]) -> list[str]:
    """What a file says it lost when it was written: an import that stopped at a damaged capture, a
    `--salvage` copy of a damaged recording (meta.salvaged: from, calls_lost, problems)."""
    out = []
    imported = meta.get("import_problems")
    if isinstance(imported, list) and imported:
        out.append(f"imported from a damaged capture: {imported[0]}")
    salvaged = meta.get("salvaged")
    if isinstance(salvaged, dict):
        out.append(f"written with --salvage from a damaged recording ({loss_text(salvaged.get('calls_lost'))})")
    return out
