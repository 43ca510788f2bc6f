"""TLS plaintext capture: uprobes on the system libssl, joined to the eBPF recorder's TCP flows.

    tls.bpf.c (uprobes on SSL_read/_ex, SSL_write/_ex, handshake calls; syscall enters)
        | its own ring buffer: SEEN (tgid, fd is this SSL's socket) / PLAIN (bytes an SSL call returned)
        v
    TlsJoiner --(tgid, fd)--> the recorder's flow of that socket --plaintext--> FlowSink.data
        ^                                                        (same decoders, same redaction)
    EbpfBackend --open_flow / data (ciphertext) / close_flow--'

`TlsBackend` wraps the eBPF backend (`Recorder` does it, capture/record.py): the backend delivers its
flows to a `TlsJoiner`, which passes them on to the real sink, except that:

* a flow whose first bytes are a TLS record and whose socket the TLS program saw inside an SSL call
  (SEEN) is **plaintext**: its ciphertext is not stored (counted, `ciphertext_bytes_not_stored`), its
  plaintext goes to the sink under the flow's key, so an HTTPS request is an HTTP/1 call whose
  Authorization is masked like any other;
* a flow whose first bytes are a TLS record with no SEEN for its socket is **encrypted**: recorded as
  raw TCP as before, and listed with the reason (meta `tls_flows`, `inspect`): the process does not
  use the system libssl (BoringSSL linked into grpcio, Go's crypto/tls), or uses it through memory
  BIOs, or TLS capture is off.

Ordering: the SEEN record is written at the *enter* of the syscall that moves the handshake's first
bytes, the recorder's record of those bytes at its *exit*, so draining this program's ring when a
flow's first TLS bytes arrive is enough to decide. Plaintext is written before the connection's
close() runs, so `close_flow` drains the ring again before closing. Plaintext that arrives before
the recorder's OPEN is handled waits (bounded) for it; plaintext of connections that are not
recorded (other ports, other processes' TLS) is dropped after `_ORPHAN_S` and its socket goes into
the program's `skip` map so its later calls copy nothing.
"""

from __future__ import annotations

import collections
import ctypes
import os
import struct
import subprocess
import threading
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any, cast

from capture.backends import RecordOptions
from capture.errors import CaptureError, PrivilegeError
from capture.recording import Direction, Flow
from capture.sink import FlowSink

BPF_SOURCE = Path(__file__).with_name("tls.bpf.c")
TLS_MODES = ("auto", "on", "off")
EV_PLAIN, EV_SEEN = 1, 2
MAX_BYTES_LIMIT = 262144    # plaintext kept per SSL call (OpenSSL hands out at most 16 KiB records)
RING_PAGES = 2048            # 8 MiB: plaintext of TLS calls between two drains (100 ms)
POLL_S = 0.1
_ORPHAN_S = 3.0              # plaintext with no recorded flow waits this long for the flow's OPEN
_ORPHAN_MAX_BYTES = 8 << 20  # and at most this much in all
_STALE_NS = 2_000_000_000    # a record this old is handed on even if the recorder's records are not there yet
_HDR = struct.Struct("<QIIIIIBBBB")
HDR_SIZE = _HDR.size
# (symbol, entry function, return function); SSL_read/SSL_write are what nginx and curl call,
# the _ex forms what Python's ssl module calls
PROBES = (
    ("SSL_read", "ssl_read_enter", "ssl_rw_exit"),
    ("SSL_read_ex", "ssl_read_ex_enter", "ssl_rw_exit"),
    ("SSL_write", "ssl_write_enter", "ssl_rw_exit"),
    ("SSL_write_ex", "ssl_write_ex_enter", "ssl_rw_exit"),
    ("SSL_do_handshake", "ssl_handshake_enter", "ssl_handshake_exit"),
    ("SSL_connect", "ssl_handshake_enter", "ssl_handshake_exit"),
    ("SSL_accept", "ssl_handshake_enter", "ssl_handshake_exit"),
    ("SSL_free", "ssl_free_enter", None),
)
_LIBSSL_PATHS = ("/lib/x86_64-linux-gnu/libssl.so.3", "/usr/lib/x86_64-linux-gnu/libssl.so.3",
                 "/lib/aarch64-linux-gnu/libssl.so.3", "/usr/lib/aarch64-linux-gnu/libssl.so.3",
                 "/usr/lib64/libssl.so.3", "/usr/lib/libssl.so.3")


def find_libssl() -> str | None:
    """The system's libssl.so.3 (what `ldconfig -p` resolves, else the usual Debian paths)."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith("libssl.so.3 ") and Path(path).is_file():
            return os.path.realpath(path)
    for p in _LIBSSL_PATHS:
        if Path(p).is_file():
            return os.path.realpath(p)
    return None


def libssl_version(path: str) -> str:
    try:
        lib = ctypes.CDLL(path)
        lib.OpenSSL_version.restype = ctypes.c_char_p
        return cast(bytes, lib.OpenSSL_version(0)).decode(errors="replace")
    except (OSError, AttributeError):
        return "unknown version"


def looks_like_tls(data: bytes) -> bool:
    """A TLS record header: content type 20-23, version 3.0-3.4 (SSLv3 .. TLS 1.3's legacy 3.3)."""
    return len(data) >= 3 and 0x14 <= data[0] <= 0x17 and data[1] == 3 and data[2] <= 4


def maps_libssl(pid: int, libssl: str | None) -> bool | None:
    """Whether process `pid` maps the system libssl (None: cannot tell, e.g. it has exited)."""
    if not libssl:
        return None
    try:
        ino = os.stat(libssl).st_ino
        with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[4] == str(ino) and "libssl" in parts[5]:
                    return True
    except OSError:
        return None
    return False


def max_bytes(options: RecordOptions) -> int:
    """Plaintext bytes kept per SSL call: --max-bytes, at most MAX_BYTES_LIMIT, in whole records."""
    want = min(options.max_bytes, MAX_BYTES_LIMIT)
    chunk = chunk_size(want)
    return (want + chunk - 1) // chunk * chunk


def chunk_size(max_bytes: int) -> int:
    """Record size: the power of two covering max_bytes, within 4-64 KiB (as the recorder's)."""
    size = 4096
    while size < max_bytes and size < 65536:
        size *= 2
    return size


def _possible_cpus() -> int:
    try:
        return int(Path("/sys/devices/system/cpu/possible").read_text().strip().split("-")[-1]) + 1
    except (OSError, ValueError):
        return os.cpu_count() or 1


def render_program(options: RecordOptions, cgroup_id: int = 0) -> str:
    """The program text with its filters and sizes substituted."""
    limit = max_bytes(options)
    defines = {"FILTER_PID": options.pid or 0, "FILTER_CGROUP": f"{cgroup_id}ULL", "MAX_BYTES": limit,
               "CHUNK": chunk_size(limit), "RINGBUF_PAGES": RING_PAGES, "SCRATCH_CPUS": _possible_cpus()}
    return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + BPF_SOURCE.read_text()


class TlsProgram:
    """tls.bpf.c loaded and attached to one libssl file. Raises PrivilegeError when it cannot be."""

    def __init__(self, options: RecordOptions, libssl: str, cgroup_id: int = 0) -> None:
        if os.geteuid() != 0:
            raise PrivilegeError("TLS capture needs root (uprobes)")
        try:
            from bcc import BPF
        except Exception as exc:  # noqa: BLE001 - bcc can fail with plain Exception
            raise PrivilegeError(f"bcc is not importable ({exc})") from exc
        self.libssl = libssl
        self.raw: list[bytes] = []
        try:
            self.bpf: Any = BPF(text=render_program(options, cgroup_id).encode())
        except Exception as exc:  # noqa: BLE001 - compile errors are plain Exception
            raise PrivilegeError(f"cannot load the TLS program ({str(exc).splitlines()[0][:160]})") from exc
        try:
            for sym, enter, ret in PROBES:
                self.bpf.attach_uprobe(name=libssl.encode(), sym=sym.encode(), fn_name=enter.encode())
                if ret:
                    self.bpf.attach_uretprobe(name=libssl.encode(), sym=sym.encode(), fn_name=ret.encode())
            self.bpf[b"tls_events"].open_ring_buffer(self._on_event)
        except Exception as exc:  # noqa: BLE001 - attach errors are plain Exception
            self.bpf.cleanup()
            raise PrivilegeError(f"cannot attach uprobes to {libssl} ({str(exc).splitlines()[0][:160]})") from exc
        self._skip = self.bpf[b"skip"]

    def _on_event(self, ctx: object, data: int, size: int) -> int:
        self.raw.append(ctypes.string_at(data, size))
        return 0

    def consume(self) -> list[bytes]:
        """Everything in the ring now (the caller serialises calls)."""
        self.bpf.ring_buffer_consume()
        out, self.raw = self.raw, []
        return out

    def skip(self, tgid: int, fd: int, on: bool = True) -> None:
        key = ctypes.c_uint64((tgid << 32) | fd)
        if on:
            self._skip[key] = ctypes.c_uint8(1)
        else:
            self._skip.pop(key, None)

    def counters(self) -> tuple[int, int, int]:
        t = self.bpf[b"counters"]
        lost, trunc, unjoined = (int(sum(t[ctypes.c_int(i)])) for i in range(3))
        return lost, trunc, unjoined

    def cleanup(self) -> None:
        self.bpf.cleanup()


_PROBE_PROGRAM = r"""
BPF_ARRAY(hits, u64, 1);
int on_handshake(struct pt_regs *ctx) {
    int zero = 0;
    u64 *v = hits.lookup(&zero);
    if (v)
        __sync_fetch_and_add(v, 1);
    return 0;
}
"""


def probe_uprobe(libssl: str) -> int:
    """Attach a uprobe to SSL_do_handshake of `libssl` for this process only, run one handshake step
    with the ssl module over memory BIOs (nothing leaves the process) and return how often it fired.
    Raises what bcc raises when it cannot load or attach."""
    import ssl

    from bcc import BPF

    b = BPF(text=_PROBE_PROGRAM.encode())
    try:
        b.attach_uprobe(name=libssl.encode(), sym=b"SSL_do_handshake", fn_name=b"on_handshake", pid=os.getpid())
        obj = ssl.create_default_context().wrap_bio(ssl.MemoryBIO(), ssl.MemoryBIO(), server_hostname="localhost")
        try:
            obj.do_handshake()
        except ssl.SSLWantReadError:
            pass           # the ClientHello went into the memory BIO: no server to answer
        return int(b[b"hits"][ctypes.c_int(0)].value)
    finally:
        b.cleanup()


class _Conn:
    """A flow the recorder opened, as the joiner sees it."""

    __slots__ = ("key", "flow_id", "pid", "opened_ns", "mode", "reason", "cipher_bytes", "plain_bytes")

    def __init__(self, key: Hashable, flow_id: int, flow: Flow) -> None:
        self.key = key
        self.flow_id = flow_id
        self.pid = flow.pid or 0
        self.opened_ns = flow.opened_ns or 0
        self.mode = "?"            # ? (no bytes yet) | plain | tls (plaintext from libssl) | encrypted
        self.reason = ""
        self.cipher_bytes = 0
        self.plain_bytes = 0


class TlsJoiner:
    """Between the eBPF backend and the FlowSink: see the module docstring. Thread-safe.

    Records of the TLS program are handed on in the order they came, each once the recorder's own
    records up to its time have been seen (`_watermark`, the latest timestamp the backend passed
    in): a connection's plaintext must not reach the flow of an earlier connection on the same fd
    whose CLOSE, or the next one's OPEN, the backend has not handled yet. A record older than
    `_STALE_NS` is handed on regardless (the backend was idle, not behind)."""

    def __init__(self, sink: FlowSink, server_side: bool, max_bytes: int, libssl: str | None) -> None:
        self.sink = sink
        self.program: TlsProgram | None = None
        self.off_reason = "TLS capture is off"
        self.libssl = libssl
        self._server_side = server_side
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._conns: dict[Hashable, _Conn] = {}
        self._by_fd: dict[tuple[int, int], Hashable] = {}
        self._watermark = 0
        # (ts, fdkey, is_write (-1: SEEN), payload, total): complete records waiting for the watermark
        self._ready: collections.deque[tuple[int, tuple[int, int], int, bytes, int]] = collections.deque()
        self._partial: dict[tuple[int, int, int], list[Any]] = {}  # one call's records, reassembled
        self._orphans: dict[tuple[int, int], list[tuple[int, int, bytes, int]]] = {}   # no flow (yet)
        self._orphan_bytes = 0
        self._first: dict[tuple[int, int], float] = {}             # when its first orphan came
        self.flows: list[list[object]] = []                        # [flow, tls, reason, ciphertext bytes]
        self.counts = {"plaintext_flows": 0, "encrypted_flows": 0, "ciphertext_bytes_not_stored": 0,
                       "plaintext_bytes": 0, "other_connections_skipped": 0, "orphan_bytes_dropped": 0,
                       "late_plaintext_flows": 0}

    @property
    def writer(self) -> Any:
        return self.sink.writer

    def __getattr__(self, name: str) -> Any:   # stats, add_loss, tick, ...: the sink's own
        return getattr(self.sink, name)

    # ---- what the backend calls ----

    def open_flow(self, key: Hashable, flow: Flow) -> int:
        with self._lock:
            fdkey = _fdkey(key)
            if self.program is not None:
                self._advance(flow.opened_ns or 0)   # what came before it goes to the fd's previous flow
            old = self._by_fd.get(fdkey) if fdkey else None
            if old is not None and old in self._conns:
                self._finish(self._conns.pop(old))   # closed unseen: the sink replaces it too
            flow_id = self.sink.open_flow(key, flow)
            c = self._conns[key] = _Conn(key, flow_id, flow)
            if fdkey is not None:
                self._by_fd[fdkey] = key
                if self.program is not None:
                    self.program.skip(*fdkey, on=False)
                    self._adopt(fdkey, c)
            return flow_id

    def data(self, key: Hashable, direction: Direction, ts_ns: int, data: bytes) -> None:
        with self._lock:
            if ts_ns > self._watermark:
                self._watermark = ts_ns
            c = self._conns.get(key)
            if self._ready and self._ready[0][0] <= self._watermark:
                self._advance(ts_ns, drain=False)
            if c is not None and c.mode != "plain":
                if c.mode == "?":
                    self._classify(c, data)
                if c.mode == "tls":
                    c.cipher_bytes += len(data)
                    self.counts["ciphertext_bytes_not_stored"] += len(data)
                    return
            self.sink.data(key, direction, ts_ns, data)

    def gap(self, key: Hashable, direction: Direction, nbytes: int) -> None:
        with self._lock:
            c = self._conns.get(key)
            if c is None or c.mode != "tls":    # a hole in ciphertext is no hole in the plaintext
                self.sink.gap(key, direction, nbytes)

    def discarded(self, key: Hashable, direction: Direction, nbytes: int) -> None:
        with self._lock:
            c = self._conns.get(key)
            if c is None or c.mode != "tls":
                self.sink.discarded(key, direction, nbytes)

    def close_flow(self, key: Hashable, ts_ns: int | None) -> None:
        with self._lock:
            if self.program is not None:
                # its last plaintext was written before its close() ran (no time: what is due only)
                self._advance(ts_ns or 0)
            c = self._conns.pop(key, None)
            if c is not None:
                fdkey = _fdkey(key)
                if fdkey is not None and self._by_fd.get(fdkey) == key:
                    del self._by_fd[fdkey]
                self._finish(c)
            self.sink.close_flow(key, ts_ns)

    # ---- the TLS program's records ----

    def poll(self) -> None:
        """Drain the ring, hand on what is due, expire plaintext no recorded flow claimed (the poll
        thread, every POLL_S)."""
        with self._lock:
            stale = time.monotonic_ns() - _STALE_NS
            for pk in [k for k, p in self._partial.items() if p[0] < stale]:
                self._flush_partial(pk)    # a call whose last records were lost: what came, then a gap
            self._advance(0)
            now = time.monotonic()
            for fdkey, first in list(self._first.items()):
                if now - first >= _ORPHAN_S:
                    self._drop_orphan(fdkey, skip=True)

    def _advance(self, ts_ns: int, drain: bool = True) -> None:
        """Drain the ring; hand on every record the backend's records have caught up with."""
        if ts_ns > self._watermark:
            self._watermark = ts_ns
        if drain:
            self._drain()
        ready = self._ready
        if not ready:
            return
        stale = time.monotonic_ns() - _STALE_NS
        while ready and (ready[0][0] <= self._watermark or ready[0][0] <= stale):
            ts, fdkey, is_write, payload, total = ready.popleft()
            if is_write < 0:
                self._on_seen(fdkey, ts)
            else:
                self._plain(fdkey, is_write, ts, payload, total)

    def _drain(self) -> None:
        if self.program is None:
            return
        for raw in self.program.consume():
            ts, tgid, fd, length, total, offset, etype, is_write, _trunc, _pad = _HDR.unpack_from(raw)
            if etype == EV_SEEN:
                self._ready.append((ts, (tgid, fd), -1, b"", 0))
            elif etype == EV_PLAIN:
                self._on_record(ts, tgid, fd, is_write, offset, total, raw[HDR_SIZE:HDR_SIZE + length])

    def _on_record(self, ts: int, tgid: int, fd: int, is_write: int, offset: int, total: int,
                   payload: bytes) -> None:
        pk = (tgid, fd, is_write)
        want = min(total, self._max_bytes)
        if offset == 0 and len(payload) >= want and pk not in self._partial:
            self._ready.append((ts, (tgid, fd), is_write, payload, total))
            return
        p = self._partial.get(pk)
        if offset == 0 or p is None or p[0] != ts:
            if p is not None:
                self._flush_partial(pk)
            p = self._partial[pk] = [ts, bytearray(), want, total]
        p[1] += payload
        if len(p[1]) >= p[2]:
            self._flush_partial(pk)

    def _flush_partial(self, pk: tuple[int, int, int]) -> None:
        ts, buf, _want, total = self._partial.pop(pk)
        self._ready.append((ts, pk[:2], pk[2], bytes(buf), total))

    def _conn_at(self, fdkey: tuple[int, int], ts: int) -> _Conn | None:
        key = self._by_fd.get(fdkey)
        c = self._conns.get(key) if key is not None else None
        return c if c is not None and ts >= c.opened_ns else None

    def _on_seen(self, fdkey: tuple[int, int], ts: int) -> None:
        c = self._conn_at(fdkey, ts)
        if c is None:
            self._orphan(fdkey, ts, -1, b"", 0)
        elif c.mode != "tls":
            self._to_tls(c)

    def _to_tls(self, c: _Conn) -> None:
        if c.mode in ("plain", "encrypted"):
            # bytes before it were stored as they came (STARTTLS, or a decision made too early)
            self.counts["late_plaintext_flows"] += 1
        c.mode = "tls"

    def _plain(self, fdkey: tuple[int, int], is_write: int, ts: int, payload: bytes, total: int) -> None:
        c = self._conn_at(fdkey, ts)
        if c is None:
            self._orphan(fdkey, ts, is_write, payload, total)
            return
        if c.mode != "tls":
            self._to_tls(c)
        direction: Direction = "s2c" if bool(is_write) == self._server_side else "c2s"
        c.plain_bytes += len(payload)
        self.counts["plaintext_bytes"] += len(payload)
        self.sink.data(c.key, direction, ts, payload)
        if len(payload) < total:     # over --max-bytes: a hole the decoders resynchronise after
            self.sink.gap(c.key, direction, total - len(payload))

    def _orphan(self, fdkey: tuple[int, int], ts: int, is_write: int, payload: bytes, total: int) -> None:
        """A record of a socket with no flow: its OPEN may still come (bounded wait), or it is not recorded."""
        if self._orphan_bytes + len(payload) > _ORPHAN_MAX_BYTES:
            self.counts["orphan_bytes_dropped"] += len(payload)
            return
        self._orphans.setdefault(fdkey, []).append((ts, is_write, payload, total))
        self._orphan_bytes += len(payload)
        self._first.setdefault(fdkey, time.monotonic())

    def _adopt(self, fdkey: tuple[int, int], c: _Conn) -> None:
        """A flow just opened: what its socket's SEEN and plaintext records said before."""
        self._first.pop(fdkey, None)
        for ts, is_write, payload, total in self._orphans.pop(fdkey, []):
            self._orphan_bytes -= len(payload)
            if ts < c.opened_ns:
                self.counts["orphan_bytes_dropped"] += len(payload)
            elif is_write < 0:
                self._to_tls(c)
            else:
                self._plain(fdkey, is_write, ts, payload, total)

    def _drop_orphan(self, fdkey: tuple[int, int], skip: bool) -> None:
        self._first.pop(fdkey, None)
        for _ts, _w, payload, _total in self._orphans.pop(fdkey, []):
            self._orphan_bytes -= len(payload)
            self.counts["orphan_bytes_dropped"] += len(payload)
        if skip and self.program is not None and fdkey not in self._by_fd:
            self.program.skip(*fdkey)     # a TLS connection we do not record: copy nothing more of it
            self.counts["other_connections_skipped"] += 1

    # ---- classification and the per-flow report ----

    def _classify(self, c: _Conn, first: bytes) -> None:
        if not looks_like_tls(first):
            c.mode = "plain"
            return
        if self.program is not None:
            self._advance(0)   # the SEEN of this socket, if any, was written before these bytes
            if c.mode == "tls":
                return
        c.mode = "encrypted"
        c.reason = self._why_unreadable(c.pid)

    def _why_unreadable(self, pid: int) -> str:
        if self.program is None:
            return f"encrypted: {self.off_reason}"
        mapped = maps_libssl(pid, self.libssl)
        if mapped is False:
            return "encrypted: process does not use the system libssl (statically linked TLS such as " \
                   "grpcio's BoringSSL, Node.js's own OpenSSL, or Go's crypto/tls)"
        if mapped:
            return "encrypted: the process maps the system libssl, but this connection's TLS does not go " \
                   "through it on this socket (another TLS library linked in, or memory BIOs as in asyncio)"
        return "encrypted: no plaintext from the system libssl for this connection (process gone)"

    def _finish(self, c: _Conn) -> None:
        if c.mode == "tls":
            self.counts["plaintext_flows"] += 1
            self.flows.append([c.flow_id, "plaintext", None, c.cipher_bytes])
        elif c.mode == "encrypted":
            self.counts["encrypted_flows"] += 1
            self.flows.append([c.flow_id, "encrypted", c.reason, 0])

    def finish_all(self) -> None:
        """At stop: the last records, then every flow still open goes into the report."""
        with self._lock:
            self._drain()
            for pk in list(self._partial):
                self._flush_partial(pk)
            self._advance(time.monotonic_ns())
            for c in list(self._conns.values()):
                self._finish(c)
            self._conns.clear()
            self._by_fd.clear()
            for fdkey in list(self._first):
                self._drop_orphan(fdkey, skip=False)

    def meta(self, status: dict[str, object]) -> dict[str, object]:
        return {"tls": status | self.counts, "tls_flows": sorted(self.flows, key=lambda r: cast(int, r[0]))}


def _fdkey(key: Hashable) -> tuple[int, int] | None:
    if isinstance(key, tuple) and len(key) >= 2 and isinstance(key[0], int) and isinstance(key[1], int):
        return (key[0], key[1])
    return None


class TlsBackend:
    """The eBPF backend with TLS plaintext capture beside it (see the module docstring).

    `options.tls`: "auto" (default: on where it works, otherwise recorded without it and
    `status["reason"]` says why), "on" (fail when it cannot work), "off"."""

    def __init__(self, inner: Any, options: RecordOptions) -> None:
        if options.tls not in TLS_MODES:
            raise CaptureError(f"--tls must be one of {', '.join(TLS_MODES)}, not {options.tls!r}")
        self.inner = inner
        self.options = options
        self.status: dict[str, object] = {"capture": "off", "reason": "--tls off"} if options.tls == "off" else {}
        self.joiner: TlsJoiner | None = None
        self.flow_report: object = []     # after stop: [flow, plaintext|encrypted, reason, ciphertext bytes]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported = (0, 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def describe(self) -> dict[str, object]:
        return cast(dict[str, object], self.inner.describe()) | {"tls": dict(self.status)}

    def start(self, sink: FlowSink) -> None:
        libssl = find_libssl()
        j = self.joiner = TlsJoiner(sink, self.options.side == "server", max_bytes(self.options), libssl)
        self.inner.start(cast(FlowSink, j))
        if self.options.tls == "off":
            j.off_reason = "TLS capture is off (--tls off)"
            return
        try:
            if libssl is None:
                raise PrivilegeError("no system libssl.so.3 found (ldconfig -p)")
            cgroup_id = int(getattr(self.inner, "cgroup_id", 0) or 0)
            program = TlsProgram(self.options, libssl, cgroup_id)
        except PrivilegeError as exc:
            self.status = {"capture": "off", "reason": str(exc)}
            j.off_reason = f"TLS capture is off ({exc})"
            if self.options.tls == "on":
                self.inner.stop()
                raise PrivilegeError(f"--tls on: {exc}") from exc
            return
        self.status = {"capture": "on", "libssl": libssl, "version": libssl_version(libssl)}
        with j._lock:
            j.program = program
        self._thread = threading.Thread(target=self._poll, name="tls-poll", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(POLL_S):
            assert self.joiner is not None
            self.joiner.poll()
            if time.monotonic() - last >= 1.0:
                last = time.monotonic()
                self._report_counters()

    def _report_counters(self) -> None:
        j = self.joiner
        if j is None or j.program is None:
            return
        lost, trunc, _unjoined = j.program.counters()
        j.sink.add_loss(lost - self._reported[0], trunc - self._reported[1])
        self._reported = (lost, trunc)

    def stop(self) -> None:
        j = self.joiner
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.inner.stop()
        finally:
            if j is not None:
                j.finish_all()
                if j.program is not None:
                    self._report_counters()
                    lost, trunc, unjoined = j.program.counters()
                    self.status |= {"lost_events": lost, "truncated_calls": trunc, "unjoined_calls": unjoined}
                    j.program.cleanup()
                    j.program = None
                meta = j.meta(self.status)
                self.status, self.flow_report = cast(dict[str, object], meta["tls"]), meta["tls_flows"]
                j.sink.writer.set_meta(meta)
                self.joiner = None
