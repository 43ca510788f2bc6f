"""Where every backend's bytes go: flows and chunks into the recording, decoded calls beside them.

    backend (eBPF / pcap / proxy / import)
        | open_flow(key, ...)  data(key, dir, ts, bytes)  close_flow(key, ts)
        v
    FlowSink --chunks (credentials masked in place)--> RecordingWriter.chunks
        |---FlowDecoder per flow--> calls (redaction rules applied) --> RecordingWriter.calls
        '---counters (flows, calls, bytes, lost, truncated, unknown methods) --> meta, live line

Thread-safe: backends call it from their own threads; one lock serialises writes.

`decode="at-stop"` (the recorder's `--decode at-stop`): while capturing, only the protocol is
detected (the masking needs it) and the masked chunks are stored; `close()` then decodes the stored
chunks into calls. The production host pays for copying and masking bytes only; credentials are
masked before anything reaches the disk either way. Gaps are kept in meta (`undecoded_gaps`) as
they happen, so `decode_stored` can also finish a file whose recorder was killed.

`decode="later"` (`--decode later`): the same while capturing, but `close()` does not decode: it
marks the file `calls_decoded = false` and `shadowtest record --finish` runs `decode_stored`
wherever convenient (see capture/deferred.py).

`discarded(key, dir, nbytes)`: the application had the kernel drop bytes it never read (recv with
MSG_TRUNC on TCP; the eBPF backend sees the flag). A gap for the decoders, never bytes, and counted:
meta `discarded_bytes` (total) and `discarded_by_flow` ([flow, direction, bytes, reads]), written at
close and by the next tick, which `inspect` lists as problems.

`not_captured(key, dir, ts, nbytes, how)`: the application sent (or received) `nbytes` by a path whose
bytes the backend cannot read (sendfile or splice on the socket; the eBPF backend sees the syscall). A
gap of known length, so the HTTP/1 decoder steps over the body it belonged to and the call says
"body not captured: response, not captured: sendfile, N bytes" (its head and status are kept), and
counted: meta `not_captured_bytes` and `not_captured_by_flow` ([flow, direction, how, bytes, syscalls]).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field, replace

from capture.decode import FlowDecoder
from capture.decode.streammask import FlowMasker
from capture.errors import CaptureError
from capture.recording import Call, Chunk, Direction, Flow, RecordingWriter
from capture.redact import BodyRegexRule, Redactor
from capture.rotate import Rotator
from capture.sample import Sampler


@dataclass
class SinkStats:
    flows: int = 0
    joined_flows: int = 0
    calls: int = 0
    bytes: int = 0
    chunks: int = 0
    lost_events: int = 0
    truncated_events: int = 0
    unknown_method_calls: int = 0
    truncated_messages: int = 0      # messages over the decoder's size cap: chunks only, no message row
    gaps: int = 0
    discarded_bytes: int = 0         # dropped unread by the application (MSG_TRUNC): gaps, not captured
    discarded_reads: int = 0
    not_captured_bytes: int = 0      # moved by sendfile/splice: length and time known, bytes not readable
    not_captured_syscalls: int = 0
    sampled_out_flows: int = 0       # --sample: connections not kept (whole)
    shed_flows: int = 0              # --max-cpu-pct: connections not recorded while over the CPU budget
    capped: bool = False             # --max-file-mb reached: nothing written after it
    bytes_after_cap: int = 0
    flows_after_cap: int = 0
    methods: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


DECODE_MODES = ("live", "at-stop", "later")
_SETTLED = frozenset(("grpc", "http1", "tcp"))   # protocols a flow keeps once written (http2 may become grpc)


class _FlowState:
    def __init__(self, flow_id: int, joined: bool, calls: bool = True, flow: Flow | None = None,
                 first_file: int | None = None) -> None:
        self.flow_id = flow_id
        self.flow = flow             # as opened: a rotation opens it again in the next file
        self.first_file = first_file   # a rotated set: the file it was opened in (its id there: the decoder's)
        self.joined = joined
        self.decoder = FlowDecoder(flow_id, joined, calls)
        self.masker: FlowMasker | None = None    # credentials masked on the reassembled stream
        self.protocol_written: str | None = None
        # chunks written per direction (where at-stop gaps go)
        self.stored: dict[Direction, int] = {"c2s": 0, "s2c": 0}


_CAP_CHECK_BYTES = 256 << 10   # with --max-file-mb: the file's size is looked at after this much payload


class FlowSink:
    """Collect flows from a backend into `writer`, decoding and redacting as bytes arrive.

    `sampler` (--sample): a flow it does not keep is never opened; `on_sampled_out(key)` then tells the
    backend to stop copying its bytes. `max_file_bytes` (--max-file-mb): once the file (and its WAL)
    reaches it, every open flow is finished (its calls stored as far as they came), nothing more is
    written, meta `capped` says so, and `on_cap()` is called (the recorder stops)."""

    def __init__(self, writer: RecordingWriter, redactor: Redactor | None = None, decode: str = "live",
                 sampler: Sampler | None = None, max_file_bytes: int | None = None) -> None:
        if decode not in DECODE_MODES:
            raise CaptureError(f"decode must be one of {', '.join(DECODE_MODES)}, not {decode!r}")
        self.writer = writer
        self.redactor = redactor if redactor is not None else Redactor([])
        self._header_rule = self.redactor.header_rule()
        # None without body rules: the masker then leaves DATA frames alone instead of copying them
        self._body_mask = self.redactor.body if any(isinstance(r, BodyRegexRule) for r in self.redactor.rules) else None
        self.stats = SinkStats()
        self._flows: dict[Hashable, _FlowState] = {}
        self._lock = threading.Lock()
        self._live = decode == "live"
        self._decode = decode
        # at-stop: (flow, direction, chunks before it, bytes missing or None)
        self._gaps: list[tuple[int, str, int, int | None, str | None]] = []
        self._discarded: dict[tuple[int, str], list[int]] = {}   # (flow, direction) -> [bytes, reads]
        self._discarded_unsaved = False
        self._not_captured: dict[tuple[int, str, str], list[int]] = {}   # (flow, dir, how) -> [bytes, syscalls]
        self.rotator: Rotator | None = None   # --rotate-mb / --rotate-s (capture/rotate.py)
        self.shedding = False                 # --max-cpu-pct: the recorder is over its CPU budget
        self.sampler = sampler
        self.on_sampled_out: Callable[[Hashable], None] | None = None
        self.max_file_bytes = max_file_bytes
        self.on_cap: Callable[[], None] | None = None
        self._since_size_check = 0
        self._cap_meta: dict[str, object] = {}
        if not self._live:
            writer.set_meta({"decode": decode})   # gaps are added as they happen (see gap())

    def first_file(self, key: Hashable) -> int | None:
        """In a rotated set, the file (1, 2, ...) flow `key` was opened in, whose flow id open_flow returned;
        None without rotation or for a flow not recorded."""
        with self._lock:
            st = self._flows.get(key)
            return st.first_file if st is not None else None

    def open_flow(self, key: Hashable, flow: Flow) -> int:
        """Start a flow (replacing one with the same key, which must have closed unseen)."""
        with self._lock:
            if key in self._flows:
                self._close_locked(key, flow.opened_ns)
            if self.stats.capped:
                self.stats.flows_after_cap += 1
                return 0
            # over the CPU budget (--max-cpu-pct) or not sampled (--sample): the whole connection is left out
            shed = self.shedding
            if shed or (self.sampler is not None and not self.sampler.decide(flow)):
                if shed:
                    self.stats.shed_flows += 1
                else:
                    self.stats.sampled_out_flows += 1
                if self.on_sampled_out is not None:
                    self.on_sampled_out(key)    # the backend stops copying its bytes
                return 0
            flow_id = self.writer.add_flow(flow)
            rotator = self.rotator
            self._flows[key] = _FlowState(flow_id, flow.joined_midstream, self._live,
                                          flow if rotator is not None else None,
                                          rotator.index if rotator is not None else None)
            self.stats.flows += 1
            self.stats.joined_flows += int(flow.joined_midstream)
            return flow_id

    def rekey(self, key: Hashable, new_key: Hashable) -> None:
        """Go on with flow `key` under `new_key` (a flow held after its close, while the same key opens
        the next connection: the TLS joiner)."""
        with self._lock:
            st = self._flows.pop(key, None)
            if st is not None:
                self._flows[new_key] = st

    def has_flow(self, key: Hashable) -> bool:
        return key in self._flows

    def data(self, key: Hashable, direction: Direction, ts_ns: int, data: bytes) -> None:
        """Bytes seen on a flow; unknown keys are ignored (their open event was filtered or lost)."""
        with self._lock:
            st = self._flows.get(key)
            if st is None or not data:
                if self.stats.capped:
                    self.stats.bytes_after_cap += len(data)
                return
            self.stats.bytes += len(data)
            calls = st.decoder.feed(direction, ts_ns, data)   # first: it detects the protocol
            for d, ts, chunk in self._masked(st, direction, ts_ns, data):
                self.writer.add_chunk_data(st.flow_id, d, ts, chunk)
                self.stats.chunks += 1
                st.stored[d] += 1
            self._store_calls(st, calls)
            if self.max_file_bytes is not None or (self.rotator is not None and self.rotator.rotate_bytes):
                self._since_size_check += len(data)
                if self._since_size_check >= _CAP_CHECK_BYTES:
                    self._check_size_locked()

    def _file_bytes(self) -> int:
        total = 0
        for p in (self.writer.path, self.writer.path.with_name(self.writer.path.name + "-wal")):
            try:
                total += p.stat().st_size
            except OSError:
                pass
        return total

    def _rotate_locked(self) -> None:
        """Go on in the rotation set's next file: every open flow is opened there again (meta `continues`
        says which flow of the previous file it is), its decoder goes on where it was, so a call is
        stored whole in the file where it completes, and none is split or lost at the boundary."""
        assert self.rotator is not None
        old = self.writer
        new = self.rotator.next_writer(old)
        continues: dict[str, int] = {}
        for st in self._flows.values():
            if st.flow is None:
                continue
            # alone, this file sees the connection from its middle (joined); merged, it is one flow again
            new_id = new.add_flow(replace(st.flow, joined_midstream=True,
                                          protocol=st.decoder.protocol or st.flow.protocol))
            continues[str(new_id)] = st.flow_id
            st.flow_id = new_id
            st.stored = {"c2s": 0, "s2c": 0}
            st.protocol_written = None
        new.set_meta({"continues": continues})   # rotation is live decoding only: no undecoded gaps to carry
        old.set_meta({"lost_events": self.stats.lost_events, "truncated_events": self.stats.truncated_events,
                      "rotated": True} | self._discarded_meta())
        old.close()
        self.writer = new

    def _check_size_locked(self) -> None:
        """Look at the file's size: the next file of a rotated set when due (--rotate-mb/-s), else, at the
        --max-file-mb cap (what is queued committed first), stop writing."""
        self._since_size_check = 0
        if self.stats.capped:
            return
        if self.max_file_bytes is not None:
            self.writer.flush()       # a hard cap: what is queued counts too (rotation: what the timer committed)
        size = self._file_bytes()
        if self.rotator is not None and self.rotator.due(size):
            self._rotate_locked()
            return
        if self.max_file_bytes is None or size < self.max_file_bytes:
            return
        self.stats.capped = True
        for key in list(self._flows):       # their calls are stored as far as they came
            self._close_locked(key, None)
        self._cap_meta = {"max_file_bytes": self.max_file_bytes, "file_bytes_at_cap": size}
        self.writer.set_meta({"capped": self._cap_meta})
        self.writer.flush()
        if self.on_cap is not None:
            self.on_cap()

    def _masked(self, st: _FlowState, direction: Direction, ts_ns: int,
                data: bytes) -> list[tuple[Direction, int, bytes]]:
        """The chunks that may be stored now: credentials masked in place, lengths unchanged (held back
        while the protocol is unknown or a secret may go on in the next chunk: capture/decode/streammask.py)."""
        if st.masker is None:
            st.masker = FlowMasker(self.redactor, st.joined)
        return st.masker.feed(direction, ts_ns, data, st.decoder.protocol)

    def _store_calls(self, st: _FlowState, calls: list[Call]) -> None:
        if not calls and st.protocol_written in _SETTLED:
            return                    # most chunks: nothing completed, the protocol is known
        proto = st.decoder.protocol
        if proto and proto != st.protocol_written:
            self.writer.update_flow(st.flow_id, protocol=proto)
            st.protocol_written = proto
        for call in calls:
            self.redactor.call(call)
            call.flow_id = st.flow_id     # the decoder's id is the flow's first file's (rotation)
            self.writer.add_call(call)
            self.stats.calls += 1
            self.stats.unknown_method_calls += int(call.method_unknown)
            name = call.method or "<unknown>"
            self.stats.methods[name] = self.stats.methods.get(name, 0) + 1

    def gap(self, key: Hashable, direction: Direction, nbytes: int | None) -> None:
        """`nbytes` of one direction never arrived (pcap holes, records a full ring lost; None: how
        many is unknown): decoders resynchronise after it."""
        with self._lock:
            st = self._flows.get(key)
            if st is not None:
                self._gap_locked(st, direction, nbytes)

    def discarded(self, key: Hashable, direction: Direction, nbytes: int) -> None:
        """The application dropped `nbytes` of this direction without reading them (recv with
        MSG_TRUNC): a gap, and counted per flow, so the recording says what it does not hold."""
        with self._lock:
            st = self._flows.get(key)
            if st is None or nbytes <= 0:
                return
            self.stats.discarded_bytes += nbytes
            self.stats.discarded_reads += 1
            per = self._discarded.setdefault((st.flow_id, direction), [0, 0])
            per[0] += nbytes
            per[1] += 1
            self._discarded_unsaved = True
            self._gap_locked(st, direction, nbytes)

    def not_captured(self, key: Hashable, direction: Direction, ts_ns: int, nbytes: int, how: str) -> None:
        """`nbytes` of this direction went by a path the backend cannot read (`how`: "sendfile",
        "splice"): a gap of known length at `ts_ns`, counted per flow (module docstring)."""
        with self._lock:
            st = self._flows.get(key)
            if st is None or nbytes <= 0:
                return
            self.stats.not_captured_bytes += nbytes
            self.stats.not_captured_syscalls += 1
            per = self._not_captured.setdefault((st.flow_id, direction, how), [0, 0])
            per[0] += nbytes
            per[1] += 1
            self._discarded_unsaved = True
            self._gap_locked(st, direction, nbytes, how)
            if self._live and st.decoder.inner is not None:
                # a body stepped over completes its message now, not at the connection's next bytes
                self._store_calls(st, st.decoder.feed(direction, ts_ns, b""))

    def _discarded_meta(self) -> dict[str, object]:
        self._discarded_unsaved = False
        return {"discarded_bytes": self.stats.discarded_bytes,
                "discarded_by_flow": [[f, d, n, reads] for (f, d), (n, reads) in sorted(self._discarded.items())],
                "not_captured_bytes": self.stats.not_captured_bytes,
                "not_captured_by_flow": [[f, d, how, n, calls]
                                         for (f, d, how), (n, calls) in sorted(self._not_captured.items())]}

    def _gap_locked(self, st: _FlowState, direction: Direction, nbytes: int | None, how: str | None = None) -> None:
        self.stats.gaps += 1
        for d, ts, chunk in st.masker.gap(direction) if st.masker else []:
            self.writer.add_chunk(Chunk(st.flow_id, d, ts, chunk))
            st.stored[d] += 1
        self.writer.add_gap(st.flow_id, direction, st.stored[direction], nbytes, how)   # export, inspect
        st.decoder.gap(direction, nbytes, how)
        if not self._live:
            self._gaps.append((st.flow_id, direction, st.stored[direction], nbytes, how))
            self.writer.set_meta({"undecoded_gaps": self._gaps})

    def close_flow(self, key: Hashable, ts_ns: int | None) -> None:
        with self._lock:
            self._close_locked(key, ts_ns)

    def _close_locked(self, key: Hashable, ts_ns: int | None) -> None:
        st = self._flows.pop(key, None)
        if st is None:
            return
        for d, ts, chunk in st.masker.flush() if st.masker else []:
            self.writer.add_chunk(Chunk(st.flow_id, d, ts, chunk))
            st.stored[d] += 1
        self._store_calls(st, st.decoder.finish(ts_ns))
        self.stats.truncated_messages += st.decoder.truncated_messages
        if ts_ns is not None:
            self.writer.update_flow(st.flow_id, closed_ns=ts_ns)

    def decode_stored(self, progress: Callable[[int, int], None] | None = None) -> None:
        """at-stop: decode every flow's stored (already masked) chunks into calls, in one pass per
        flow that streams the chunks back in batches. Masked header values decode as '*' and the
        redaction rules then give the same calls as live decoding. `progress(flows done, flows)` before each flow."""
        self.writer.flush()
        self.writer.clear_calls()     # none while recording; some if an earlier decode was killed
        # (flow, direction, chunks before it) -> bytes missing there (None: unknown; files before the
        # length was kept have 3 fields, before the cause was kept 4); consecutive gaps at one place add up
        gaps: dict[tuple[int, str, int], int | None] = {}
        hows: dict[tuple[int, str, int], str] = {}
        for g in self.writer.meta_value("undecoded_gaps", []):
            where, n = (g[0], g[1], g[2]), (g[3] if len(g) > 3 else None)
            prev = gaps.get(where, 0)
            gaps[where] = None if n is None or prev is None else prev + n
            if len(g) > 4 and g[4]:
                hows[where] = str(g[4])
        rows = self.writer.flow_rows()
        for done, (flow_id, joined, closed_ns) in enumerate(rows):
            if progress is not None:
                progress(done, len(rows))
            st = _FlowState(flow_id, joined)
            for direction, ts_ns, data in self.writer.chunks_of(flow_id):
                if (flow_id, direction, st.stored[direction]) in gaps:
                    where = (flow_id, direction, st.stored[direction])
                    st.decoder.gap(direction, gaps[where], hows.get(where))
                st.stored[direction] += 1
                self._store_calls(st, st.decoder.feed(direction, ts_ns, data))
            for direction in ("c2s", "s2c"):     # a gap after a direction's last chunk (a sendfile body)
                where = (flow_id, direction, st.stored[direction])
                if where in gaps:
                    st.decoder.gap(direction, gaps[where], hows.get(where))
            self._store_calls(st, st.decoder.finish(closed_ns))
            self.stats.truncated_messages += st.decoder.truncated_messages
        self.writer.set_meta({"calls_decoded": True, "truncated_messages": self.stats.truncated_messages})

    def add_loss(self, lost: int = 0, truncated: int = 0) -> None:
        with self._lock:
            self.stats.lost_events += lost
            self.stats.truncated_events += truncated

    def tick(self) -> None:
        """Commit what was written (bounds what a SIGKILL can lose)."""
        with self._lock:
            if self._discarded_unsaved:
                self.writer.set_meta(self._discarded_meta())
            self.writer.flush()
            if self.max_file_bytes is not None or self.rotator is not None:
                self._check_size_locked()

    def close(self, ts_ns: int | None = None, meta: dict[str, object] | None = None) -> SinkStats:
        """Finish every open flow (its calls are stored incomplete) and write the counters to meta."""
        with self._lock:
            for key in list(self._flows):
                self._close_locked(key, None)
            if self._decode == "at-stop":
                self.decode_stored()
            elif self._decode == "later":
                self.writer.set_meta({"calls_decoded": False})   # `record --finish` decodes them
            self.writer.set_meta({"lost_events": self.stats.lost_events,
                                  "truncated_events": self.stats.truncated_events,
                                  "unknown_method_calls": self.stats.unknown_method_calls,
                                  "truncated_messages": self.stats.truncated_messages,
                                  "redaction_rules": self.redactor.specs} | self._discarded_meta()
                                 | ({"sampling": self.sampler.meta()} if self.sampler is not None else {})
                                 | ({"capped": self._cap_meta | {"bytes_after_cap": self.stats.bytes_after_cap,
                                                                 "flows_after_cap": self.stats.flows_after_cap}}
                                    if self.stats.capped else {})
                                 | (meta or {}))
            self.writer.flush()
        return self.stats
