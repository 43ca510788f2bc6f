"""A pipelined Redis connection on asyncio (RESP2, or RESP3 after HELLO 3): the agent cache's Redis tier
talks through it.

    send(cmds) --> socket --> redis           a reply is matched to the oldest send still waiting;
    future <-- _Pending (FIFO) <-- replies    a send abandoned at its budget keeps its place in line
                                              and its reply is read and dropped when it comes
    on_push <-- Push (RESP3 ">")              out-of-band messages (client tracking's invalidations)
                                              answer no send: they go to on_push, in stream order

A send's `then` sees its reply in stream order too, before anything read after it (a push that follows
it included): what a reply says can be kept without a later invalidation slipping in between.

Replies are bounded (MAX_REPLY_BYTES incomplete, MAX_REPLY_DEPTH nested): a reply past either closes the
connection, and every send still waiting fails with ConnectionError.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RedisAddress:
    """Where a Redis listens and how to log in: a redis:// or unix:// URL, parsed."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None          # a unix socket's path (unix://), else TCP to host:port
    db: int = 0
    username: str | None = None
    password: str | None = None

    def setup(self) -> list[bytes]:
        """The commands a new connection sends first: AUTH (when a password is set), SELECT (db > 0)."""
        out = []
        if self.password is not None:
            out.append(command("AUTH", *([self.username] if self.username else []), self.password))
        if self.db:
            out.append(command("SELECT", self.db))
        return out


def parse_url(url: str) -> RedisAddress:
    """redis://[[user]:password@]host[:port][/db][?db=N] or unix://[[user]:password@]/path[?db=N], the
    forms redis-cli and the Redis clients take. ValueError, one line, for anything else."""
    if not url.startswith(("redis://", "unix://")):
        raise ValueError("must start with redis:// or unix://")
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    unknown = sorted(set(query) - {"db"})
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} (only db=N)")
    db_text = query["db"][-1] if "db" in query else ""
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad port: {exc}") from None
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("unix:// needs the socket's path (unix:///run/redis.sock)")
        return RedisAddress(path=unquote(parts.path), db=_db(db_text), username=user, password=password)
    path_db = parts.path.lstrip("/")
    if path_db and db_text:
        raise ValueError("the database is named twice (path and ?db=)")
    return RedisAddress(host=parts.hostname or "localhost", port=port or 6379, db=_db(path_db or db_text),
                        username=user, password=password)


def _db(text: str) -> int:
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"the database must be a number, not {text!r}")
    return int(text)


MAX_REPLY_BYTES = 4 << 20   # a reply still incomplete past this closes the connection (ours are KiB)
MAX_REPLY_DEPTH = 4


class RedisReplyError(Exception):
    """Redis answered a command with an error reply (-ERR ...)."""


class Push(list[object]):
    """A RESP3 push message (">"): out of band, it answers no command."""


Then = Callable[["RespConnection", object], None]


class _Pending:
    """The replies one send waits for (`left` of them): the last one answers, an error reply fails it;
    `then` (if any) is given the last reply when it comes, abandoned or not, unless one was an error."""

    __slots__ = ("future", "left", "error", "sent", "then")

    def __init__(self, future: asyncio.Future[object], left: int, sent: float, then: Then | None) -> None:
        self.future, self.left, self.sent, self.then = future, left, sent, then
        self.error: RedisReplyError | None = None


class RespConnection(asyncio.Protocol):
    """One Redis connection, pipelined: every command goes out at once, replies come back in order.
    redis-py's asyncio client cost ~170 us of CPU per lookup here and dropped (then reopened) a connection
    after every abandoned command; this costs a write, a read and a parse, and abandons nothing."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._waiting: deque[_Pending] = deque()
        self._buf = b""
        self.lost = False
        self.on_push: Callable[[Push], None] | None = None   # None: pushes are read and dropped
        self.on_lost: Callable[[RespConnection], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.on_lost is not None:
            self.on_lost(self)
        while self._waiting:
            future = self._waiting.popleft().future
            if not future.done():
                future.set_exception(ConnectionError(f"redis connection lost ({exc or 'closed'})"))

    def send(self, payload: bytes, replies: int, now: float, then: Then | None = None) -> asyncio.Future[object]:
        """Write `payload` (`replies` commands); the future answers the last reply (see _Pending for `then`)."""
        assert self.transport is not None, "send() after connection_made()"
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Pending(future, replies, now, then))
        self.transport.write(payload)
        return future

    def oldest(self) -> float | None:
        """When the oldest send still waiting for a reply went out (None when nothing waits)."""
        return self._waiting[0].sent if self._waiting else None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        pos, end = 0, len(buf)
        waiting = self._waiting
        try:
            while pos < end:
                # A write batch's replies but its last (":n" and "+OK", three per bucket) are counted,
                # not parsed: nothing reads them. A run of them is found and counted in C (a batch of 100
                # entries has ~300: one by one in Python they cost ~150 us a batch). No run here (another
                # kind of reply, or a line not all here yet): _parse reads it, or waits for the rest.
                if (waiting and (left := waiting[0].left) > 1
                        and (run := _SIMPLE_LINES.match(buf, pos)) is not None):
                    stop = run.end()
                    lines = buf.count(b"\r\n", pos, stop)
                    for _ in range(lines - (left - 1)):  # not this send's last reply, nor the next send's
                        stop = buf.rfind(b"\r\n", pos, stop - 2) + 2
                    waiting[0].left -= min(lines, left - 1)
                    pos = stop
                    continue
                parsed = _parse(buf, pos)
                if parsed is None:
                    break
                reply, pos = parsed
                if type(reply) is Push:
                    if self.on_push is not None:
                        self.on_push(reply)
                    continue
                self._answer(reply)
        except (ValueError, IndexError) as exc:   # not RESP, or a reply nothing asked for: drop the line
            _log.warning("redis: bad reply (%s); closing the connection", exc)
            self._buf = b""
            self.close()
            return
        self._buf = buf[pos:]
        if len(self._buf) > MAX_REPLY_BYTES:     # a bucket's entries are a few KiB: this is no reply of ours
            _log.warning("redis: a reply over %d bytes; closing the connection", MAX_REPLY_BYTES)
            self._buf = b""
            self.close()

    def _answer(self, reply: object) -> None:
        pending = self._waiting[0]
        if isinstance(reply, RedisReplyError):
            pending.error = reply
        pending.left -= 1
        if pending.left:
            return
        self._waiting.popleft()
        if pending.then is not None and pending.error is None:
            pending.then(self, reply)
        if pending.future.done():   # abandoned at its budget: its reply is read and dropped
            return
        if pending.error is not None:
            pending.future.set_exception(pending.error)
        else:
            pending.future.set_result(reply)


def _parse(buf: bytes, pos: int, depth: int = 0) -> tuple[object, int] | None:
    """One reply at `pos`: (value, the position after it), or None when it is not all here yet.
    RESP2 and RESP3: bulk and verbatim strings are bytes, arrays and sets lists, maps flat lists (key,
    value, ...), pushes Push, nulls None, errors RedisReplyError, attributes skipped (the reply they
    annotate is returned). ValueError for bytes that are not RESP (aggregates nested deeper than
    MAX_REPLY_DEPTH included: ours are at most two deep)."""
    if depth > MAX_REPLY_DEPTH:
        raise ValueError(f"arrays nested over {MAX_REPLY_DEPTH} deep")
    eol = buf.find(b"\r\n", pos)
    if eol < 0:
        return None
    kind, line = buf[pos], buf[pos + 1:eol]
    if kind in _LENGTHS:                             # $ bulk string; RESP3: = verbatim string, ! blob error
        n = int(line)
        if n < 0:
            if kind == 33:
                raise ValueError("a blob error of negative length")
            return None, eol + 2
        start = eol + 2
        if start + n + 2 > len(buf):
            return None
        data = buf[start:start + n]
        return (RedisReplyError(data.decode(errors="replace")) if kind == 33 else data), start + n + 2
    if kind in _AGGREGATES:                          # * array; RESP3: ~ set, % map, > push, | attribute
        n = int(line)
        count = 2 * n if kind in (37, 124) else n    # a map's (and an attribute's) pairs
        items: list[object] = Push() if kind == 62 else []
        pos = eol + 2
        end = len(buf)
        for _ in range(max(count, 0)):
            if pos < end and buf[pos] == 36:         # a bulk string, inline: an LRANGE reply is 32 of them
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    return None
                size = int(buf[pos + 1:eol])
                if size >= 0:
                    pos = eol + 2 + size + 2
                    if pos > end:
                        return None
                    items.append(buf[eol + 2:pos - 2])
                    continue
            parsed = _parse(buf, pos, depth + 1)
            if parsed is None:
                return None
            item, pos = parsed
            items.append(item)
        if kind == 124:                              # an attribute: the reply it annotates follows
            return _parse(buf, pos, depth + 1)       # (deeper: a chain of them ends at the bound)
        return (items if n >= 0 else None), pos
    if kind == 43:                                   # + simple string
        return line, eol + 2
    if kind == 58 or kind == 40:                     # : integer, ( big number (RESP3)
        return int(line), eol + 2
    if kind == 45:                                   # - error
        return RedisReplyError(line.decode(errors="replace")), eol + 2
    if kind == 95:                                   # _ null (RESP3)
        if line:
            raise ValueError("a null with a payload")
        return None, eol + 2
    if kind == 35:                                   # # boolean (RESP3)
        if line not in (b"t", b"f"):
            raise ValueError(f"boolean {line[:8]!r}")
        return line == b"t", eol + 2
    if kind == 44:                                   # , double (RESP3)
        return float(line), eol + 2
    raise ValueError(f"reply type {chr(kind)!r}")


_LENGTHS = frozenset(b"$=!")     # a length line, then that many bytes
_AGGREGATES = frozenset(b"*~%>|")
_SIMPLE_LINES = re.compile(rb"(?:[:+][^\r\n]*\r\n)+")   # integers and simple strings, one line each


def command(*args: bytes | str | int) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def with_key(head: bytes, key: bytes, tail: bytes) -> bytes:
    """A command whose first argument is `key` (the hot ones): `head` its array header and name, `tail`
    the arguments after the key, each already RESP."""
    return b"%s$%d\r\n%s\r\n%s" % (head, len(key), key, tail)
