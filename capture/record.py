"""Record traffic in-process: `Recorder(RecordOptions(...))`, start()/stop() or a `with` block.

    with Recorder(RecordOptions(backend="ebpf", port=50051, output="prod.rec")) as rec:
        ...                      # traffic flows; rec.stats is live
    print(rec.result)            # flows, calls, bytes, lost_events, ...

A ticker commits the file every 0.25 s, so a recorder killed with SIGKILL leaves a readable file
that misses at most the last second.

`RecordOptions(decode="at-stop")` stores masked chunks only while recording and decodes them into
calls in `stop()` (see capture/sink.py); a recording whose recorder was killed before that has its
chunks but no calls, which `finish_recording(path)` (`shadowtest record --finish -o FILE`) decodes.
`RecordOptions(decode="later")` is at-stop without the decode in `stop()`: the file is closed with
its chunks, flows and counters, marked `calls_decoded = false`, and `finish_recording` decodes it
on any machine (it needs neither root nor bcc), so the recorded host pays for the capture only.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from capture import backends
from capture.backends import RecordOptions
from capture.deferred import calls_pending, finish_command
from capture.errors import CaptureError
from capture.recording import RecordingWriter
from capture.redact import DEFAULT_RULES, Redactor, parse_rule
from capture.ring import SLICES, TriggerRefused, TriggerServer, dump_name, ring_dir
from capture.rotate import Rotator
from capture.sample import Sampler
from capture.sink import FlowSink, SinkStats
from wire.clock import Clock, MonotonicClock

TOOL_VERSION = "shadowtest-capture 0.1.0"
CPU_WINDOW_S = 1.0      # --max-cpu-pct: the recorder's CPU is judged over this long


def build_redactor(default: bool, specs: list[str]) -> Redactor:
    """Default rules (unless disabled) plus user rules. Raises CaptureError for a bad spec."""
    return Redactor(([*DEFAULT_RULES] if default else []) + [parse_rule(s) for s in specs])


class Recorder:
    """Run one capture backend into one recording file.

    Raises PrivilegeError (from start) when the backend cannot run here, RecordingError when the
    output cannot be created. On failure after the file was created the file is closed, not removed.
    """

    def __init__(self, options: RecordOptions, clock: Clock | None = None) -> None:
        self.options = options
        self.clock = clock or MonotonicClock()
        self.backend = backends.create(options)
        if options.backend == "ebpf":   # TLS plaintext beside it, joined to its flows (capture/ebpf/tls.py)
            from capture.ebpf.tls import TlsBackend

            self.backend = TlsBackend(self.backend, options)
        self.redactor = build_redactor(options.default_redaction, options.redact)
        self.sink: FlowSink | None = None
        self.result: dict[str, object] | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._started_ns = 0
        self.capped = threading.Event()    # --max-file-mb reached: nothing more is written; stop
        self._dump_lock = threading.Lock()  # --ring: dumps (capture/ring.py)
        self._last_dump = -1e18
        self._dumps_running: list[threading.Thread] = []
        self.dumps: list[dict[str, object]] = []
        self.trigger: TriggerServer | None = None
        self._shed_s = 0.0                 # --max-cpu-pct (see _budget)
        self._shed_since = 0.0
        self._shed_periods = 0
        self._cpu_peak = 0.0

    def _meta(self) -> dict[str, object]:
        opts = asdict(self.options)
        return {"host": socket.gethostname(), "kernel": platform.release(), "tool_version": TOOL_VERSION,
                "started_wall_ns": self.clock.wall_ns(), "started_mono_ns": self.clock.now_ns(),
                "clock": "CLOCK_MONOTONIC", "backend": self.options.backend,
                "filters": {k: opts[k] for k in ("port", "pid", "cgroup", "side", "max_bytes", "sample_pct",
                                                 "sample_seed", "max_file_mb", "rotate_mb", "rotate_s")},
                "redaction_rules": self.redactor.specs, "recorder_pid": os.getpid(), "decode": self.options.decode}

    def start(self) -> Recorder:
        preflight = getattr(self.backend, "preflight", None)
        if preflight is not None:
            preflight()        # missing privileges fail here, before a file is created or replaced
        if self.options.trigger_listen and not self.options.ring_s:
            raise CaptureError("--trigger-listen needs --ring (a trigger dumps the ring)")
        rotator = self._ring_rotator() if self.options.ring_s else self._rotator()
        if rotator is not None:
            writer = RecordingWriter(rotator.first, meta=self._meta() | rotator.meta())
        else:
            writer = RecordingWriter(self.options.output, meta=self._meta(), overwrite=self.options.overwrite)
        try:
            sampler = Sampler(self.options.sample_pct, self.options.sample_seed) \
                if self.options.sample_pct < 100.0 else None
            cap = int(self.options.max_file_mb * (1 << 20)) if self.options.max_file_mb else None
            self.sink = FlowSink(writer, self.redactor, self.options.decode, sampler=sampler, max_file_bytes=cap)
            self.sink.rotator = rotator
            if self.options.trigger_listen:
                self.trigger = TriggerServer(self.options.trigger_listen, self.dump)
        except BaseException:
            writer.close()
            writer.remove()
            self.sink = None
            raise
        self.sink.on_sampled_out = getattr(self.backend, "forget", None)
        self.sink.on_cap = self.capped.set
        try:
            self.backend.start(self.sink)
        except BaseException:
            writer.close()
            writer.remove()    # a recording that never started is no recording: leave no file behind
            self.sink = None   # nothing started: stop() has nothing to stop (it would write to a closed file)
            if self.trigger is not None:
                self.trigger.close()
            raise
        self._started_ns = self.clock.now_ns()   # after the (slow) eBPF load: capture starts now
        writer.set_meta({"backend_settings": self.backend.describe()})
        self._ticker = threading.Thread(target=self._tick, name="recorder-flush", daemon=True)
        self._ticker.start()
        return self

    def _rotator(self) -> Rotator | None:
        """--rotate-mb/--rotate-s: OUTPUT is a directory of numbered files (capture/rotate.py); else None."""
        o = self.options
        if not (o.rotate_mb or o.rotate_s):
            return None
        if o.decode != "live":
            raise CaptureError("--rotate-mb/--rotate-s need --decode live (each file holds its own calls)")
        if o.max_file_mb:
            raise CaptureError("give --max-file-mb or --rotate-mb/--rotate-s, not both (--rotate-mb bounds each file)")
        return Rotator(o.output, int(o.rotate_mb * (1 << 20)) if o.rotate_mb else None, o.rotate_s,
                       overwrite=o.overwrite)

    def _ring_rotator(self) -> Rotator:
        """--ring: OUTPUT is a directory of dumps; the ring itself is OUTPUT/.ring, a rotated set of
        window/10-second files of which only the window is kept (capture/ring.py)."""
        o = self.options
        if o.decode != "live":
            raise CaptureError("--ring needs --decode live (a dump must hold whole calls)")
        if o.max_file_mb or o.rotate_mb or o.rotate_s:
            raise CaptureError("--ring keeps its own files: it goes with neither --max-file-mb nor --rotate-*")
        out = Path(o.output)
        if out.exists() and not out.is_dir():
            raise CaptureError(f"{out} exists and is not a directory (--ring writes its dumps into one)")
        out.mkdir(mode=0o700, parents=False, exist_ok=True)
        assert o.ring_s is not None
        return Rotator(ring_dir(out), None, max(1.0, o.ring_s / SLICES), overwrite=True, keep_s=o.ring_s,
                       keep_bytes=int(o.ring_mb * (1 << 20)) if o.ring_mb else None)

    def dump(self, name: str, labels: dict[str, str] | None = None) -> None:
        """--ring: write the last window to OUTPUT/<time>-<name>.rec, in a thread of its own (a webhook
        must not wait for it). Raises TriggerRefused within trigger_min_interval_s of the last dump."""
        sink = self.sink
        if sink is None or sink.rotator is None or not self.options.ring_s:
            raise CaptureError("a dump needs a flight recorder (--ring)")
        with self._dump_lock:
            now = time.monotonic()
            if now - self._last_dump < self.options.trigger_min_interval_s:
                raise TriggerRefused(f"the last dump was {now - self._last_dump:.1f} s ago (at most one per "
                                     f"{self.options.trigger_min_interval_s:g} s)")
            self._last_dump = now
        received = self.clock.wall_ns()
        thread = threading.Thread(target=self._dump, args=(name, labels or {}, received), name="ring-dump", daemon=True)
        thread.start()
        self._dumps_running.append(thread)

    def _dump(self, name: str, labels: dict[str, str], received_wall_ns: int) -> None:
        from capture.merge import merge_recordings

        sink = self.sink
        assert sink is not None and sink.rotator is not None
        with sink._lock:
            sink._rotate_locked()         # the file being written is closed: its calls are in
        rotator = sink.rotator
        files = rotator.window()
        out = Path(self.options.output) / dump_name(name, received_wall_ns / 1e9)
        try:
            if not files:
                raise CaptureError("the ring holds no file yet")
            trigger = {"name": name, "labels": labels, "received_wall_ns": received_wall_ns,
                       "window_s": self.options.ring_s, "files": len(files)}
            merge_recordings([str(f) for f in files], str(out), allow_disjoint=True, meta={"trigger": trigger},
                             single_ok=True)
            self.dumps.append({"file": str(out), "name": name, "files": len(files)})
        except CaptureError as exc:
            self.dumps.append({"file": None, "name": name, "error": str(exc)})
        finally:
            rotator.unpin()

    def _tick(self) -> None:
        cpu0, wall0 = time.process_time(), time.monotonic()
        while not self._stop.wait(0.25):
            assert self.sink is not None
            self.sink.tick()
            if self.options.max_cpu_pct and time.monotonic() - wall0 >= CPU_WINDOW_S:
                cpu1, wall1 = time.process_time(), time.monotonic()
                self._budget((cpu1 - cpu0) / (wall1 - wall0) * 100.0)
                cpu0, wall0 = cpu1, wall1

    def _budget(self, pct: float) -> None:
        """--max-cpu-pct: over the budget (this process's CPU, all its threads, over the last second), new
        connections are shed, whole, until it falls below 80 % of the budget; said in meta and the summary."""
        sink, limit = self.sink, self.options.max_cpu_pct
        assert sink is not None and limit is not None
        if pct > limit and not sink.shedding:
            sink.shedding = True
            self._shed_periods += 1
            self._shed_since = time.monotonic()
        elif pct < 0.8 * limit and sink.shedding:
            sink.shedding = False
            self._shed_s += time.monotonic() - self._shed_since
        self._cpu_peak = max(self._cpu_peak, pct)

    @property
    def stats(self) -> SinkStats:
        assert self.sink is not None, "start() the recorder first"
        return self.sink.stats

    def stop(self) -> dict[str, object]:
        """Stop the backend, finish open flows, write counters; returns the final stats. Idempotent."""
        if self.result is not None or self.sink is None:
            return self.result or {}
        cpu0 = time.process_time()   # what stopping costs (the at-stop decode runs here)
        if self.trigger is not None:
            self.trigger.close()
        for t in self._dumps_running:
            t.join(120)               # a dump under way is finished before the ring goes
        self._stop.set()
        if self._ticker:
            self._ticker.join(timeout=2)   # no commit may race the final close below
        try:
            self.backend.stop()
        finally:
            duration = (self.clock.now_ns() - self._started_ns) / 1e9
            budget: dict[str, object] = {}
            if self.sink.shedding:      # shedding until the end
                self._shed_s += time.monotonic() - self._shed_since
            if self.options.max_cpu_pct:
                budget["cpu_budget"] = {"max_cpu_pct": self.options.max_cpu_pct, "shed_flows": self.sink.stats.shed_flows,
                                        "shedding_s": round(self._shed_s, 2), "times_over": self._shed_periods,
                                        "peak_cpu_pct": round(self._cpu_peak, 1)}
            stats = self.sink.close(meta={"stopped_wall_ns": self.clock.wall_ns(),
                                          "capture_duration_s": duration, **budget})
            self.sink.writer.close()
            if self.options.ring_s:     # the ring is working data: the dumps are what it leaves
                shutil.rmtree(ring_dir(self.options.output), ignore_errors=True)
        self.result = stats.as_dict() | {"duration_s": duration, "output": self.options.output,
                                         "decode": self.options.decode,
                                         "stop_cpu_s": round(time.process_time() - cpu0, 4)}
        if budget:
            self.result |= budget
        if self.options.ring_s:
            self.result["dumps"] = list(self.dumps)
            if self.trigger is not None:
                self.result["triggers"] = dict(self.trigger.counts)
        elif self.sink.rotator is not None:
            self.result["files"] = self.sink.rotator.index
        if self.options.decode == "later":   # tell the caller the calls are still to be decoded, and how
            self.result |= {"calls_decoded": False, "finish": finish_command(self.options.output)}
        return self.result

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def finish_recording(path: str, progress: Callable[[int, int], None] | None = None) -> dict[str, object]:
    """Decode the calls of a `--decode later` recording, or of an at-stop one whose recorder was
    killed before its stop. Needs no root and no bcc: it only reads and writes the file.

    Its chunks are masked already; the rules it lists in meta are applied to the calls. Returns the
    calls decoded and `cpu_s`, the CPU the decode took. Raises CaptureError when the file has
    nothing to finish (its calls were decoded live, at stop, or by an earlier finish). `progress(flows
    decoded, flows)` is called as it goes."""
    cpu0 = time.process_time()
    writer = RecordingWriter(path, existing=True)
    try:
        meta = {k: writer.meta_value(k) for k in ("decode", "calls_decoded")}
        if not calls_pending(meta):
            raise CaptureError(f"{path}: nothing to finish (its calls were decoded while recording, at stop "
                               "or by an earlier --finish)")
        specs = [str(s) for s in writer.meta_value("redaction_rules", [])]
        user = [s for s in specs if not s.startswith("default:")]
        sink = FlowSink(writer, build_redactor(len(user) < len(specs), user), str(meta["decode"]))
        sink.decode_stored(progress)
        writer.set_meta({"unknown_method_calls": sink.stats.unknown_method_calls})
    finally:
        writer.close()
    return {"calls": sink.stats.calls, "unknown_method_calls": sink.stats.unknown_method_calls, "output": path,
            "cpu_s": round(time.process_time() - cpu0, 4)}
