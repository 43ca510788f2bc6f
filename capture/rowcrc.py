"""CRC-32 of each chunk, message and call row, so bytes damaged on disk are found, not replayed.

SQLite checks its own page structure, not the values it stores: a byte flipped inside a chunk's
payload or a call's metadata reads back as a different, plausible value. The writer stores
`crc` beside every chunk, message and call row (capture/recording.py); readers recompute it and
leave out rows whose CRC differs; `capture.integrity.check` runs the same functions inside SQLite
over a whole file. Rows written before the column existed (or by hand) have crc NULL: unchecked.

The functions take the row's columns in table order, so the writer (Python values) and the
checker (the values SQLite hands back) compute the same number. Values are canonicalised as SQLite
stores them (an integral float or a bool in an INTEGER column comes back as an int), so a value's
type never reads as damage.
"""

from __future__ import annotations

import sqlite3
import struct
import zlib
from typing import Any

_INTS = struct.Struct("<qqq")
_MESSAGE_INTS = struct.Struct("<qqqqq")
_DIRECTIONS = {"c2s": 0, "s2c": 1}
_SEP = "\x1f"   # unit separator: never in method names or JSON text


def _int(v: Any) -> int:
    """An integer column's value as SQLite would hand it back (damaged text raises ValueError)."""
    return int(v)


def _direction(v: Any) -> int:
    return _DIRECTIONS.get(v, 2)


def chunk_crc(flow_id: Any, direction: Any, ts_ns: Any, data: bytes) -> int:
    """CRC of a chunk row: its payload, seeded with its flow, direction and time."""
    seed = zlib.crc32(_INTS.pack(_int(flow_id), _direction(direction), _int(ts_ns)))
    return zlib.crc32(data, seed)


def message_crc(call_id: Any, direction: Any, seq: Any, ts_ns: Any, data: bytes, compressed: Any) -> int:
    """CRC of a message row: its payload, seeded with its call, direction, sequence, time and flag."""
    seed = zlib.crc32(_MESSAGE_INTS.pack(_int(call_id), _direction(direction), _int(seq), _int(ts_ns),
                                         _int(compressed)))
    return zlib.crc32(data, seed)


def _text(v: Any) -> str:
    """A value other than str, int or None as text, the way SQLite hands it back."""
    if isinstance(v, bool) or (isinstance(v, float) and v.is_integer()):
        return str(int(v))
    return str(v)


def call_crc(*columns: Any) -> int:
    """CRC of a call row over every column after `id`, in table order (CALL_COLUMNS)."""
    # str, int and None (nearly every value) inline: the recorder pays this once per call
    text = [v if type(v) is str else "" if v is None else str(v) if type(v) is int else _text(v) for v in columns]
    return zlib.crc32(_SEP.join(text).encode("utf-8", "surrogatepass"))


# The writer's own: its values are already ints, strs and None (a call's columns as it builds them), so
# no conversion is needed, and a function call less per row (the recorder pays these per syscall and
# per call). They give the same CRC as the functions above for those values (tests/test_recording.py).

def chunk_crc_of(flow_id: int, direction: str, ts_ns: int, data: bytes, _crc: Any = zlib.crc32,
                 _pack: Any = _INTS.pack) -> int:
    return int(_crc(data, _crc(_pack(flow_id, _DIRECTIONS[direction], ts_ns))))


def message_crc_of(call_id: int, direction: str, seq: int, ts_ns: int, data: bytes, compressed: int,
                   _crc: Any = zlib.crc32, _pack: Any = _MESSAGE_INTS.pack) -> int:
    return int(_crc(data, _crc(_pack(call_id, _DIRECTIONS[direction], seq, ts_ns, compressed))))


def call_crc_of(row: tuple[Any, ...]) -> int:
    return zlib.crc32(_SEP.join(["" if v is None else str(v) for v in row]).encode("utf-8", "surrogatepass"))


# The calls columns the CRC covers, in the order call_crc takes them (the INSERT's order after id).
CALL_COLUMNS = ("flow_id", "protocol", "method", "kind", "stream_id", "request_metadata", "response_metadata",
                "status", "status_message", "request_ts_ns", "response_ts_ns", "end_ts_ns", "method_unknown",
                "method_ref")
CHUNK_COLUMNS = ("flow_id", "direction", "ts_ns", "data")
MESSAGE_COLUMNS = ("call_id", "direction", "seq", "ts_ns", "data", "compressed")


def _sql(fn: Any) -> Any:
    """For SQL: a row whose columns cannot even be read as their types (damaged) gets -1, never a match."""
    def wrapped(*args: Any) -> int:
        try:
            return int(fn(*args))
        except (TypeError, ValueError, OverflowError, struct.error):
            return -1
    return wrapped


def _sql_chunk(flow_id: Any, direction: Any, ts_ns: Any, data: Any) -> int:
    # chunk_crc inlined: the integrity check calls it once per chunk of the file
    try:
        return zlib.crc32(data, zlib.crc32(_INTS.pack(int(flow_id), _DIRECTIONS.get(direction, 2), int(ts_ns))))
    except (TypeError, ValueError, OverflowError, struct.error):
        return -1


def _sql_message(call_id: Any, direction: Any, seq: Any, ts_ns: Any, data: Any, compressed: Any) -> int:
    # message_crc inlined, as _sql_chunk
    try:
        return zlib.crc32(data, zlib.crc32(_MESSAGE_INTS.pack(int(call_id), _DIRECTIONS.get(direction, 2), int(seq),
                                                              int(ts_ns), int(compressed))))
    except (TypeError, ValueError, OverflowError, struct.error):
        return -1


def register(db: sqlite3.Connection) -> None:
    """Make the row CRCs callable in SQL on `db` (capture.integrity): st_chunk_crc, st_message_crc,
    st_call_crc, taking CHUNK_COLUMNS, MESSAGE_COLUMNS and CALL_COLUMNS."""
    db.create_function("st_chunk_crc", len(CHUNK_COLUMNS), _sql_chunk, deterministic=True)
    db.create_function("st_message_crc", len(MESSAGE_COLUMNS), _sql_message, deterministic=True)
    db.create_function("st_call_crc", len(CALL_COLUMNS), _sql(call_crc), deterministic=True)


def row_matches(table: str, row: sqlite3.Row) -> bool:
    """True when `row` (read with SELECT *) has no crc, or its crc matches its columns."""
    stored = row["crc"]
    if stored is None:
        return True
    try:
        if table == "calls":
            return call_crc(*(row[c] for c in CALL_COLUMNS)) == stored
        if table == "chunks":
            return chunk_crc(*(row[c] for c in CHUNK_COLUMNS)) == stored
        return message_crc(*(row[c] for c in MESSAGE_COLUMNS)) == stored
    except (TypeError, ValueError, OverflowError, struct.error):
        return False
