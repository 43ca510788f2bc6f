"""Read a recording as the schedule's call source: gRPC/HTTP calls plus raw TCP flows, in time order.

Raw TCP flows (protocol 'tcp', no decoded calls) become one pseudo-call each (kind 'tcp') whose
request messages are the flow's client chunks at their own times. Only the first chunk time of each
TCP flow is held up front; the chunks themselves are read when the flow is reached.
"""

from __future__ import annotations

import heapq
import json
import sqlite3
from collections.abc import Iterator

from capture.recording import Call, Message, Recording

_CALLS_SQL = ("SELECT id, protocol, method, request_ts_ns, flow_id, kind, request_metadata, status "
              "FROM calls ORDER BY request_ts_ns, id")
_BATCH_SQL = ("SELECT call_id, direction, seq, ts_ns, data, compressed FROM messages "
              "WHERE call_id IN ({}) ORDER BY call_id, direction, seq")
_ONE_SQL = "SELECT call_id, direction, seq, ts_ns, data, compressed FROM messages WHERE call_id = ? ORDER BY direction, seq"
_BATCH = 256  # calls whose messages are fetched by one query (bounded memory, few statements)


def tcp_flow_starts(rec: Recording) -> list[tuple[int, int]]:
    starts = []
    for flow in rec.flows():
        if flow.protocol != "tcp" or flow.id is None:
            continue
        first = next((c.ts_ns for c in rec.chunks(flow.id) if c.direction == "c2s"), None)
        if first is not None:
            starts.append((first, flow.id))
    return sorted(starts)


def tcp_calls(rec: Recording, starts: list[tuple[int, int]]) -> Iterator[Call]:
    for first, flow_id in starts:
        msgs = [Message("c2s", i, c.ts_ns, c.data)
                for i, c in enumerate(c for c in rec.chunks(flow_id) if c.direction == "c2s")]
        yield Call(protocol="tcp", method=None, request_ts_ns=first, flow_id=flow_id, kind="tcp",
                   requests=msgs, id=None)


def _damaged(rec: Recording, exc: Exception, sql: str) -> None:
    # The same wording as Recording's own readers: replay what was read, say what was cut off.
    rec.problems.append(f"stopped reading at damaged data ({exc}) in: {sql.split(' FROM ')[1][:40]}")


class _Metadata:
    """Decoded request metadata per distinct JSON text (recordings repeat the same few headers)."""

    def __init__(self) -> None:
        self._cache: dict[str, list[tuple[str, str]]] = {}

    def get(self, text: str | None) -> list[tuple[str, str]]:
        md = self._cache.get(text or "")
        if md is None:
            if len(self._cache) >= 4096:  # bounded: some recordings carry unique metadata per call
                self._cache.clear()
            md = self._cache[text or ""] = [(str(k), str(v)) for k, v in json.loads(text or "[]")]
        return md  # shared between calls: readers copy it (schedule._planned does)


def _attach(db: sqlite3.Connection, rec: Recording, calls: list[Call]) -> None:
    """Fetch the messages of `calls` with one query; on damage, call by call (salvage what is intact)."""
    by_id = {c.id: c for c in calls}
    try:
        rows = db.execute(_BATCH_SQL.format(",".join("?" * len(calls))), tuple(by_id)).fetchall()
    except sqlite3.DatabaseError:
        rows = []
        for c in calls:
            try:
                rows.extend(db.execute(_ONE_SQL, (c.id,)).fetchall())
            except sqlite3.DatabaseError as exc:
                _damaged(rec, exc, _ONE_SQL)
    for call_id, direction, seq, ts_ns, data, compressed in rows:
        call = by_id[call_id]
        (call.requests if direction == "c2s" else call.responses).append(
            Message(direction, seq, ts_ns, data, bool(compressed)))


def fast_calls(rec: Recording) -> Iterator[Call]:
    """`rec.calls()` without TCP pseudo-calls, read cheaply: plain rows, messages fetched for a batch
    of calls at a time, metadata decoded once per distinct text. Damage ends the read like rec.calls()."""
    db = sqlite3.connect(rec.path, check_same_thread=False)  # plain tuples; Recording's rows are sqlite3.Row
    meta = _Metadata()
    try:
        cur = db.execute(_CALLS_SQL)
        damaged = False
        while not damaged:
            rows: list[tuple] = []
            try:
                for row in cur:  # row by row: the rows read before a damaged page still replay
                    rows.append(row)
                    if len(rows) >= _BATCH:
                        break
            except sqlite3.DatabaseError as exc:
                _damaged(rec, exc, _CALLS_SQL)
                damaged = True
            if not rows:
                return
            batch = [Call(protocol=p, method=m, request_ts_ns=ts, flow_id=f, kind=k, request_metadata=meta.get(md),
                          status=st, id=i) for i, p, m, ts, f, k, md, st in rows if p != "tcp"]
            if batch:
                _attach(db, rec, batch)
            yield from batch
    finally:
        db.close()


def recording_calls(rec: Recording) -> Iterator[Call]:
    """All replayable calls of `rec` in request-time order (streamed; see module docstring)."""
    starts = tcp_flow_starts(rec)
    calls = fast_calls(rec)
    if not starts:
        yield from calls
        return
    yield from heapq.merge(calls, tcp_calls(rec, starts), key=lambda c: c.request_ts_ns)


def recording_problems(rec: Recording) -> list[str]:
    """What the recording says it lost or could not read (empty for an intact, complete file)."""
    problems: list[str] = []
    for p in rec.problems:  # one line per kind of damage, with how often it was hit
        n = rec.problems.count(p)
        line = p if n == 1 else f"{p} ({n} times)"
        if line not in problems:
            problems.append(line)
    for key in ("lost_events", "truncated_events"):
        value = rec.meta.get(key)
        if value:
            problems.append(f"the recorder reported {key}={value}")
    return problems
