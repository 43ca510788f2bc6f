"""Load recorder.bpf.c through bcc and turn its ring-buffer records into flows and chunks.

    recorder.bpf.c (filters substituted in `render_program`, the one place)
        | ring buffer: OPEN / DATA (<= CHUNK bytes each, split syscalls share a timestamp) / CLOSE
        v
    EbpfBackend._on_event --(tgid, fd) flow key--> FlowSink

Connections already open are found in /proc (procnet) and put into the program's socket map, so
their bytes are captured from the next syscall on; they are marked `joined_midstream`.

Accepts with no address (libuv servers: uvloop, Node.js) are traced by listener (see the .bpf.c).
Their OPEN has no peer: `_open` reads it from /proc while the socket is still the one accepted
(checked against the socket map before and after), else the flow waits, held, for its CLOSE, which
carries the peer the close revealed. A flow whose peer stays unknown is still recorded, with
src 0.0.0.0:0, and counted in meta (`accepted_peer_unknown`).

Receive flags are read in the kernel (see the .bpf.c): peeks are not recorded; a recv with MSG_TRUNC
arrives as a DATA record with no payload and `discarded` set, recorded as a gap of `total` bytes
(`FlowSink.discarded`: counted in meta and listed by `inspect`), never as bytes.
"""

from __future__ import annotations

import collections
import ctypes
import ipaddress
import itertools
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Protocol, cast

from capture import privileges
from capture.backends import RecordOptions
from capture.ebpf import cgroups, detach, procnet
from capture.ebpf.ringbuf import RingReader
from capture.ebpf.streams import Streams
from capture.errors import CaptureError, PrivilegeError
from capture.recording import Direction, Flow
from capture.sink import FlowSink

BPF_SOURCE = Path(__file__).with_name("recorder.bpf.c")
CHUNK_MIN, CHUNK_MAX = 4096, 65536
MAX_IOV = 128      # iovecs of a syscall of at most one record (copy_small in the .bpf.c)
BIG_IOVS = 512     # iovecs of a larger one (copy_big; grpc passes at most 260, IOV_MAX is 1024)
MAX_BYTES_LIMIT = 64 << 20   # per syscall; the ring must hold a few such syscalls between drains
POLL_S = 0.1              # ring drain period (see _poll)
WAKE_BYTES = 4 << 20      # the program wakes the poller once per this much payload per CPU (see the .bpf.c)
_MAX_QUEUED = 2_000_000   # records waiting for the decoder (<= ~64 KiB each, mostly far smaller)
_MAX_QUEUED_BYTES = 256 << 20   # and their bytes: a burst of large writes is decoded late, memory bounded
# A record's time is taken a few instructions before it is committed to the ring; a progress mark (see
# _poll) stays this far behind the poll's start, far more than that, even on a preempted CPU.
_COMMIT_SLACK_NS = 5_000_000
EV_DATA, EV_OPEN, EV_CLOSE, EV_LISTENER = 1, 2, 3, 4
# ev_hdr.discarded: a DATA record without payload, and why (NC_* in the .bpf.c)
NC_TRUNC, NC_SENDFILE, NC_SPLICE, NC_TLS = 1, 2, 3, 4
TLS_CIPHERTEXT = "tls-ciphertext"
# NC_TLS: ciphertext of a socket whose plaintext the TLS program records (capture/ebpf/tls.py): the
# length only, which the TLS joiner counts and never hands to the sink as a gap
NOT_CAPTURED_HOW = {NC_SENDFILE: "sendfile", NC_SPLICE: "splice", NC_TLS: TLS_CIPHERTEXT}
UNKNOWN_END = ("0.0.0.0", 0)
# The maps the TLS program shares (BPF_TABLE_PUBLIC in the .bpf.c): bcc shares public maps by name
# within a process, so each recorder's get names of their own (two recorders may run side by side).
SHARED_MAPS = ("socks", "tls_socks")
_instances = itertools.count(1)


class _Bcc(Protocol):
    """What this module uses of bcc's BPF object (bcc ships no types; its tables are dynamic classes)."""

    def __getitem__(self, name: bytes) -> Any: ...
    def cleanup(self) -> None: ...


class SockInfo(ctypes.Structure):
    _fields_ = [("family", ctypes.c_uint8), ("is_server", ctypes.c_uint8), ("lport", ctypes.c_uint16),
                ("rport", ctypes.c_uint16), ("peer_unknown", ctypes.c_uint8), ("pad", ctypes.c_uint8),
                ("laddr", ctypes.c_uint8 * 16), ("raddr", ctypes.c_uint8 * 16), ("opened_ns", ctypes.c_uint64),
                ("rd", ctypes.c_uint64), ("wr", ctypes.c_uint64)]


class Listener(ctypes.Structure):
    _fields_ = [("lport", ctypes.c_uint16), ("family", ctypes.c_uint8), ("ours", ctypes.c_uint8)]


class _Held:
    """An accepted flow whose peer is not known yet: its records wait here for its CLOSE."""

    __slots__ = ("h", "records")

    def __init__(self, h: EvHdr) -> None:
        self.h = h
        self.records: list[bytes] = []


class EvHdr(ctypes.Structure):
    _fields_ = [("ts_ns", ctypes.c_uint64), ("pos", ctypes.c_uint64), ("tgid", ctypes.c_uint32), ("fd", ctypes.c_uint32),
                ("len", ctypes.c_uint32), ("total", ctypes.c_uint32), ("offset", ctypes.c_uint32),
                ("type", ctypes.c_uint8), ("is_write", ctypes.c_uint8), ("truncated", ctypes.c_uint8),
                ("discarded", ctypes.c_uint8), ("si", SockInfo), ("comm", ctypes.c_char * 16)]


HDR_SIZE = ctypes.sizeof(EvHdr)
_DISCARDED_AT = EvHdr.discarded.offset
# The leading fields of EvHdr (ts_ns .. is_write): struct reads them from a record's bytes in one call,
# where a ctypes copy of the whole header cost more than everything else done per DATA record.
_HDR_HEAD = struct.Struct("<QQIIIIIBB")


def _no_marks(ts_ns: int) -> None:
    """The progress marks of a sink that does not want them (see EbpfBackend._poll)."""


def cgroup_filter(path: str | None) -> tuple[int, bool, set[int]]:
    """(cgroup v2 id, use-tgid-map, tgids) for `--cgroup PATH`, the cgroup and every cgroup under it.

    cgroup v2: the kernel tests bpf_current_task_under_cgroup() against the directory (the `cgroup_under`
    array, set in _load). cgroup v1 has no such test, so the member processes of the directory and of its
    children (capture/ebpf/cgroups.py) go into a map, refreshed every second."""
    if not path:
        return 0, False, set()
    p = Path(path)
    if not p.is_dir():
        raise CaptureError(f"--cgroup {path}: no such cgroup directory")
    if cgroups.is_v2(p):
        return p.stat().st_ino, False, set()
    return 0, True, cgroups.members(p)


def set_cgroup(bpf: _Bcc, path: str) -> None:
    """Point a loaded program's `cgroup_under` array at the cgroup v2 directory `path`."""
    try:
        bpf[b"cgroup_under"][0] = path
    except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception
        bpf.cleanup()
        raise CaptureError(f"--cgroup {path}: cannot use it as a cgroup v2 filter ({exc})") from exc


def chunk_size(max_bytes: int) -> int:
    """Record size: the power of two covering max_bytes, within 4-64 KiB.

    One record per syscall up to 64 KiB keeps the verifier's work small (its cost grows with the
    number of records a syscall may need); beyond that a syscall is split into 64 KiB records."""
    size = CHUNK_MIN
    while size < max_bytes and size < CHUNK_MAX:
        size *= 2
    return size


def ring_pages(options: RecordOptions) -> int:
    """Ring buffer pages: as asked, and at least four of the largest syscalls (plus headers): 64 MiB
    for the default 8 MiB --max-bytes. A burst of 4 MiB messages on loopback runs at ~500 MB/s; the
    poller, woken by each large syscall, must be scheduled before the ring fills (else: lost, counted)."""
    need = 4 * (options.max_bytes + options.max_bytes // 8) // 4096
    pages = max(options.ring_pages, need)
    return 1 << (pages - 1).bit_length()     # a power of two, as the kernel requires


def _possible_cpus() -> int:
    try:
        text = Path("/sys/devices/system/cpu/possible").read_text().strip()
        return int(text.split("-")[-1]) + 1
    except (OSError, ValueError):
        return os.cpu_count() or 1


def shared_names(instance: int) -> dict[str, str]:
    """The names the shared maps get in recorder number `instance` of this process."""
    return {name: f"st{instance}_{name}" for name in SHARED_MAPS}


def render_program(options: RecordOptions, cgroup_id: int = 0, tgid_map: bool = False,
                   names: dict[str, str] | None = None) -> str:
    """The BPF program text with every filter substituted (what --print-bpf shows), and the shared
    maps renamed to `names` (shared_names(); the source's own names without it)."""
    chunk = chunk_size(options.max_bytes)
    max_bytes = (options.max_bytes + chunk - 1) // chunk * chunk
    defines = {
        "FILTER_PORT": options.port or 0, "FILTER_PID": options.pid or 0, "FILTER_CGROUP": f"{cgroup_id}ULL",
        "FILTER_TGID_MAP": int(tgid_map), "SIDE_SERVER": int(options.side == "server"),
        "MAX_BYTES": max_bytes, "CHUNK": chunk, "MAX_IOV": MAX_IOV, "BIG_IOVS": BIG_IOVS,
        "RINGBUF_PAGES": ring_pages(options), "WAKE_BYTES": WAKE_BYTES,
        "SCRATCH_CPUS": _possible_cpus(),
    }
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + rename_maps(BPF_SOURCE.read_text(), names or {})


def rename_maps(text: str, names: dict[str, str]) -> str:
    """`text` with each map `old` of `names` called `new` (whole words: tls_socks is not socks)."""
    for old, new in names.items():
        text = re.sub(rf"\b{old}\b", new, text)
    return text


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _ip(family: int, raw: ctypes.Array[ctypes.c_uint8]) -> str:
    b = bytes(raw)
    if family == 2:
        return str(ipaddress.IPv4Address(b[:4]))
    ip6 = ipaddress.IPv6Address(b)
    return str(ip6.ipv4_mapped or ip6)


class EbpfBackend:
    """Syscall-tracepoint capture (root). See recorder.bpf.c for what is traced and why."""

    def __init__(self, options: RecordOptions) -> None:
        if options.side not in ("server", "client"):
            raise CaptureError(f"--side must be server or client, not {options.side!r}")
        if not 0 < options.max_bytes <= MAX_BYTES_LIMIT:
            # Beyond this a few syscalls would fill the ring between two drains.
            raise CaptureError(f"--max-bytes {options.max_bytes}: choose 1 to {MAX_BYTES_LIMIT} bytes per syscall")
        self.options = options
        self.cgroup_id, self.tgid_map, self.tgids = cgroup_filter(options.cgroup)
        self.bpf: _Bcc | None = None
        self.sink: FlowSink | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker: threading.Thread | None = None
        # records, and (with a sink that wants them) progress marks: ints, see _poll
        self._queue: collections.deque[bytes | int] = collections.deque()
        self._ready = threading.Event()
        self._drained = threading.Event()
        self._user_lost = 0
        chunk = chunk_size(options.max_bytes)
        self._max_bytes = (options.max_bytes + chunk - 1) // chunk * chunk
        self._reported = (0, 0)
        self._ring: RingReader | None = None
        self.extra_drain: Callable[[], None] | None = None    # another ring to drain on this poller's timer
        self._enqueued = self._dequeued = 0       # record bytes into and out of the queue
        self._server_side = options.side == "server"
        self.map_names = shared_names(next(_instances))
        # accepts with no address (see the module docstring)
        self._instances: dict[tuple[int, int], int] = {}      # key -> opened_ns of its peer_unknown flow
        self._opening: tuple[tuple[int, ...], SockInfo] | None = None   # the flow _start is opening
        self._held: dict[tuple[int, int], _Held] = {}         # key -> flow waiting for its CLOSE
        self._orphans: dict[tuple[int, int, int], _Held] = {}  # held flows whose fd was reused first
        self._listeners_seen: dict[tuple[int, int], bool] = {}  # (tgid, fd) -> ours, learnt from /proc
        self.accepts = {"peer_from_proc": 0, "peer_from_close": 0, "peer_unknown": 0,
                        "joined_late": 0, "missed": 0}

    def describe(self) -> dict[str, object]:
        return {"chunk": chunk_size(self.options.max_bytes), "max_iov": MAX_IOV, "big_iovs": BIG_IOVS,
                "max_bytes": self._max_bytes, "ring_pages": ring_pages(self.options),
                "cgroup_id": self.cgroup_id, "cgroup_v1_tgids": self.tgid_map}

    def preflight(self) -> None:
        """Raise PrivilegeError when this process lacks a capability the backend needs."""
        if lacking := privileges.missing(privileges.RECORDER):
            raise PrivilegeError(privileges.refusal("the ebpf backend", lacking, privileges.RECORDER)
                                 + "; or use --backend proxy (unprivileged)")

    def _load(self) -> _Bcc:
        self.preflight()
        try:
            from bcc import BPF
        except Exception as exc:  # noqa: BLE001 - bcc can fail with plain Exception
            raise PrivilegeError("bcc is not importable: apt-get install python3-bpfcc (and expose it to this "
                                 f"interpreter; `make setup` does), or use --backend proxy ({exc})") from exc
        try:
            text = render_program(self.options, self.cgroup_id, self.tgid_map, self.map_names)
            bpf: _Bcc = BPF(text=text.encode())
        except Exception as exc:  # noqa: BLE001 - compile/attach errors are plain Exception
            raise PrivilegeError(f"cannot load the eBPF program ({str(exc).splitlines()[0][:160]}): needs kernel "
                                 "headers (apt-get install linux-headers-amd64) and tracefs; "
                                 "`shadowtest doctor` says which is missing") from exc
        if self.cgroup_id:
            set_cgroup(bpf, str(self.options.cgroup))
        return bpf

    def start(self, sink: FlowSink) -> None:
        self.sink = sink
        self._streams = Streams(sink, self._max_bytes)
        self._caught_up: Callable[[int], None] = getattr(sink, "caught_up", _no_marks)
        self.bpf = b = self._load()
        self._sync_tgids()
        b[b"events"].open_ring_buffer(self._on_event)
        self._ring = RingReader(b, b"events")
        self._learn_listeners()
        self._arm()
        self._join_open_connections()
        self._thread = threading.Thread(target=self._poll, name="ebpf-poll", daemon=True)
        self._worker = threading.Thread(target=self._work, name="ebpf-decode", daemon=True)
        self._thread.start()
        self._worker.start()

    def _arm(self) -> None:
        """Every probe is attached: from now on new connections enter the socket map (recorder.bpf.c,
        `armed`); the ones opened before are joined from /proc right after."""
        self._table(b"armed")[ctypes.c_int(0)] = ctypes.c_uint32(1)

    def _table(self, name: bytes) -> Any:
        """One of the program's maps (a bcc table: untyped)."""
        assert self.bpf is not None, "the eBPF program is not loaded"
        return self.bpf[name]

    def _socks(self) -> Any:
        """The program's map of traced sockets, (tgid << 32 | fd) -> SockInfo."""
        return self._table(self.map_names["socks"].encode())

    def forget(self, key: Hashable) -> None:
        """Stop recording a connection (the sink does not keep it: --sample): its socket leaves the
        program's map, so the kernel copies none of its bytes from now on, and no CLOSE comes for it."""
        opening = self._opening
        if not (isinstance(key, tuple) and len(key) == 2 and opening is not None and opening[0] == key):
            return            # not the flow being opened: the sink ignores its bytes, the kernel copies them
        si = opening[1]
        if not (si.is_server and (si.rport or si.opened_ns)):
            return            # a client's connect: nothing in the map tells this connection from the fd's next one
        # The kernel may be on the fd's next connection already: only this connection's entry is deleted,
        # told by its peer (an accept with an address) or its accept time (one without).
        k = ctypes.c_uint64((key[0] << 32) | key[1])
        socks = self._socks()
        try:
            now = socks[k]
            if (now.rport, bytes(now.raddr), now.opened_ns, now.lport) != (si.rport, bytes(si.raddr), si.opened_ns,
                                                                         si.lport):
                return        # another connection on that fd by now (rd/wr, its stream positions, move: not compared)
            del socks[k]
        except KeyError:
            return            # closed already
        try:
            del self._table(self.map_names["tls_socks"].encode())[k]   # the TLS program may have marked it
        except KeyError:
            pass

    def _sync_tgids(self) -> None:
        if not self.tgid_map:
            return
        table = self._table(b"tgids")
        try:
            current = cgroups.members(Path(self.options.cgroup or "")) if self.options.cgroup else set()
        except CaptureError:      # the cgroup went away (its pod deleted): none of its processes is left
            current = set()
        for tgid in current - self.tgids:
            table[ctypes.c_uint32(tgid)] = ctypes.c_uint8(1)
        for tgid in self.tgids - current:
            table.pop(ctypes.c_uint32(tgid), None)
        self.tgids = current
        if not current:
            return
        for tgid in current:
            table[ctypes.c_uint32(tgid)] = ctypes.c_uint8(1)

    def _pids(self) -> set[int] | None:
        return {self.options.pid} if self.options.pid else (self.tgids if self.tgid_map else None)

    def _learn_listeners(self) -> None:
        """Tell the program which listening sockets, already open, are on the port: their accepts
        with no address are traced (later listen() calls it sees for itself)."""
        if not self._server_side:
            return
        table = self._table(b"listeners")
        for c in procnet.listening(self.options.port, self._pids()):
            table[ctypes.c_uint64((c.pid << 32) | c.fd)] = Listener(lport=c.local[1], family=c.family, ours=1)

    def _join_open_connections(self) -> None:
        """Put connections opened before the capture into the socket map, marked as joined."""
        assert self.sink is not None
        pids = self._pids()
        socks = self._socks()
        now = time.monotonic_ns()
        for c in procnet.open_connections(self.options.port, self.options.side, pids):
            key = ctypes.c_uint64((c.pid << 32) | c.fd)
            if key in socks:
                continue
            si = SockInfo(family=c.family, is_server=int(self.options.side == "server"))
            socks[key] = si
            client, server = (c.remote, c.local) if self.options.side == "server" else (c.local, c.remote)
            self.sink.open_flow((c.pid, c.fd), Flow(src=client, dst=server, pid=c.pid, comm=c.comm,
                                                    opened_ns=now, joined_midstream=True))

    def _poll(self) -> None:
        """Drain the ring every POLL_S: the callback only copies bytes out, so a burst waits in user
        memory (bounded) rather than overflowing the kernel ring. The program writes records
        without wake-ups, so this timer is the only one: ten wake-ups a second, however busy (a
        thread wake-up costs ~90 us of CPU on this VM; at 100 a second the idle recorder used
        1.3 % of a core). The 32 MiB ring holds far more than POLL_S of traffic (~0.4 MiB at
        3,000 calls/s). A syscall larger than one record wakes this thread early with its last
        record (megabytes can arrive faster than the timer drains them); the poll then returns at
        once and the drain follows.

        A sink with a `caught_up(ts)` method (the TLS joiner, capture/ebpf/tls_join.py) also gets
        progress marks while it says it `needs_marks`: every record written before a poll began is in
        the queue ahead of a mark with that time (less _COMMIT_SLACK_NS, the most a record's time
        precedes its commit), so when the decode thread reaches the mark, it has handed on every record
        up to that time. (Marks only while plaintext waits: an idle recorder's decode thread sleeps.)"""
        assert self._ring is not None
        ring = self._ring
        marks = self._caught_up is not _no_marks
        while not self._stop.is_set():
            began = time.monotonic_ns()
            ring.wait(POLL_S)        # returns early only for a large syscall's wake-up
            ring.consume()           # with the GIL held: see capture/ebpf/ringbuf.py
            if self.extra_drain is not None:
                self.extra_drain()   # the TLS ring, on this thread's timer (capture/ebpf/tls.py)
            if marks and getattr(self.sink, "needs_marks", True):   # plaintext waits for the recorder
                self._queue.append(began - _COMMIT_SLACK_NS)
            if self._queue:
                self._ready.set()

    def _work(self) -> None:
        """Decode and store what the poller queued; counters and cgroup members once a second."""
        last = time.monotonic()
        while True:
            self._ready.wait(1.0)   # the poller wakes us when there is work: no idle ticking
            self._ready.clear()
            self._process_queue()
            self._streams.flush()
            if time.monotonic() - last >= 1.0:
                last = time.monotonic()
                self._report_counters()
                self._sync_tgids()
            if self._stop.is_set() and self._drained.is_set():
                return

    def _process_queue(self) -> None:
        q = self._queue
        while q:
            raw = q.popleft()
            if raw.__class__ is int:
                self._caught_up(raw)
            else:
                record = cast(bytes, raw)
                self._dequeued += len(record)
                self._handle(record)

    def _on_event(self, ctx: object, data: int, size: int) -> int:
        # An int, always: bcc's wrapper turns any other return value into 0 by raising and
        # catching a TypeError, which cost more than the rest of this callback.
        if len(self._queue) >= _MAX_QUEUED or self._enqueued - self._dequeued >= _MAX_QUEUED_BYTES:
            self._user_lost += 1      # user space cannot keep up: counted as lost (a gap), never silent
            return 0
        self._enqueued += size        # each counter has one writer (this thread, the decode thread)
        self._queue.append(ctypes.string_at(data, size))
        return 0

    def _handle(self, raw: bytes, as_key: tuple[int, ...] | None = None) -> None:
        ts_ns, pos, tgid, fd, length, total, offset, etype, is_write = _HDR_HEAD.unpack_from(raw)
        key: tuple[int, ...] = as_key or (tgid, fd)
        if etype == EV_DATA:
            if self._held and as_key is None and (held := self._held.get((tgid, fd))) is not None:
                held.records.append(raw)
                return
            direction: Direction = "s2c" if bool(is_write) == self._server_side else "c2s"
            if offset == 0 and length == total:
                if length:   # a whole syscall in one record: the usual case
                    self._streams.whole(key, direction, ts_ns, pos, raw[HDR_SIZE:HDR_SIZE + length])
                    return
            if length == 0 and raw[_DISCARDED_AT]:
                self._length_only(key, direction, ts_ns, pos, total, raw[_DISCARDED_AT])
            else:
                self._streams.piece(key, direction, ts_ns, pos, offset, total, raw[HDR_SIZE:HDR_SIZE + length])
        elif etype == EV_OPEN:
            self._open((tgid, fd), EvHdr.from_buffer_copy(raw[:HDR_SIZE]))
        elif etype == EV_CLOSE:
            h = EvHdr.from_buffer_copy(raw[:HDR_SIZE])
            if h.si.opened_ns and as_key is None:
                self._close_accepted((tgid, fd), h)
                return
            self._close(key, ts_ns, h.si)
        elif etype == EV_LISTENER:
            self._unknown_listener(tgid, fd, total)

    def _length_only(self, key: tuple[int, ...], direction: Direction, ts_ns: int, pos: int, nbytes: int,
                     how: int) -> None:
        """A syscall whose bytes were not copied: dropped unread by the application (MSG_TRUNC: a
        gap, counted), moved by sendfile/splice (not captured: length and time), or TLS ciphertext
        (the TLS joiner counts it). After whatever syscall of this direction is being reassembled."""
        assert self.sink is not None
        self._streams.length_only(key, direction, pos, nbytes)
        if how == NC_TRUNC:
            self.sink.discarded(key, direction, nbytes)
        else:
            self.sink.not_captured(key, direction, ts_ns, nbytes, NOT_CAPTURED_HOW.get(how, "zero-copy"))

    def _close(self, key: tuple[int, ...], ts_ns: int | None, si: SockInfo | None = None) -> None:
        """A flow ends: its pending syscalls, a gap for bytes lost after its last record (the
        CLOSE's final positions, when it has them), then the sink's close."""
        final: dict[Direction, int] | None = None
        if si is not None and (si.rd or si.wr):
            final = {"c2s": int(si.rd), "s2c": int(si.wr)} if self._server_side else \
                {"c2s": int(si.wr), "s2c": int(si.rd)}
        self._streams.close(key, final)
        assert self.sink is not None
        self.sink.close_flow(key, ts_ns)

    def _open(self, key: tuple[int, int], h: EvHdr) -> None:
        si = h.si
        if key in self._held:                 # its fd was reused before its CLOSE came: it is complete
            old = self._held.pop(key)
            self._orphans[(*key, old.h.si.opened_ns)] = old
        self._instances.pop(key, None)
        if si.is_server and si.opened_ns:
            self._open_accepted(key, h)
            return
        remote = (_ip(si.family, si.raddr), si.rport)
        if si.is_server:
            client, server = remote, (_ip(si.family, si.laddr), si.lport)
        else:
            # connect() bound the local end already; /proc has it by the time we see the event
            client, server = procnet.local_end(h.tgid, h.fd) or ("0.0.0.0", 0), remote
        self._start(key, h, client, server)

    # ---- accepts with no address ----

    def _still_accepted(self, key: tuple[int, int], opened_ns: int) -> bool:
        """Whether the program's socket map still holds this accept (not closed, fd not reused)."""
        try:
            return int(self._socks()[ctypes.c_uint64((key[0] << 32) | key[1])].opened_ns) == opened_ns
        except KeyError:
            return False

    def _open_accepted(self, key: tuple[int, int], h: EvHdr) -> None:
        """OPEN of an accept with no address: the peer from /proc if the socket is still the one
        accepted (the inode is read between two checks of the socket map, so a closed and reused
        fd cannot lend its successor's peer); otherwise the flow is held until its CLOSE."""
        opened = int(h.si.opened_ns)
        ends = None
        if self._still_accepted(key, opened):
            inode = procnet.socket_inode(*key)
            if inode is not None and self._still_accepted(key, opened):
                ends = procnet.tcp_ends(key[0], inode)
            if ends is None and self._still_accepted(key, opened):
                # open, yet /proc does not show it: record it now rather than hold a live flow
                self.accepts["peer_unknown"] += 1
                self._start(key, h, UNKNOWN_END, ("0.0.0.0", int(h.si.lport)))
                self._instances[key] = opened
                return
        if ends is None:
            self._held[key] = _Held(h)      # closed already: its CLOSE (with the peer) follows
            return
        self.accepts["peer_from_proc"] += 1
        local, remote, _family, _state = ends
        self._start(key, h, remote, local)
        self._instances[key] = opened

    def _start(self, key: tuple[int, ...], h: EvHdr, client: tuple[str, int], server: tuple[str, int]) -> None:
        """Open the flow an OPEN event announced (seen from its first byte: not joined midstream)."""
        assert self.sink is not None
        self._new_socket(key)
        self._opening = (key, h.si)        # forget() tells this connection's map entry from a later one's
        try:
            self.sink.open_flow(key, Flow(src=client, dst=server, pid=h.tgid, comm=h.comm.decode(errors="replace"),
                                          opened_ns=h.ts_ns, joined_midstream=False))
        finally:
            self._opening = None

    def _new_socket(self, key: tuple[int, ...]) -> None:
        """A new socket on `key`: its stream positions start at 0. A flow still open on that key lost its
        CLOSE (a full ring): what it last sent may be lost too, so both its directions end in a gap of
        unknown size, before the sink replaces it."""
        assert self.sink is not None
        self._streams.close(key, None)          # its last syscalls go to the old flow, if any
        if self.sink.has_flow(key):
            for direction in ("c2s", "s2c"):
                self.sink.gap(key, direction, None)

    def _close_accepted(self, key: tuple[int, int], h: EvHdr) -> None:
        """CLOSE of an accept with no address (sent at close's exit: the fd may be reused already)."""
        opened = int(h.si.opened_ns)
        held = self._held.get(key)
        if held is not None and int(held.h.si.opened_ns) == opened:
            del self._held[key]
        else:
            held = self._orphans.pop((*key, opened), None)
        if held is not None:
            self._release(held, h.si, h.ts_ns)
        elif self._instances.get(key) == opened:
            del self._instances[key]
            self._close(key, h.ts_ns, h.si)
        # else: its fd's next flow opened first and the sink closed this one then

    def _release(self, held: _Held, si: SockInfo | None, closed_ns: int | None) -> None:
        """Record a held flow, under a key of its own (its fd may belong to a newer flow by now)."""
        h = held.h
        if si is not None and si.rport:
            self.accepts["peer_from_close"] += 1
            client, server = (_ip(si.family, si.raddr), si.rport), (_ip(si.family, si.laddr), si.lport)
        else:
            self.accepts["peer_unknown"] += 1
            client, server = UNKNOWN_END, ("0.0.0.0", int(h.si.lport))
        key = (h.tgid, h.fd, int(h.si.opened_ns))
        self._start(key, h, client, server)
        for raw in held.records:
            self._handle(raw, key)
        self._close(key, closed_ns, si)

    def _unknown_listener(self, tgid: int, lfd: int, fd: int) -> None:
        """An accept with no address on a listener the program did not know: look the listener up
        in /proc (once) and tell the program; if it is on the port, join the accepted connection
        from here on (marked joined) or count it as missed. Never silent."""
        lkey = (tgid, lfd)
        ours = self._listeners_seen.get(lkey)
        if ours is None:
            inode = procnet.socket_inode(tgid, lfd)
            ends = procnet.tcp_ends(tgid, inode) if inode is not None else None
            port = self.options.port
            ours = bool(ends and ends[3] == procnet.LISTEN and (not port or ends[0][1] == port))
            self._listeners_seen[lkey] = ours
            if ends is not None:
                self._table(b"listeners")[ctypes.c_uint64((tgid << 32) | lfd)] = Listener(
                    lport=ends[0][1], family=ends[2], ours=int(ours))
        if not ours:
            return
        inode = procnet.socket_inode(tgid, fd)
        ends = procnet.tcp_ends(tgid, inode) if inode is not None else None
        socks = self._socks()
        skey = ctypes.c_uint64((tgid << 32) | fd)
        port = self.options.port
        if ends is None or ends[3] != procnet.ESTABLISHED or (port and ends[0][1] != port) or skey in socks:
            self.accepts["missed"] += 1
            return
        local, remote, family, _state = ends
        socks[skey] = SockInfo(family=family, is_server=1)
        self.accepts["joined_late"] += 1
        assert self.sink is not None
        self._new_socket((tgid, fd))
        self.sink.open_flow((tgid, fd), Flow(src=remote, dst=local, pid=tgid, comm=_comm(tgid),
                                             opened_ns=time.monotonic_ns(), joined_midstream=True))

    def _counter(self, name: str) -> int:
        table = self._table(name.encode())
        return int(sum(table[ctypes.c_int(0)]))

    def _report_counters(self) -> None:
        assert self.sink is not None
        lost, trunc = self._counter("lost") + self._user_lost, self._counter("truncated")
        self.sink.add_loss(lost - self._reported[0], trunc - self._reported[1])
        self._reported = (lost, trunc)

    def stop(self) -> None:
        bpf = self.bpf
        if bpf is None:
            return
        self._stop.set()
        if self._ring is not None:
            self._ring.wake()
        if self._thread:
            self._thread.join(timeout=5)
        if self._ring is not None:
            self._ring.consume()
        self._drained.set()
        self._ready.set()
        if self._worker:
            self._worker.join(timeout=60)
        self._process_queue()
        self._streams.flush(force=True)
        # flows still waiting for a CLOSE that never came: recorded, with their peer unknown
        for held in [*self._held.values(), *self._orphans.values()]:
            self._release(held, None, None)
        self._held.clear()
        self._orphans.clear()
        self._report_counters()
        if self._server_side:
            assert self.sink is not None   # the recorder's ticker has stopped: nothing else writes now
            self.sink.writer.set_meta({"accepted_without_address": dict(self.accepts),
                                       "accepted_peer_unknown": self.accepts["peer_unknown"]})
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        detach.cleanup(bpf)
        self.bpf = None
