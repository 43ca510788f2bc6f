"""Follow the target while it runs: /metrics scrapes, /events, and CPU use of the target and host.

Each follower is a small daemon thread that never raises: a target that stops answering leaves a
gap in the timeline (and a note), not a crashed run.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.scenario import MetricNames
from harness.timeline import CpuSample, Event, MetricSample

log = logging.getLogger(__name__)


def flatten_metrics(text: str, names: MetricNames) -> dict[str, float]:
    """'name{label="v",...}' -> value for the metrics the harness reads (histogram buckets left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = set(vars(names).values()) | {"agent_period_latency_seconds", "agent_batch_size"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted and family.name + "_total" not in wanted:
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def scrape(url: str, names: MetricNames, timeout_s: float = 5.0) -> dict[str, float]:
    """One scrape of a Prometheus endpoint. Raises OSError (URLError) when it cannot be read."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 -- loopback targets
        return flatten_metrics(resp.read().decode("utf-8", "replace"), names)


class _Poller:
    def __init__(self, every_s: float, name: str) -> None:
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.failures = 0
        self.last_error = ""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop polling, then poll once more so what happened since the last poll is not lost (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(10.0)
        try:
            self.poll()
        except Exception as exc:  # noqa: BLE001 -- as in the loop: a gap, noted
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 -- a gap in the data, never a crashed run
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._stop.wait(self.every_s)

    def poll(self) -> None:
        raise NotImplementedError


class MetricsFollower(_Poller):
    """Scrapes `url` every `every_s`; `samples` holds MetricSamples at seconds from `t0`."""

    def __init__(self, url: str, names: MetricNames, t0: float, every_s: float = 0.5) -> None:
        super().__init__(every_s, "shadowtest-metrics")
        self.url, self.names, self.t0 = url, names, t0
        self.samples: list[MetricSample] = []

    def poll(self) -> None:
        values = scrape(self.url, self.names)
        self.samples.append(MetricSample(time.monotonic() - self.t0, values))


class EventsFollower(_Poller):
    """Reads `url?since=SEQ&follow=0` every `every_s`: every event once, in order, with its `mono` time."""

    def __init__(self, url: str, t0: float, every_s: float = 0.2,
                 on_event: Callable[[Event], None] | None = None) -> None:
        super().__init__(every_s, "shadowtest-events")
        self.url, self.t0, self.on_event = url, t0, on_event
        self.events: list[Event] = []
        self.seq = 0

    def poll(self) -> None:
        sep = "&" if "?" in self.url else "?"
        # A throttled target answers slowly: wait for it rather than lose the poll (since= resumes anyway).
        with urllib.request.urlopen(f"{self.url}{sep}since={self.seq}&follow=0", timeout=5.0) as resp:  # noqa: S310
            lines = resp.read().decode("utf-8", "replace").splitlines()
        for line in lines:
            if not line.strip():
                continue
            raw = json.loads(line)
            self.seq = max(self.seq, int(raw.get("seq", 0)))
            fields = {k: v for k, v in raw.items() if k not in ("seq", "ts", "mono", "type")}
            mono = float(raw.get("mono", time.monotonic()))
            event = Event(round(mono - self.t0, 6), str(raw.get("type")), fields | {"seq": raw.get("seq")})
            self.events.append(event)
            if self.on_event is not None:
                self.on_event(event)


class CpuFollower(_Poller):
    """Samples the target's CPU (% of one core; None when it is not our process) and the host's, the
    target's scheduler stats (`sched`: (t, CPU s, run-queue wait s), cumulative, from /proc) and its
    memory (`memory`: (t, MB): the process's RSS, or its cgroup's memory.current)."""

    def __init__(self, pid: int | None, t0: float, every_s: float = 0.5, cgroup: str | None = None) -> None:
        super().__init__(every_s, "shadowtest-cpu")
        import psutil

        self._psutil = psutil
        self.t0 = t0
        self._proc = psutil.Process(pid) if pid else None
        self._pid = pid
        if self._proc is not None:
            self._proc.cpu_percent(None)
        psutil.cpu_percent(None)
        self.samples: list[CpuSample] = []
        self.sched: list[tuple[float, float, float]] = []
        self.memory: list[tuple[float, float]] = []
        self._cgroup = cgroup
        self.memory_of = (f"cgroup {cgroup} (memory.current)" if cgroup else
                          f"process {pid} (RSS)" if pid else "")

    def recent_pct(self, window_s: float) -> float | None:
        """The target's CPU use (% of one core) over about the last `window_s` seconds, from its
        scheduler samples; None with fewer than two samples that far apart."""
        from harness.checks.truth import sched_rate_between

        sched = list(self.sched)
        if len(sched) < 2:
            return None
        older = [x for x in sched if x[0] <= sched[-1][0] - window_s]
        rates = sched_rate_between(older[-1], sched[-1]) if older else None
        return rates[0] if rates else None

    def poll(self) -> None:
        target = None
        if self._proc is not None:
            try:
                target = self._proc.cpu_percent(None)
            except self._psutil.Error:
                self._proc = None
        host = self._psutil.cpu_percent(None)
        now = round(time.monotonic() - self.t0, 3)
        self.samples.append(CpuSample(now, target, host))
        if self._proc is not None and self._pid:
            from harness.checks.truth import read_schedstat

            stat = read_schedstat(self._pid)
            if stat is not None:
                self.sched.append((now, *stat))
        mb = self._memory_mb()
        if mb is not None and len(self.memory) < 1_000_000:
            self.memory.append((now, mb))

    def _memory_mb(self) -> float | None:
        if self._cgroup:
            try:
                return round(int(Path(self._cgroup, "memory.current").read_text().split()[0]) / 2**20, 3)
            except (OSError, ValueError, IndexError):
                return None
        if self._proc is None:
            return None
        try:
            return round(self._proc.memory_info().rss / 2**20, 3)
        except self._psutil.Error:
            return None


MAX_HEAP_BODY = 256 * 1024      # a /heap answer holds at most 50 sites: a few KB


def heap_call(metrics_url: str, path: str, post: bool = False, timeout_s: float = 10.0) -> dict[str, Any]:
    """Ask the bundled agent's heap tracer (`/heap/start`, `/heap/growth`, `/heap/stop` beside its
    /metrics); the decoded JSON answer. Raises OSError or ValueError (one line) when it cannot."""
    parts = urllib.parse.urlsplit(metrics_url)
    url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path.split("?")[0], path.partition("?")[2], ""))
    req = urllib.request.Request(url, data=b"" if post else None, method="POST" if post else "GET")  # noqa: S310
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 -- the target's own endpoint
        body = resp.read(MAX_HEAP_BODY + 1)
    if len(body) > MAX_HEAP_BODY:
        raise ValueError(f"{url} answered more than {MAX_HEAP_BODY} bytes")
    out = json.loads(body)
    if not isinstance(out, dict):
        raise ValueError(f"{url} answered {type(out).__name__}, not an object")
    return out


def wait_http(url: str, timeout_s: float) -> None:
    """Wait until `url` answers; raises OSError with the last error after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1.0):  # noqa: S310
                return
        except (urllib.error.URLError, OSError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
