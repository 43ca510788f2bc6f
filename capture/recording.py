"""The recording: one SQLite file that the recorder writes and the replayer reads.

This is the project's one data model for captured traffic. The recorder
(eBPF, pcap, proxy backends), the pcap importer, the decoders, `inspect`, `redact` and the replayer
all use the dataclasses and the reader/writer defined here; nothing else invents its own shape.

    recorder / importer                        replayer / inspect / export
        |  Flow, Chunk, Call                          ^  iterators in time order
        v                                             |  (streamed, never all in memory)
    RecordingWriter --- WAL, commit every <=0.5 s ---> Recording

Schema (version 1), queryable with plain `sqlite3 FILE`:

    meta(key TEXT PRIMARY KEY, value TEXT)            -- JSON values: host, kernel, started_wall_ns,
                                                      -- clock, filters, tool_version, lost_events,
                                                      -- truncated_events, redaction_rules, ...
    flows(id, src_addr, src_port, dst_addr, dst_port, -- src is the client, dst the server
          pid, comm, opened_ns, closed_ns,
          joined_midstream, protocol)                 -- protocol: grpc | http2 | http1 | tcp
    chunks(id, flow_id, direction, ts_ns, data)       -- direction: c2s | s2c; raw TCP payload bytes
    calls(id, flow_id, protocol, method, kind,        -- kind: unary | client_stream | server_stream
          stream_id, request_metadata,                --       | bidi | request (HTTP/1.1)
          response_metadata, status, status_message,  -- metadata: JSON list of [name, value]
          request_ts_ns, response_ts_ns, end_ts_ns,   -- status: grpc-status or HTTP status code
          method_unknown, method_ref)                 -- method_unknown: 1 when HPACK state was missing
                                                      -- (joined); method_ref: see below
    messages(id, call_id, direction, seq, ts_ns,      -- each gRPC message (or HTTP body) with its
             data, compressed)                        -- own timestamp; data without the 5-byte prefix
    method_map(flow_id, ref, method, how,             -- the method of a group of calls whose method
               PRIMARY KEY (flow_id, ref))            -- is NULL; how: why it was chosen
    gaps(id, flow_id, direction, chunks_before,       -- bytes of one direction that were not captured:
         nbytes, how)                                 -- after that direction's first chunks_before
                                                      -- chunks; nbytes NULL when unknown; how: NULL
                                                      -- (lost/truncated), "sendfile", "splice", ...

`gaps` was added within version 1 (files without it have no gap positions, only counters in meta); it
is where `export` marks gaps and `inspect` counts them. Deleted rows are zeroed (secure_delete).

Row checksums (within version 1): chunks, calls and messages have a `crc` column, the CRC-32 of the
row's columns (capture/rowcrc.py). Readers leave out a row whose crc does not match (bytes damaged
on disk) and say so in `problems`; rows with crc NULL (older files) are read unchecked. Every commit
also writes meta `rows_written` ({chunks, calls, messages}: rows the file should hold), so a reader
of a damaged file can say how many calls were lost (capture/integrity.py).

Method groups (connections joined mid-stream): a call whose request header fields referred to HPACK
dynamic-table entries inserted before the recording joined has `method_ref`, e.g. "hpack:5,4,3"
(the pre-join ordinals of those entries, see capture/decode/h2grpc.py). Calls of one flow with the
same method_ref had the same :path, so (flow_id, method_ref) is a *group* whose method, once found
(`shadowtest infer`, `--method-map`), is written once into `method_map`; readers apply the map to
calls whose `method` is NULL (`Call.method` = the mapped method, `Call.method_how` = how; the calls
table itself is never rewritten). `calls.method_ref` and `method_map` were added within version 1:
files without them open and read as before (writers add them; readers check PRAGMA table_info).

All `*_ns` columns share one clock (CLOCK_MONOTONIC for eBPF captures, capture time for pcaps);
`meta.started_wall_ns` and `meta.started_mono_ns` map it to wall-clock time.

Meta keys written by capture (JSON values): `clock` ("CLOCK_MONOTONIC" for live backends,
"capture-wall" for imported pcaps, whose ts_ns already are wall-clock ns), `backend` (ebpf | pcap |
proxy | import), `filters` {port, pid, cgroup, side, max_bytes}, `backend_settings`, `host`, `kernel`,
`tool_version`, `recorder_pid`, `lost_events`, `truncated_events`, `unknown_method_calls`,
`redaction_rules` (every rule applied, record time first), `capture_duration_s` and
`stopped_wall_ns` (absent when the recorder was killed), and for imports `source`, `import_problems`,
`gaps`, `gap_bytes`, `retransmitted_segments`.

Durability: WAL mode with synchronous=NORMAL and a commit at least every `flush_interval_s`
(default 0.5 s), so a recorder killed with SIGKILL leaves a file that opens, missing at most the
last second. Chunks, calls and messages wait in memory until that commit and go in with one
`executemany` per table (a statement per row was a fifth of the recorder's CPU); flows and meta
are written at once. The file is created with mode 0600: recordings hold production data.
"""

from __future__ import annotations

import functools
import json
import operator
import os
import sqlite3
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from capture.errors import CorruptRecordingError, RecordingError
from capture.rowcrc import (
    CALL_COLUMNS,
    MESSAGE_COLUMNS,
    call_crc,
    message_crc_of_ints,
    row_matches,
    with_call_crcs,
    with_chunk_crcs,
    with_message_crcs,
)

SqlValue = int | float | str | bytes | None   # a column value as sqlite3 takes it

_F = TypeVar("_F", bound=Callable[..., Any])

SCHEMA_VERSION = 1
# calls.status_message of a call whose trailers were recorded but refer to HPACK entries from before the
# capture joined (a grpc C-core server indexes `grpc-status: 0`): its status is unknown, not missing.
STATUS_HIDDEN = "status not captured: the trailers refer to HPACK entries from before the capture joined"
# calls.status_message of an HTTP/1 call whose body fell in a gap of known size that the decoder stepped
# over ("body not captured: request, N bytes missing in a gap"): the body is not stored (never invented);
# replay does not send a call whose request body is missing.
BODY_NOT_CAPTURED = "body not captured"
# calls.status_message of an HTTP/1 call after a gap the decoder could not resynchronise from: no status.
OUTCOME_UNKNOWN = "outcome unknown: bytes of the connection were lost and the HTTP/1 pairing could not resume"
# calls.status_message of a call that was open when bytes of its connection were lost (a gap: ring
# buffer loss, a truncated syscall, a pcap hole) or one of whose messages was too large to keep:
# "damaged: bytes lost in a gap (s2c)[; grpc-message: ...]". Its messages may be incomplete.
CALL_DAMAGED = "damaged"
Direction = Literal["c2s", "s2c"]


def call_damage(status: int | None, status_message: str | None, protocol: str | None = None) -> str | None:
    """Why a recorded call cannot be compared with a replayed one (None: it can): damaged by a gap,
    a body not captured, an outcome or status unknown, or no status recorded at all (raw TCP
    pseudo-calls have none by nature)."""
    msg = status_message or ""
    if msg.startswith(CALL_DAMAGED) or msg.startswith(BODY_NOT_CAPTURED) or msg == OUTCOME_UNKNOWN:
        return msg.split(";")[0]
    if msg == STATUS_HIDDEN:
        return "status not captured"
    if status is None and protocol != "tcp":
        return "no status recorded"
    return None

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS flows (
    id INTEGER PRIMARY KEY, src_addr TEXT NOT NULL, src_port INTEGER NOT NULL,
    dst_addr TEXT NOT NULL, dst_port INTEGER NOT NULL, pid INTEGER, comm TEXT,
    opened_ns INTEGER, closed_ns INTEGER, joined_midstream INTEGER NOT NULL DEFAULT 0,
    protocol TEXT NOT NULL DEFAULT 'tcp');
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY, flow_id INTEGER NOT NULL REFERENCES flows(id),
    direction TEXT NOT NULL CHECK (direction IN ('c2s', 's2c')),
    ts_ns INTEGER NOT NULL, data BLOB NOT NULL, crc INTEGER);
CREATE INDEX IF NOT EXISTS chunks_by_flow ON chunks(flow_id, id);
CREATE INDEX IF NOT EXISTS chunks_by_time ON chunks(ts_ns);
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY, flow_id INTEGER REFERENCES flows(id), protocol TEXT NOT NULL,
    method TEXT, kind TEXT NOT NULL DEFAULT 'unary', stream_id INTEGER,
    request_metadata TEXT NOT NULL DEFAULT '[]', response_metadata TEXT NOT NULL DEFAULT '[]',
    status INTEGER, status_message TEXT, request_ts_ns INTEGER NOT NULL,
    response_ts_ns INTEGER, end_ts_ns INTEGER, method_unknown INTEGER NOT NULL DEFAULT 0,
    method_ref TEXT, crc INTEGER);
CREATE INDEX IF NOT EXISTS calls_by_time ON calls(request_ts_ns, id);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY, call_id INTEGER NOT NULL REFERENCES calls(id),
    direction TEXT NOT NULL CHECK (direction IN ('c2s', 's2c')), seq INTEGER NOT NULL,
    ts_ns INTEGER NOT NULL, data BLOB NOT NULL, compressed INTEGER NOT NULL DEFAULT 0, crc INTEGER);
CREATE INDEX IF NOT EXISTS messages_by_call ON messages(call_id, direction, seq);
"""
_METHOD_MAP_TABLE = """CREATE TABLE IF NOT EXISTS method_map (
    flow_id INTEGER, ref TEXT, method TEXT NOT NULL, how TEXT NOT NULL, PRIMARY KEY (flow_id, ref))"""
_SCHEMA += _METHOD_MAP_TABLE + ";\n"
_SCHEMA += """CREATE TABLE IF NOT EXISTS gaps (
    id INTEGER PRIMARY KEY, flow_id INTEGER NOT NULL, direction TEXT NOT NULL,
    chunks_before INTEGER NOT NULL, nbytes INTEGER, how TEXT);
"""
# Tables whose rows carry a CRC-32 (capture/rowcrc.py), and whose row counts meta.rows_written keeps.
_CRC_TABLES = ("chunks", "calls", "messages")
# After the calls table has its method_ref column (files from before it get it by ALTER TABLE). A
# partial index: the recorder's ordinary calls (method known) never touch it.
_REF_INDEX = "CREATE INDEX IF NOT EXISTS calls_unknown_by_ref ON calls(flow_id, method_ref) WHERE method IS NULL"
_UPSERT_MAP = ("INSERT INTO method_map(flow_id, ref, method, how) VALUES (?,?,?,?)"
               " ON CONFLICT(flow_id, ref) DO UPDATE SET method = excluded.method, how = excluded.how")


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {str(r[1]) for r in db.execute(f"PRAGMA table_info({table})")}


def _ensure_method_ref(db: sqlite3.Connection) -> None:
    """Give a calls table from before method groups its method_ref column (and the group index)."""
    if "method_ref" not in _columns(db, "calls"):
        db.execute("ALTER TABLE calls ADD COLUMN method_ref TEXT")
    db.execute(_REF_INDEX)


def _ensure_crc(db: sqlite3.Connection) -> None:
    """Give tables from before row checksums their crc column (their old rows stay NULL: unchecked)."""
    for table in _CRC_TABLES:
        if "crc" not in _columns(db, table):
            db.execute(f"ALTER TABLE {table} ADD COLUMN crc INTEGER")


def _written_counts(db: sqlite3.Connection) -> dict[str, int]:
    """Rows already in a file the writer appends to (the start of meta.rows_written)."""
    return {t: int(db.execute(f"SELECT count(*) FROM {t}").fetchone()[0]) for t in _CRC_TABLES}


@dataclass(frozen=True)
class Flow:
    """One TCP connection. `src` is the client side, `dst` the server side."""

    src: tuple[str, int]
    dst: tuple[str, int]
    pid: int | None = None
    comm: str | None = None
    opened_ns: int | None = None
    closed_ns: int | None = None
    joined_midstream: bool = False
    protocol: str = "tcp"
    id: int | None = None


@dataclass(frozen=True)
class Chunk:
    """Bytes seen in one direction of a flow at one instant (one syscall or one TCP segment run)."""

    flow_id: int
    direction: Direction
    ts_ns: int
    data: bytes


@dataclass(frozen=True, init=False)
class Message:
    """One gRPC message (without its 5-byte length prefix) or one HTTP body."""

    direction: Direction
    seq: int
    ts_ns: int
    data: bytes
    compressed: bool = False

    def __init__(self, direction: Direction, seq: int, ts_ns: int, data: bytes, compressed: bool = False) -> None:
        # Frozen, but built at half the cost of the generated __init__ (one object.__setattr__ per
        # field): decoders make one per message.
        d = self.__dict__
        d["direction"], d["seq"], d["ts_ns"], d["data"], d["compressed"] = direction, seq, ts_ns, data, compressed


@dataclass
class Call:
    """One RPC or HTTP request/response exchange on a flow."""

    protocol: str
    method: str | None
    request_ts_ns: int
    flow_id: int | None = None
    kind: str = "unary"
    stream_id: int | None = None
    request_metadata: list[tuple[str, str]] = field(default_factory=list)
    response_metadata: list[tuple[str, str]] = field(default_factory=list)
    status: int | None = None
    status_message: str | None = None
    response_ts_ns: int | None = None
    end_ts_ns: int | None = None
    method_unknown: bool = False
    requests: list[Message] = field(default_factory=list)
    responses: list[Message] = field(default_factory=list)
    id: int | None = None
    # Joined connections: the identity of the pre-join HPACK entries the request headers used
    # ("hpack:5,4,3"; see the module docstring), and for a call whose method was NULL in the file
    # and came back mapped, how that method was found (None: as decoded).
    method_ref: str | None = None
    method_how: str | None = None


@dataclass(frozen=True)
class MethodGroup:
    """Calls of one flow whose method is NULL in the calls table and that share a method_ref.

    kinds: calls per Call.kind. method/how: from the method map (or a reader's overrides), else None."""

    flow_id: int
    ref: str
    protocol: str
    calls: int
    kinds: dict[str, int]
    method: str | None
    how: str | None


def _create_private(path: Path, overwrite: bool) -> None:
    """Create `path` empty with mode 0600 before SQLite opens it (SQLite would use the umask)."""
    if overwrite:
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(str(path) + suffix).unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError as exc:
        raise RecordingError(f"{path} already exists (pass overwrite to replace it)") from exc
    except OSError as exc:
        raise RecordingError(f"cannot create {path}: {exc.strerror}") from exc
    os.close(fd)


def _locked(method: _F) -> _F:
    """Run `method` holding the writer's lock (RecordingWriter: one thread at a time)."""
    @functools.wraps(method)
    def run(self: RecordingWriter, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return cast(_F, run)


class RecordingWriter:
    """Append flows, chunks and calls to a new recording file.

    Args:
        path: the file to create (mode 0600). Fails if it exists unless `overwrite`.
        meta: initial metadata (JSON-serialisable values).
        flush_interval_s: the longest time between commits; bounds the loss on SIGKILL.
        existing: append to a recording that exists (e.g. to decode its chunks afterwards).

    Raises RecordingError when the file cannot be created or written. Use as a context manager;
    `close()` commits everything written so far.
    """

    def __init__(self, path: str | os.PathLike[str], *, meta: dict[str, Any] | None = None,
                 overwrite: bool = False, flush_interval_s: float = 0.5, existing: bool = False) -> None:
        self.path = Path(path)
        # Every public method holds it: the recorder writes from its decode thread while others set
        # meta, and two commits at once wrote the same queued rows twice (a batch of messages stored
        # twice: each call got another's answer as well).
        self._lock = threading.RLock()
        if existing:
            if not self.path.is_file():
                raise RecordingError(f"{self.path}: no such recording")
        else:
            _create_private(self.path, overwrite)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False)
            # 8 KiB pages (a new file's setting): a chunk or message of ~1 KiB per row then costs
            # the recorder ~20 % less to insert than with 4 KiB pages (fewer pages and WAL frames).
            self._db.execute("PRAGMA page_size=8192")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA secure_delete=ON")    # rows removed (a redone decode) leave no bytes
            self._db.executescript(_SCHEMA)
            _ensure_method_ref(self._db)
            _ensure_crc(self._db)
            # How many rows this file should hold, kept in meta at every commit: a reader of a damaged
            # copy compares it with what it could read to say how many calls were lost.
            self._written = _written_counts(self._db)
            self._db.commit()
        except sqlite3.Error as exc:
            raise RecordingError(f"cannot initialise {self.path}: {exc}") from exc
        self._flush_interval = flush_interval_s
        self._last_commit = time.monotonic()
        # Rows waiting for the next commit, in arrival order. Call ids are ours to give (the
        # messages need them before the calls are inserted): one past the largest in the file.
        # rows queued for the next write, their CRCs added then (capture/rowcrc.py: with_*_crcs)
        self._chunk_rows: list[tuple[int, str, int, bytes]] = []
        self._gap_rows: list[tuple[int, str, int, int | None, str | None]] = []
        self._call_rows: list[tuple[SqlValue, ...]] = []
        self._message_rows: list[tuple[int, str, int, int, bytes, int]] = []
        self._map_rows: dict[tuple[int, str], tuple[str, str]] = {}
        self._next_call_id = 1 + int(self._db.execute("SELECT coalesce(max(id), 0) FROM calls").fetchone()[0])
        self._meta_json: dict[tuple[tuple[str, str], ...], str] = {}
        base = {} if existing else {"schema_version": SCHEMA_VERSION, "created_wall_ns": time.time_ns()}
        self.set_meta(base | (meta or {}))
        self.flush()

    @_locked
    def set_meta(self, values: dict[str, Any]) -> None:
        self._db.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                             [(k, json.dumps(v)) for k, v in values.items()])
        self._maybe_commit()

    @_locked
    def add_flow(self, flow: Flow) -> int:
        cur = self._db.execute(
            "INSERT INTO flows(src_addr, src_port, dst_addr, dst_port, pid, comm, opened_ns, closed_ns,"
            " joined_midstream, protocol) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (flow.src[0], flow.src[1], flow.dst[0], flow.dst[1], flow.pid, flow.comm, flow.opened_ns,
             flow.closed_ns, int(flow.joined_midstream), flow.protocol))
        self._maybe_commit()
        return int(cur.lastrowid or 0)

    @_locked
    def update_flow(self, flow_id: int, **fields: Any) -> None:
        """Set columns of a flow already written, e.g. `closed_ns=...` or `protocol='grpc'`."""
        allowed = {"closed_ns", "protocol", "pid", "comm", "opened_ns", "joined_midstream"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot update flow columns {sorted(bad)}")
        cols = ", ".join(f"{k} = ?" for k in fields)
        self._db.execute(f"UPDATE flows SET {cols} WHERE id = ?", (*fields.values(), flow_id))
        self._maybe_commit()

    def add_chunk(self, chunk: Chunk) -> None:
        self.add_chunk_data(chunk.flow_id, chunk.direction, chunk.ts_ns, chunk.data)

    def add_chunk_data(self, flow_id: int, direction: Direction, ts_ns: int, data: bytes) -> None:
        """`add_chunk` without building a Chunk first (the recorder's per-syscall path)."""
        row = (flow_id, direction, ts_ns, bytes(data))
        # The lock taken here, not by @_locked: its wrapper cost 0.6 us a call, once per recorded syscall.
        with self._lock:
            self._chunk_rows.append(row)
            self._maybe_commit()

    @_locked
    def add_gap(self, flow_id: int, direction: Direction, chunks_before: int, nbytes: int | None,
                how: str | None = None) -> None:
        """Bytes of `direction` not captured after its first `chunks_before` chunks (nbytes None: unknown)."""
        self._gap_rows.append((flow_id, direction, chunks_before, nbytes, how))
        self._maybe_commit()

    def add_call(self, call: Call) -> int:
        """Queue a call and its messages for the next commit; returns the call's id.

        A call read with a mapped method (`method_how` set: its method was NULL in the file it came
        from) is stored as it was, method NULL, and its group's mapping goes into this file's
        method_map: a copy (`shadowtest redact`) keeps both the calls and how their method was found."""
        with self._lock:          # not @_locked: once per recorded call (see add_chunk_data)
            return self._add_call(call)

    def _add_call(self, call: Call) -> int:
        call_id = self._next_call_id
        self._next_call_id += 1
        method = call.method
        if call.method_how is not None and call.method_ref is not None and call.flow_id is not None \
                and method is not None:
            self._map_rows[(call.flow_id, call.method_ref)] = (method, call.method_how)
            method = None
        row = (call.flow_id, call.protocol, method, call.kind, call.stream_id,
               self._json(call.request_metadata), self._json(call.response_metadata), call.status,
               call.status_message, call.request_ts_ns, call.response_ts_ns, call.end_ts_ns,
               int(call.method_unknown), call.method_ref)
        self._call_rows.append((call_id, *row))
        for m in (*call.requests, *call.responses):
            data, flag = bytes(m.data), int(m.compressed)
            self._message_rows.append((call_id, m.direction, m.seq, m.ts_ns, data, flag))
        self._maybe_commit()
        return call_id

    def _json(self, metadata: list[tuple[str, str]]) -> str:
        # Calls of one service repeat a few header sets: encode each distinct set once.
        try:
            key = tuple(metadata)
            text = self._meta_json.get(key)
        except TypeError:          # pairs given as lists: fine to store, not to hash
            return json.dumps(metadata)
        if text is None:
            if len(self._meta_json) >= 4096:
                self._meta_json.clear()
            text = self._meta_json[key] = json.dumps(metadata)
        return text

    @_locked
    def clear_calls(self) -> None:
        """Drop every call and message (a decode that was cut short is redone from the chunks)."""
        self._call_rows, self._message_rows = [], []
        self._db.execute("DELETE FROM messages")
        self._db.execute("DELETE FROM calls")
        self._written["calls"] = self._written["messages"] = 0
        self._maybe_commit()

    @_locked
    def meta_value(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    @_locked
    def flow_rows(self) -> list[tuple[int, bool, int | None]]:
        """(id, joined_midstream, closed_ns) of every flow written so far."""
        return [(int(r[0]), bool(r[1]), r[2])
                for r in self._db.execute("SELECT id, joined_midstream, closed_ns FROM flows ORDER BY id")]

    def chunks_of(self, flow_id: int, batch: int = 2048) -> Iterator[tuple[Direction, int, bytes]]:
        """(direction, ts_ns, data) of one flow's committed chunks in order, fetched in batches so
        that rows may be written between them (and memory stays bounded)."""
        last = 0
        while True:
            rows = self._db.execute("SELECT id, direction, ts_ns, data FROM chunks WHERE flow_id = ? AND id > ?"
                                    " ORDER BY id LIMIT ?", (flow_id, last, batch)).fetchall()
            if not rows:
                return
            for _, direction, ts_ns, data in rows:
                yield direction, ts_ns, data
            last = rows[-1][0]

    def _maybe_commit(self) -> None:
        if time.monotonic() - self._last_commit >= self._flush_interval:
            self.flush()

    def _write_rows(self) -> None:
        db = self._db
        written = self._written
        written["chunks"] += len(self._chunk_rows)
        written["calls"] += len(self._call_rows)
        written["messages"] += len(self._message_rows)
        if self._chunk_rows:
            db.executemany("INSERT INTO chunks(flow_id, direction, ts_ns, data, crc) VALUES (?,?,?,?,?)",
                           with_chunk_crcs(self._chunk_rows))
            self._chunk_rows = []
        if self._gap_rows:
            db.executemany("INSERT INTO gaps(flow_id, direction, chunks_before, nbytes, how) VALUES (?,?,?,?,?)",
                           self._gap_rows)
            self._gap_rows = []
        if self._call_rows:
            db.executemany(
                "INSERT INTO calls(id, flow_id, protocol, method, kind, stream_id, request_metadata,"
                " response_metadata, status, status_message, request_ts_ns, response_ts_ns, end_ts_ns,"
                " method_unknown, method_ref, crc) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                with_call_crcs(self._call_rows))
            self._call_rows = []
        if self._map_rows:
            db.executemany(_UPSERT_MAP, [(f, r, m, h) for (f, r), (m, h) in self._map_rows.items()])
            self._map_rows = {}
        if self._message_rows:
            db.executemany("INSERT INTO messages(call_id, direction, seq, ts_ns, data, compressed, crc)"
                           " VALUES (?,?,?,?,?,?,?)", with_message_crcs(self._message_rows))
            self._message_rows = []
        db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('rows_written', ?)", (json.dumps(written),))

    @_locked
    def flush(self) -> None:
        """Write the queued rows and commit; after this a SIGKILL loses none of it."""
        try:
            self._write_rows()
            self._db.commit()
        except sqlite3.Error as exc:
            raise RecordingError(f"cannot write {self.path}: {exc}") from exc
        self._last_commit = time.monotonic()

    @_locked
    def close(self) -> None:
        self.flush()
        # Fold the WAL back so the recording is one self-contained file when the recorder exits.
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()

    def remove(self) -> None:
        """Delete the (closed) file this writer created, and SQLite's side files."""
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(str(self.path) + suffix).unlink(missing_ok=True)

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _metadata_column(r: sqlite3.Row, column: str) -> list[tuple[str, str]]:
    try:
        return _metadata(r[column])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{column} is not a JSON list of pairs ({exc})") from exc


def _row_id(r: sqlite3.Row) -> object:
    return r["id"] if "id" in r.keys() else "?"


def _ints(r: sqlite3.Row, *columns: str, null: bool = False) -> None:
    """TypeError naming the first of `columns` that is not an integer (a damaged or hand-edited row)."""
    for c in columns:
        v = r[c]
        if not isinstance(v, int) and not (null and v is None):
            raise TypeError(f"{c} is {v!r}, not an integer")


def _row_to_flow(r: sqlite3.Row) -> Flow:
    return Flow(src=(r["src_addr"], r["src_port"]), dst=(r["dst_addr"], r["dst_port"]), pid=r["pid"],
                comm=r["comm"], opened_ns=r["opened_ns"], closed_ns=r["closed_ns"],
                joined_midstream=bool(r["joined_midstream"]), protocol=r["protocol"], id=r["id"])


@functools.lru_cache(maxsize=4096)
def _decoded_metadata(text: str) -> tuple[tuple[str, str], ...]:
    return tuple((str(k), str(v)) for k, v in json.loads(text or "[]"))


def _metadata(text: str) -> list[tuple[str, str]]:
    # Recordings repeat the same few header sets: decode each distinct text once. A fresh list per
    # call, because readers such as redaction edit a call's metadata in place.
    return list(_decoded_metadata(text or ""))


_CALLS_SQL = "SELECT * FROM calls ORDER BY request_ts_ns, id"
_CALL_BY_ID_SQL = "SELECT * FROM calls WHERE id = ?"
_CALL_IDS_SQL = "SELECT id FROM calls INDEXED BY calls_by_time"
_BATCH_MESSAGES_SQL = "SELECT * FROM messages WHERE call_id IN ({}) ORDER BY call_id, direction, seq"
_CALL_MESSAGES_SQL = "SELECT * FROM messages WHERE call_id = ? ORDER BY direction, seq"
# No ORDER BY: a sort reads every row before the first comes back, so damage would lose them all;
# rowid order already is each direction's seq order (messages are written in order).
_SCAN_MESSAGES_SQL = "SELECT * FROM messages NOT INDEXED WHERE call_id IN ({})"
# Grouped by kind too (MethodGroup.kinds); ordered by each group's first call.
_GROUPS_SQL = ("SELECT flow_id, method_ref, protocol, kind, count(*), min(request_ts_ns) AS first_ts,"
               " min(id) AS first_id FROM calls WHERE method IS NULL AND method_ref IS NOT NULL"
               " AND flow_id IS NOT NULL GROUP BY flow_id, method_ref, protocol, kind"
               " ORDER BY first_ts, first_id")
_GROUP_CALLS_SQL = ("SELECT * FROM calls WHERE flow_id = ? AND method_ref = ? AND method IS NULL"
                    " ORDER BY request_ts_ns, id LIMIT ?")
_BATCH = 256  # calls whose messages one query fetches: bounded memory, few statements


class Recording:
    """Read a recording as streams in time order, without loading it into memory.

    Raises RecordingError when the file does not exist, CorruptRecordingError when it is not a
    recording or is damaged. Iterators stop at the first unreadable row of a damaged file and record
    what happened in `problems`, so a caller can replay what is intact and say what was lost.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.problems: list[str] = []
        self._hit_damage = False     # the last _rows() stopped at damaged data
        if not self.path.exists():
            raise RecordingError(f"{self.path}: no such recording")
        try:
            # Not read-only mode: a recording left by a killed recorder still has its WAL to replay.
            self._db = sqlite3.connect(self.path, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self.meta = {r["key"]: json.loads(r["value"]) for r in self._db.execute("SELECT * FROM meta")}
        except sqlite3.DatabaseError as exc:
            self._db.close()   # now: a connection left to the collector keeps -wal/-shm files beside the file
            raise CorruptRecordingError(f"{self.path} is not a readable recording: {exc}") from exc
        except (ValueError, TypeError) as exc:
            self._db.close()
            raise CorruptRecordingError(f"{self.path} is damaged: a meta value is not JSON ({exc})") from exc
        version = self.meta.get("schema_version")
        if version != SCHEMA_VERSION:
            raise RecordingError(f"{self.path}: schema version {version!r}, this shadowtest reads "
                                 f"{SCHEMA_VERSION}")
        # Files from before method groups have neither calls.method_ref nor method_map.
        # Ids of rows whose crc did not match, by table (messages: by call id); a set, so reading
        # the file again (a replay's loops) does not count a row twice.
        self._left_out: dict[str, set[object]] = {}
        self._left_out_line: dict[str, int] = {}     # where in `problems` each table's count is said
        try:
            # Tables whose rows carry a crc (capture/rowcrc.py); files from before it have none.
            self._checked = frozenset(t for t in _CRC_TABLES if "crc" in _columns(self._db, t))
            self._has_ref = "method_ref" in _columns(self._db, "calls")
            has_map = bool(_columns(self._db, "method_map"))
            rows = self._db.execute("SELECT flow_id, ref, method, how FROM method_map").fetchall() if has_map else []
        except sqlite3.DatabaseError as exc:
            self._has_ref, rows, self._checked = False, [], frozenset()
            self.problems.append(f"cannot read the method map: {exc}")
        self._method_map: dict[tuple[int | None, str], tuple[str, str]] = {
            (r[0], r[1]): (r[2], r[3]) for r in rows}
        self._overrides: dict[tuple[int | None, str], tuple[str, str]] = {}

    @property
    def has_method_refs(self) -> bool:
        """False for a file written before method groups (no calls.method_ref column)."""
        return self._has_ref

    def map_methods(self, mapping: Mapping[tuple[int | None, str], str], how: str = "--method-map") -> None:
        """Name groups for this reader only (the file is not changed): {(flow_id or None, ref): method}.
        A None flow applies to that ref on every flow. These win over the file's method_map."""
        for key, method in mapping.items():
            self._overrides[key] = (method, how)

    def _mapped(self, flow_id: int | None, ref: str) -> tuple[str, str] | None:
        over = self._overrides
        if over:
            hit = over.get((flow_id, ref)) or over.get((None, ref))
            if hit is not None:
                return hit
        return self._method_map.get((flow_id, ref)) or self._method_map.get((None, ref))

    def _intact(self, table: str, r: sqlite3.Row) -> bool:
        """False (and counted in `problems`) for a row whose crc does not match its columns: bytes
        damaged on disk. Such a row is left out, never read as if it were what was recorded."""
        if table not in self._checked or row_matches(table, r):
            return True
        return self._left_out_row(table, r)

    def _left_out_row(self, table: str, r: sqlite3.Row) -> bool:
        """Count a row whose checksum failed as left out (messages: by their call, in _with_messages); False."""
        if table != "messages":      # messages are counted by call (_with_messages)
            self._leave_out(table, [_row_id(r)])
        return False

    def _leave_out(self, table: str, ids: Iterable[object]) -> None:
        seen = self._left_out.setdefault(table, set())
        seen.update(ids)
        n = len(seen)
        line = {"calls": f"{n} call(s) left out: their row failed its checksum (bytes damaged on disk)",
                "messages": f"{n} call(s) left out: a message of theirs failed its checksum (bytes damaged on disk)",
                "chunks": f"{n} chunk(s) left out: they failed their checksum (bytes damaged on disk)",
                "unreadable": f"{n} call(s) left out: their messages are on damaged pages"}[table]
        if table in self._left_out_line:
            self.problems[self._left_out_line[table]] = line
        else:
            self._left_out_line[table] = len(self.problems)
            self.problems.append(line)

    @property
    def left_out(self) -> dict[str, int]:
        """Rows left out so far because their checksum failed, by table (calls, messages, chunks)."""
        return {table: len(ids) for table, ids in self._left_out.items()}

    def _damaged(self, table: str, r: sqlite3.Row, exc: Exception) -> CorruptRecordingError:
        return CorruptRecordingError(f"{self.path} is damaged: row {_row_id(r)} of {table} is unreadable ({exc})")

    def _call(self, r: sqlite3.Row) -> Call:
        try:
            return self._checked_call(r)
        except (ValueError, TypeError) as exc:   # bad JSON metadata, a timestamp that is not an integer
            raise self._damaged("calls", r, exc) from exc

    def _checked_call(self, r: sqlite3.Row) -> Call:
        _ints(r, "request_ts_ns")
        _ints(r, "response_ts_ns", "end_ts_ns", "flow_id", "stream_id", "status", "id", null=True)
        call = Call(
            protocol=r["protocol"], method=r["method"], request_ts_ns=r["request_ts_ns"],
            flow_id=r["flow_id"], kind=r["kind"], stream_id=r["stream_id"],
            request_metadata=_metadata_column(r, "request_metadata"),
            response_metadata=_metadata_column(r, "response_metadata"), status=r["status"],
            status_message=r["status_message"], response_ts_ns=r["response_ts_ns"],
            end_ts_ns=r["end_ts_ns"], method_unknown=bool(r["method_unknown"]), id=r["id"],
            method_ref=r["method_ref"] if self._has_ref else None)
        if call.method is None and call.method_ref is not None:
            hit = self._mapped(call.flow_id, call.method_ref)
            if hit is not None:
                call.method, call.method_how = hit
        return call

    def _rows(self, sql: str, args: tuple[SqlValue, ...] = ()) -> Iterator[sqlite3.Row]:
        try:
            yield from self._db.execute(sql, args)
        except sqlite3.DatabaseError as exc:
            # Salvage: everything yielded before the damage stands; say what was cut off (once).
            line = f"stopped reading at damaged data ({exc}) in: {sql.split(' FROM ')[1][:40]}"
            if line not in self.problems:
                self.problems.append(line)
            self._hit_damage = True

    def _call_rows(self) -> Iterator[sqlite3.Row]:
        """The calls rows in time order; when damage stops the scan, the calls it did not reach one by one
        by id: a lookup descends from the table's root, so rows on intact pages past the damage still read
        (a cut file's first leaf is often a late page: a scan alone would salvage nothing)."""
        self._hit_damage = False
        seen: set[int] = set()
        for r in self._rows(_CALLS_SQL):
            seen.add(r["id"])
            yield r
        if not self._hit_damage:
            return
        for call_id in sorted(self._call_ids() - seen):
            try:
                row = self._db.execute(_CALL_BY_ID_SQL, (call_id,)).fetchone()
            except sqlite3.DatabaseError:
                continue                  # on a damaged page: lost (calls_lost counts it)
            if row is not None:
                yield row

    def _call_ids(self) -> set[int]:
        """Ids the calls table should hold: from its time index, as far as it reads, and 1 to the count
        its writer committed (meta.rows_written)."""
        ids: set[int] = set()
        try:
            ids.update(int(r[0]) for r in self._db.execute(_CALL_IDS_SQL))
        except sqlite3.DatabaseError:
            pass
        written = (self.meta.get("rows_written") or {}).get("calls")
        top = max(ids | {written if isinstance(written, int) else 0})
        return ids | set(range(1, top + 1))

    def flows(self) -> Iterator[Flow]:
        for r in self._rows("SELECT * FROM flows ORDER BY id"):
            yield _row_to_flow(r)

    def flow(self, flow_id: int) -> Flow | None:
        r = self._db.execute("SELECT * FROM flows WHERE id = ?", (flow_id,)).fetchone()
        return _row_to_flow(r) if r else None

    def chunks(self, flow_id: int | None = None) -> Iterator[Chunk]:
        """Chunks in capture order (of one flow when `flow_id` is given)."""
        sql, args = "SELECT * FROM chunks ORDER BY ts_ns, id", cast(tuple[SqlValue, ...], ())
        if flow_id is not None:
            sql, args = "SELECT * FROM chunks WHERE flow_id = ? ORDER BY id", (flow_id,)
        for r in self._rows(sql, args):
            if not self._intact("chunks", r):
                continue
            try:
                _ints(r, "ts_ns")
            except TypeError as exc:
                raise self._damaged("chunks", r, exc) from exc
            yield Chunk(flow_id=r["flow_id"], direction=r["direction"], ts_ns=r["ts_ns"], data=r["data"])

    def calls(self, *, with_messages: bool = True, batch_size: int = _BATCH) -> Iterator[Call]:
        """Calls ordered by request time, each with its messages. Streamed in batches of
        `batch_size` calls whose messages one query fetches, so memory stays bounded and long
        recordings read fast (a reader that must not stall for long, like the replayer reading
        ahead between sends, asks for small batches)."""
        batch: list[Call] = []
        fast: _FastCalls | None = None
        for r in self._call_rows():
            if fast is None:
                fast = _FastCalls(self, r.keys())
            call = fast.call(r)
            if call is None:
                continue
            batch.append(call)
            if len(batch) >= batch_size:
                yield from self._with_messages(batch, with_messages)
                batch = []
        yield from self._with_messages(batch, with_messages)

    def _with_messages(self, calls: list[Call], attach: bool) -> list[Call]:
        if not attach or not calls:
            return calls
        by_id = {c.id: c for c in calls}
        try:
            rows = self._db.execute(_BATCH_MESSAGES_SQL.format(",".join("?" * len(calls))),
                                    tuple(by_id)).fetchall()
        except sqlite3.DatabaseError:
            rows, unsure = self._salvage_messages(calls)
            if unsure:                # some of their messages may be on pages the damage took
                self._leave_out("unreadable", unsure)
                by_id = {i: c for i, c in by_id.items() if i not in unsure}
                calls = [c for c in calls if c.id not in unsure]
        damaged: set[int] = set()    # calls with a message that failed its checksum: left out whole
        fast = _FastMessages(self, rows[0].keys()) if rows else None
        for m in rows:
            if fast is not None and fast.add(m, by_id, damaged):
                continue             # the usual row, checked and attached (else: the checks below)
            if not self._intact("messages", m):
                damaged.add(m["call_id"])
                continue
            if m["call_id"] not in by_id:
                continue                  # a message of a call left out above
            try:
                _ints(m, "seq", "ts_ns")
                call = by_id[m["call_id"]]
            except (ValueError, TypeError, KeyError) as exc:
                raise self._damaged("messages", m, exc) from exc
            (call.requests if m["direction"] == "c2s" else call.responses).append(Message(
                direction=m["direction"], seq=m["seq"], ts_ns=m["ts_ns"], data=m["data"],
                compressed=bool(m["compressed"])))
        if not damaged:
            return calls
        self._leave_out("messages", damaged)
        return [c for c in calls if c.id not in damaged]

    def _salvage_messages(self, calls: list[Call]) -> tuple[list[sqlite3.Row], set[int]]:
        """Messages of `calls` from a damaged file: call by call through the index (intact pages still
        count), then, for calls whose lookup hit the damage (often the index itself), one scan of the
        table without the index, up to the damage. Returns the rows and the calls whose messages may be
        incomplete: those are left out, never replayed half. The writer inserts a call's messages after
        the previous call's, and the scan reads in that order up to the damage, so a call is whole when
        the scan got past it (it read a message of a later call)."""
        rows: list[sqlite3.Row] = []
        failed: list[int] = []
        for c in calls:
            try:
                rows += self._db.execute(_CALL_MESSAGES_SQL, (c.id,)).fetchall()
            except sqlite3.DatabaseError:
                failed.append(cast(int, c.id))
        if not failed:
            return rows, set()
        line = "damaged message index or pages: messages read by scanning the table"
        if line not in self.problems:
            self.problems.append(line)
        self._hit_damage = False
        scanned = list(self._rows(_SCAN_MESSAGES_SQL.format(",".join("?" * len(failed))), tuple(failed)))
        if not self._hit_damage:
            return rows + scanned, set()
        reached = max((int(r["call_id"]) for r in scanned), default=None)
        return rows + scanned, {c for c in failed if reached is None or c >= reached}

    def method_groups(self) -> list[MethodGroup]:
        """The groups of calls whose method is NULL in the calls table, by (flow_id, method_ref), in
        order of their first call, with the method map (and this reader's overrides) applied in
        `method`/`how`. Calls without a method_ref (their request headers were not seen) are in none."""
        if not self._has_ref:
            return []
        groups: dict[tuple[int, str], tuple[Counter[str], Counter[str]]] = {}
        for r in self._rows(_GROUPS_SQL):
            protocols, kinds = groups.setdefault((int(r[0]), str(r[1])), (Counter(), Counter()))
            protocols[str(r[2])] += int(r[4])
            kinds[str(r[3])] += int(r[4])
        out = []
        for (flow_id, ref), (protocols, kinds) in groups.items():
            hit = self._mapped(flow_id, ref)
            out.append(MethodGroup(flow_id=flow_id, ref=ref, protocol=protocols.most_common(1)[0][0],
                                   calls=sum(kinds.values()), kinds=dict(kinds.most_common()),
                                   method=hit[0] if hit else None, how=hit[1] if hit else None))
        return out

    def group_calls(self, flow_id: int, ref: str, limit: int = 50) -> list[Call]:
        """The first `limit` calls (request time order) of one group, with their messages."""
        if not self._has_ref:
            return []
        calls = [self._call(r) for r in self._rows(_GROUP_CALLS_SQL, (flow_id, ref, limit)) if self._intact("calls", r)]
        return self._with_messages(calls, True)

    def gaps(self) -> list[tuple[int, Direction, int, int | None, str | None]]:
        """(flow_id, direction, chunks_before, nbytes or None, how) of every gap (none in older files)."""
        try:
            if not _columns(self._db, "gaps"):
                return []
            return [(int(r[0]), r[1], int(r[2]), r[3], r[4]) for r in self._db.execute(
                "SELECT flow_id, direction, chunks_before, nbytes, how FROM gaps ORDER BY id")]
        except (sqlite3.DatabaseError, TypeError, ValueError) as exc:
            self.problems.append(f"cannot read the gaps: {exc}")
            return []

    def first_bytes(self, flow_id: int, direction: Direction, limit: int = 16384) -> bytes:
        """Up to `limit` bytes from the start of one direction of a flow (bounded read)."""
        out = bytearray()
        try:
            for r in self._db.execute("SELECT data FROM chunks WHERE flow_id = ? AND direction = ? ORDER BY id",
                                      (flow_id, direction)):
                out += r[0][:limit - len(out)]
                if len(out) >= limit:
                    break
        except sqlite3.DatabaseError:
            pass
        return bytes(out)

    def count(self, table: str) -> int:
        if table not in {"flows", "chunks", "calls", "messages"}:
            raise ValueError(table)
        try:
            return int(self._db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
        except sqlite3.DatabaseError as exc:
            self.problems.append(f"cannot count {table}: {exc}")
            return 0

    def time_range_ns(self) -> tuple[int, int] | None:
        """(first, last) request time over all calls, or None for a recording without calls."""
        r = self._db.execute("SELECT min(request_ts_ns), max(request_ts_ns) FROM calls").fetchone()
        return None if r[0] is None else (int(r[0]), int(r[1]))

    def call_protocols(self) -> frozenset[str]:
        """The protocols of the calls and flows in the file (grpc, http2, http1, tcp, tls), as far as
        they can be read."""
        found: set[str] = set()
        for sql in ("SELECT DISTINCT protocol FROM calls", "SELECT DISTINCT protocol FROM flows"):
            try:
                found.update(str(r[0]) for r in self._db.execute(sql))
            except sqlite3.DatabaseError:
                pass
        return frozenset(found)

    def chunk_time_range_ns(self) -> tuple[int, int] | None:
        """(first, last) chunk timestamp (bytes seen), or None without chunks or when it cannot be read."""
        try:
            r = self._db.execute("SELECT min(ts_ns), max(ts_ns) FROM chunks").fetchone()
        except sqlite3.DatabaseError:
            return None
        return None if r[0] is None or not isinstance(r[0], int) or not isinstance(r[1], int) else (r[0], r[1])

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the calls reader's fast path ---------------------------------------------------------------
# Replaying reads every call row and its message rows while it plays, so what Python does per row
# is client CPU per replayed call: read by name, a row cost ~25 us (CRC check, integer checks, the
# Call); by position, with the usual row's checks done inline, ~8 us. Any row the fast path does not
# take as ordinary (a type that is not the usual one, bad JSON, a CRC that does not match) goes
# through the by-name code above, so a damaged row is reported and left out exactly as before.

def _positions(keys: list[str], columns: tuple[str, ...]) -> Callable[[sqlite3.Row], tuple[Any, ...]] | None:
    """A getter of `columns` by position in rows with `keys`, or None when one is missing."""
    if not set(columns) <= set(keys):
        return None
    return operator.itemgetter(*(keys.index(c) for c in columns))


_CALL_FIELDS = ("id", "crc") + CALL_COLUMNS
_MESSAGE_FIELDS = ("crc",) + MESSAGE_COLUMNS


class _FastCalls:
    """Recording.calls' rows -> Call, with the usual row's checks done by position."""

    __slots__ = ("rec", "pick", "checked")

    def __init__(self, rec: Recording, keys: list[str]) -> None:
        self.rec, self.checked = rec, "calls" in rec._checked
        self.pick = _positions(keys, _CALL_FIELDS if self.checked else _CALL_FIELDS[:1] + _CALL_FIELDS[2:])

    def call(self, r: sqlite3.Row) -> Call | None:
        """The row's Call, or None when its checksum failed (left out and counted, as `_intact`)."""
        rec = self.rec
        if self.pick is None:
            return rec._call(r) if rec._intact("calls", r) else None
        if self.checked:
            call_id, crc, *cols = self.pick(r)
            if crc is not None:
                try:
                    intact = call_crc(*cols) == crc
                except (TypeError, ValueError, OverflowError, struct.error):
                    intact = False  # as row_matches: a row whose columns cannot be read as their types
                if not intact:
                    rec._left_out_row("calls", r)
                    return None
        else:
            call_id, *cols = self.pick(r)
        flow, protocol, method, kind, stream, req_md, resp_md, status, message, ts, resp_ts, end_ts, unknown, ref = cols
        if (type(ts) is not int or type(call_id) is not int or type(req_md) is not str or type(resp_md) is not str
                or not _int_or_none(flow, stream, status, resp_ts, end_ts)):
            return rec._call(r)  # the by-name checks: a damaged row raises there, naming its column
        try:
            req, resp = _metadata(req_md), _metadata(resp_md)
        except (ValueError, TypeError):
            return rec._call(r)
        call = Call(protocol, method, ts, flow, kind, stream, req, resp, status, message, resp_ts, end_ts,
                    bool(unknown), [], [], call_id, ref if rec._has_ref else None)
        if method is None and call.method_ref is not None:
            hit = rec._mapped(flow, call.method_ref)
            if hit is not None:
                call.method, call.method_how = hit
        return call


def _int_or_none(*values: object) -> bool:
    for v in values:
        if v is not None and type(v) is not int:
            return False
    return True


class _FastMessages:
    """Recording._with_messages' rows, attached to their calls with the usual row's checks by position."""

    __slots__ = ("pick", "checked")

    def __init__(self, rec: Recording, keys: list[str]) -> None:
        self.checked = "messages" in rec._checked
        self.pick = _positions(keys, _MESSAGE_FIELDS)

    def add(self, m: sqlite3.Row, by_id: dict[int | None, Call], damaged: set[int]) -> bool:
        """True when the row was an intact message of a call in `by_id` and is attached; False: the
        caller's by-name checks decide (a damaged, odd or orphan row)."""
        if self.pick is None:
            return False
        crc, call_id, direction, seq, ts, data, compressed = self.pick(m)
        if (type(seq) is not int or type(ts) is not int or type(call_id) is not int or type(compressed) is not int
                or call_id in damaged):
            return False
        call = by_id.get(call_id)
        if call is None:
            return False
        if crc is not None and self.checked:
            try:
                if message_crc_of_ints(call_id, direction, seq, ts, data, compressed) != crc:
                    return False
            except (TypeError, OverflowError, struct.error):
                return False
        (call.requests if direction == "c2s" else call.responses).append(
            Message(direction, seq, ts, data, bool(compressed)))
        return True


def open_recording(path: str | os.PathLike[str]) -> Recording:
    """Open a recording for reading (see `Recording`)."""
    return Recording(path)


def set_group_methods(path: Path | str, assignments: Iterable[tuple[int, str, str, str]]) -> None:
    """Write (flow_id, ref, method, how) rows into the method map of the existing recording `path`
    (an upsert: a group named again gets the new method and how). The file keeps its mode (0600).

    Raises RecordingError when the file is missing or not a writable recording, ValueError for a row
    that is not (int, non-empty str, non-empty str, non-empty str)."""
    rows = []
    for row in assignments:
        flow_id, ref, method, how = row
        if not isinstance(flow_id, int) or isinstance(flow_id, bool) or not all(
                isinstance(v, str) and v for v in (ref, method, how)):
            raise ValueError(f"a method map row is (flow_id, ref, method, how), not {row!r}")
        rows.append((flow_id, ref, method, how))
    path = Path(path)
    if not path.is_file():
        raise RecordingError(f"{path}: no such recording")
    mode = os.stat(path).st_mode & 0o777
    try:
        db = sqlite3.connect(path)
        try:
            if db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() is None:
                raise RecordingError(f"{path} is not a recording (no schema_version)")
            db.execute(_METHOD_MAP_TABLE)
            db.executemany(_UPSERT_MAP, rows)
            db.commit()
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        raise RecordingError(f"cannot write the method map of {path}: {exc}") from exc
    if os.stat(path).st_mode & 0o777 != mode:
        os.chmod(path, mode)
