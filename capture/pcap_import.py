"""`shadowtest import`: a tcpdump/Wireshark capture (pcap or pcapng) -> a recording.

    pcapfile.read_packets (own pcap/pcapng framing, 1 MiB reads)
        --> packets.parse (own header parsing) --> Reassembler (own TCP reassembly)
        --> FlowSink (chunks, decoded calls, redaction) --> RecordingWriter

Timestamps are the capture's own (wall clock, nanoseconds): meta.clock = "capture-wall".
A file cut short or damaged mid-way is imported up to the damage; `problems` says where it stopped
(and meta.import_problems, so the recording itself says it is partial). With `strict` (the CLI without
--salvage) such an import writes nothing. The recording appears whole or not at all (capture.output):
an import that fails leaves no file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from capture.errors import PcapError
from capture.output import atomic_output
from capture.packets import parse
from capture.pcapfile import read_packets
from capture.reassembly import Reassembler, ReassemblyStats
from capture.recording import RecordingWriter
from capture.redact import Redactor
from capture.sink import FlowSink, SinkStats

__all__ = ["ImportResult", "import_capture", "read_packets"]


@dataclass
class ImportResult:
    packets: int = 0
    reassembly: ReassemblyStats = field(default_factory=ReassemblyStats)
    sink: SinkStats = field(default_factory=SinkStats)
    problems: list[str] = field(default_factory=list)

    @property
    def all_problems(self) -> list[str]:
        """The import's problems, then the first 20 of the reassembly's (what `problems` holds in as_dict)."""
        return self.problems + self.reassembly.problems[:20]

    def as_dict(self) -> dict[str, object]:
        return {"packets": self.packets, **asdict(self.reassembly), **self.sink.as_dict(),
                "problems": self.all_problems}


_MAGICS = {b"\xd4\xc3\xb2\xa1", b"\xa1\xb2\xc3\xd4", b"\x4d\x3c\xb2\xa1", b"\xa1\xb2\x3c\x4d",
           b"\x0a\x0d\x0d\x0a"}


def _check_magic(path: str) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except FileNotFoundError as exc:
        raise PcapError(f"{path}: no such capture file") from exc
    except OSError as exc:
        raise PcapError(f"cannot read {path}: {exc.strerror}") from exc
    if head not in _MAGICS:
        raise PcapError(f"{path} is not a pcap or pcapng file (starts with {head!r}); "
                        "write captures with tcpdump -w or save them from Wireshark as pcapng")


def import_capture(path: str, output: str, *, port: int | None = None, redactor: Redactor | None = None,
                   overwrite: bool = False, strict: bool = False,
                   progress: Callable[[int, int], None] | None = None) -> ImportResult:
    """Import `path` into a new recording `output`.

    Args:
        port: keep only connections with this port (and treat it as the service side).
        redactor: rules applied to the imported calls and chunks, on each flow's reassembled stream
            (default: the default credential rules; `Redactor([])` for none).
        strict: a damaged (cut, corrupt) capture is a PcapError and nothing is written.
        progress: called with (bytes of `path` read so far, its size), every 4,096 packets.

    Raises PcapError (unreadable file, or damaged with `strict`) or RecordingError (output). Otherwise
    a damaged capture is imported up to the damage and the result's `problems` say so (the recording's
    meta too). Nothing is left at `output` when it raises.
    """
    _check_magic(path)   # before creating the output: a wrong input leaves nothing behind
    with atomic_output(output, overwrite=overwrite) as tmp:
        result = _import_into(path, str(tmp), port, redactor, progress)
        if result.problems and not result.packets:     # nothing before the damage: nothing to salvage
            raise PcapError(f"{path} is damaged: {result.problems[0]}; no packet before the damage, nothing "
                            f"written to {output}")
        if strict and result.problems:
            raise PcapError(f"{path} is damaged: {result.problems[0]}; nothing written to {output}: pass "
                            f"--salvage to keep the {result.packets} packets before the damage (the recording "
                            "then says it is partial)")
    return result


def _import_into(path: str, output: str, port: int | None, redactor: Redactor | None,
                 progress: Callable[[int, int], None] | None = None) -> ImportResult:
    result = ImportResult()
    accept = (lambda s: port in (s.src[1], s.dst[1])) if port else None
    writer = RecordingWriter(output, meta={"clock": "capture-wall", "source": os.path.basename(path), "backend": "import"})
    sink = FlowSink(writer, redactor if redactor is not None else Redactor())
    reasm = Reassembler(sink, {port} if port else None, accept)
    first_ts: int | None = None
    count, feed = 0, reasm.feed
    try:
        for linktype, ts, frame in read_packets(path, result.problems, progress):
            if not count:
                first_ts = ts                           # the first packet's time starts the recording
            count += 1
            seg = parse(linktype, frame)
            if seg is not None:
                feed(seg, ts)
    finally:
        result.packets = count
        result.reassembly = reasm.finish()
        result.sink = sink.close(meta={"started_wall_ns": first_ts, "started_mono_ns": first_ts,
                                       "import_problems": result.problems,
                                       "gaps": result.reassembly.gaps, "gap_bytes": result.reassembly.gap_bytes,
                                       "retransmitted_segments": result.reassembly.retransmitted})
        writer.close()
    return result
