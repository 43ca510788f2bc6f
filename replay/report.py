"""The final report of a run: the JSON fields the CLI writes and the harness reads, and its
verdict against thresholds (`judge`, k6-style: each threshold passes or fails with its numbers)."""

from __future__ import annotations

import errno
import os
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from replay.stats import RunStats, percentiles_ms, percentiles_us

if TYPE_CHECKING:   # the options import the senders
    from replay.options import ReplayOptions

# --salvage: calls a damaged recording lost are not sent with this reason, and one problem line starting
# with DAMAGE_PREFIX says how many ("an unknown number" when no count can tell).
DAMAGED_RECORDING = "damaged_recording"
DAMAGE_PREFIX = "recording damaged: "
_UNKNOWN_LOSS = DAMAGE_PREFIX + "an unknown number"


@dataclass
class ReplayReport:
    """What a run did. `invariant_ok`: scheduled == ok + rejected + errors + timeouts + not_sent.

    `workers`: one entry per worker process (one for a plain run), `worker_share`'s fields.
    `error_reasons`: {error code: why its first call failed, in words}. `thresholds`, `failures` and
    `passed` are the verdict, set by `judge` (the CLI judges every run; `passed` is None until then):
    each threshold is {name, limit, actual, passed, unit, detail}, each failure one line."""

    scheduled: int
    sent: int
    ok: int
    rejected: int
    errors: dict[str, int]
    timeouts: int
    not_sent: int
    not_sent_reasons: dict[str, int]
    duration_s: float
    achieved_rate: float
    latency_ms: dict[str, float]
    latency_from_send_ms: dict[str, float]
    lag_us: dict[str, float]
    drift_pct: float
    end_lag_us: float
    mismatches: dict[str, Any]
    invariant_ok: bool
    target: str = ""
    speed: float = 1.0
    seed: int = 0
    workers: list[dict[str, Any]] = field(default_factory=list)  # each worker's share (worker_share)
    problems: list[str] = field(default_factory=list)
    error_reasons: dict[str, str] = field(default_factory=dict)
    thresholds: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    passed: bool | None = None

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def never_reached(self) -> bool:
        """Every call sent failed before the target answered (refused, unreachable, a TLS handshake that
        failed): the service itself was never measured."""
        if not self.sent or self.ok or self.rejected or self.timeouts or not self.errors:
            return False
        return all(code in _LOCAL_CODES or self.error_reasons.get(code, "").startswith(_UNREACHED)
                   for code in self.errors)

    @property
    def broken(self) -> bool:
        """The run is not a measurement of the service: its accounting does not add up, calls were lost to
        a damaged recording without a limit saying how many may be, or no call reached the target (exit 1,
        not a threshold's 99)."""
        return not self.invariant_ok or self.never_reached or any(f.startswith(DAMAGE_PREFIX) for f in self.failures)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _drift(stats: RunStats) -> tuple[float, float]:
    """(total drift: how late the last send was, in percent of the intended span; that lag in us).

    Measured at the end, as tcpreplay measures its total time error: a scheduler that sleeps
    relative to the previous send accumulates its errors here; an absolute schedule does not."""
    if not stats.last_sent:
        return 0.0, 0.0
    end_lag = stats.last_sent - stats.last_intended
    intended = stats.last_intended - stats.first_intended
    return (round(100.0 * end_lag / intended, 4) if intended > 0 else 0.0), end_lag / 1000


def worker_share(worker: int, stats: RunStats, *, complete: bool = True) -> dict[str, Any]:
    """One worker's part of a run: {worker, scheduled, sent, ok, rejected, errors, timeouts, not_sent,
    lag_p99_us, latency_p99_ms, complete} (complete: False when its final counts never came)."""
    o = stats.outcomes
    return {"worker": worker, "scheduled": stats.scheduled, "sent": stats.sent, "ok": o["ok"],
            "rejected": o["rejected"], "errors": sum(stats.errors.values()), "timeouts": o["timeout"],
            "not_sent": o["not_sent"], "lag_p99_us": percentiles_us(stats.lag)["p99"],
            "latency_p99_ms": percentiles_ms(stats.latency)["p99"], "complete": complete}


class Summarizes(Protocol):
    """What the report reads of a comparison: a Comparer, or the merged summaries of several workers."""

    def summary(self) -> dict[str, Any]: ...


def build(stats: RunStats, t0_ns: int, end_ns: int, *, target: str, options: ReplayOptions, problems: list[str],
          comparer: Summarizes | None = None, workers: list[dict[str, Any]] | None = None) -> ReplayReport:
    """Assemble the report from (merged) stats; `options` is a ReplayOptions. `workers`: each
    worker's share (`worker_share`), default the one process that ran."""
    duration = max(0, end_ns - t0_ns) / 1e9
    span = (stats.last_sent - t0_ns) / 1e9 if stats.last_sent else 0.0  # from t0: a late start counts
    sent = stats.sent
    rate = sent / span if span > 0 else (sent / duration if duration > 0 else 0.0)
    drift_pct, end_lag = _drift(stats)
    o = stats.outcomes
    unknown = stats.not_sent.get("unknown_method", 0)
    if unknown:
        problems = [*problems, f"{unknown} calls not sent: their method is unknown (recorded on a connection "
                    "joined mid-stream); `shadowtest inspect FILE` lists their groups: name them with "
                    "--method-map FLOW:REF=METHOD, or `shadowtest infer FILE`"]
    return ReplayReport(
        scheduled=stats.scheduled, sent=sent, ok=o["ok"], rejected=o["rejected"], errors=dict(stats.errors),
        timeouts=o["timeout"], not_sent=o["not_sent"], not_sent_reasons=dict(stats.not_sent),
        duration_s=round(duration, 3), achieved_rate=round(rate, 1),
        latency_ms=percentiles_ms(stats.latency), latency_from_send_ms=percentiles_ms(stats.from_send),
        lag_us=percentiles_us(stats.lag), drift_pct=drift_pct, end_lag_us=end_lag,
        mismatches=comparer.summary() if comparer is not None else {},
        invariant_ok=stats.invariant_ok(), target=target, speed=options.schedule.speed,
        seed=options.schedule.seed,
        workers=workers if workers is not None else [worker_share(0, stats)], problems=list(problems),
        error_reasons={code: error_reason(code, detail, target) for code, detail in stats.error_examples.items()})


def _invariant_failure(rep: ReplayReport) -> str:
    accounted = rep.ok + rep.rejected + rep.error_count + rep.timeouts + rep.not_sent
    if accounted == rep.scheduled:  # the sums hold, but a shard was never counted (a worker died)
        lost = [p for p in rep.problems if "died" in p]
        return "invariant broken: " + ("; ".join(lost) or "not every call could be accounted for")
    return (f"invariant broken: {rep.scheduled} calls scheduled but {accounted} accounted for "
            "(ok + rejected + errors + timeouts + not sent)")


# Details that the client wrote itself about reaching the target (not a message from the server):
# the h2 sender's and grpcio's connect failures, and the http1/tcp senders' str(OSError).
_CONNECT_PREFIXES = ("cannot connect:", "failed to connect to all addresses")
_OS_ERROR_CODES = frozenset({"CONNECTION", "CONNECTION_REFUSED", "CONNECTION_RESET"})
_LOCAL_CODES = _OS_ERROR_CODES | {"TLS"}
_UNREACHED = ("connection refused by ", "cannot connect to ", *_CONNECT_PREFIXES)   # error_reason's words
_ERRNO = re.compile(r"\[Errno (\d+)\]")


def error_reason(code: str, detail: str, target: str) -> str:
    """One error detail in words, on one line: a refused connection reads "connection refused by
    HOST:PORT", another failure to connect "cannot connect to HOST:PORT: <why>"; a server's own
    message (grpc-message) is kept as it is."""
    text = " ".join(detail.split())
    local = code in _OS_ERROR_CODES or text.startswith(_CONNECT_PREFIXES)
    if not local:
        return text
    found = _ERRNO.search(text)
    num = int(found.group(1)) if found else None
    if num == errno.ECONNREFUSED or (num is None and "connection refused" in text.lower()):
        return f"connection refused by {target}"
    if num is not None and (text.startswith(_CONNECT_PREFIXES) or code == "CONNECTION_REFUSED"):
        return f"cannot connect to {target}: {os.strerror(num).lower()}"
    return text


_SHOWN_KINDS = 5


def error_lines(rep: ReplayReport) -> list[str]:
    """"20 calls UNAVAILABLE: first: connection refused by 127.0.0.1:1", one per error code, the
    most frequent first (at most five, then how many more)."""
    kinds = sorted(rep.errors.items(), key=lambda kv: (-kv[1], kv[0]))
    lines = []
    for code, n in kinds[:_SHOWN_KINDS]:
        reason = rep.error_reasons.get(code)
        lines.append(f"{n} call{'' if n == 1 else 's'} {code}" + (f": first: {reason}" if reason else ""))
    if len(kinds) > _SHOWN_KINDS:
        lines.append(f"... and {len(kinds) - _SHOWN_KINDS} more kinds of error")
    return lines


@dataclass(frozen=True)
class Thresholds:
    """Limits a run must keep (None: not judged), k6-style. Percentages are of the calls sent
    (errors, rejected) or scheduled (not sent); latency and lag are the report's own p99s.

    max_error_pct: errors + timeouts (connection errors included) in % of sent; rejections
        (RESOURCE_EXHAUSTED, HTTP 429: the target shedding load) are not errors, see max_rejected_pct.
    max_rejected_pct: rejected in % of sent. max_not_sent_pct: not sent (every reason) in % of scheduled.
    max_p99_ms: latency p99 from the intended send time (every call sent, whatever its outcome).
    max_lag_p99_us: the replayer's own send lag p99 (how late it sent; a run above it was not faithful).
    min_ok: at least this many calls ok. None: 1 when at least one call was scheduled (a run in which
        nothing succeeded fails); 0 turns it off.
    max_mismatch_pct: with --compare, calls whose response differs from the recording in % of the
        calls compared. None: 0, any mismatch fails (compare is a gate)."""

    max_error_pct: float | None = None
    max_rejected_pct: float | None = None
    max_not_sent_pct: float | None = None
    max_p99_ms: float | None = None
    max_lag_p99_us: float | None = None
    min_ok: int | None = None
    max_mismatch_pct: float | None = None


def _pct(n: int, of: int) -> float:
    return round(100.0 * n / of, 4) if of else 0.0


def _num(x: float) -> str:
    return f"{x:,.4f}".rstrip("0").rstrip(".")


def _check(name: str, limit: float, actual: float, unit: str, detail: str, *, at_least: bool = False) -> dict[str, Any]:
    passed = actual >= limit if at_least else actual <= limit
    return {"name": name, "limit": limit, "actual": actual, "passed": passed, "unit": unit, "detail": detail}


def judge(rep: ReplayReport, limits: Thresholds) -> ReplayReport:
    """Judge `rep` against `limits`: fills rep.thresholds, rep.failures (one line each, with the
    numbers) and rep.passed (the invariant and every threshold). Returns `rep`."""
    checks: list[dict[str, Any]] = []
    sent, scheduled, failed = rep.sent, rep.scheduled, rep.error_count + rep.timeouts
    of_sent = f"of {sent} sent"
    if limits.max_error_pct is not None:
        checks.append(_check("max_error_pct", limits.max_error_pct, _pct(failed, sent), "%",
                             f"{rep.error_count} errors + {rep.timeouts} timeouts {of_sent}"))
    if limits.max_rejected_pct is not None:
        checks.append(_check("max_rejected_pct", limits.max_rejected_pct, _pct(rep.rejected, sent), "%",
                             f"{rep.rejected} rejected {of_sent}"))
    if limits.max_not_sent_pct is not None:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(rep.not_sent_reasons.items()))
        checks.append(_check("max_not_sent_pct", limits.max_not_sent_pct, _pct(rep.not_sent, scheduled), "%",
                             f"{rep.not_sent} not sent of {scheduled} scheduled" + (f": {reasons}" if reasons else "")))
    if limits.max_p99_ms is not None:
        checks.append(_check("max_p99_ms", limits.max_p99_ms, rep.latency_ms["p99"], "ms",
                             f"latency from the intended send time, {sent} calls sent"))
    if limits.max_lag_p99_us is not None:
        checks.append(_check("max_lag_p99_us", limits.max_lag_p99_us, rep.lag_us["p99"], "us",
                             f"the replayer's send lag, {sent} calls sent"))
    min_ok = limits.min_ok if limits.min_ok is not None else (1 if scheduled else 0)
    if min_ok:
        checks.append(_check("min_ok", min_ok, rep.ok, "calls", f"{rep.ok} ok of {scheduled} scheduled",
                             at_least=True))
    if rep.mismatches:   # --compare ran: a gate, any mismatch fails unless --max-mismatch-pct allows it
        checks.append(_mismatch_check(rep.mismatches, limits.max_mismatch_pct))
    rep.thresholds = checks
    rep.failures = ([] if rep.invariant_ok else [_invariant_failure(rep)]) + _damage_failure(rep, limits) \
        + [_failure(rep, c) for c in checks if not c["passed"]]
    rep.passed = not rep.failures
    return rep


def _damage_failure(rep: ReplayReport, limits: Thresholds) -> list[str]:
    """A --salvage run that lost calls to a damaged recording fails unless --max-not-sent-pct says how
    many calls not sent (these included) are acceptable: lost calls are never silently absent."""
    lost = rep.not_sent_reasons.get(DAMAGED_RECORDING, 0)
    unknown = any(p.startswith(_UNKNOWN_LOSS) for p in rep.problems)
    if not (lost or unknown) or limits.max_not_sent_pct is not None:
        return []
    what = "an unknown number of calls" if unknown else f"{lost} call{'' if lost == 1 else 's'}"
    return [f"{DAMAGE_PREFIX}{what} lost to damage (not sent: {DAMAGED_RECORDING}); pass --max-not-sent-pct P "
            "to accept that loss"]


_SHOWN_MISMATCHES = 3


def mismatch_where(call: dict[str, Any]) -> str:
    """"call 5 (flow 1, POST /orders/5): $.price: 10 != 11; status: 200 != 500" for one mismatched call."""
    flow = f"flow {call['flow']}, " if call.get("flow") is not None else ""
    return f"call {call['index']} ({flow}{call.get('method') or '?'}): {'; '.join(call['diffs'])}"


def _mismatch_check(mismatches: dict[str, Any], limit: float | None) -> dict[str, Any]:
    by = mismatches.get("by_method", {})
    compared = mismatches.get("compared", sum(e.get("compared", 0) for e in by.values()))
    differ = int(mismatches.get("total", 0))
    detail = f"{differ} of {compared} compared calls differ from the recording"
    calls = mismatches.get("calls", [])
    if calls:
        more = f"; and {differ - _SHOWN_MISMATCHES} more" if differ > _SHOWN_MISMATCHES else ""
        detail += ": " + " | ".join(mismatch_where(c) for c in calls[:_SHOWN_MISMATCHES]) + more
    return _check("max_mismatch_pct", 0.0 if limit is None else limit, _pct(differ, compared), "%", detail)


def _failure(rep: ReplayReport, c: dict[str, Any]) -> str:
    unit = "" if c["unit"] == "calls" else f" {c['unit']}"
    if c["name"] == "min_ok":
        head = "no call succeeded" if rep.ok == 0 else f"too few calls succeeded (min_ok {c['limit']})"
        cause = _cause(rep)
        return f"{head}: {c['detail']}" + (f"; {cause}" if cause else "")
    return (f"threshold {c['name']} failed: {_num(c['actual'])}{unit} > {_num(c['limit'])}{unit} "
            f"({c['detail']})")


def _cause(rep: ReplayReport) -> str:
    """What happened to the calls that did not succeed, most telling first."""
    parts = error_lines(rep)[:1]
    if rep.timeouts:
        parts.append(f"{rep.timeouts} timeouts")
    if rep.rejected:
        parts.append(f"{rep.rejected} rejected")
    if rep.not_sent:
        parts.append("not sent: " + ", ".join(f"{k} {v}" for k, v in sorted(rep.not_sent_reasons.items())))
    return "; ".join(parts)


def threshold_line(c: dict[str, Any]) -> str:
    """"FAILED max_error_pct: 100 % (limit 5 %): 20 errors + 0 timeouts of 20 sent"."""
    unit = "" if c["unit"] == "calls" else f" {c['unit']}"
    op = ">=" if c["name"].startswith("min_") else "<="
    return (f"{'passed' if c['passed'] else 'FAILED'} {c['name']}: {_num(c['actual'])}{unit} "
            f"(limit {op} {_num(c['limit'])}{unit}): {c['detail']}")
