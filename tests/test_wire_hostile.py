"""The lean HTTP/2 gRPC server (agent_under_test/h2server.py) against hostile clients.

Each attack is written by hand on a raw socket (frames packed with struct, header blocks from hpack's
Encoder) against a LeanServer running in its own process (tests/hostile_server.py), so that the
server's memory can be measured from outside (psutil RSS, sampled during the attack) and a crash or a
traceback cannot take the test process with it. Every attack asserts the server's exact answer (GOAWAY
or RST_STREAM with its error code, or the gRPC status), a memory bound, that normal grpcio calls on
another connection keep working, and that the server's stderr holds no traceback.

    gzip bombs ............. test_gzip_bomb_*
    header-block floods .... test_continuation_flood_*, test_flood_of_empty_frames_*
    flow control ........... test_data_beyond_the_*_window_*, test_oversized_frame_*
    PING / rapid reset ..... test_ping_flood_*, test_rapid_reset_*
    malformed frames ....... test_malformed_frame_is_a_connection_error[*], test_empty_header_name_*
    timeouts ............... test_silent_client_*, test_idle_client_*
    -bin metadata .......... test_bin_metadata_*
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterator
from enum import IntEnum
from pathlib import Path
from typing import IO, NamedTuple
from urllib.parse import unquote

import grpc
import hpack
import psutil
import pytest

from wire.process import end_child
from wire.process import spawn as spawn_child

ROOT = Path(__file__).resolve().parent.parent
SERVER_SCRIPT = ROOT / "tests" / "hostile_server.py"
SERVICE = "test.Bytes"
MiB = 1 << 20
GROWTH_LIMIT_MB = 40           # what any single attack may add to the server's RSS
GUARD_MB = 512                 # beyond this the server is killed (an inflated bomb must not eat the host)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEAD = struct.Struct(">BHBBL")  # 24-bit length as 8+16, type, flags, stream id
U32 = struct.Struct(">L")
SETTING = struct.Struct(">HL")


class T(IntEnum):
    DATA = 0
    HEADERS = 1
    PRIORITY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PUSH_PROMISE = 5
    PING = 6
    GOAWAY = 7
    WINDOW_UPDATE = 8
    CONTINUATION = 9


class Err(IntEnum):
    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    SETTINGS_TIMEOUT = 4
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9
    CONNECT_ERROR = 10
    ENHANCE_YOUR_CALM = 11


END_STREAM = ACK = 0x1
END_HEADERS, PADDED = 0x4, 0x8
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6


def type_name(ftype: int) -> str:
    try:
        return T(ftype).name
    except ValueError:
        return f"type {ftype}"


def err_name(code: int) -> str:
    try:
        return f"{Err(code).name} ({code})"
    except ValueError:
        return f"unknown error code {code}"


# ---- frames and header blocks -----------------------------------------------------------------------
def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return HEAD.pack(n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def frame_head(length: int, ftype: int, flags: int, sid: int) -> bytes:
    """Only a frame's 9-byte header, with any length field (a lie about the payload, if we like)."""
    return HEAD.pack(length >> 16, length & 0xFFFF, ftype, flags, sid)


def settings(*pairs: tuple[int, int]) -> bytes:
    return frame(T.SETTINGS, 0, 0, b"".join(SETTING.pack(k, v) for k, v in pairs))


def grpc_message(payload: bytes, flag: int = 0) -> bytes:
    return bytes((flag,)) + U32.pack(len(payload)) + payload


def header_block(method: str, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A request header block that never touches the dynamic table (never-indexed literals and static
    indexes), so it decodes the same on any connection at any time and can be repeated byte for byte."""
    fields = [(":method", "POST"), (":scheme", "http"), (":path", f"/{SERVICE}/{method}"),
              (":authority", "127.0.0.1"), ("content-type", "application/grpc"), ("te", "trailers"), *extra]
    encoder = hpack.Encoder()
    block = encoder.encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in fields], huffman=False)
    assert not encoder.header_table.dynamic_entries
    return block


def pad_block(size: int) -> bytes:
    """`size` bytes of header block: never-indexed `x-pad: aaa...` fields (only the length matters)."""
    one = hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple("x-pad", "a" * 4000)], huffman=False)
    return (one * (size // len(one) + 1))[:size]


class Frame(NamedTuple):
    type: int
    flags: int
    sid: int
    payload: bytes

    def describe(self) -> str:
        name = type_name(self.type)
        if self.type == T.GOAWAY and len(self.payload) >= 8:
            last, code = struct.unpack_from(">LL", self.payload)
            debug = self.payload[8:][:120]
            said = f"GOAWAY {err_name(code)} last-stream-id={last & 0x7FFFFFFF}"
            return said + (f" debug={debug!r}" if debug else "")
        if self.type == T.RST_STREAM and len(self.payload) == 4:
            return f"RST_STREAM {err_name(U32.unpack(self.payload)[0])} on stream {self.sid}"
        ack = "[ACK]" if self.flags & ACK and self.type in (T.SETTINGS, T.PING) else ""
        return f"{name}{ack}(stream {self.sid}, {len(self.payload)} bytes)"

    @property
    def code(self) -> int:
        off = 4 if self.type == T.GOAWAY else 0
        return int(U32.unpack_from(self.payload, off)[0])


# ---- the raw client --------------------------------------------------------------------------------
class H2Conn:
    """A raw HTTP/2 client connection: writes whatever it is told, parses every frame that comes back
    (SETTINGS and PINGs are ACKed, windows tracked, header blocks decoded), never blocks unbounded."""

    opened: list[H2Conn] = []  # closed after each test

    def __init__(self, port: int, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        H2Conn.opened.append(self)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(5)
        self.sock.connect(("127.0.0.1", port))
        self.sock.setblocking(False)
        self.buf = bytearray()
        self.frames: list[Frame] = []            # all but ACKs and WINDOW_UPDATEs (those are only counted)
        self.counts: Counter[str] = Counter()
        self.recent: deque[str] = deque(maxlen=8)
        self.ended: str | None = None             # "closed" (EOF), "reset" (RST), "broken pipe"
        self.eof = False                          # nothing more to read (EOF or reset seen by recv)
        self.settings: dict[int, int] | None = None
        self.conn_window = 65535                  # what we may still send on the connection
        self.initial_window = 65535
        self.stream_windows: dict[int, int] = {}
        self.next_sid = 1
        self.decoder = hpack.Decoder()
        self.hpack_error: str | None = None
        self._block: tuple[int, list[bytes]] | None = None
        self.blocks: dict[int, list[list[tuple[str, str]]]] = {}
        self.auto_ack = False                     # on once our preface is out (an ACK before it breaks it)
        self.unacked_settings = 0

    # -- plumbing
    def close(self) -> None:
        self.sock.close()

    def _end(self, how: str) -> None:
        if self.ended is None:
            self.ended = how

    def send(self, data: bytes, timeout: float = 5.0) -> bool:
        """Write all of `data` (False when the connection ended first); reads what arrives meanwhile."""
        view, deadline = memoryview(data), time.monotonic() + timeout
        while view:
            if self.ended is not None:
                return False
            left = deadline - time.monotonic()
            assert left > 0, f"could not write {len(view)} of {len(data)} bytes within {timeout} s"
            readable, writable, _ = select.select([self.sock], [self.sock], [], min(left, 0.1))
            if readable:
                self._read()
            if writable:
                view = view[self.try_send(view):]
        return True

    def try_send(self, data: bytes | memoryview) -> int:
        """One non-blocking send: how many bytes the kernel took (0 when full or ended)."""
        try:
            return self.sock.send(data)
        except BlockingIOError:
            return 0
        except BrokenPipeError:
            self._end("broken pipe")
        except ConnectionResetError:
            self._end("reset")
        return 0

    def _read(self) -> None:
        try:
            data = self.sock.recv(1 << 18)
        except BlockingIOError:
            return
        except ConnectionResetError:
            self.eof = True
            return self._end("reset")
        if not data:
            self.eof = True
            return self._end("closed")
        self.buf += data
        pos = 0
        while len(self.buf) - pos >= 9:
            hi, lo, ftype, flags, sid = HEAD.unpack_from(self.buf, pos)
            end = pos + 9 + (hi << 16 | lo)
            if end > len(self.buf):
                break
            self._handle(Frame(ftype, flags, sid & 0x7FFFFFFF, bytes(self.buf[pos + 9:end])))
            pos = end
        del self.buf[:pos]

    def poll(self, timeout: float) -> None:
        """Read whatever arrives within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            left = deadline - time.monotonic()
            readable, _, _ = select.select([self.sock], [], [], max(0.0, left))
            if readable:
                self._read()
            elif left <= 0:
                return

    def settle(self, quiet: float = 0.2, limit: float = 3.0) -> None:
        """Read until nothing has arrived for `quiet` seconds (at most `limit`)."""
        deadline = time.monotonic() + limit
        while not self.eof and time.monotonic() < deadline:
            readable, _, _ = select.select([self.sock], [], [], quiet)
            if not readable:
                return
            self._read()

    def wait_for(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if self.eof or left <= 0:
                return done()
            readable, _, _ = select.select([self.sock], [], [], min(left, 0.05))
            if readable:
                self._read()
        return True

    def wait_closed(self, timeout: float) -> bool:
        """Read until the server's end of the connection (EOF or reset): what it sent before is parsed."""
        return self.wait_for(lambda: self.eof, timeout)

    # -- what came back
    def _handle(self, f: Frame) -> None:
        self.recent.append(f.describe())
        if f.type == T.SETTINGS and not f.flags & ACK:
            values = dict(SETTING.unpack_from(f.payload, i) for i in range(0, len(f.payload) - 5, 6))
            if self.settings is None:
                self.settings = {}
            self.settings.update(values)
            if S_INITIAL_WINDOW_SIZE in values:
                delta = values[S_INITIAL_WINDOW_SIZE] - self.initial_window
                self.initial_window = values[S_INITIAL_WINDOW_SIZE]
                for sid in self.stream_windows:
                    self.stream_windows[sid] += delta
            if self.auto_ack:
                self.try_send(frame(T.SETTINGS, ACK, 0))
            else:
                self.unacked_settings += 1
        elif f.type == T.WINDOW_UPDATE and len(f.payload) == 4:
            inc = U32.unpack(f.payload)[0] & 0x7FFFFFFF
            if f.sid == 0:
                self.conn_window += inc
            elif f.sid in self.stream_windows:
                self.stream_windows[f.sid] += inc
        elif f.type == T.PING and not f.flags & ACK and self.auto_ack:
            self.try_send(frame(T.PING, ACK, 0, f.payload))
        elif f.type in (T.HEADERS, T.CONTINUATION):
            self._header_frame(f)
        self.counts[type_name(f.type) + ("[ACK]" if f.flags & ACK else "")] += 1
        if f.type not in (T.WINDOW_UPDATE,) and not (f.type in (T.SETTINGS, T.PING) and f.flags & ACK):
            self.frames.append(f)

    def _header_frame(self, f: Frame) -> None:
        payload = f.payload
        if f.type == T.HEADERS:
            if f.flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if f.flags & 0x20:
                payload = payload[5:]
            self._block = (f.sid, [payload])
        elif self._block is not None:
            self._block[1].append(payload)
        if f.flags & END_HEADERS and self._block is not None and self.hpack_error is None:
            sid, parts = self._block
            self._block = None
            try:
                fields = [(str(k), str(v)) for k, v in self.decoder.decode(b"".join(parts))]
            except hpack.HPACKError as exc:
                self.hpack_error = f"{type(exc).__name__}: {exc}"
                return
            self.blocks.setdefault(sid, []).append(fields)

    def goaway(self) -> Frame | None:
        return next((f for f in self.frames if f.type == T.GOAWAY), None)

    def rst(self, sid: int) -> Frame | None:
        return next((f for f in self.frames if f.type == T.RST_STREAM and f.sid == sid), None)

    def status(self, sid: int) -> tuple[int, str] | None:
        """grpc-status and grpc-message of stream `sid`, once its trailers arrived."""
        for fields in self.blocks.get(sid, []):
            d = dict(fields)
            if "grpc-status" in d:
                return int(d["grpc-status"]), unquote(d.get("grpc-message", ""))
        return None

    def answered(self, sid: int) -> bool:
        return self.status(sid) is not None or self.rst(sid) is not None or self.goaway() is not None

    def describe(self, sid: int | None = None) -> str:
        """What the server did, in one line, for assertion messages."""
        said = []
        if sid is not None and (st := self.status(sid)) is not None:
            said.append(f"grpc-status {st[0]} {st[1]!r} on stream {sid}")
        if sid is not None and (r := self.rst(sid)) is not None:
            said.append(r.describe())
        if (g := self.goaway()) is not None:
            said.append(g.describe())
        if self.ended is not None:
            end = {"closed": "connection closed", "reset": "connection reset",
                   "broken pipe": "connection closed (broken pipe)"}[self.ended]
            said.append(end + ("" if self.goaway() is not None else " without GOAWAY"))
        else:
            said.append("connection still open")
        if self.hpack_error:
            said.append(f"response headers did not decode: {self.hpack_error}")
        return "; ".join(said) + f" [last frames: {', '.join(self.recent) or 'none'}]"

    # -- what we send
    def handshake(self) -> None:
        """Preface + empty SETTINGS, then wait for the server's SETTINGS (ACKed as it arrives)."""
        assert self.send(PREFACE + settings()), f"connection ended during the preface: {self.describe()}"
        self.auto_ack = True
        if self.unacked_settings:
            self.send(frame(T.SETTINGS, ACK, 0) * self.unacked_settings)
            self.unacked_settings = 0
        assert self.wait_for(lambda: self.settings is not None, 5), \
            f"expected the server's SETTINGS after our preface, got {self.describe()}"

    def open(self, method: str, end_stream: bool = False, extra: tuple[tuple[str, str], ...] = (),
             block: bytes | None = None) -> int:
        sid, self.next_sid = self.next_sid, self.next_sid + 2
        self.stream_windows[sid] = self.initial_window
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        self.send(frame(T.HEADERS, flags, sid, header_block(method, extra) if block is None else block))
        return sid

    def send_data(self, sid: int, data: bytes, end_stream: bool, timeout: float = 10.0) -> None:
        """DATA within the server's windows and 16 KiB frames, waiting for WINDOW_UPDATEs as needed."""
        view, deadline = memoryview(data), time.monotonic() + timeout
        max_frame = 16384
        while True:
            room = min(max_frame, self.conn_window, self.stream_windows[sid], len(view))
            if room == 0 and view:
                opened = self.wait_for(lambda: min(self.conn_window, self.stream_windows[sid]) > 0
                                       or self.answered(sid), deadline - time.monotonic())
                if self.answered(sid):
                    return  # the server ended the call before the request was complete
                assert opened, (f"the server never opened its flow-control window for the rest of the "
                                f"request ({len(view)} of {len(data)} bytes unsent): {self.describe(sid)}")
                continue
            last = room == len(view)
            flags = END_STREAM if last and end_stream else 0
            if not self.send(frame(T.DATA, flags, sid, bytes(view[:room]))):
                return
            self.conn_window -= room
            self.stream_windows[sid] -= room
            view = view[room:]
            if last:
                return

    def unary(self, method: str, message: bytes, flag: int = 0,
              extra: tuple[tuple[str, str], ...] = ()) -> int:
        sid = self.open(method, extra=extra)
        self.send_data(sid, grpc_message(message, flag), end_stream=True)
        return sid


class Pumped(NamedTuple):
    sent: int
    seconds: float
    why: str          # "answered", "ended", "exhausted", "time"


def pump(conn: H2Conn, batches: Iterator[bytes], stop: Callable[[], bool], max_s: float,
         paced_until: int = 0, pause_s: float = 0.05) -> Pumped:
    """Write `batches` as fast as the socket takes them while reading whatever comes back; stop once
    `stop()` holds, the connection ends, the batches run out or `max_s` passes. Until `paced_until`
    bytes are out, wait `pause_s` for an answer after each batch (so the byte count is meaningful)."""
    t0 = time.monotonic()
    deadline, sent, pending = t0 + max_s, 0, memoryview(b"")
    while True:
        if stop():
            why = "answered"
            break
        if conn.ended is not None:
            why = "ended"
            break
        if time.monotonic() > deadline:
            why = "time"
            break
        if not pending:
            if 0 < sent < paced_until:
                conn.poll(pause_s)
                if stop() or conn.ended is not None:
                    continue
            nxt = next(batches, None)
            if nxt is None:
                why = "exhausted"
                break
            pending = memoryview(nxt)
        readable, writable, _ = select.select([conn.sock], [conn.sock], [], 0.05)
        if readable:
            conn._read()
        if writable and conn.ended is None:
            n = conn.try_send(pending)
            pending, sent = pending[n:], sent + n
    return Pumped(sent, time.monotonic() - t0, why)


def repeat(chunk: bytes, total: int) -> Iterator[bytes]:
    """`chunk` again and again until `total` bytes (whole chunks) have been yielded."""
    for _ in range(max(1, total // len(chunk))):
        yield chunk


# ---- the server process, its memory, and grpcio next to the attack -------------------------------------
class ServerProc:
    """tests/hostile_server.py in its own process: port, stderr (a file), RSS, a grpcio channel."""

    def __init__(self, *flags: str) -> None:
        self.flags = flags
        self.err: IO[bytes] = tempfile.TemporaryFile()
        self.proc = spawn_child([sys.executable, str(SERVER_SCRIPT), *flags], cwd=str(ROOT),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err)
        self._channel: grpc.Channel | None = None
        self.port = self._read_port(15.0)
        self.ps = psutil.Process(self.proc.pid)

    def _read_port(self, timeout: float) -> int:
        assert self.proc.stdout is not None
        deadline, line = time.monotonic() + timeout, b""
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            readable, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if readable:
                chunk = os.read(self.proc.stdout.fileno(), 64)
                if not chunk:
                    break
                line += chunk
        if not line.strip().isdigit():
            rc, err = self.proc.poll(), self.stderr()[-600:].strip()
            self.stop()
            pytest.fail(f"hostile server {' '.join(self.flags)} did not print its port "
                        f"(exit status {rc}): {err}")
        return int(line)

    def stderr(self, since: int = 0) -> str:
        self.err.flush()
        self.err.seek(since)
        return self.err.read().decode(errors="replace")

    def stderr_size(self) -> int:
        return self.err.seek(0, os.SEEK_END)

    def assert_no_traceback(self, since: int = 0) -> None:
        time.sleep(0.1)  # a traceback logged while the connection was being torn down
        text = self.stderr(since)
        at = text.find("Traceback")
        assert at < 0, ("expected no traceback in the server's stderr, got:\n"
                        f"{text[max(0, at - 300):at + 1500]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        return int(self.ps.memory_info().rss)

    def kill(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        return self._channel

    def echo(self, payload: bytes = b"ping", timeout: float = 5.0) -> bytes:
        return bytes(self.channel.unary_unary(f"/{SERVICE}/Echo")(payload, timeout=timeout))

    def assert_serving(self) -> None:
        """One normal grpcio call on its own connection must succeed."""
        try:
            reply = self.echo(b"still serving")
        except grpc.RpcError as exc:
            reply = f"{exc.code()}: {exc.details()}".encode()
        assert reply == b"still serving", f"expected a normal grpcio call to succeed, got {reply!r}"

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        end_child(self.proc, term_s=5, kill_s=5)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self.err.close()


class RssMonitor:
    """Samples the server's RSS every 10 ms from a thread; kills the server beyond GUARD_MB of growth."""

    def __init__(self, srv: ServerProc, guard_mb: int = GUARD_MB) -> None:
        self.srv, self.guard = srv, guard_mb * MiB
        self.before = self.peak = self.after = srv.rss()
        self.tripped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                rss = self.srv.rss()
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)
            if rss - self.before > self.guard:
                self.tripped = True
                self.srv.kill()
                return

    def stop(self) -> None:
        if not self._stop.is_set():
            time.sleep(0.2)  # whatever the attack left in flight reaches the server
            self._stop.set()
            self._thread.join(5)
            try:
                self.after = self.srv.rss()
            except psutil.Error:
                self.after = self.peak
            self.peak = max(self.peak, self.after)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.before) / MiB

    def describe(self) -> str:
        s = (f"server RSS {self.before / MiB:.0f} MB before, peak {self.peak / MiB:.0f} MB "
             f"(+{self.growth_mb:.1f} MB), {self.after / MiB:.0f} MB after")
        return s + (f"; killed by the test's {self.guard // MiB} MB guard" if self.tripped else "")

    def assert_bounded(self, limit_mb: int = GROWTH_LIMIT_MB) -> None:
        self.stop()
        assert not self.tripped and self.growth_mb < limit_mb, \
            f"expected the server's RSS to grow by < {limit_mb} MB, got {self.describe()}"


class Prober:
    """Normal grpcio unary calls on their own connection, every `every` s while the attack runs."""

    def __init__(self, srv: ServerProc, every: float = 0.1) -> None:
        self.srv, self.every = srv, every
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        srv.assert_serving()  # and the channel is connected before the attack starts

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _call(self) -> None:
        t0 = time.monotonic()
        try:
            reply = self.srv.echo(b"probe", timeout=5)
            assert reply == b"probe", f"echo answered {reply!r}"
            self.ok += 1
        except (grpc.RpcError, AssertionError) as exc:
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
            self.failures.append(f"{code} after {time.monotonic() - t0:.1f} s: {exc}"[:300])

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._call()

    def assert_all_ok(self) -> None:
        self.__exit__()
        self._call()  # and one after the attack
        assert not self.failures, (f"expected every concurrent grpcio call to succeed, got "
                                   f"{len(self.failures)} failures of {self.ok + len(self.failures)}: "
                                   f"{self.failures[:3]}")


@pytest.fixture(autouse=True)
def _close_connections() -> Iterator[None]:
    yield
    while H2Conn.opened:
        H2Conn.opened.pop().close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., ServerProc]]:
    started: list[ServerProc] = []

    def start(*flags: str) -> ServerProc:
        started.append(ServerProc(*flags))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def _shared_holder() -> Iterator[list[ServerProc]]:
    holder: list[ServerProc] = []
    yield holder
    for s in holder:
        s.stop()


@pytest.fixture
def shared(_shared_holder: list[ServerProc]) -> ServerProc:
    """One server for the cheap tests (each on its own connection); replaced if a test killed it."""
    if not _shared_holder or not _shared_holder[-1].alive():
        _shared_holder.append(ServerProc())
    return _shared_holder[-1]


def connect(srv: ServerProc, rcvbuf: int | None = None) -> H2Conn:
    conn = H2Conn(srv.port, rcvbuf)
    conn.handshake()
    return conn


# ---- 1, 2: gzip bombs --------------------------------------------------------------------------------
_BOMB: list[bytes] = []


def gzip_bomb(inflated: int = 1 << 30) -> bytes:
    """~1 MB of gzip that inflates to 1 GiB of zeros, built from one full-flushed 1 MiB deflate block
    repeated (a full flush resets the compressor, so every such block is the same bytes)."""
    if not _BOMB:
        zeros = bytes(MiB)
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
        assert block == c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
        crc = 0
        for _ in range(inflated // MiB):
            crc = zlib.crc32(zeros, crc)
        body = block * (inflated // MiB) + zlib.compressobj(9, zlib.DEFLATED, -15).flush(zlib.Z_FINISH)
        header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"  # gzip, deflate, no name, no mtime
        _BOMB.append(header + body + struct.pack("<LL", crc, inflated % (1 << 32)))
    return _BOMB[0]


def test_gzip_bomb_sanity() -> None:
    bomb = gzip_bomb()
    d = zlib.decompressobj(31)
    first = d.decompress(bomb, 1 << 16)
    assert len(bomb) < 1_100_000 and first == bytes(1 << 16) and d.unconsumed_tail


def _send_bomb(srv: ServerProc, extra: tuple[tuple[str, str], ...]) -> tuple[H2Conn, int, float, RssMonitor,
                                                                               Prober]:
    with Prober(srv) as prober, RssMonitor(srv) as mon:
        conn = connect(srv)
        sid = conn.unary("Len", gzip_bomb(), flag=1, extra=extra)
        sent_at = time.monotonic()
        conn.wait_for(lambda: conn.answered(sid) or mon.tripped, 10)
        took = time.monotonic() - sent_at
    return conn, sid, took, mon, prober


def test_gzip_bomb_is_resource_exhausted_without_inflating_it(spawn: Callable[..., ServerProc]) -> None:
    srv = spawn()
    conn, sid, took, mon, prober = _send_bomb(srv, (("grpc-encoding", "gzip"),))
    st = conn.status(sid)
    print(f"gzip bomb: {conn.describe(sid)} {took:.2f} s after the last byte; {mon.describe()}")
    assert st is not None and st[0] == 8 and "larger than max" in st[1], \
        (f"expected grpc-status 8 RESOURCE_EXHAUSTED 'larger than max', got {conn.describe(sid)}; "
         f"{mon.describe()}")
    assert took < 2.0, f"expected the refusal within 2 s of the last byte, it took {took:.1f} s"
    mon.assert_bounded()
    prober.assert_all_ok()
    srv.assert_no_traceback()


def test_gzip_bomb_without_grpc_encoding_is_internal(spawn: Callable[..., ServerProc]) -> None:
    srv = spawn()
    conn, sid, took, mon, prober = _send_bomb(srv, ())
    st = conn.status(sid)
    print(f"gzip bomb without grpc-encoding: {conn.describe(sid)} {took:.2f} s after the last byte; "
          f"{mon.describe()}")
    assert st is not None and st[0] == 13, \
        (f"expected grpc-status 13 INTERNAL (compressed flag without grpc-encoding), got "
         f"{conn.describe(sid)}; {mon.describe()}")
    assert took < 2.0, f"expected the refusal within 2 s of the last byte, it took {took:.1f} s"
    mon.assert_bounded()
    prober.assert_all_ok()
    srv.assert_no_traceback()


# ---- 3: CONTINUATION without end ---------------------------------------------------------------------
@pytest.mark.slow
def test_continuation_flood_is_cut_at_the_header_list_limit(spawn: Callable[..., ServerProc]) -> None:
    srv = spawn()
    with Prober(srv) as prober, RssMonitor(srv) as mon:
        conn = connect(srv)
        block = header_block("Echo")
        pad = pad_block(16384)
        start = frame(T.HEADERS, 0, 1, block)  # no END_HEADERS: the block goes on in CONTINUATIONs
        batches = iter([start, *repeat(frame(T.CONTINUATION, 0, 1, pad) * 4, 64 * MiB)])
        got = pump(conn, batches, lambda: conn.goaway() is not None, max_s=15, paced_until=MiB)
        closed = conn.wait_closed(3)
    g = conn.goaway()
    print(f"CONTINUATION flood: {conn.describe()} after {got.sent} bytes ({got.why}); {mon.describe()}")
    assert g is not None and g.code == Err.ENHANCE_YOUR_CALM, \
        (f"expected GOAWAY ENHANCE_YOUR_CALM once the header block passed 64 KiB, got {conn.describe()} "
         f"after {got.sent / MiB:.2f} MiB sent in {got.seconds:.1f} s ({got.why}); {mon.describe()}")
    assert got.sent < MiB, f"expected GOAWAY well before 1 MiB of header block, it came after {got.sent} B"
    assert closed, f"expected the connection closed after GOAWAY, got {conn.describe()}"
    mon.assert_bounded()
    prober.assert_all_ok()
    srv.assert_no_traceback()


# ---- 4: flow control ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_data_beyond_the_stream_window_is_a_flow_control_error(spawn: Callable[..., ServerProc]) -> None:
    srv = spawn()
    with Prober(srv) as prober, RssMonitor(srv) as mon:
        conn = connect(srv)
        window = (conn.settings or {}).get(S_INITIAL_WINDOW_SIZE, 65535)
        sid = conn.open("Hold")  # a handler that never reads
        data = frame(T.DATA, 0, sid, grpc_message(bytes(16384 - 5))) * 64  # 1 MiB a batch, windows ignored
        got = pump(conn, repeat(data, 64 * MiB), lambda: conn.answered(sid), max_s=20)
        conn.wait_for(lambda: conn.answered(sid), 2)
    answer = conn.rst(sid) or conn.goaway()
    print(f"stream window overrun: {conn.describe(sid)} after {got.sent} bytes ({got.why}); {mon.describe()}")
    assert answer is not None and answer.code == Err.FLOW_CONTROL_ERROR, \
        (f"expected RST_STREAM or GOAWAY FLOW_CONTROL_ERROR once the {window}-byte stream window was "
         f"overrun, got {conn.describe(sid)} after {got.sent / MiB:.1f} MiB sent ({got.why}); "
         f"{mon.describe()}")
    assert got.sent > window, f"FLOW_CONTROL_ERROR after only {got.sent} bytes, within the {window} B window"
    mon.assert_bounded()
    prober.assert_all_ok()
    srv.assert_no_traceback()


@pytest.mark.slow
def test_request_bytes_held_on_one_connection_are_capped(spawn: Callable[..., ServerProc]) -> None:
    """Fill stream after stream on handlers that never read, each within its own window: the server
    gives the connection window back as DATA arrives (grpc-go's way, so slow streams cannot starve the
    others), and caps what it holds per connection instead: the call that takes it over 32 MiB ends
    RESOURCE_EXHAUSTED, and memory stays bounded."""
    srv = spawn()
    with Prober(srv) as prober, RssMonitor(srv) as mon:
        conn = connect(srv)
        conn.settle()
        streams: list[int] = []
        while len(streams) < 40 and conn.ended is None:
            sid = conn.open("Hold")
            streams.append(sid)
            while conn.stream_windows[sid] >= 16384 and conn.conn_window >= 16384 and not conn.answered(sid):
                conn.send(frame(T.DATA, 0, sid, grpc_message(bytes(16384 - 5))))
                conn.conn_window -= 16384
                conn.stream_windows[sid] -= 16384
            conn.settle(quiet=0.05)
            if conn.answered(sid):
                break
        conn.settle()
        over = streams[-1]
    print(f"held-bytes cap: {len(streams)} streams; {conn.describe(over)}; {mon.describe()}")
    assert conn.goaway() is None, f"expected the connection to live on, got {conn.describe(over)}"
    assert len(streams) == 33, f"expected the 33rd 1 MiB stream to pass the 32 MiB cap, got {len(streams)}"
    assert conn.status(over) == (8, "over 33554432 request bytes held on the connection"), conn.describe(over)
    assert not any(conn.answered(sid) for sid in streams[:-1]), "a stream under the cap was ended"
    mon.assert_bounded(48)   # 32 MiB held by design, plus the server's own overhead
    prober.assert_all_ok()
    srv.assert_no_traceback()


# ---- 5: PING flood, never reading ----------------------------------------------------------------------
@pytest.mark.slow
def test_ping_flood_from_a_client_that_never_reads(spawn: Callable[..., ServerProc]) -> None:
    srv = spawn()
    ping, per_batch, total = frame(T.PING, 0, 0, b"hostile!"), 20_000, 3_000_000
    with Prober(srv) as prober, RssMonitor(srv) as mon:
        # Room in our kernel for the ACKs a PING budget answers and a GOAWAY behind them; none for the
        # 51 MB of ACKs that 3 million PINGs ask for.
        conn = connect(srv, rcvbuf=128 << 10)
        batch = memoryview(ping * per_batch)
        sent, pending, t0 = 0, batch, time.monotonic()
        last_progress, why = t0, "all sent"
        while sent < total * len(ping):
            now = time.monotonic()
            if conn.ended is not None:
                why = "connection ended"
                break
            if now - t0 > 20:
                why = "time"
                break
            if now - last_progress > 2:
                why = "server stopped reading"
                break
            _, writable, _ = select.select([], [conn.sock], [], 0.2)  # we never read
            if writable and (n := conn.try_send(pending)):
                sent, pending, last_progress = sent + n, pending[n:] or batch, time.monotonic()
        seconds = time.monotonic() - t0
        if why == "connection ended":
            conn.wait_closed(5)  # read what the server said before it went (a GOAWAY may be in there)
    pings = sent // len(ping)
    g = conn.goaway()
    print(f"PING flood: {why} after {pings} PINGs in {seconds:.1f} s: {conn.describe()}; {mon.describe()}")
    # Closing a socket with our PINGs still unread makes the server's kernel send RST and drop what it
    # had not sent yet: when the ACKs before it filled our window, the GOAWAY is lost that way. Then
    # the connection must have been reset and the server's log must name ENHANCE_YOUR_CALM.
    logged = "ENHANCE_YOUR_CALM" in srv.stderr()
    ok = why == "server stopped reading" or (g is not None and g.code == Err.ENHANCE_YOUR_CALM) \
        or (why == "connection ended" and g is None and conn.ended == "reset" and logged)
    assert ok, (f"expected the server to stop reading from us or to send GOAWAY ENHANCE_YOUR_CALM and close, "
                f"got {why} after {pings} PINGs in {seconds:.1f} s: {conn.describe()}"
                f"{'' if logged else ' (and no ENHANCE_YOUR_CALM in its log)'}; {mon.describe()}")
    mon.assert_bounded()
    prober.assert_all_ok()
    srv.assert_no_traceback()


def test_pings_that_come_with_calls_are_not_a_flood(shared: ServerProc) -> None:
    """A busy client pings too (grpc-go and grpc-core send BDP pings as data flows): every call opened
    gives one PING back, so 3,000 PINGs interleaved with 3,000 calls, three times the burst, are fine."""
    conn = connect(shared)
    ping = frame(T.PING, 0, 0, b"bdp-ping")
    sids = []
    for i in range(3000):
        sids.append(conn.unary("Echo", b"x"))
        conn.send(ping)
        if i % 200 == 199:
            conn.wait_for(lambda: all(conn.answered(s) for s in sids), 10)
    conn.wait_for(lambda: all(conn.answered(s) for s in sids), 10)
    assert conn.goaway() is None, f"expected no GOAWAY for pings that come with calls, got {conn.describe()}"
    assert [conn.status(s) for s in sids] == [(0, "")] * 3000, conn.describe(sids[-1])
    shared.assert_no_traceback()


# ---- 6: a frame beyond MAX_FRAME_SIZE -------------------------------------------------------------------
def test_oversized_frame_is_a_frame_size_error_without_buffering_it(shared: ServerProc) -> None:
    since = shared.stderr_size()
    conn = connect(shared)
    limit = (conn.settings or {}).get(S_MAX_FRAME_SIZE, 16384)
    assert limit < MiB, f"the server advertised MAX_FRAME_SIZE {limit}: a 1 MiB frame is not oversized"
    sid = conn.open("Count")
    conn.send(frame_head(MiB, T.DATA, 0, sid) + grpc_message(bytes(200)))  # 1 MiB announced, 205 bytes sent
    conn.wait_for(lambda: conn.goaway() is not None, 3)
    g = conn.goaway()
    assert g is not None and g.code == Err.FRAME_SIZE_ERROR, \
        (f"expected GOAWAY FRAME_SIZE_ERROR for a 1 MiB DATA frame (MAX_FRAME_SIZE {limit}) without waiting "
         f"for its payload, got {conn.describe()} within 3 s")
    assert conn.wait_closed(2), f"expected the connection closed after GOAWAY, got {conn.describe()}"
    shared.assert_no_traceback(since)


# ---- 7: malformed frames --------------------------------------------------------------------------------
def _open_count(sid: int = 1) -> bytes:
    return frame(T.HEADERS, END_HEADERS, sid, header_block("Count"))


_BLOCK = header_block("Count")
_PUSH_PROMISE = frame(T.PUSH_PROMISE, END_HEADERS, 1, U32.pack(2) + _BLOCK)  # promising stream 2
MALFORMED: dict[str, tuple[Callable[[], bytes], Err]] = {
    "padded-headers-empty": (lambda: frame(T.HEADERS, PADDED | END_HEADERS, 1), Err.FRAME_SIZE_ERROR),
    "padded-data-pad-too-long": (lambda: _open_count() + frame(T.DATA, PADDED, 1, b"\x04abc"),
                                 Err.PROTOCOL_ERROR),
    "window-update-1-byte": (lambda: frame(T.WINDOW_UPDATE, 0, 0, b"\x01"), Err.FRAME_SIZE_ERROR),
    "window-update-0-on-stream-0": (lambda: frame(T.WINDOW_UPDATE, 0, 0, U32.pack(0)), Err.PROTOCOL_ERROR),
    "ping-7-bytes": (lambda: frame(T.PING, 0, 0, b"1234567"), Err.FRAME_SIZE_ERROR),
    "settings-length-5": (lambda: frame(T.SETTINGS, 0, 0, b"\x00\x04\x00\x00\x01"), Err.FRAME_SIZE_ERROR),
    "settings-on-stream-1": (lambda: frame(T.SETTINGS, 0, 1), Err.PROTOCOL_ERROR),
    "settings-initial-window-2^31": (lambda: settings((S_INITIAL_WINDOW_SIZE, 1 << 31)),
                                     Err.FLOW_CONTROL_ERROR),
    "settings-max-frame-100": (lambda: settings((S_MAX_FRAME_SIZE, 100)), Err.PROTOCOL_ERROR),
    "settings-enable-push-2": (lambda: settings((S_ENABLE_PUSH, 2)), Err.PROTOCOL_ERROR),
    "ping-inside-a-header-block": (lambda: frame(T.HEADERS, 0, 1, _BLOCK[:10]) + frame(T.PING, 0, 0, bytes(8))
                                   + frame(T.CONTINUATION, END_HEADERS, 1, _BLOCK[10:]), Err.PROTOCOL_ERROR),
    "continuation-without-headers": (lambda: frame(T.CONTINUATION, END_HEADERS, 1, _BLOCK),
                                     Err.PROTOCOL_ERROR),
    "data-on-stream-0": (lambda: frame(T.DATA, 0, 0, grpc_message(b"x")), Err.PROTOCOL_ERROR),
    "invalid-hpack": (lambda: frame(T.HEADERS, END_HEADERS, 1, b"\xfe"), Err.COMPRESSION_ERROR),  # index 126
    "window-update-overflows-the-connection": (lambda: frame(T.WINDOW_UPDATE, 0, 0, U32.pack(0x7FFFFFFF)),
                                               Err.FLOW_CONTROL_ERROR),
    "even-stream-id": (lambda: frame(T.HEADERS, END_HEADERS | END_STREAM, 2, _BLOCK), Err.PROTOCOL_ERROR),
    "client-push-promise": (lambda: _open_count() + _PUSH_PROMISE, Err.PROTOCOL_ERROR),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_frame_is_a_connection_error(shared: ServerProc, case: str) -> None:
    build, expected = MALFORMED[case]
    since = shared.stderr_size()
    conn = connect(shared)
    conn.send(build())
    conn.wait_for(lambda: conn.goaway() is not None, 3)
    g = conn.goaway()
    assert g is not None and g.code == expected, \
        f"expected GOAWAY {err_name(expected)}, got {conn.describe()}"
    assert conn.wait_closed(2), f"expected the connection closed after GOAWAY, got {conn.describe()}"
    conn.close()
    shared.assert_no_traceback(since)
    shared.assert_serving()


def test_goaway_survives_a_client_that_keeps_sending(shared: ServerProc) -> None:
    """A connection error while the client's input is still unread: the server half-closes after its
    GOAWAY and drains, so the client reads GOAWAY and then a clean end, never a reset that can overtake
    (and so lose) the GOAWAY. The input after the bad frame is valid PINGs, 256 KiB of them, so all
    the server can object to is the first frame."""
    since = shared.stderr_size()
    conn = connect(shared)
    pings = frame(T.PING, 0, 0, b"12345678") * ((256 << 10) // 17)
    conn.send(frame(T.HEADERS, PADDED | END_HEADERS, 1) + pings)
    closed = conn.wait_closed(3)
    g = conn.goaway()
    assert g is not None and g.code == Err.FRAME_SIZE_ERROR, f"expected GOAWAY FRAME_SIZE_ERROR, got {conn.describe()}"
    assert closed and conn.ended == "closed", \
        f"expected the GOAWAY then a clean close (FIN), not a reset, got {conn.ended}: {conn.describe()}"
    conn.close()
    shared.assert_no_traceback(since)
    shared.assert_serving()


# ---- 8: an empty header name --------------------------------------------------------------------------
def test_empty_header_name_resets_only_that_stream(shared: ServerProc) -> None:
    since = shared.stderr_size()
    conn = connect(shared)
    empty_name = b"\x00\x00\x01x"  # literal without indexing, new name of length 0, value "x"
    bad = conn.open("Echo", block=header_block("Echo") + empty_name)
    conn.send_data(bad, grpc_message(b"bad"), end_stream=True)
    conn.wait_for(lambda: conn.answered(bad), 3)
    r = conn.rst(bad)
    assert r is not None and r.code == Err.PROTOCOL_ERROR and conn.goaway() is None, \
        f"expected RST_STREAM PROTOCOL_ERROR on stream {bad} only, got {conn.describe(bad)}"
    good = conn.unary("Echo", b"after")
    conn.wait_for(lambda: conn.answered(good), 3)
    assert conn.status(good) == (0, ""), \
        f"expected the same connection to complete a normal call (grpc-status 0), got {conn.describe(good)}"
    shared.assert_no_traceback(since)


# ---- 9: rapid reset --------------------------------------------------------------------------------------
def _rapid_reset_batches(count: int, per_batch: int = 500) -> Iterator[bytes]:
    block = header_block("Echo")
    n = len(block)
    headers = HEAD.pack(n >> 16, n & 0xFFFF, T.HEADERS, END_HEADERS, 0)[:5]
    cancel = U32.pack(Err.CANCEL)
    for first in range(0, count, per_batch):
        yield b"".join(headers + U32.pack(2 * i + 1) + block + frame(T.RST_STREAM, 0, 2 * i + 1, cancel)
                       for i in range(first, min(count, first + per_batch)))


@pytest.mark.slow
def test_rapid_reset_is_cut_off(spawn: Callable[..., ServerProc]) -> None:
    srv = spawn()
    with Prober(srv, every=0.05) as prober, RssMonitor(srv) as mon:
        conn = connect(srv)
        got = pump(conn, _rapid_reset_batches(100_000), lambda: conn.goaway() is not None, max_s=20)
        closed = conn.wait_closed(3)
    g = conn.goaway()
    streams = got.sent // (len(header_block("Echo")) + 9 + 13)
    print(f"rapid reset: {conn.describe()} after ~{streams} streams in {got.seconds:.1f} s ({got.why}); "
          f"{prober.ok} concurrent calls; {mon.describe()}")
    assert g is not None and g.code == Err.ENHANCE_YOUR_CALM, \
        (f"expected GOAWAY ENHANCE_YOUR_CALM well before 100,000 reset streams, got {conn.describe()} after "
         f"~{streams} streams in {got.seconds:.1f} s ({got.why}); {mon.describe()}")
    served = ((U32.unpack_from(g.payload)[0] & 0x7FFFFFFF) + 1) // 2
    assert served <= 20_000, f"expected the cut-off after a few thousand streams, GOAWAY came after {served}"
    assert closed, f"expected the connection closed after GOAWAY, got {conn.describe()}"
    prober.assert_all_ok()
    mon.assert_bounded()
    srv.assert_no_traceback()


# ---- 10: SETTINGS and empty-frame floods ------------------------------------------------------------------
FLOODS: dict[str, tuple[bytes, bytes]] = {   # what opens the flood, what repeats
    "settings": (b"", frame(T.SETTINGS, 0, 0)),
    "empty-data": (_open_count(), frame(T.DATA, 0, 1)),
    "empty-continuation": (frame(T.HEADERS, 0, 1, _BLOCK), frame(T.CONTINUATION, 0, 1)),
}


@pytest.mark.slow
@pytest.mark.parametrize("flood", list(FLOODS))
def test_flood_of_empty_frames_is_cut_off(spawn: Callable[..., ServerProc], flood: str) -> None:
    srv = spawn()
    opening, one = FLOODS[flood]
    with Prober(srv) as prober, RssMonitor(srv) as mon:
        conn = connect(srv)
        batches = iter([opening, *repeat(one * 10_000, 400_000 * len(one))])
        got = pump(conn, batches, lambda: conn.goaway() is not None, max_s=8)
        closed = conn.wait_closed(3)
    g = conn.goaway()
    print(f"{flood} flood: {conn.describe()} after {got.sent // len(one)} frames ({got.why}); "
          f"{mon.describe()}")
    assert g is not None and g.code == Err.ENHANCE_YOUR_CALM, \
        (f"expected GOAWAY ENHANCE_YOUR_CALM for a {flood} flood, got {conn.describe()} after "
         f"{got.sent // len(one)} frames in {got.seconds:.1f} s ({got.why}); {mon.describe()}")
    assert closed, f"expected the connection closed after GOAWAY, got {conn.describe()}"
    mon.assert_bounded()
    prober.assert_all_ok()
    srv.assert_no_traceback()


# ---- 11: handshake and idle timeouts ------------------------------------------------------------------
TIMEOUT_FLAGS = ("--handshake-timeout-s", "1", "--idle-timeout-s", "1")


@pytest.mark.parametrize("sends", [b"", PREFACE[:12]], ids=["nothing", "half-the-preface"])
def test_silent_client_is_closed_after_the_handshake_timeout(spawn: Callable[..., ServerProc],
                                                             sends: bytes) -> None:
    srv = spawn(*TIMEOUT_FLAGS)
    conn = H2Conn(srv.port)
    t0 = time.monotonic()
    conn.send(sends)
    closed = conn.wait_closed(3)
    took = time.monotonic() - t0
    assert closed and took >= 0.8, \
        (f"expected the server to close a silent client after the 1 s handshake timeout, got "
         f"{conn.describe()} after {took:.1f} s")
    srv.assert_serving()
    srv.assert_no_traceback()


def test_idle_client_gets_goaway_no_error(spawn: Callable[..., ServerProc]) -> None:
    srv = spawn(*TIMEOUT_FLAGS)
    conn = connect(srv)
    t0 = time.monotonic()
    conn.wait_for(lambda: conn.goaway() is not None, 3)
    g = conn.goaway()
    assert g is not None and g.code == Err.NO_ERROR, \
        (f"expected GOAWAY NO_ERROR after the 1 s idle timeout, got {conn.describe()} after "
         f"{time.monotonic() - t0:.1f} s")
    assert conn.wait_closed(3), f"expected the idle connection closed after GOAWAY, got {conn.describe()}"
    srv.assert_serving()
    srv.assert_no_traceback()


# ---- 12: -bin metadata ---------------------------------------------------------------------------------
def test_bin_metadata_from_grpcio_reaches_the_handler_as_bytes(shared: ServerProc) -> None:
    since = shared.stderr_size()
    echo = shared.channel.unary_unary(f"/{SERVICE}/Echo")
    reply, call = echo.with_call(b"x", metadata=(("x-blob-bin", b"\x00\xff"),), timeout=5)
    seen = dict(call.trailing_metadata() or ()).get("seen-blob-repr")
    assert reply == b"x" and seen == repr(b"\x00\xff"), \
        f"expected the handler to see x-blob-bin as b'\\x00\\xff', it saw {seen}"
    shared.assert_no_traceback(since)


def test_bin_initial_metadata_reaches_grpcio_as_bytes(shared: ServerProc) -> None:
    since = shared.stderr_size()
    method = shared.channel.unary_unary(f"/{SERVICE}/BinHeaders")
    try:
        reply, call = method.with_call(b"", timeout=5)
    except grpc.RpcError as exc:
        pytest.fail(f"expected b'ok' with initial metadata init-blob-bin=b'\\x00\\xff', got {exc.code()}: "
                    f"{exc.details()}")
    initial = dict(call.initial_metadata() or ())
    assert reply == b"ok" and initial.get("init-blob-bin") == b"\x00\xff", \
        f"expected initial metadata init-blob-bin=b'\\x00\\xff', got {initial}"
    shared.assert_no_traceback(since)
