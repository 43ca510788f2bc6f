"""The sockets of a proxied connection and the two directions (flows) that move bytes between them.

Each proxied connection owns its two non-blocking sockets (`Sock`), watched with `loop.add_reader` and
`loop.add_writer` (no asyncio transports, so a direction can take its socket's reads over). A socket
is read by one direction and written by the other: the client socket is read by the upstream flow and
written by the downstream one, and the other way round for the upstream socket.

Each read a `Flow` makes goes one of two ways, chosen afresh at every read by the connection's `gate`:

    chunk path   recv -> Connection.on_data -> [call tap] -> Link -> [toxic stages] -> Sock.write
    fast path    recv_into a scratch buffer -> send            (small reads: one copy, two syscalls)
                 splice socket -> pipe -> socket               (bulk: no copy through Python at all)

The gate opens only while nothing on the way needs to see the bytes: the connection has no call tap,
its protocol has been detected, and the direction's link has no toxic and nothing queued. Whatever
the fast path read has been handed to the destination socket before the next read, so the switch is
exact: the first read after a toxic is added goes into the toxic, and a removed toxic's flushed bytes
(the link's queue) leave before the fast path reads again. The fast path reads only while the
destination has nothing queued (the rest of a short write, or bytes still in the splice pipe): its
buffering is bounded by one read, and a slow destination stops the source (backpressure).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

READ_MAX = 256 * 1024        # one read on the chunk path (asyncio's transports read this much)
FAST_BUF = 256 * 1024        # the fast path's scratch buffer (one per thread, reused by every flow)
PIPE_SIZE = 1 << 20          # a splice pipe's capacity (Linux's default limit for unprivileged pipes)
SPLICE_AT = 64 * 1024        # a direction reads by splice once one read brought this much (bulk)
BURST = 16                   # reads per readiness event before the loop serves others
WRITE_HIGH = 1 << 20         # queued bytes past which the chunk path's writer waits (pause_writing)
_ACCEPT_BACKLOG = 100
_NO_SPLICE_ERRNOS = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}
_SPLICE = getattr(os, "splice", None)
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_scratch = threading.local()


def _buffer() -> tuple[bytearray, memoryview]:
    """This thread's scratch buffer: a read is fully handed on (sent or copied) before the next."""
    pair: tuple[bytearray, memoryview] | None = getattr(_scratch, "pair", None)
    if pair is None:
        buf = bytearray(FAST_BUF)
        pair = _scratch.pair = (buf, memoryview(buf))
    return pair


def set_nodelay(sock: socket.socket) -> None:
    """Small writes leave at once, as on asyncio's transports."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class Sock:
    """One socket of a connection: its reads (switched on and off by the flow that reads it) and its
    write queue (filled by the flow that writes it): bytes (`buf`) or bytes spliced into its pipe
    (`piped`, never both: the pipe is emptied into `buf` before bytes are queued behind it).

    Mirrors an asyncio transport where the proxy relied on one: `write` sends at once when nothing is
    queued, `write_eof` and `close` wait for the queue to drain, `abort` drops it, a failed read or
    write closes the socket at once, and `on_lost` is called (on a later loop step) once it is closed.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, role: str,
                 high: int = WRITE_HIGH) -> None:
        self.loop, self.sock, self.role = loop, sock, role
        self.fd = sock.fileno()
        self.high, self.low = high, high // 4
        self.on_read: Callable[[], None] | None = None
        self.on_lost: Callable[[str], None] | None = None
        self.on_write_paused: Callable[[bool], None] | None = None
        self.on_drained: Callable[[], None] | None = None
        self.buf = bytearray()
        self.piped = 0
        self.pipe_r = self.pipe_w = -1
        self.reading = self.writing = self.write_paused = False
        self.eof_pending = False    # write_eof asked: the write side shuts once the queue is empty
        self.closing = False        # close or abort asked: no more reads
        self.lost = False           # nothing more is written: the socket is (being) closed
        self.closed = False

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def queued(self) -> int:
        return len(self.buf) + self.piped

    # --- reading ---------------------------------------------------------------------------------
    def set_reading(self, on: bool) -> None:
        if on and (self.closing or self.on_read is None):
            on = False
        if on == self.reading:
            return
        self.reading = on
        if on:
            assert self.on_read is not None
            self.loop.add_reader(self.fd, self.on_read)
        else:
            self.loop.remove_reader(self.fd)

    # --- writing ---------------------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send now what the kernel takes, queue the rest (never waits)."""
        if not data or self.lost or self.eof_pending:
            return
        if self.piped:
            self._unpipe()
        if not self.buf:
            try:
                n = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                return self.fail(exc)
            if n == len(data):
                return
            data = data[n:]
        self.buf += data
        self._queued()

    def _queued(self) -> None:
        if not self.writing:
            self.writing = True
            self.loop.add_writer(self.fd, self._writable)
        if not self.write_paused and self.queued() > self.high:
            self.write_paused = True
            if self.on_write_paused is not None:
                self.on_write_paused(True)

    def pipe(self) -> int:
        """The write end of this socket's splice pipe (made on first use); -1 when there is none."""
        if self.pipe_w < 0 and _SPLICE is not None and not self.lost:
            try:
                self.pipe_r, self.pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                return -1
            try:
                fcntl.fcntl(self.pipe_w, _F_SETPIPE_SZ, PIPE_SIZE)
            except OSError:
                pass
        return self.pipe_w

    def spliced(self, n: int) -> None:
        """`n` more bytes were spliced into the pipe: pass on what the socket takes now."""
        self.piped += n
        assert _SPLICE is not None
        try:
            self.piped -= _SPLICE(self.pipe_r, self.fd, self.piped, flags=_SPLICE_FLAGS)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            return self.fail(exc)
        if self.piped:
            self._queued()

    def _unpipe(self) -> None:
        """Bytes are to be queued behind the pipe's: move the pipe's into `buf` (it was empty)."""
        while self.piped > 0:
            try:
                data = os.read(self.pipe_r, self.piped)
            except OSError:
                data = b""
            if not data:
                break
            self.buf += data
            self.piped -= len(data)
        self.piped = 0

    def _writable(self) -> None:
        try:
            if self.piped:
                assert _SPLICE is not None
                self.piped -= _SPLICE(self.pipe_r, self.fd, self.piped, flags=_SPLICE_FLAGS)
            if self.buf and not self.piped:
                del self.buf[:self.sock.send(self.buf)]
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self.fail(exc)
        left = self.queued()
        if self.write_paused and left <= self.low:
            self.write_paused = False
            if self.on_write_paused is not None:
                self.on_write_paused(False)
        if left:
            return
        self.writing = False
        self.loop.remove_writer(self.fd)
        if self.eof_pending:
            self._shutdown()
        if self.closing:
            self.lost = True
            self.loop.call_soon(self._finish)
            return
        if self.on_drained is not None:
            self.on_drained()

    def write_eof(self) -> None:
        """Half-close (FIN) once everything queued has left."""
        if self.closing or self.eof_pending:
            return
        self.eof_pending = True
        if not self.queued():
            self._shutdown()

    def _shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    # --- ends ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop reading; close once everything queued has left."""
        if self.closing:
            return
        self.closing = True
        self.set_reading(False)
        if not self.queued():
            self.lost = True
            self.loop.call_soon(self._finish)

    def abort(self) -> None:
        """Close at once; whatever is queued is dropped."""
        self._force()

    def fail(self, exc: BaseException) -> None:
        """A read or write failed (a reset, a broken pipe): the socket is closed at once."""
        log.debug("%s socket failed: %r", self.role, exc)
        self._force()

    def _force(self) -> None:
        self.closing = True
        self.set_reading(False)
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.fd)
        self.buf.clear()
        self.piped = 0
        if not self.lost:
            self.lost = True
            self.loop.call_soon(self._finish)

    def _finish(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.sock.close()
        for fd in (self.pipe_r, self.pipe_w):
            if fd >= 0:
                os.close(fd)
        self.pipe_r = self.pipe_w = -1
        if self.on_lost is not None:
            self.on_lost(self.role)


class Flow:
    """One direction: reads `src` and moves what it read to `dst`, by the fast path while `gate()`
    allows, else by `on_data` (the connection's chunk path). Counts what went which way."""

    def __init__(self, src: Sock, dst: Sock, gate: Callable[[], bool], on_data: Callable[[str, bytes], None],
                 on_eof: Callable[[str], None]) -> None:
        self.src, self.dst, self.gate = src, dst, gate
        self.role = src.role
        self._on_data, self._on_eof = on_data, on_eof
        self.started = self.eof = self.link_paused = self.waiting = False
        self.fast = False
        self.splice = False                  # reading by splice (after a bulk read), else recv_into
        self.can_splice = _SPLICE is not None
        self.fast_bytes = self.chunk_bytes = self.spliced_bytes = 0
        self.to_fast = self.to_chunk = 0
        self._buf, self._view = _buffer()     # this (the loop's) thread's
        src.on_read = self._readable
        dst.on_drained = self._drained

    def start(self) -> None:
        self.started = True
        self._update()

    def pause(self, paused: bool) -> None:
        """The link's backpressure (its first channel is full, or has room again)."""
        self.link_paused = paused
        self._update()

    def _update(self) -> None:
        self.src.set_reading(self.started and not self.eof and not self.link_paused and not self.waiting)

    def _drained(self) -> None:
        """The destination's queue has emptied: read on at once (the source most likely has more, and
        reading now saves a loop step and the reader's re-registration); watch it again if it ran dry."""
        if self.waiting:
            self.waiting = False
            if self.started and not self.eof and not self.link_paused and not self.src.closing:
                self._readable()
            self._update()

    def _wait(self) -> None:
        """The destination has bytes queued: read no more until they have left."""
        self.waiting = True
        self._update()

    def stats(self) -> dict[str, int | str]:
        return {"mode": "fast" if self.fast else "chunk", "fast_bytes": self.fast_bytes,
                "spliced_bytes": self.spliced_bytes, "chunk_bytes": self.chunk_bytes,
                "to_fast": self.to_fast, "to_chunk": self.to_chunk}

    # --- reads -----------------------------------------------------------------------------------
    def _readable(self) -> None:
        if self.gate() and not self.dst.lost:
            if not self.fast:
                self.fast = True
                self.to_fast += 1
            return self._splice() if self.splice else self._copy()
        if self.fast:
            self.fast = False
            self.to_chunk += 1
        self._chunk()

    def _chunk(self) -> None:
        try:
            data = self.src.sock.recv(READ_MAX)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self.src.fail(exc)
        if not data:
            return self._ended()
        self.chunk_bytes += len(data)
        self._on_data(self.role, data)

    def _ended(self) -> None:
        self.eof = True
        self._update()
        self._on_eof(self.role)

    def _copy(self) -> None:
        dst = self.dst
        if dst.queued():            # read only behind an empty queue: order kept, buffering bounded
            return self._wait()
        buf, view = self._buf, self._view
        recv_into = self.src.sock.recv_into
        size = len(buf)
        for _ in range(BURST):
            try:
                n = recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                return self.src.fail(exc)
            if not n:
                return self._ended()
            self.fast_bytes += n
            dst.write(view[:n])
            if dst.buf or dst.lost:
                return self._wait()
            if n >= SPLICE_AT and self.can_splice:
                self.splice = True              # bulk: the next reads go by splice
                return self._splice() if n == size else None
            if n < size:
                return

    def _splice(self) -> None:
        dst = self.dst
        if dst.queued():            # as in _copy; and pipe bytes must never overtake `buf`'s
            return self._wait()
        pipe = dst.pipe()
        if pipe < 0:
            self.can_splice = self.splice = False
            return self._copy()
        assert _SPLICE is not None
        fd = self.src.fd
        for _ in range(BURST):
            try:
                n = _SPLICE(fd, pipe, PIPE_SIZE, flags=_SPLICE_FLAGS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _NO_SPLICE_ERRNOS:
                    self.can_splice = self.splice = False
                    return self._copy()
                return self.src.fail(exc)
            if not n:
                return self._ended()
            self.fast_bytes += n
            self.spliced_bytes += n
            dst.spliced(n)
            if dst.piped or dst.lost:
                return self._wait()
            if n < SPLICE_AT:
                self.splice = False      # small reads again: one copy costs less than the pipe
                return


async def dial(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to host:port (each resolved address tried in turn)."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError("getaddrinfo() returned empty list")
    errors: list[OSError] = []
    for family, type_, proto, _, addr in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, addr)
        except OSError as exc:
            sock.close()
            errors.append(exc)
            continue
        except BaseException:
            sock.close()
            raise
        set_nodelay(sock)
        return sock
    if len(errors) == 1 or len({str(e) for e in errors}) == 1:
        raise errors[0]
    raise OSError(f"Multiple exceptions: {', '.join(str(e) for e in errors)}")


class Listener:
    """Listening sockets for host:port (as asyncio's create_server binds them) handing each accepted,
    non-blocking, TCP_NODELAY socket to `on_accept`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_accept: Callable[[socket.socket], None]) -> None:
        self.loop, self.on_accept = loop, on_accept
        self.sockets: list[socket.socket] = []

    async def start(self, host: str, port: int) -> None:
        infos = await self.loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, type_, proto, _, addr in dict.fromkeys(infos):
                sock = socket.socket(family, type_, proto)
                self.sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    sock.bind(addr)
                except OSError as err:
                    raise OSError(err.errno, f"error while attempting to bind on address {addr!r}: "
                                             f"{(err.strerror or '').lower()}") from None
                sock.listen(_ACCEPT_BACKLOG)
                sock.setblocking(False)
        except BaseException:
            self.close()
            raise
        if not self.sockets:
            raise OSError(f"no address to listen on for {host}:{port}")
        for sock in self.sockets:
            self.loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, listening: socket.socket) -> None:
        for _ in range(_ACCEPT_BACKLOG):
            try:
                sock, _ = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("proxy listener: accept failed (%s); pausing accepts for 1 s", exc)
                    self.loop.remove_reader(listening.fileno())
                    self.loop.call_later(1.0, self._resume, listening)
                    return
                continue            # the peer gave up before we took it (ECONNABORTED and the like)
            sock.setblocking(False)
            set_nodelay(sock)
            self.on_accept(sock)

    def _resume(self, listening: socket.socket) -> None:
        if listening in self.sockets:
            self.loop.add_reader(listening.fileno(), self._accept, listening)

    def close(self) -> None:
        for sock in self.sockets:
            if sock.fileno() >= 0:
                self.loop.remove_reader(sock.fileno())
                sock.close()
        self.sockets = []
