"""TLS plaintext capture: uprobes on every libssl the targeted processes map, and on Go binaries'
crypto/tls (tls.bpf.c has probes of both kinds), joined to the eBPF recorder's TCP flows.

    tls.bpf.c (uprobes on SSL_read/_ex, SSL_write/_ex, handshake calls; syscall enters; close)
        | its own ring buffer: PLAIN (bytes an SSL call returned on a recorded socket, at their
        | stream position) / CLOSE (the socket's final positions)
        v
    TlsJoiner (capture/ebpf/tls_join.py) --(tgid, fd)--> the recorder's flow --plaintext, gaps--> FlowSink
        ^                                                                (same decoders, same redaction)
    EbpfBackend --open_flow / data / not_captured (ciphertext length) / close_flow--'

`TlsBackend` wraps the eBPF backend (`Recorder` does it, capture/record.py). The two programs share two
maps (public bcc maps, named per recorder): the TLS program copies plaintext only of the sockets the
recorder records, and marks those whose ciphertext moves inside an SSL call, whose bytes the recorder
then sends as a length only. So neither the ciphertext of a plaintext flow nor the plaintext of any
other connection (the clients on the same host, other services) crosses a ring buffer.

Sizing: plaintext is copied once, so the TLS ring only needs room for what arrives between two drains,
and the decoding must not be what drains it:

    ring (32 MiB, tls_ring_pages) --copied, GIL held: by the recorder's poller every POLL_S, and by the
        tls-drain thread at each MiB written on a CPU--> drained records (<= _RAW_MAX_BYTES)
        --the recorder's progress marks (its decode thread), or tls-poll under a backlog-->
        TlsJoiner (ready queue <= 64 MiB, decoding and storing through the sink)

Under a burst of downloads the decoding (Python: masking, HTTP/1 decoding, SQLite) falls behind the
network; the drained records and the ready queue absorb that, so the ring itself never fills unless a
burst outgrows both. Whatever is still lost (a ring shrunk on purpose, a host out of CPU for longer than
the buffers last) becomes a gap at exactly the bytes lost (tls_join.py): never a silent mis-pairing.
With light traffic no TLS thread wakes on a timer faster than once a second.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, cast

from capture import privileges
from capture.backends import RecordOptions
from capture.ebpf import detach, uprobe_multi
from capture.ebpf.goelf import GoTlsInfo
from capture.ebpf.loader import SockInfo, rename_maps, set_cgroup
from capture.ebpf.ringbuf import RingReader
from capture.ebpf.tls_join import TlsJoiner
from capture.ebpf.tlslibs import Inspector, ProcessTls, TlsFile, target_pids
from capture.errors import CaptureError, PrivilegeError
from capture.sink import FlowSink

BPF_SOURCE = Path(__file__).with_name("tls.bpf.c")
TLS_MODES = ("auto", "on", "off")
MAX_BYTES_LIMIT = 262144    # plaintext kept per SSL call (OpenSSL hands out at most 16 KiB records)
POLL_S = 0.1                 # how long the full drain thread waits before it looks again
IDLE_S = 1.0                 # the longest a TLS thread sleeps with no wake-up (light traffic: the poller drains)
RESCAN_S = 1.0               # how often processes started since the last look are inspected for TLS libraries
_PROCS_KEPT = 65536          # processes whose inspection is remembered (for the flows they leave behind)
# The program wakes the drain thread once per WAKE_BYTES written on a CPU: at download speed a
# megabyte comes in milliseconds, not in POLL_S. (With a 100 ms timer alone and the decoding in the same
# thread, four clients downloading 8 MiB files lost 800-5,000 records a run to an 8 MiB ring; with the
# drain on its own thread but still on a timer, 0-260 records a run to a 32 MiB one.)
WAKE_BYTES = 1 << 20
# Drained records waiting for the decoding: at most this much (then the ring keeps them, and loses
# what it cannot hold: a gap each). A burst of downloads is decoded late rather than lost.
_RAW_MAX_BYTES = 128 << 20
_PRESSURE_BYTES = 4 << 20   # drained and not taken: the joiner's own thread hands them on
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


def ring_pages(options: RecordOptions) -> int:
    """The TLS ring's size in pages, a power of two as the kernel requires (as asked: tests shrink it
    on purpose to see losses become gaps)."""
    return 1 << (max(1, options.tls_ring_pages) - 1).bit_length()


def render_program(options: RecordOptions, cgroup_id: int = 0, names: dict[str, str] | None = None) -> str:
    """The program text with its filters and sizes substituted, and the recorder's shared maps
    (`socks`, `tls_socks`) under the names that recorder gave them (capture/ebpf/loader.py)."""
    limit = max_bytes(options)
    defines = {"FILTER_PID": options.pid or 0, "FILTER_CGROUP": f"{cgroup_id}ULL", "MAX_BYTES": limit,
               "CHUNK": chunk_size(limit), "RINGBUF_PAGES": ring_pages(options), "SCRATCH_CPUS": _possible_cpus(),
               "SOCK_INFO_SIZE": ctypes.sizeof(SockInfo), "WAKE_BYTES": WAKE_BYTES}
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + rename_maps(BPF_SOURCE.read_text(), names or {})


def _file_key(path: str) -> tuple[int, int]:
    """(device, inode) of the file probes would attach to: each file is probed once."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise PrivilegeError(f"cannot attach uprobes to {path} ({exc.strerror})") from exc
    return st.st_dev, st.st_ino


class TlsProgram:
    """tls.bpf.c loaded, and attached (`attach`) to each file holding OpenSSL's API. Raises
    PrivilegeError when it cannot be loaded, or attached to the first file `libssl`."""

    def __init__(self, options: RecordOptions, libssl: str, cgroup_id: int = 0,
                 names: dict[str, str] | None = None) -> None:
        if lacking := privileges.missing(privileges.RECORDER + privileges.TLS):
            raise PrivilegeError(privileges.refusal("TLS capture (uprobes)", lacking,
                                                    privileges.RECORDER + privileges.TLS))
        try:
            from bcc import BPF
        except Exception as exc:  # noqa: BLE001 - bcc can fail with plain Exception
            raise PrivilegeError(f"bcc is not importable ({exc})") from exc
        self.libssl = libssl
        self.attached: dict[tuple[int, int], str] = {}   # (device, inode) -> the path it was attached by
        self._held: dict[tuple[int, int], int] = {}      # (device, inode) -> the descriptor bcc names it by
        # uprobes as uprobe_multi links (capture/ebpf/uprobe_multi.py), per file; None until the first
        # attach has tried, False where this kernel cannot (bcc's perf-event uprobes then)
        self._multi: bool | None = None
        self._links: dict[tuple[int, int], list[int]] = {}
        # records drained from the ring, in ring order; consumed only under _ring_lock (libbpf's
        # consumer is not thread-safe), by the drain thread and by the joiner when it must be current
        self._raw: list[bytes] = []
        self._raw_bytes = 0
        self._ring_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.more = threading.Event()     # set when the drain thread found records
        self._taken = threading.Event()   # set when the joiner took the drained records
        try:
            self.bpf: Any = BPF(text=render_program(options, cgroup_id, names).encode())
        except Exception as exc:  # noqa: BLE001 - compile errors are plain Exception
            raise PrivilegeError(f"cannot load the TLS program ({str(exc).splitlines()[0][:160]})") from exc
        if cgroup_id:
            set_cgroup(self.bpf, str(options.cgroup))
        try:
            self.attach(libssl)
            self.bpf[b"tls_events"].open_ring_buffer(self._on_event)
            self._ring = RingReader(self.bpf, b"tls_events")
        except Exception as exc:  # noqa: BLE001 - attach errors are plain Exception
            self._close_links()
            self.bpf.cleanup()
            self._release_all()
            raise PrivilegeError(str(exc)) from exc
        self._positions = self.bpf[b"positions"]

    def attach(self, path: str) -> bool:
        """Attach the probes to the file at `path` (once per device and inode: False when it already
        was). A function the file lacks (SSL_read_ex before OpenSSL 1.1.1) is left out; a file without
        SSL_read and SSL_write raises PrivilegeError."""
        key = _file_key(path)
        if key in self.attached:
            return False
        short = self._short_path(path, key)
        if self._multi is not False:
            groups: dict[tuple[str, bool], list[int]] = {}
            for sym, enter, ret in PROBES:
                try:
                    offset = self._offset(short, sym.encode(), None)
                except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception
                    if sym in ("SSL_read", "SSL_write"):
                        self._release(key)
                        raise PrivilegeError(f"cannot attach uprobes to {path} "
                                             f"({str(exc).splitlines()[0][:160]})") from exc
                    continue          # a function this file lacks (SSL_read_ex before OpenSSL 1.1.1)
                groups.setdefault((enter, False), []).append(offset)
                if ret:
                    groups.setdefault((ret, True), []).append(offset)
            if self._link_all(key, path, short, groups):
                self.attached[key] = path
                return True
        done: list[str] = []
        for sym, enter, ret in PROBES:
            try:
                self.bpf.attach_uprobe(name=short, sym=sym.encode(), fn_name=enter.encode())
                if ret:
                    self.bpf.attach_uretprobe(name=short, sym=sym.encode(), fn_name=ret.encode())
            except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception
                if sym in ("SSL_read", "SSL_write"):
                    for name in done:   # bcc detaches by the same (path, symbol) it attached
                        self._detach(short, name)
                    self._release(key)
                    raise PrivilegeError(f"cannot attach uprobes to {path} "
                                         f"({str(exc).splitlines()[0][:160]})") from exc
                continue
            done.append(sym)
        self.attached[key] = path
        return True

    def attach_go(self, path: str, info: GoTlsInfo) -> bool:
        """Attach the Go crypto/tls probes to the Go binary at `path` (analysed: `info`): Read and Write
        entries, each of their return instructions, the handshake's entry. Once per device and inode
        (False when it already was). A non-PIE binary's entries are configured here for every process
        that runs it; a PIE binary's per process (`add_go_process`)."""
        key = _file_key(path)
        if key in self.attached:
            return False
        assert info.write_vaddr is not None and info.read_vaddr is not None
        entries = [(info.write_vaddr, "go_write_enter"), (info.read_vaddr, "go_read_enter")]
        if info.handshake_vaddr is not None:
            entries.append((info.handshake_vaddr, "go_handshake_enter"))
        probes = entries + [(a, "go_rw_return") for a in info.read_ret_vaddrs + info.write_ret_vaddrs]
        short = self._short_path(path, key)
        linked = False
        if self._multi is not False:
            groups: dict[tuple[str, bool], list[int]] = {}
            try:
                for addr, fn in probes:
                    groups.setdefault((fn, False), []).append(self._offset(short, b"", addr))
            except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception
                self._release(key)
                raise PrivilegeError(f"cannot attach uprobes to {path} "
                                     f"({str(exc).splitlines()[0][:160]})") from exc
            linked = self._link_all(key, path, short, groups)
        done: list[int] = []
        for addr, fn in [] if linked else probes:
            try:
                self.bpf.attach_uprobe(name=short, addr=addr, fn_name=fn.encode())
            except Exception as exc:  # noqa: BLE001 - bcc raises plain Exception
                for a in done:
                    try:
                        self.bpf.detach_uprobe(name=short, addr=a)
                    except Exception:  # noqa: BLE001, S110 - detached already
                        pass
                self._release(key)
                raise PrivilegeError(f"cannot attach uprobes to {path} at {addr:#x} "
                                     f"({str(exc).splitlines()[0][:160]})") from exc
            done.append(addr)
        if not info.pie:
            conf = self._go_conf(info, 0)
            table = self.bpf[b"go_bins"]
            for addr, _fn in entries:
                table[ctypes.c_uint64(addr)] = conf
        self.attached[key] = path
        return True

    def add_go_process(self, pid: int, info: GoTlsInfo, bias: int) -> None:
        """Process `pid` runs the Go binary `info` describes, loaded `bias` bytes from its link address."""
        self.bpf[b"go_procs"][ctypes.c_uint32(pid)] = self._go_conf(info, bias)

    def _go_conf(self, info: GoTlsInfo, bias: int) -> Any:
        o = info.offsets
        assert o is not None
        itab = info.tcpconn_itab_vaddr + bias if info.tcpconn_itab_vaddr is not None else 0
        leaf = self.bpf[b"go_bins"].Leaf()
        leaf.itab, leaf.conn, leaf.data = itab, o.tls_conn_conn, o.iface_data
        leaf.fd, leaf.sysfd = o.tcpconn_conn_fd, o.netfd_pfd + o.fd_sysfd
        return leaf

    def _short_path(self, path: str, key: tuple[int, int]) -> bytes:
        """The name bcc is given for the file at `path`: /proc/self/fd/N of a descriptor held open until
        cleanup. Without CAP_SYS_ADMIN bcc adds uprobes through tracefs' uprobe_events, under an event
        name made from the path and limited to 64 bytes by the kernel: a library inside a container,
        /proc/PID/root/usr/lib/x86_64-linux-gnu/libssl.so.3, is already too long ("Event name is too
        long", EINVAL). The descriptor names the same inode, in a name that is always short."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise PrivilegeError(f"cannot attach uprobes to {path} ({exc.strerror})") from exc
        self._held[key] = fd
        return f"/proc/self/fd/{fd}".encode()

    def _release(self, key: tuple[int, int]) -> None:
        fd = self._held.pop(key, None)
        if fd is not None:
            os.close(fd)

    def _release_all(self) -> None:
        for key in list(self._held):
            self._release(key)

    @staticmethod
    def _offset(short: bytes, sym: bytes, addr: int | None) -> int:
        """Where in the file a probe of `sym` (or of virtual address `addr`) goes, as bcc reckons it."""
        from bcc import BPF
        return int(BPF._check_path_symbol(short, sym, addr, -1)[1])

    def _link_all(self, key: tuple[int, int], path: str, short: bytes,
                  groups: dict[tuple[str, bool], list[int]]) -> bool:
        """Attach each (program, return probe?) group of offsets as one uprobe_multi link. False when
        this kernel cannot (the first try tells; bcc's uprobes then, for this file and the rest)."""
        made: list[int] = []
        try:
            for (fn, ret), offsets in groups.items():
                made.append(uprobe_multi.create(uprobe_multi.load(self.bpf, fn), short, offsets, ret))
        except uprobe_multi.LinkUnsupported as exc:
            uprobe_multi.close_all(made)
            if self._multi:
                self._release(key)
                raise PrivilegeError(f"cannot attach uprobes to {path} ({exc})") from exc
            self._multi = False
            for fn, _ret in groups:        # loaded for links: bcc loads them again for perf events
                loaded = self.bpf.funcs.pop(fn.encode(), None)
                if loaded is not None:
                    os.close(loaded.fd)
            return False
        self._multi = True
        self._links[key] = made
        return True

    def _close_links(self) -> None:
        links = [fd for fds in self._links.values() for fd in fds]
        self._links.clear()
        uprobe_multi.close_all(links)

    def _detach(self, short: bytes, sym: str) -> None:
        for how in (self.bpf.detach_uprobe, self.bpf.detach_uretprobe):
            try:
                how(name=short, sym=sym.encode())
            except Exception:  # noqa: BLE001, S110 - not attached that way (SSL_free has no return probe)
                pass

    def _on_event(self, ctx: object, data: int, size: int) -> int:
        self._raw.append(ctypes.string_at(data, size))
        self._raw_bytes += size
        return 0     # an int, always (bcc's wrapper makes anything else costly)

    def _consume(self) -> int:
        """Move the ring's records into memory, unless _RAW_MAX_BYTES wait there already (then the
        ring keeps them). Returns how many came. Called with _ring_lock held."""
        if self._raw_bytes >= _RAW_MAX_BYTES:
            return 0
        before = len(self._raw)
        self._ring.consume()          # with the GIL held: see capture/ebpf/ringbuf.py
        return len(self._raw) - before

    def consume(self) -> list[bytes]:
        """Every record drained so far and everything in the ring now, in ring order."""
        with self._ring_lock:
            self._consume()
            out, self._raw, self._raw_bytes = self._raw, [], 0
        self._taken.set()
        return out

    def start_draining(self) -> None:
        """Drain the ring from a thread of its own (see the module docstring)."""
        self._thread = threading.Thread(target=self._drain_loop, name="tls-drain", daemon=True)
        self._thread.start()

    def _drain_loop(self) -> None:
        """Drain at each wake-up (a MiB written on a CPU); the recorder's poller drains the rest on its
        timer (drain_now), so this thread sleeps while traffic is light."""
        while not self._stop.is_set():
            if self._raw_bytes >= _RAW_MAX_BYTES:   # full: until the joiner takes what is drained
                self._taken.wait(POLL_S)
                self._taken.clear()
                continue
            self._ring.wait(IDLE_S)
            self.drain_now()

    def drain_now(self) -> None:
        """Copy what the ring holds into memory (any thread); the joiner's thread is woken only when a
        backlog builds (_PRESSURE_BYTES): otherwise the recorder's progress marks hand it on."""
        if self._raw_bytes >= _RAW_MAX_BYTES:
            return
        with self._ring_lock:
            self._consume()
        if self._raw_bytes >= _PRESSURE_BYTES:
            self.more.set()

    def pending(self) -> bool:
        """Records drained and not taken yet."""
        return bool(self._raw)

    def positions(self, fdkey: tuple[int, int]) -> tuple[int, int] | None:
        """(plaintext bytes read, written) of a socket still open, as the kernel counted them."""
        try:
            p = self._positions[ctypes.c_uint64((fdkey[0] << 32) | fdkey[1])]
        except KeyError:
            return None
        return int(p.rd), int(p.wr)

    def counters(self) -> tuple[int, int, int]:
        """Records lost to a full ring, calls truncated at --max-bytes, calls whose socket is unknown
        (an SSL* over memory buffers; a Go tls.Conn over a net.Conn other than a *net.TCPConn)."""
        t = self.bpf[b"counters"]
        lost, trunc, unjoined, go_other = (int(sum(t[ctypes.c_int(i)])) for i in range(4))
        return lost, trunc, unjoined + go_other

    def cleanup(self) -> None:
        self._stop.set()
        self._ring.wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._ring.close()
        self._close_links()
        detach.cleanup(self.bpf)
        self._release_all()


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


def _library(path: str, inode: int, kind: str, version: str, attached: bool, why_not: str) -> dict[str, object]:
    """One entry of status["libraries"]: a file found, whether it is probed, the processes mapping it."""
    return {"path": path, "inode": inode, "kind": kind, "version": version, "attached": attached,
            "why_not": why_not, "pids": [], "processes": 0}


class TlsBackend:
    """The eBPF backend with TLS plaintext capture beside it (see the module docstring).

    `options.tls`: "auto" (default: on where it works, otherwise recorded without it and
    `status["reason"]` says why), "on" (fail when it cannot work), "off"."""

    def __init__(self, inner: Any, options: RecordOptions) -> None:   # the eBPF backend, and what it grows
        if options.tls not in TLS_MODES:
            raise CaptureError(f"--tls must be one of {', '.join(TLS_MODES)}, not {options.tls!r}")
        self.inner = inner
        self.options = options
        self.status: dict[str, object] = {"capture": "off", "reason": "--tls off"} if options.tls == "off" else {}
        self.joiner: TlsJoiner | None = None
        self.flow_report: object = []     # after stop: [flow, plaintext|encrypted, reason, ciphertext bytes]
        self.libssl: str | None = None
        self.off_reason = "TLS capture is off"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported = (0, 0)
        # discovery of TLS libraries per process (capture/ebpf/tlslibs.py)
        self.inspector = Inspector()
        self.libraries: dict[tuple[int, int], dict[str, object]] = {}   # per file, as status["libraries"]
        self._procs: dict[int, ProcessTls] = {}       # the last inspection of each process
        self._seen: set[int] = set()
        self._asked: dict[int, float] = {}            # processes that opened a flow -> when inspected
        self._due: set[int] = set()                   # ... and opened one since: inspected at the next look
        self._asked_lock = threading.Lock()
        self._ask = threading.Event()
        self._discovery: threading.Thread | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def describe(self) -> dict[str, object]:
        return cast(dict[str, object], self.inner.describe()) | {"tls": dict(self.status)}

    def why_unreadable(self, pid: int, program: TlsProgram | None) -> str:
        """Why a TLS flow of process `pid` was recorded as ciphertext: what its process holds."""
        if program is None:
            return f"encrypted: {self.off_reason}"
        proc = self._procs.get(pid)
        if proc is None or proc.error:         # not inspected yet, or it could not be: look now
            fresh = self.inspector.process(pid)
            if proc is None or not fresh.error:
                proc = fresh
        if proc.error:
            return f"encrypted: no plaintext for this connection, and its process cannot be inspected ({proc.error})"
        named = [f for f in proc.files if not f.readable]
        probed = [f.path for f in proc.files if f.readable and self.libraries.get(f.key, {}).get("attached")]
        if named:
            also = (f" (it also maps {', '.join(probed)}, probed, which this connection's TLS did not go through)"
                    if probed else "")
            return "encrypted: " + "; ".join(f.why_not for f in named) + also
        if probed:
            return (f"encrypted: the process maps {', '.join(probed)}, probed, but this connection's TLS does not "
                    "go through it on this socket (another TLS library linked in, or memory BIOs whose handshake write was "
                    "not seen: a connection open before the recorder started)")
        return ("encrypted: no TLS library this tool can probe in the process (no libssl mapped, no OpenSSL API "
                "exported; see `shadowtest record --list-tls --pid PID`)")

    # ---- discovery: which files to probe ----------------------------------------------------------
    def _targets(self) -> list[int]:
        """The processes the recording targets: --pid, the --cgroup's, else every process (any may open
        the recorded port later, so not only those that hold it now)."""
        return target_pids(self.options.pid, self.options.cgroup)

    def _flow_opened(self, pid: int) -> None:
        """A flow of `pid` opened: inspect it again (it may have exec'd or loaded a TLS library since), at
        once, or at the next look if it was inspected less than RESCAN_S ago."""
        if pid in self._due:
            return
        with self._asked_lock:
            self._due.add(pid)
        if time.monotonic() - self._asked.get(pid, 0.0) >= RESCAN_S:
            self._ask.set()      # else the look after RESCAN_S takes it

    def _discover(self, program: TlsProgram) -> None:
        """Inspect new processes every RESCAN_S, and those whose flows open: at once, or at the next look
        when inspected less than RESCAN_S ago. A process that opened no flow since its last look is not
        read again (the recorded service was re-read every second: ~1.5 ms of its /proc/PID/maps each time)."""
        while not self._stop.is_set():
            self._ask.wait(RESCAN_S)
            self._ask.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            with self._asked_lock:
                again = [p for p in self._due if now - self._asked.get(p, 0.0) >= RESCAN_S]
                self._due.difference_update(again)
                for p in again:
                    self._asked[p] = now
                if len(self._asked) > _PROCS_KEPT:
                    self._asked.clear()
            try:
                fresh = [p for p in self._targets() if p not in self._seen]
            except OSError:
                fresh = []
            self._inspect(program, sorted(set(again) | set(fresh)))

    def _inspect(self, program: TlsProgram, pids: list[int]) -> None:
        me = os.getpid()
        for pid in pids:
            if pid == me:
                continue
            proc = self.inspector.process(pid)
            self._seen.add(pid)
            if len(self._procs) >= _PROCS_KEPT:
                self._procs.pop(next(iter(self._procs)))
            self._procs[pid] = proc
            for f in proc.files:
                self._note_file(program, f, pid)
        self.status["libraries"] = list(self.libraries.values())

    def _note_file(self, program: TlsProgram, f: TlsFile, pid: int) -> None:
        entry = self.libraries.get(f.key)
        if entry is None:
            entry = self.libraries[f.key] = _library(f.path, f.ino, f.kind, f.version, False, f.why_not)
            if f.readable:
                try:
                    if f.go is not None:
                        program.attach_go(f.attach_path, f.go)
                    else:
                        program.attach(f.attach_path)
                    entry["attached"] = True
                except PrivilegeError as exc:
                    entry["why_not"] = str(exc)
        if f.go is not None and entry["attached"]:
            program.add_go_process(pid, f.go, f.map_start - f.go.link_base if f.go.pie else 0)
        pids = cast(list[int], entry["pids"])
        if pid not in pids:
            entry["processes"] = cast(int, entry["processes"]) + 1
            if len(pids) < 8:
                pids.append(pid)

    def start(self, sink: FlowSink) -> None:
        libssl = self.libssl = find_libssl()
        j = self.joiner = TlsJoiner(sink, self.options.side == "server", max_bytes(self.options),
                                    self.why_unreadable, self._flow_opened)
        self.inner.start(cast(FlowSink, j))
        if self.options.tls == "off":
            self.off_reason = "TLS capture is off (--tls off)"
            return
        try:
            if libssl is None:
                raise PrivilegeError("no system libssl.so.3 found (ldconfig -p)")
            cgroup_id = int(getattr(self.inner, "cgroup_id", 0) or 0)
            program = TlsProgram(self.options, libssl, cgroup_id, getattr(self.inner, "map_names", None))
        except PrivilegeError as exc:
            self.status = {"capture": "off", "reason": str(exc)}
            self.off_reason = f"TLS capture is off ({exc})"
            if self.options.tls == "on":
                self.inner.stop()
                raise PrivilegeError(f"--tls on: {exc}") from exc
            return
        self.status = {"capture": "on", "libssl": libssl, "version": libssl_version(libssl)}
        st = os.stat(libssl)
        self.libraries[(st.st_dev, st.st_ino)] = _library(libssl, st.st_ino, "openssl", str(self.status["version"]),
                                                          True, "")
        self._inspect(program, self._targets())      # what runs now; then new processes as they come
        self._discovery = threading.Thread(target=self._discover, args=(program,), name="tls-discovery", daemon=True)
        self._discovery.start()
        with j._lock:
            j.program = program
        program.start_draining()
        self.inner.extra_drain = program.drain_now     # the recorder's poller drains this ring on its timer
        self._thread = threading.Thread(target=self._poll, args=(program,), name="tls-poll", daemon=True)
        self._thread.start()

    def _poll(self, program: TlsProgram) -> None:
        """Hand the drained records on when the drain thread found some; once a second regardless
        (orphans and calls cut short expire, counters go to the sink)."""
        last = time.monotonic()
        while not self._stop.is_set():
            program.more.wait(IDLE_S)
            program.more.clear()
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
        self._ask.set()
        if j is not None and j.program is not None:
            j.program.more.set()      # the poll thread: now, not at the end of its idle second
        for thread in (self._thread, self._discovery):
            if thread is not None:
                thread.join(timeout=5)
        try:
            self.inner.stop()
        finally:
            if j is not None:
                j.finish_all(j.program.positions if j.program is not None else None)
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
