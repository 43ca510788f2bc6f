"""Open a damaged recording and read what is intact.

A recording cut short (disk full, a copy interrupted) fails SQLite's own size check and would be
refused whole. `open_salvaged` then writes a repaired copy (mode 0600, removed on close) whose
header claims only the pages actually present; `Recording`'s iterators read up to the first
damaged page and list what was cut off in `problems`.
"""

from __future__ import annotations

import os
import sqlite3
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from capture.errors import CorruptRecordingError
from capture.recording import Recording

_MAGIC = b"SQLite format 3\x00"


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
        self._copy.unlink(missing_ok=True)


def _repaired_copy(path: str) -> str | None:
    data = bytearray(Path(path).read_bytes())
    if len(data) < 100 or not data.startswith(_MAGIC):
        return None                       # not SQLite at all: nothing to salvage
    page = struct.unpack(">H", data[16:18])[0]
    page = 65536 if page == 1 else page
    pages = len(data) // page
    if pages < 1:
        return None
    del data[pages * page:]
    data[28:32] = struct.pack(">I", pages)   # the header's page count: what is really there
    fd, tmp = tempfile.mkstemp(prefix="shadowtest-salvage-", suffix=".rec")   # mkstemp: mode 0600
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return tmp


def open_salvaged(path: str | os.PathLike[str]) -> Recording:
    """`Recording(path)`, or, when the file is damaged, a reader over what is intact.

    Raises RecordingError when the file does not exist, CorruptRecordingError when nothing in it
    can be read (the message says so)."""
    try:
        return Recording(path)
    except CorruptRecordingError as exc:
        copy = _repaired_copy(str(path))
        if copy is None:
            raise
        try:
            return SalvagedRecording(copy, str(path), str(exc.__cause__ or exc))
        except CorruptRecordingError as again:
            Path(copy).unlink(missing_ok=True)
            raise CorruptRecordingError(f"{path} is damaged beyond salvage: {again}") from again
