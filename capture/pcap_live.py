"""The `pcap` backend: live packet capture on an interface (root or CAP_NET_RAW), own reassembly.

    AF_PACKET socket on --interface + kernel BPF filter "tcp port P" (compiled by scapy/libpcap)
        --> packets.parse --> Reassembler --> FlowSink

Outgoing copies are dropped (on `lo` every packet is seen leaving and arriving). Packets carry no
process: flows have no pid/comm. Timestamps are CLOCK_MONOTONIC at receipt, like the eBPF backend.

One thread reads and reassembles; only it touches the Reassembler, finish() included. stop() asks it
to end: it reads what the kernel already queued for at most `_DRAIN_S`, finishes, and returns, so a
SIGINT under load ends the capture within `_STOP_S` with everything fed so far delivered to the sink.
A segment the reassembler cannot take is counted in `errors` (first one in `problems`), never fatal.
"""

from __future__ import annotations

import select
import socket
import threading
import time

from capture.backends import RecordOptions
from capture.errors import CaptureError, PrivilegeError
from capture.packets import parse
from capture.reassembly import Reassembler
from capture.sink import FlowSink

_ETH_P_ALL = 0x0003
_PACKET_OUTGOING = 4
_SNAP = 1 << 18       # bytes kept of each frame (the kernel filter's snap length, and what recv reads)
_BPF_RET_K = 0x06
_RCVBUF = 64 << 20    # kernel receive queue for captured frames
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)   # Linux; Python does not always name it
_BATCH = 512          # frames read per wake-up (non-blocking) before the stop flag is checked again
_DRAIN_S = 0.5        # after stop(): read what is already queued for at most this long
_STOP_S = 1.5         # stop() waits this long for the capture thread, then finishes without it


def _drain(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        while True:
            sock.recv(1 << 18)
    except BlockingIOError:
        pass
    finally:
        sock.setblocking(True)


def _big_buffer(sock: socket.socket) -> None:
    """A kernel queue that absorbs bursts (1 MB messages arrive on lo faster than Python reads frames):
    _RCVBUF with the privilege the backend already needs (beyond net.core.rmem_max), else what is allowed."""
    for option in (_SO_RCVBUFFORCE, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, _RCVBUF)
            return
        except OSError:
            continue


def _attach_filter(sock: socket.socket, expr: str, iface: str) -> None:
    """scapy's attach_filter, with the snap length raised from scapy's 65535 to _SNAP: on `lo` (MTU
    65536) a full segment is a 65550-byte frame, and the last 15 bytes of every one were cut off,
    a gap per segment under load."""
    from scapy.arch.common import compile_filter, free_filter  # heavy: only when used
    from scapy.data import SO_ATTACH_FILTER
    from scapy.libs.structures import sock_fprog

    bp = compile_filter(expr, iface)
    try:
        for i in range(bp.bf_len):
            ins = bp.bf_insns[i]
            if ins.code == _BPF_RET_K and ins.k > 0:     # "accept, keeping k bytes"
                ins.k = max(ins.k, _SNAP)
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, sock_fprog(bp.bf_len, bp.bf_insns))
    finally:
        free_filter(bp)


class PcapBackend:
    def __init__(self, options: RecordOptions) -> None:
        self.options = options
        self.sock: socket.socket | None = None
        self.reasm: Reassembler | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._finished = threading.Lock()   # finish() runs once, by whichever side gets here first
        self._done = False
        self._deadline = float("inf")       # set by stop(): reading ends then, whatever is still queued
        self.errors = 0
        self.problems: list[str] = []

    def describe(self) -> dict[str, object]:
        return {"interface": self.options.interface, "filter": self._filter()}

    def _filter(self) -> str:
        return f"tcp port {self.options.port}" if self.options.port else "tcp"

    def start(self, sink: FlowSink) -> None:
        try:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        except PermissionError as exc:
            raise PrivilegeError("the pcap backend needs root or CAP_NET_RAW: run as root, or use "
                                 "--backend proxy (unprivileged)") from exc
        try:
            sock.bind((self.options.interface, 0))
            _attach_filter(sock, self._filter(), self.options.interface)
        except OSError as exc:
            sock.close()
            raise CaptureError(f"cannot capture on interface {self.options.interface!r}: {exc.strerror}; "
                               "list interfaces with `ip link`") from exc
        _big_buffer(sock)
        _drain(sock)   # frames queued before the filter was attached are unfiltered: drop them
        self.sock = sock
        port = self.options.port
        self.reasm = Reassembler(sink, {port} if port else None,
                                 (lambda s: port in (s.src[1], s.dst[1])) if port else None)
        self._thread = threading.Thread(target=self._run, name="pcap-capture", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self.sock is not None
        sock = self.sock
        try:
            sock.setblocking(False)
            while not self._stop.is_set():
                ready, _, _ = select.select([sock], [], [], 0.1)
                if ready:
                    self._read_batch(sock)
            while self._read_batch(sock) == _BATCH:   # what the kernel queued before the stop
                pass
        except OSError as exc:   # the socket closed under a thread that stop() stopped waiting for
            self._problem(f"capture stopped reading: {exc}")
        finally:
            try:
                self._finish()
            except Exception as exc:  # noqa: BLE001 - the sink may be closed already (see stop())
                self._problem(f"could not deliver the last held segments: {exc}")

    def _read_batch(self, sock: socket.socket) -> int:
        """Read and feed up to _BATCH queued frames; returns how many were read (fewer: the queue is
        empty, or the time stop() allows for draining it has run out)."""
        assert self.reasm is not None
        n = 0
        for n in range(1, _BATCH + 1):   # noqa: B007 - n is the count read
            if time.monotonic() > self._deadline:
                return n - 1
            try:
                frame, addr = sock.recvfrom(_SNAP)
            except BlockingIOError:
                return n - 1
            if addr[2] == _PACKET_OUTGOING:
                continue
            seg = parse(1, frame)      # lo and Ethernet devices both deliver Ethernet framing
            if seg is None:
                continue
            try:
                self.reasm.feed(seg, time.monotonic_ns())
            except Exception as exc:  # noqa: BLE001 - one bad segment must not end the capture
                self._problem(f"a segment could not be reassembled: {type(exc).__name__}: {exc}")
        return n

    def _problem(self, text: str) -> None:
        self.errors += 1
        if len(self.problems) < 20:
            self.problems.append(text)

    def _finish(self) -> None:
        with self._finished:
            if not self._done and self.reasm is not None:
                self._done = True
                self.reasm.finish()

    def stop(self) -> None:
        if self.sock is None:
            return
        self._deadline = time.monotonic() + _DRAIN_S
        self._stop.set()
        if self._thread:
            self._thread.join(_STOP_S)
        if self._thread is None or not self._thread.is_alive():
            self._finish()
        # else: the thread is inside one segment still; it finishes itself (the reassembler is locked)
        self.sock.close()
        self.sock = None
