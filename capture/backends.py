"""Capture backends behind one small interface, registered by name.

    ebpf   syscall tracepoints through bcc (root): outside the request path, nothing to reconfigure
    pcap   live capture on an interface with scapy (root or CAP_NET_RAW): packets, own reassembly
    proxy  unprivileged: a local TCP proxy IN the request path (clients must connect to it)

A backend pushes flows and bytes into a `FlowSink`; `Recorder` (capture/record.py) owns the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from capture.errors import CaptureError
from wire.registry import Registry

if TYPE_CHECKING:   # the sink pulls in the decoders: not needed to list the backends (the CLI's --backend)
    from capture.sink import FlowSink


@dataclass
class RecordOptions:
    """What to record and where. `port` is the service port (server side by default)."""

    output: str
    backend: str = "ebpf"
    port: int = 0
    pid: int | None = None
    cgroup: str | None = None
    side: str = "server"               # server | client: which end's syscalls (eBPF)
    max_bytes: int = 8 << 20           # payload bytes kept per syscall (eBPF): a 4 MiB message and its framing
    interface: str = "lo"              # pcap
    listen_port: int = 0               # proxy: where clients connect (0 = any free port)
    upstream_host: str = "127.0.0.1"   # proxy: where the service is
    redact: list[str] = field(default_factory=list)   # user rules, e.g. "header:x-session"
    default_redaction: bool = True
    overwrite: bool = False
    ring_pages: int = 8192             # eBPF ring buffer size in pages (32 MiB: absorbs bursts)
    decode: str = "live"               # live | at-stop | later: decode calls while recording, at stop, or by --finish
    tls: str = "auto"                  # auto | on | off: TLS plaintext from uprobes on the system libssl (eBPF)
    tls_ring_pages: int = 8192         # the TLS program's ring buffer in pages (32 MiB; see capture/ebpf/tls.py)
    sample_pct: float = 100.0          # --sample: share of connections kept, whole (capture/sample.py)
    sample_seed: int = 0
    max_file_mb: float | None = None   # --max-file-mb: stop writing (and recording) at this file size
    rotate_mb: float | None = None     # --rotate-mb / --rotate-s: output is a directory of numbered files
    rotate_s: float | None = None      #   (capture/rotate.py)
    ring_s: float | None = None        # --ring: flight recorder, output is a directory of dumps (capture/ring.py)
    ring_mb: float | None = None       # --ring-mb: and the ring's files hold at most this much
    trigger_listen: str | None = None  # --trigger-listen HOST:PORT: Alertmanager webhook -> a dump
    trigger_min_interval_s: float = 10.0
    max_cpu_pct: float | None = None   # --max-cpu-pct: above it, new connections are shed (whole) until below


class Backend(Protocol):
    def start(self, sink: FlowSink) -> None:
        """Begin delivering flows and bytes to `sink`. Raises PrivilegeError when this host cannot."""

    def stop(self) -> None:
        """Stop and deliver what is still buffered; idempotent."""

    def describe(self) -> dict[str, object]:
        """Filters and settings, stored in the recording's meta."""


BACKENDS: Registry[str, Callable[[RecordOptions], Backend]] = Registry("capture backend", {
    "ebpf": "capture.ebpf.loader:EbpfBackend",   # imported only when used: bcc and scapy are heavy
    "pcap": "capture.pcap_live:PcapBackend",
    "proxy": "capture.proxy:ProxyBackend",
}, error=CaptureError)


def create(options: RecordOptions) -> Backend:
    return BACKENDS.get(options.backend)(options)
