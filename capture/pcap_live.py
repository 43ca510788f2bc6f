"""The `pcap` backend: live packet capture on an interface (root or CAP_NET_RAW), own reassembly.

    AF_PACKET socket on --interface + kernel BPF filter "tcp port P" (compiled by scapy/libpcap)
        --> packets.parse --> Reassembler --> FlowSink

Outgoing copies are dropped (on `lo` every packet is seen leaving and arriving). Packets carry no
process: flows have no pid/comm. Timestamps are CLOCK_MONOTONIC at receipt, like the eBPF backend.
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


def _drain(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        while True:
            sock.recv(1 << 18)
    except BlockingIOError:
        pass
    finally:
        sock.setblocking(True)


class PcapBackend:
    def __init__(self, options: RecordOptions) -> None:
        self.options = options
        self.sock: socket.socket | None = None
        self.reasm: Reassembler | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
            from scapy.arch.linux import attach_filter  # heavy: only when used

            attach_filter(sock, self._filter(), self.options.interface)
        except OSError as exc:
            sock.close()
            raise CaptureError(f"cannot capture on interface {self.options.interface!r}: {exc.strerror}; "
                               "list interfaces with `ip link`") from exc
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        _drain(sock)   # frames queued before the filter was attached are unfiltered: drop them
        self.sock = sock
        port = self.options.port
        self.reasm = Reassembler(sink, {port} if port else None,
                                 (lambda s: port in (s.src[1], s.dst[1])) if port else None)
        self._thread = threading.Thread(target=self._run, name="pcap-capture", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self.sock is not None and self.reasm is not None
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if not ready:
                continue
            frame, addr = self.sock.recvfrom(1 << 18)
            if addr[2] == _PACKET_OUTGOING:
                continue
            seg = parse(1, frame)      # lo and Ethernet devices both deliver Ethernet framing
            if seg is not None:
                self.reasm.feed(seg, time.monotonic_ns())

    def stop(self) -> None:
        if self.sock is None:
            return
        self._stop.set()
        if self._thread:
            self._thread.join(5)
        if self.reasm:
            self.reasm.finish()
        self.sock.close()
        self.sock = None
