"""Open a damaged recording and read what is intact.

A recording cut short (disk full, a copy interrupted) fails SQLite's own size check and would be
refused whole. `open_salvaged` then writes a repaired copy (mode 0600, removed on close, with any
-wal/-shm/-journal beside it) whose header claims only the pages actually present; `Recording`'s
iterators read up to the first damaged page and list what was cut off in `problems`.

The copy is streamed in blocks of `_BLOCK` bytes, so memory stays bounded whatever the file's size,
and is marked as a rollback-journal database so that reading it creates no WAL files.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from capture.errors import CorruptRecordingError
from capture.recording import Recording

_MAGIC = b"SQLite format 3\x00"
_BLOCK = 1 << 20
_SIDE_FILES = ("-wal", "-shm", "-journal")


class SalvagedRecording(Recording):
    """A Recording read from a repaired temporary copy; closing it removes the copy."""

    def __init__(self, path: str | os.PathLike[str], original: str, why: str) -> None:
        super().__init__(path)
        self._copy = Path(path)
        self.path = Path(original)
        self.problems.append(f"{original} is damaged ({why}); reading its intact part")

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> Iterator[sqlite3.Row]:
        # The time indexes live wherever SQLite put them, often in the lost tail; insertion order
        # (by id, the table itself) reads every intact row and is nearly time order anyway.
        for time_order in (" ORDER BY request_ts_ns, id", " ORDER BY ts_ns, id"):
            sql = sql.replace(time_order, " ORDER BY id")
        yield from super()._rows(sql, args)

    def close(self) -> None:
        super().close()
        _remove(self._copy)


def _remove(copy: Path) -> None:
    for suffix in ("", *_SIDE_FILES):
        Path(f"{copy}{suffix}").unlink(missing_ok=True)


def _repaired_copy(path: str) -> str | None:
    """A repaired copy of `path`, streamed; None when the file is not SQLite at all. Raises
    CorruptRecordingError when its header cannot be repaired (a page size SQLite does not allow)."""
    with open(path, "rb") as src:
        head = bytearray(src.read(100))
        if len(head) < 100 or not head.startswith(_MAGIC):
            return None                   # not SQLite at all: nothing to salvage
        page = struct.unpack(">H", head[16:18])[0]
        page = 65536 if page == 1 else page
        if page < 512 or page & (page - 1):
            raise CorruptRecordingError(f"{path} is damaged beyond salvage: its header's page size ({page}) "
                                        "is not one SQLite allows")
        pages = os.fstat(src.fileno()).st_size // page
        if pages < 1:
            return None
        head[18:20] = b"\x01\x01"        # rollback journal, not WAL: reading the copy leaves no -wal/-shm
        head[28:32] = struct.pack(">I", pages)   # the header's page count: what is really there
        fd, tmp = tempfile.mkstemp(prefix="shadowtest-salvage-", suffix=".rec")   # mkstemp: mode 0600
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(head)
                left = pages * page - len(head)
                while left > 0:
                    block = src.read(min(_BLOCK, left))
                    if not block:
                        break
                    out.write(block)
                    left -= len(block)
        except BaseException:
            _remove(Path(tmp))
            raise
    return tmp


def _wal_copy(path: str) -> str:
    """A copy of `path` and its WAL (mode 0600): SQLite reads the WAL's frames up to its damage from the
    copy, and the original keeps its WAL (opening it would fold in the intact part and delete the rest)."""
    fd, tmp = tempfile.mkstemp(prefix="shadowtest-salvage-", suffix=".rec")
    try:
        with os.fdopen(fd, "wb") as out, open(path, "rb") as src:
            shutil.copyfileobj(src, out, _BLOCK)
        wal_fd = os.open(f"{tmp}-wal", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(wal_fd, "wb") as out, open(f"{path}-wal", "rb") as src:
            shutil.copyfileobj(src, out, _BLOCK)
    except BaseException:
        _remove(Path(tmp))
        raise
    return tmp


def open_salvaged(path: str | os.PathLike[str], *, wal_damaged: bool = False) -> Recording:
    """`Recording(path)`, or, when the file is damaged, a reader over what is intact.

    wal_damaged: FILE-wal fails its checksums (capture.integrity): read a copy of the file and its WAL.
    Raises RecordingError when the file does not exist, CorruptRecordingError when nothing in it
    can be read (the message says so)."""
    if wal_damaged:
        try:
            wal_copy = _wal_copy(str(path))
        except OSError as err:
            raise CorruptRecordingError(f"{path} is damaged and cannot be salvaged: {err}") from err
        try:
            return SalvagedRecording(wal_copy, str(path), "its WAL is damaged")
        except BaseException:
            _remove(Path(wal_copy))
            raise
    try:
        return Recording(path)
    except CorruptRecordingError as exc:
        if not isinstance(exc.__cause__, sqlite3.DatabaseError):
            raise                         # readable pages, damaged values: a copy would not help
        try:
            copy = _repaired_copy(str(path))
        except OSError as err:
            raise CorruptRecordingError(f"{path} is damaged and cannot be salvaged: {err}") from err
        if copy is None:
            raise
        try:
            return SalvagedRecording(copy, str(path), str(exc.__cause__ or exc))
        except CorruptRecordingError as again:
            _remove(Path(copy))
            raise CorruptRecordingError(f"{path} is damaged beyond salvage: {again}") from again
        except BaseException:
            _remove(Path(copy))
            raise
