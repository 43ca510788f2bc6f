"""Counters and HDR histograms for one run (or a shard), mergeable across worker processes.

Latency is recorded twice: from the intended send time (coordinated omission corrected, as wrk2
does) and from the actual send. Lag is actual minus intended send time. Histograms are in
microseconds, 1 us to 1 hour, 3 significant digits; a value beyond the range is clamped (and
counted in `clamped`) rather than lost.
"""

from __future__ import annotations

import base64
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hdrh.histogram import HdrHistogram

_MAX_US = 3_600_000_000
# One example detail per error kind (the first one seen that has a detail), bounded: the kinds a
# run meets are few (gRPC codes, HTTP statuses), but a sender bug's exception names are not.
EXAMPLE_KINDS = 32
EXAMPLE_CHARS = 240


def _hist() -> HdrHistogram:
    return HdrHistogram(1, _MAX_US, 3)


# Three values are recorded per call, and hdrh's record_value spends ~3 us of Python on finding the
# counts index. Every histogram here has the same layout, so the index of a value is the same in all
# of them: memoised for values under 64 ms (where nearly all lag and latency values fall), bounded.
_FAST_US = 1 << 16
_INDEX: dict[int, int] = {}


def record_fast(hist: HdrHistogram, us: int) -> None:
    """`hist.record_value(us)` for 0 <= us < 65536 on a `_hist()` histogram, with the same effect."""
    idx = _INDEX.get(us)
    if idx is None:
        idx = _INDEX[us] = hist._counts_index_for(us)
    hist.counts[idx] += 1
    hist.total_count += 1
    if us < hist.min_value:
        hist.min_value = us
    if us > hist.max_value:
        hist.max_value = us


@dataclass
class CallResult:
    """One call's fate, delivered to `on_result` as it happens. Times are clock ns (0 when not sent)."""

    index: int
    method: str | None
    connection: str
    flow_id: int | None
    intended_ns: int
    sent_ns: int
    done_ns: int
    outcome: str          # ok | rejected | error | timeout | connection_error | not_sent
    code: str | None      # gRPC status name, HTTP status, or the not-sent reason
    mismatch: list[str] = field(default_factory=list)
    detail: str = ""      # the sender's detail (SendOutcome.detail): why an error happened

    @property
    def latency_ns(self) -> int:
        return self.done_ns - self.intended_ns if self.sent_ns else 0


class RunStats:
    """Counts every outcome and records latency and lag; `merge` adds another shard's stats.

    `error_examples`: {error code: the first detail seen for it} (at most EXAMPLE_KINDS codes,
    EXAMPLE_CHARS characters each), so a summary can say why calls failed."""

    def __init__(self) -> None:
        self.scheduled = 0
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.not_sent: Counter[str] = Counter()
        self.error_examples: dict[str, str] = {}
        self.latency, self.from_send, self.lag = _hist(), _hist(), _hist()
        self.clamped = 0
        self.first_intended = self.first_sent = self.last_intended = self.last_sent = 0
        self.last_done = 0

    def _record(self, hist: HdrHistogram, ns: int) -> None:
        us = ns // 1000 if ns > 0 else 0
        if us < _FAST_US:
            record_fast(hist, us)
            return
        if us > _MAX_US:
            us, self.clamped = _MAX_US, self.clamped + 1
        hist.record_value(us)

    def add(self, r: CallResult) -> None:
        """Count one finished (or never sent) call."""
        self.outcomes[r.outcome] += 1
        if r.outcome == "not_sent":
            self.not_sent[r.code or "unknown"] += 1
            return
        if r.outcome in ("error", "connection_error"):
            code = r.code or "UNKNOWN"
            self.errors[code] += 1
            if r.detail:
                self._example(code, r.detail)
        self._record(self.latency, r.done_ns - r.intended_ns)
        self._record(self.from_send, r.done_ns - r.sent_ns)
        self.last_done = max(self.last_done, r.done_ns)

    def _example(self, code: str, detail: str) -> None:
        if code not in self.error_examples and len(self.error_examples) < EXAMPLE_KINDS:
            self.error_examples[code] = detail[:EXAMPLE_CHARS]

    def on_sent(self, intended_ns: int, sent_ns: int) -> None:
        """Record the send lag at the moment a call goes out (before its outcome is known)."""
        self._record(self.lag, sent_ns - intended_ns)
        if not self.first_sent or intended_ns < self.first_intended:
            self.first_intended, self.first_sent = intended_ns, sent_ns
        if intended_ns >= self.last_intended:
            self.last_intended, self.last_sent = intended_ns, sent_ns

    @property
    def sent(self) -> int:
        return sum(self.outcomes.values()) - self.outcomes["not_sent"]

    def accounted(self) -> int:
        o = self.outcomes
        return o["ok"] + o["rejected"] + sum(self.errors.values()) + o["timeout"] + o["not_sent"]

    def invariant_ok(self) -> bool:
        """scheduled = ok + rejected + errors + timeouts + not_sent."""
        return self.scheduled == self.accounted()

    def merge(self, other: RunStats) -> None:
        self.scheduled += other.scheduled
        for mine, theirs in ((self.outcomes, other.outcomes), (self.errors, other.errors),
                             (self.not_sent, other.not_sent)):
            mine.update(theirs)
        for code, detail in other.error_examples.items():
            self._example(code, detail)
        for mine_h, theirs_h in ((self.latency, other.latency), (self.from_send, other.from_send),
                                 (self.lag, other.lag)):
            mine_h.add(theirs_h)
        self.clamped += other.clamped
        if other.first_sent and (not self.first_sent or other.first_intended < self.first_intended):
            self.first_intended, self.first_sent = other.first_intended, other.first_sent
        if other.last_intended >= self.last_intended and other.last_sent:
            self.last_intended, self.last_sent = other.last_intended, other.last_sent
        self.last_done = max(self.last_done, other.last_done)

    def to_wire(self) -> dict[str, Any]:
        """A picklable/JSON form (histograms HDR-encoded) for sending from a worker process."""
        d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(self).items()
             if not isinstance(v, HdrHistogram)}
        d.update({k: base64.b64encode(v.encode()).decode() for k, v in vars(self).items()
                  if isinstance(v, HdrHistogram)})
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RunStats:
        s = cls()
        for k, v in d.items():
            if isinstance(getattr(s, k), HdrHistogram):
                setattr(s, k, HdrHistogram.decode(base64.b64decode(v)))
            elif isinstance(getattr(s, k), Counter):
                setattr(s, k, Counter(v))
            else:
                setattr(s, k, v)
        return s


def percentiles_ms(h: HdrHistogram, points: tuple[float, ...] = (50, 95, 99)) -> dict[str, float]:
    """{'p50': ms, 'p95': ms, 'p99': ms, 'max': ms} from a microsecond histogram (zeros when empty)."""
    if h.get_total_count() == 0:
        return {**{f"p{p:g}": 0.0 for p in points}, "max": 0.0}
    out = {f"p{p:g}": h.get_value_at_percentile(p) / 1000 for p in points}
    out["max"] = h.get_max_value() / 1000
    return out


def percentiles_us(h: HdrHistogram) -> dict[str, float]:
    return {k: v * 1000 for k, v in percentiles_ms(h, (50, 99)).items()}
