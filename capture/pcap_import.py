"""`shadowtest import`: a tcpdump/Wireshark capture (pcap or pcapng) -> a recording.

    RawPcapReader / RawPcapNgReader (scapy: framing only, no dissection)
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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Protocol, cast

from capture.errors import PcapError
from capture.output import atomic_output
from capture.packets import parse
from capture.reassembly import Reassembler, ReassemblyStats
from capture.recording import RecordingWriter
from capture.redact import Redactor
from capture.sink import FlowSink, SinkStats

_SNAP = 1 << 18


class _PcapMeta(Protocol):
    """scapy's RawPcapReader.PacketMetadata (a namedtuple: sec, usec, wirelen, caplen)."""

    sec: int
    usec: int


class _PcapNgMeta(Protocol):
    """scapy's RawPcapNgReader.PacketMetadata (namedtuple PacketMetadataNg)."""

    linktype: int
    tshigh: int
    tslow: int
    tsresol: int


class _PcapFile(Protocol):
    """What is read from either scapy reader: its link type and its open file."""

    linktype: int
    f: IO[bytes]


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


def read_packets(path: str, problems: list[str]) -> Iterator[tuple[int, int, bytes]]:
    """(linktype, timestamp ns, frame bytes) for each packet; stops at damage, noting it in `problems`.

    Raises PcapError when the file is missing or not a pcap/pcapng at all."""
    from scapy.utils import RawPcapReader  # heavy: imported when used
    try:
        reader = RawPcapReader(path)
    except FileNotFoundError as exc:
        raise PcapError(f"{path}: no such capture file") from exc
    except Exception as exc:  # noqa: BLE001 - scapy raises Scapy_Exception for a bad magic
        raise PcapError(f"{path} is not a pcap or pcapng file ({exc}); export it from Wireshark as pcapng") from exc
    count = 0
    start = _track_record_starts(reader)
    try:
        while True:
            start[0] = _tell(reader)
            try:
                data, meta = reader._read_packet(size=_SNAP)   # the public one caps frames at 1500 bytes
            except EOFError:
                # scapy reads a cut-off last record (pcap header, pcapng block) as a clean EOF: a record
                # that began before the end of the file and did not come back whole is a truncation
                if 0 <= start[0] < os.path.getsize(path):
                    problems.append(f"the file ends inside a record after {count} whole packets "
                                    f"(truncated capture); imported the {count} packets before it")
                break
            if len(data) < getattr(meta, "caplen", 0):
                problems.append(f"the file ends inside packet {count + 1} (truncated capture); "
                                f"imported the {count} whole packets before it")
                return
            count += 1
            yield _stamp(reader, meta, data)
    except Exception as exc:  # noqa: BLE001 - damaged blocks surface as assorted scapy/struct errors
        problems.append(f"stopped at packet {count + 1}: damaged data ({exc}); imported what came before")
    finally:
        reader.close()
    if _truncated_tail(path, reader) and not problems:
        problems.append(f"the file ends inside a packet after {count} whole packets (truncated capture)")


def _tell(reader: object) -> int:
    try:
        return int(cast(_PcapFile, reader).f.tell())
    except (ValueError, OSError, AttributeError):
        return -1


def _track_record_starts(reader: object) -> list[int]:
    """[offset where the record being read began]: for pcapng, updated at every block (one packet read
    may step over interface and statistics blocks first); for pcap, set by the caller per packet."""
    start = [-1]
    block = getattr(reader, "_read_block", None)
    if block is not None:
        def read_block(*args: object, **kwargs: object) -> object:
            start[0] = _tell(reader)
            return block(*args, **kwargs)

        reader._read_block = read_block   # type: ignore[attr-defined]  # scapy's per-block hook
    return start


def _stamp(reader: object, meta: object, data: bytes) -> tuple[int, int, bytes]:
    # scapy's readers return namedtuples built at run time: these casts are the boundary to them
    if hasattr(meta, "tshigh"):
        ng = cast(_PcapNgMeta, meta)
        units = (ng.tshigh << 32) | ng.tslow
        return ng.linktype, units * 1_000_000_000 // ng.tsresol, data
    scale = 1 if getattr(reader, "nano", False) else 1000
    pcap = cast(_PcapMeta, meta)
    return cast(_PcapFile, reader).linktype, pcap.sec * 1_000_000_000 + pcap.usec * scale, data


def _truncated_tail(path: str, reader: object) -> bool:
    """scapy reports a cut-off last record as a clean EOF; compare positions to tell them apart."""
    try:
        pos = cast(_PcapFile, reader).f.tell()
    except (ValueError, OSError, AttributeError):
        return False
    return 0 < pos < os.path.getsize(path)


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
                   overwrite: bool = False, strict: bool = False) -> ImportResult:
    """Import `path` into a new recording `output`.

    Args:
        port: keep only connections with this port (and treat it as the service side).
        redactor: rules applied to the imported calls and chunks, on each flow's reassembled stream
            (default: the default credential rules; `Redactor([])` for none).
        strict: a damaged (cut, corrupt) capture is a PcapError and nothing is written.

    Raises PcapError (unreadable file, or damaged with `strict`) or RecordingError (output). Otherwise
    a damaged capture is imported up to the damage and the result's `problems` say so (the recording's
    meta too). Nothing is left at `output` when it raises.
    """
    _check_magic(path)   # before creating the output: a wrong input leaves nothing behind
    with atomic_output(output, overwrite=overwrite) as tmp:
        result = _import_into(path, str(tmp), port, redactor)
        if result.problems and not result.packets:     # nothing before the damage: nothing to salvage
            raise PcapError(f"{path} is damaged: {result.problems[0]}; no packet before the damage, nothing "
                            f"written to {output}")
        if strict and result.problems:
            raise PcapError(f"{path} is damaged: {result.problems[0]}; nothing written to {output}: pass "
                            f"--salvage to keep the {result.packets} packets before the damage (the recording "
                            "then says it is partial)")
    return result


def _import_into(path: str, output: str, port: int | None, redactor: Redactor | None) -> ImportResult:
    result = ImportResult()
    accept = (lambda s: port in (s.src[1], s.dst[1])) if port else None
    writer = RecordingWriter(output, meta={"clock": "capture-wall", "source": os.path.basename(path), "backend": "import"})
    sink = FlowSink(writer, redactor if redactor is not None else Redactor())
    reasm = Reassembler(sink, {port} if port else None, accept)
    first_ts = None
    try:
        for linktype, ts, frame in read_packets(path, result.problems):
            result.packets += 1
            first_ts = ts if first_ts is None else first_ts
            seg = parse(linktype, frame)
            if seg is not None:
                reasm.feed(seg, ts)
    finally:
        result.reassembly = reasm.finish()
        result.sink = sink.close(meta={"started_wall_ns": first_ts, "started_mono_ns": first_ts,
                                       "import_problems": result.problems,
                                       "gaps": result.reassembly.gaps, "gap_bytes": result.reassembly.gap_bytes,
                                       "retransmitted_segments": result.reassembly.retransmitted})
        writer.close()
    return result
