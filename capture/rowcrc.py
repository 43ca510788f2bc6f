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


def message_crc_of_ints(call_id: int, direction: str, seq: int, ts_ns: int, data: bytes, compressed: int) -> int:
    """message_crc for a row whose integer columns already are ints (a reader's usual row): the same
    number without converting each one (raises TypeError when `data` is not bytes-like)."""
    return zlib.crc32(data, zlib.crc32(_MESSAGE_INTS.pack(call_id, _DIRECTIONS.get(direction, 2), seq, ts_ns,
                                                          compressed)))


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


# The writer's own, over a batch of rows as it queued them (without the CRC), at write time: its values
# are already ints, strs and None, so no conversion is needed, and one tight loop per batch costs the
# recorder less than a function call per syscall and per call in between the decoding. They give the
# same CRCs as the functions above for those values (tests/test_recording.py).

def with_chunk_crcs(rows: list[tuple[int, str, int, bytes]]) -> list[tuple[int, str, int, bytes, int]]:
    """(flow_id, direction, ts_ns, data) rows -> the same rows with chunk_crc as a last column."""
    crc, pack, dirs = zlib.crc32, _INTS.pack, _DIRECTIONS
    return [(f, d, t, b, crc(b, crc(pack(f, dirs[d], t)))) for f, d, t, b in rows]


def with_message_crcs(rows: list[tuple[int, str, int, int, bytes, int]]) -> list[tuple[Any, ...]]:
    """(call_id, direction, seq, ts_ns, data, compressed) rows -> with message_crc as a last column."""
    crc, pack, dirs = zlib.crc32, _MESSAGE_INTS.pack, _DIRECTIONS
    return [(c, d, q, t, b, z, crc(b, crc(pack(c, dirs[d], q, t, z)))) for c, d, q, t, b, z in rows]


def with_call_crcs(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """(id, *CALL_COLUMNS) rows -> with call_crc over the columns after id as a last column."""
    crc = zlib.crc32
    out = []
    for r in rows:
        # call_crc's text spelled out column by column: one string built, no list, no str() calls
        _id, f, p, m, k, s, rq, rs, st, sm, t1, t2, t3, mu, mr = r
        text = (f"{'' if f is None else f}\x1f{'' if p is None else p}\x1f{'' if m is None else m}"
                f"\x1f{'' if k is None else k}\x1f{'' if s is None else s}\x1f{'' if rq is None else rq}"
                f"\x1f{'' if rs is None else rs}\x1f{'' if st is None else st}\x1f{'' if sm is None else sm}"
                f"\x1f{'' if t1 is None else t1}\x1f{'' if t2 is None else t2}\x1f{'' if t3 is None else t3}"
                f"\x1f{'' if mu is None else mu}\x1f{'' if mr is None else mr}")
        out.append((*r, crc(text.encode("utf-8", "surrogatepass"))))
    return out


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
            return bool(call_crc(*(row[c] for c in CALL_COLUMNS)) == stored)
        if table == "chunks":
            return bool(chunk_crc(*(row[c] for c in CHUNK_COLUMNS)) == stored)
        return bool(message_crc(*(row[c] for c in MESSAGE_COLUMNS)) == stored)
    except (TypeError, ValueError, OverflowError, struct.error):
        return False
