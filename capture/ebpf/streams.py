"""Each traced socket's two byte streams, rebuilt from the recorder's DATA records, with every loss a gap.

    DATA records (one per syscall, or several for a syscall over one record, each with its offset;
    header-only for bytes not copied: MSG_TRUNC, sendfile/splice, TLS ciphertext)
        | position of the syscall's first byte in its direction, counted in the kernel
        v
    Streams --data / gap / discarded / not_captured, in stream order--> FlowSink

The kernel counts every byte a traced syscall moved, whether or not its record found room in the ring,
and stamps each record with where its syscall's bytes start. A record whose position is past the bytes
handed on so far means records were lost in between: the sink gets a gap of exactly that size there, so
the decoders resynchronise (an HTTP/1 body of known length is stepped over, the calls a gap touched are
marked) and never pair a response with the wrong request. The CLOSE record carries the final positions,
so records lost at a connection's end are a gap too. Records lost inside one large syscall split it
into pieces at their own offsets, with a gap between them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from capture.recording import Direction

if TYPE_CHECKING:
    from capture.sink import FlowSink

Key = tuple[int, ...]
_WAIT_S = 1.0    # a syscall still missing records after this long lost them


class Streams:
    """Positions and half-assembled syscalls of every open flow; thread-confined (the decode thread)."""

    def __init__(self, sink: FlowSink, max_bytes: int) -> None:
        self.sink = sink
        self._max_bytes = max_bytes
        self._next: dict[tuple[Key, Direction], int] = {}       # the next position expected
        # (key, direction) -> [time, bytes, the syscall's position, its length, offset of bytes[0], since]
        self._pending: dict[tuple[Key, Direction], list[Any]] = {}
        self.lost_bytes = 0

    def whole(self, key: Key, direction: Direction, ts_ns: int, pos: int, payload: bytes) -> None:
        """A syscall whose bytes are all in one record: the usual case."""
        sk = (key, direction)
        if self._pending and sk in self._pending:
            self._finish(sk)
        nxt = self._next
        if nxt.get(sk, 0) != pos:
            self._catch_up(key, direction, pos)
        nxt[sk] = pos + len(payload)
        self.sink.data(key, direction, ts_ns, payload)

    def piece(self, key: Key, direction: Direction, ts_ns: int, pos: int, offset: int, total: int,
              payload: bytes) -> None:
        """One record of a syscall over one record's size (records of other syscalls may come between)."""
        sk = (key, direction)
        p = self._pending.get(sk)
        if p is not None and p[0] == ts_ns and p[2] == pos and offset >= p[4] + len(p[1]):
            if offset > p[4] + len(p[1]):          # records lost inside the syscall
                self._hand(key, direction, p, final=False)
                p[1], p[4] = bytearray(), offset
        else:
            if p is not None:
                self._finish(sk)
            p = self._pending[sk] = [ts_ns, bytearray(), pos, total, offset, time.monotonic()]
        p[1] += payload
        if p[4] + len(p[1]) >= min(total, self._max_bytes):
            self._finish(sk)

    def length_only(self, key: Key, direction: Direction, pos: int, nbytes: int) -> None:
        """A syscall whose bytes were not copied (the caller tells the sink how): its place in the stream."""
        sk = (key, direction)
        if sk in self._pending:
            self._finish(sk)
        self._catch_up(key, direction, pos)
        self._next[sk] = pos + nbytes

    def flush(self, force: bool = False) -> None:
        """Hand on syscalls whose records are all in, or (force, or waiting over _WAIT_S) what came."""
        now = time.monotonic()
        for sk in [k for k, p in self._pending.items() if force or now - p[5] >= _WAIT_S]:
            self._finish(sk)

    def close(self, key: Key, final: dict[Direction, int] | None) -> None:
        """The flow ends: what is pending, then a gap for bytes lost after its last record (`final`:
        the kernel's final positions, None when unknown)."""
        directions: tuple[Direction, Direction] = ("c2s", "s2c")
        for direction in directions:
            sk = (key, direction)
            if sk in self._pending:
                self._finish(sk)
            if final is not None:
                self._catch_up(key, direction, final[direction])
            self._next.pop(sk, None)

    # ---- inside ----

    def _finish(self, sk: tuple[Key, Direction]) -> None:
        self._hand(sk[0], sk[1], self._pending.pop(sk), final=True)

    def _hand(self, key: Key, direction: Direction, p: list[Any], final: bool) -> None:
        """The bytes `p` holds at their place in the stream; its last piece stands for the rest of the
        syscall, whose missing part (over --max-bytes, more iovecs than walked, or records lost) is a gap."""
        ts_ns, buf, pos, total, off, _since = p
        self._catch_up(key, direction, pos + off)
        self.sink.data(key, direction, ts_ns, bytes(buf))
        end = pos + (total if final else off + len(buf))
        have = pos + off + len(buf)
        self._next[(key, direction)] = end
        if end > have:
            # Truncated or cut short: the stream has a hole, which the decoders are told about so
            # they resynchronise instead of misparsing.
            self.sink.gap(key, direction, end - have)

    def _catch_up(self, key: Key, direction: Direction, pos: int) -> None:
        """Bytes at stream position `pos` come next: a gap for those whose records the ring lost."""
        expect = self._next.get((key, direction), 0)
        if pos > expect:
            self.lost_bytes += pos - expect
            self.sink.gap(key, direction, pos - expect)
