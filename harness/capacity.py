"""`shadowtest capacity`: how much load a service takes before an SLO breaks, and whether its limiter
refuses calls before that.

    rates (--steps, or --start/--step/--max) --> one step at a time, open loop:
        harness.traffic.TrafficRun (the generator, or a recording time-warped to the step's rate)
            --> replay.engine.ReplayRun --> target           (latency from each call's intended send)
        target CPU: /proc/PID/stat over the step's send window; the agent's /metrics before and after
    --> StepResult per step, judged against the SLOs (held or broke, with the numbers)
    --> stop at the first step that breaks (--confirm: only when its re-run at the same rate breaks too)
    --> Knee: the last step that held before that break, where the limiter first refused
    --> verdicts (--expect), JSON, PNG, and the chaos runner's JUnit/Markdown writers

Steps are separate replays back to back: each step's calls are all answered (or timed out) before
the next step starts, so a step's P99 is its own calls' and a slow tail never leaks into the next
step. Memory is bounded by one step's calls (MAX_STEP_CALLS).
"""

from __future__ import annotations

import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from harness.checks.base import Verdict
from harness.errors import HarnessError
from harness.outputs import stamped
from harness.scenario import GeneratorTraffic, MetricNames, RecordingTraffic, Traffic
from harness.timeline import CallResult
from wire.stats import percentile

MAX_STEPS = 100
MAX_STEP_CALLS = 500_000          # one step's results are held until it is judged: bounded
DEFAULT_SLOS = ("p99<20ms", "errors<0.5%")
SHOWN_PERCENTILES = ("p50", "p95", "p99")
FEW_SAMPLES = 100                 # below this a step's p99 is its slowest call or close to it
_START_DELAY_S = 0.3              # as the chaos runner: the replayer builds its senders before t0
_STOP_GRACE_S = 3.0
_REJECTED = 'agent_requests_total{outcome="rejected"}'
_LIMITER_RATE = "agent_limiter_rate"
EXPECTATIONS = ("capacity_at_least=RATE", "limiter_engages_before_knee")


class CapacityError(HarnessError):
    """A capacity run cannot start or cannot go on (unreachable target, empty recording, bad input)."""


# ---- SLOs, steps, expectations: parsed from the command line, one-line errors --------------------------
@dataclass(frozen=True)
class Slo:
    """One objective a step must meet: `metric` is a latency percentile (pNN, from the intended send
    time, in ms), `errors` or `rejected` (% of the step's calls). `op` is < or <=."""

    text: str
    metric: str
    op: str
    limit: float           # ms for a percentile, % otherwise
    unit: str              # "ms" or "%"

    @property
    def quantile(self) -> float | None:
        """0..1 for a percentile objective (p99.9 -> 0.999), None for errors/rejected."""
        return float(self.metric[1:]) / 100.0 if self.metric.startswith("p") else None

    def holds(self, value: float | None) -> bool:
        """Whether `value` meets the objective; an unknown value (no call answered) never does."""
        if value is None:
            return False
        return value < self.limit if self.op == "<" else value <= self.limit


_SLO = re.compile(r"^\s*([a-z]+[0-9.]*)\s*(<=|<)\s*([0-9]*\.?[0-9]+)\s*([a-z%]*)\s*$")
_TIME_UNITS = {"ms": 1.0, "s": 1000.0, "us": 0.001}
_SLO_HELP = "expected METRIC<LIMIT: pNN (p50, p99, p99.9) with ms, s or us, or errors/rejected with %, " \
            "e.g. p99<20ms or errors<0.5%"


def parse_slo(text: str) -> Slo:
    """`p99<20ms`, `p99.9<=0.2s`, `errors<0.5%`, `rejected<=0%` -> Slo; CapacityError (one line) otherwise."""
    m = _SLO.match(text.lower())
    if not m:
        raise CapacityError(f"{text!r}: {_SLO_HELP}")
    metric, op, number, unit = m.groups()
    limit = float(number)
    if re.fullmatch(r"p[0-9]+(\.[0-9]+)?", metric):
        if not 0 < float(metric[1:]) < 100:
            raise CapacityError(f"{text!r}: a percentile is between p0 and p100 (exclusive), e.g. p99")
        if unit not in _TIME_UNITS:
            raise CapacityError(f"{text!r}: give the latency's unit (ms, s or us), e.g. {metric}<20ms")
        limit, unit = limit * _TIME_UNITS[unit], "ms"
    elif metric in ("errors", "rejected"):
        if unit != "%":
            raise CapacityError(f"{text!r}: {metric} is a share of the step's calls: give it in %, "
                                f"e.g. {metric}<0.5%")
        if limit > 100:
            raise CapacityError(f"{text!r}: a share above 100% always holds")
    else:
        raise CapacityError(f"{text!r}: unknown metric {metric!r}; {_SLO_HELP}")
    if op == "<" and limit <= 0:
        raise CapacityError(f"{text!r}: nothing is below 0; use <= 0 for 'none at all'")
    return Slo(text.strip(), metric, op, limit, unit)


def parse_steps(text: str) -> list[float]:
    """`100,200,400` -> [100.0, 200.0, 400.0]: positive and rising, at most MAX_STEPS."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CapacityError(f"{text!r}: expected calls/s separated by commas, e.g. 100,200,400") from None
    return check_rates(rates, repr(text))


def ramp_steps(start: float, step: float, top: float) -> list[float]:
    """--start/--step/--max -> start, start+step, ... up to `top` (included when it falls on a step)."""
    if start <= 0 or step <= 0:
        raise CapacityError(f"--start {start:g} --step {step:g}: both must be above 0 calls/s")
    if top < start:
        raise CapacityError(f"--max {top:g} is below --start {start:g}: the steps must rise")
    count = math.floor((top - start) / step + 1e-9) + 1
    if count > MAX_STEPS:
        raise CapacityError(f"--start {start:g} --step {step:g} --max {top:g} makes {count} steps; at most "
                            f"{MAX_STEPS}: take a larger --step")
    return check_rates([round(start + i * step, 6) for i in range(count)], "--start/--step/--max")


def check_rates(rates: list[float], what: str) -> list[float]:
    """The rates when they are finite, above 0, strictly rising and at most MAX_STEPS; else CapacityError."""
    if not rates:
        raise CapacityError(f"{what}: no rate given")
    if len(rates) > MAX_STEPS:
        raise CapacityError(f"{what}: {len(rates)} steps; at most {MAX_STEPS}")
    bad = next((r for r in rates if not math.isfinite(r) or r <= 0), None)
    if bad is not None:
        raise CapacityError(f"{what}: {bad:g} calls/s; every rate must be above 0")
    for a, b in zip(rates, rates[1:], strict=False):
        if b <= a:
            raise CapacityError(f"{what}: the steps must rise, but {b:g} follows {a:g}")
    return rates


def check_step_size(rates: list[float], step_s: float) -> None:
    """CapacityError when the largest step would hold more than MAX_STEP_CALLS calls (memory is one step's)."""
    calls = max(rates) * step_s
    if calls > MAX_STEP_CALLS:
        raise CapacityError(f"a step of {max(rates):g}/s for {step_s:g}s is {calls:.0f} calls; at most "
                            f"{MAX_STEP_CALLS} a step: shorten --step-s")


@dataclass(frozen=True)
class Expectation:
    """One --expect: `capacity_at_least` (with `rate`) or `limiter_engages_before_knee`."""

    kind: str
    rate: float | None = None

    @property
    def id(self) -> str:
        return f"{self.kind}={self.rate:g}" if self.rate is not None else self.kind


def parse_expect(text: str) -> Expectation:
    """`capacity_at_least=300` (or 300/s) or `limiter_engages_before_knee`; CapacityError otherwise."""
    name, sep, value = text.strip().partition("=")
    if name == "limiter_engages_before_knee" and not sep:
        return Expectation(name)
    if name == "capacity_at_least" and sep:
        try:
            rate = float(value.strip().removesuffix("/s"))
        except ValueError:
            rate = -1.0
        if math.isfinite(rate) and rate > 0:
            return Expectation(name, rate)
        raise CapacityError(f"{text!r}: the rate is calls/s above 0, e.g. capacity_at_least=300")
    raise CapacityError(f"{text!r}: expected one of {', '.join(EXPECTATIONS)}")


# ---- one step's result ------------------------------------------------------------------------------
@dataclass
class StepResult:
    """What one step did: counts by outcome, latency percentiles (ms, from the intended send time, over
    the calls the target admitted: ok and timed out), the target's CPU, and how it met the SLOs."""

    index: int
    rate: float                               # the step's nominal rate, calls/s
    duration_s: float
    offered: int                              # calls due in the step (whatever became of them)
    ok: int
    rejected: int                             # RESOURCE_EXHAUSTED / HTTP 429: the limiter refused them
    errors: int                               # errors, connection errors
    timeouts: int
    not_sent: int                             # the replayer's in-flight cap (the target fell behind)
    percentiles_ms: dict[str, float | None] = field(default_factory=dict)
    latency_samples: int = 0
    cpu_pct: float | None = None              # the target's CPU, % of one core, over the send window
    rejected_server: int | None = None        # the agent's own count of refusals (its /metrics)
    limiter_rate: float | None = None         # the agent's limiter rate at the end of the step
    client_lag_p99_ms: float | None = None    # the replayer's own send lag: large = the client's limit
    error_reasons: dict[str, str] = field(default_factory=dict)
    confirm_of: int | None = None             # --confirm: the index of the step this one re-ran
    breaches: list[str] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return not self.breaches

    @property
    def offered_rate(self) -> float:
        return self.offered / self.duration_s

    @property
    def goodput(self) -> float:
        """OK calls per second of the step (achieved rate)."""
        return self.ok / self.duration_s

    @property
    def error_pct(self) -> float:
        """Errors + timeouts + calls not sent, % of the calls offered (refusals are not errors)."""
        return 100.0 * (self.errors + self.timeouts + self.not_sent) / self.offered if self.offered else 0.0

    @property
    def rejected_pct(self) -> float:
        return 100.0 * self.rejected / self.offered if self.offered else 0.0

    def value(self, slo: Slo) -> float | None:
        """The step's value of the objective's metric."""
        if slo.metric == "errors":
            return self.error_pct if self.offered else None
        if slo.metric == "rejected":
            return self.rejected_pct if self.offered else None
        return self.percentiles_ms.get(slo.metric)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(held=self.held, offered_rate=round(self.offered_rate, 3), goodput=round(self.goodput, 3),
                   error_pct=round(self.error_pct, 4), rejected_pct=round(self.rejected_pct, 4),
                   p50_ms=self.percentiles_ms.get("p50"), p99_ms=self.percentiles_ms.get("p99"))
        return out


def summarise(calls: list[CallResult], index: int, rate: float, duration_s: float, slos: list[Slo],
              confirm_of: int | None = None) -> StepResult:
    """One step's calls -> its StepResult, judged against `slos` (`breaches` says which broke and by how much)."""
    counts = dict.fromkeys(("ok", "rejected", "error", "timeout", "not_sent"), 0)
    latencies: list[float] = []
    for c in calls:
        counts[c.outcome if c.outcome in counts else "error"] += 1
        if c.outcome in ("ok", "timeout") and c.latency_ms is not None:
            latencies.append(c.latency_ms)   # a timeout is an admitted call that took at least that long
    latencies.sort()
    wanted = dict.fromkeys(SHOWN_PERCENTILES) | {s.metric: None for s in slos if s.quantile is not None}
    pcts = {name: (round(percentile(latencies, float(name[1:]) / 100.0), 3) if latencies else None)
            for name in wanted}
    step = StepResult(index, rate, duration_s, len(calls), counts["ok"], counts["rejected"], counts["error"],
                      counts["timeout"], counts["not_sent"], pcts, len(latencies), confirm_of=confirm_of)
    step.breaches = breaches(step, slos)
    return step


def breaches(step: StepResult, slos: list[Slo]) -> list[str]:
    """One line per objective the step broke, with its value and the limit."""
    out = []
    for slo in slos:
        value = step.value(slo)
        if slo.holds(value):
            continue
        shown = "unknown (no call answered)" if value is None else f"{value:.3g} {slo.unit}".replace(" %", "%")
        limit = f"{slo.limit:g} {slo.unit}".replace(" %", "%")
        out.append(f"{slo.metric} {shown} {'>=' if slo.op == '<' else '>'} {limit} ({slo.text})")
    return out


# ---- the knee ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Knee:
    """Where the ramp ended. knee: the index of the last step that held before the break (None when the
    first step broke); broke: the index of the break that stood (None: no step broke, the ramp ran out);
    limiter: the first step with any refusal (None: the limiter never refused)."""

    knee: int | None
    broke: int | None
    limiter: int | None

    @property
    def bounded(self) -> bool:
        """Whether a step broke: without one the capacity is only known to be at least the last step."""
        return self.broke is not None


def find_knee(steps: list[StepResult]) -> Knee:
    """The knee of measured steps. A break stands unless its --confirm re-run (the next step, with
    `confirm_of` its index) held: then it was a blip and the ramp went on."""
    broke = None
    for i, step in enumerate(steps):
        if step.held:
            continue
        after = steps[i + 1] if i + 1 < len(steps) else None
        if after is not None and after.confirm_of == i and after.held:
            continue
        broke = i
        break
    before = steps if broke is None else steps[:broke]
    knee = max((i for i, s in enumerate(before) if s.held), default=None)
    limiter = next((i for i, s in enumerate(steps) if s.rejected > 0), None)
    return Knee(knee, broke, limiter)


def ramp(rates: list[float], confirm: bool, measure: Callable[[int, float, int | None], StepResult]
         ) -> Iterator[StepResult]:
    """Measure the steps in order (`measure(index, rate, confirm_of)`) until one breaks; with `confirm`
    a breaking step is measured once more at its rate, and only a second break ends the ramp."""
    index = 0
    for rate in rates:
        step = measure(index, rate, None)
        index += 1
        yield step
        if step.held:
            continue
        if not confirm:
            return
        again = measure(index, rate, step.index)
        index += 1
        yield again
        if not again.held:
            return


# ---- verdicts ---------------------------------------------------------------------------------------
def _step_text(step: StepResult) -> str:
    p99 = step.percentiles_ms.get("p99")
    return (f"step {step.index + 1} at {step.rate:g}/s: goodput {step.goodput:.1f}/s, p99 "
            f"{'-' if p99 is None else f'{p99:.3g} ms'}, errors {step.error_pct:.2f}%, "
            f"{step.rejected} refused")


def knee_verdict(steps: list[StepResult], knee: Knee) -> Verdict:
    """The measurement itself, as a verdict that always passes (so reports show the knee even without
    --expect): where it is and what broke after it."""
    if not steps:
        return Verdict("knee", "capacity", True, "no step measured", {})
    evidence = _evidence(steps, knee)
    if knee.broke is None:
        last = steps[-1]
        return Verdict("knee", "capacity", True, f"no step broke the SLOs up to {last.rate:g}/s: the capacity is "
                       f"at least that ({_step_text(last)})", evidence)
    broke = steps[knee.broke]
    why = f"{broke.rate:g}/s broke: {'; '.join(broke.breaches)}"
    if knee.knee is None:
        return Verdict("knee", "capacity", True, f"no knee: the first step already broke ({why})", evidence)
    return Verdict("knee", "capacity", True, f"knee {steps[knee.knee].rate:g}/s ({_step_text(steps[knee.knee])}); "
                   f"{why}", evidence)


def _evidence(steps: list[StepResult], knee: Knee) -> dict[str, Any]:
    return {"knee_rate": None if knee.knee is None else steps[knee.knee].rate,
            "broke_rate": None if knee.broke is None else steps[knee.broke].rate,
            "limiter_rate": None if knee.limiter is None else steps[knee.limiter].rate,
            "rates": [s.rate for s in steps], "p99_ms": [s.percentiles_ms.get("p99") for s in steps],
            "goodput": [round(s.goodput, 3) for s in steps], "rejected": [s.rejected for s in steps]}


def judge(expectation: Expectation, steps: list[StepResult], knee: Knee) -> Verdict:
    """The verdict of one --expect on the measured steps."""
    if expectation.kind == "capacity_at_least":
        return _capacity_at_least(expectation, steps, knee)
    return _limiter_before_knee(expectation, steps, knee)


def _capacity_at_least(exp: Expectation, steps: list[StepResult], knee: Knee) -> Verdict:
    assert exp.rate is not None
    evidence = _evidence(steps, knee) | {"at_least": exp.rate}
    if knee.knee is None:
        why = "no step measured" if not steps else \
            f"the first step, {steps[0].rate:g}/s, already broke: {'; '.join(steps[0].breaches)}"
        return Verdict(exp.id, exp.kind, False, f"no knee (0/s < {exp.rate:g}/s): {why}", evidence)
    at = steps[knee.knee]
    passed = at.rate >= exp.rate
    bound = "" if knee.bounded else " (no step broke: the capacity is at least that)"
    after = "" if knee.broke is None else f"; {steps[knee.broke].rate:g}/s broke: {'; '.join(steps[knee.broke].breaches)}"
    return Verdict(exp.id, exp.kind, passed, f"knee {at.rate:g}/s {'>=' if passed else '<'} {exp.rate:g}/s"
                   f"{bound} ({_step_text(at)}){after}", evidence)


def _limiter_before_knee(exp: Expectation, steps: list[StepResult], knee: Knee) -> Verdict:
    evidence = _evidence(steps, knee)
    first = None if knee.limiter is None else steps[knee.limiter]
    refused = "" if first is None else \
        f"the limiter first refused at {first.rate:g}/s (step {first.index + 1}: {first.rejected} of " \
        f"{first.offered} calls, {first.rejected_pct:.2f}%)"
    if knee.broke is None:
        if first is None:
            return Verdict(exp.id, exp.kind, True, f"nothing to judge: no step broke the SLOs up to "
                           f"{steps[-1].rate if steps else 0:g}/s and the limiter never refused", evidence,
                           skipped=True)
        return Verdict(exp.id, exp.kind, True, f"{refused}; no step broke the SLOs up to {steps[-1].rate:g}/s",
                       evidence)
    broke = steps[knee.broke]
    what = f"{broke.rate:g}/s (step {broke.index + 1}) broke: {'; '.join(broke.breaches)}"
    if first is None:
        total = sum(s.offered for s in steps)
        return Verdict(exp.id, exp.kind, False, f"the limiter never refused (0 RESOURCE_EXHAUSTED in {total} calls "
                       f"over {len(steps)} steps), but {what}", evidence)
    passed = knee.limiter is not None and knee.limiter <= knee.broke
    order = "at or before" if passed else "only after"
    return Verdict(exp.id, exp.kind, passed, f"{refused}, {order} the break: {what}", evidence)


# ---- traffic and target ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrafficSource:
    """What each step plays: the generator at the step's rate, or a recording time-warped so that it
    plays at the step's rate (`base_rate`: its own calls/s at speed 1)."""

    traffic: Traffic
    base_rate: float | None = None

    def for_rate(self, rate: float, duration_s: float, seed: int) -> tuple[Traffic, list[tuple[float, float, float]]]:
        """The traffic and its one-phase load profile (TrafficRun's arguments) for one step."""
        if isinstance(self.traffic, GeneratorTraffic):
            return replace(self.traffic, rate=rate, seed=seed), [(0.0, duration_s, 1.0)]
        assert self.base_rate
        return self.traffic, [(0.0, duration_s, rate / self.base_rate)]

    def describe(self) -> dict[str, Any]:
        if isinstance(self.traffic, GeneratorTraffic):
            return {"kind": "generator", "pattern": self.traffic.pattern}
        return {"kind": "recording", "path": self.traffic.path, "base_rate": round(self.base_rate or 0.0, 3)}


def generator_source(pattern: str) -> TrafficSource:
    """The built-in generator (unary Decide calls, `pattern` arrivals); each step sets its rate."""
    return TrafficSource(GeneratorTraffic(rate=1.0, pattern=pattern))


def recording_source(path: str) -> TrafficSource:
    """A recording played in a loop at any rate; CapacityError when it plays no calls."""
    from harness.scenario import UNTIL_END
    from harness.traffic import recording_span

    traffic = RecordingTraffic(path, loop=UNTIL_END)
    span = recording_span(traffic)
    if not span.calls or span.pass_s <= 0:
        raise CapacityError(f"{path}: the recording plays no calls; record some traffic first "
                            f"(`shadowtest inspect {path}` shows what it holds)")
    return TrafficSource(traffic, span.calls / span.pass_s)


def probe(address: str, timeout_s: float = 2.0) -> None:
    """Connect once to `address`; CapacityError (one line) when nothing listens there."""
    from replay.target import split_target

    host, port = split_target(address)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise CapacityError(f"cannot reach {address}: {exc.strerror or exc}; is the service listening "
                            f"there?") from exc


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) of process `pid` from /proc/PID/stat; None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        fields = text.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None


def _scrape(url: str | None) -> dict[str, float]:
    """The agent's refusal counter and limiter rate, or {} when there is no endpoint or it fails."""
    if not url:
        return {}
    from harness.observe import scrape

    try:
        return scrape(url, MetricNames(), timeout_s=2.0)
    except (OSError, ValueError):
        return {}


@dataclass
class StepRunner:
    """Plays one step at a time to `address` and measures it (see the module docstring)."""

    address: str
    source: TrafficSource
    slos: list[Slo]
    step_s: float
    timeout_s: float = 2.0
    seed: int = 0
    pid: int | None = None
    metrics_url: str | None = None
    tls: Any = None

    def measure(self, index: int, rate: float, confirm_of: int | None = None,
                duration_s: float | None = None) -> StepResult:
        """Play `rate` calls/s for the step's duration, wait for every call's fate, summarise."""
        from harness.traffic import TrafficRun

        duration = duration_s or self.step_s
        check_step_size([rate], duration)
        traffic, profile = self.source.for_rate(rate, duration, self.seed + index)
        before = _scrape(self.metrics_url)
        t0 = time.monotonic() + _START_DELAY_S
        run = TrafficRun(traffic, profile, self.address, int(t0 * 1e9), self.seed + index,
                         timeout_s=self.timeout_s, tls=self.tls)
        run.start()
        try:
            cpu = self._cpu_over(t0, duration)
            self._wait(run, t0 + duration + self.timeout_s + _STOP_GRACE_S)
        except BaseException:      # Ctrl-C: stop the replayer before the caller stops the target
            run.stop()
            run.join(_STOP_GRACE_S)
            raise
        if run.error is not None:
            raise CapacityError(f"the traffic failed at {rate:g}/s: {run.error}")
        step = summarise(run.snapshot(), index, rate, duration, self.slos, confirm_of)
        self._extras(step, run.report, before, _scrape(self.metrics_url), cpu)
        return step

    def _cpu_over(self, t0: float, duration: float) -> float | None:
        """The target's CPU (% of one core) from t0 to t0 + duration, read at both ends."""
        if self.pid is None:
            _sleep_until(t0 + duration)
            return None
        _sleep_until(t0)
        first, wall0 = cpu_seconds(self.pid), time.monotonic()
        _sleep_until(t0 + duration)
        last, wall1 = cpu_seconds(self.pid), time.monotonic()
        if first is None or last is None or wall1 <= wall0:
            return None
        return round(100.0 * (last - first) / (wall1 - wall0), 1)

    @staticmethod
    def _wait(run: Any, deadline: float) -> None:
        """Until the replayer has every call's fate; past `deadline` it is stopped (bounded)."""
        while not run.join(0.2):
            if time.monotonic() > deadline:
                run.stop()
                run.join(_STOP_GRACE_S)
                return

    @staticmethod
    def _extras(step: StepResult, report: dict[str, Any], before: dict[str, float], after: dict[str, float],
                cpu: float | None) -> None:
        step.cpu_pct = cpu
        if _REJECTED in after:
            step.rejected_server = int(after[_REJECTED] - before.get(_REJECTED, 0.0))
        step.limiter_rate = after.get(_LIMITER_RATE)
        if step.limiter_rate is not None and not math.isfinite(step.limiter_rate):
            step.limiter_rate = None          # +Inf: the limiter is off (JSON has no Infinity)
        lag = (report.get("lag_us") or {}).get("p99")
        step.client_lag_p99_ms = None if lag is None else round(lag / 1000.0, 3)
        step.error_reasons = dict(list((report.get("error_reasons") or {}).items())[:8])


def _sleep_until(when: float) -> None:
    """Sleep to monotonic time `when` in short naps (Ctrl-C is seen within 0.2 s)."""
    while (left := when - time.monotonic()) > 0:
        time.sleep(min(left, 0.2))


# ---- the report -------------------------------------------------------------------------------------
@dataclass
class CapacityReport:
    """Everything a run found, for the table, --json, the PNG and the reports."""

    rates: list[float]
    slos: list[Slo]
    step_s: float
    confirm: bool
    target: dict[str, Any]
    traffic: dict[str, Any]
    steps: list[StepResult] = field(default_factory=list)
    expectations: list[Expectation] = field(default_factory=list)
    warmup: StepResult | None = None
    interrupted: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def knee(self) -> Knee:
        return find_knee(self.steps)

    @property
    def verdicts(self) -> list[Verdict]:
        knee = self.knee
        return [knee_verdict(self.steps, knee)] + [judge(e, self.steps, knee) for e in self.expectations]

    @property
    def passed(self) -> bool:
        return self.interrupted is None and all(v.passed for v in self.verdicts)

    def as_dict(self) -> dict[str, Any]:
        knee, steps = self.knee, self.steps

        def at(i: int | None, **more: Any) -> dict[str, Any] | None:
            return None if i is None else {"index": i, "rate": steps[i].rate, **more}

        return stamped("capacity", {"target": self.target, "traffic": self.traffic,
                "slos": [asdict(s) for s in self.slos], "step_s": self.step_s, "confirm": self.confirm,
                "rates": self.rates, "steps": [s.as_dict() for s in steps],
                "warmup": None if self.warmup is None else self.warmup.as_dict(),
                "knee": at(knee.knee, goodput=round(steps[knee.knee].goodput, 3),
                           p99_ms=steps[knee.knee].percentiles_ms.get("p99")) if knee.knee is not None else None,
                "bounded": knee.bounded,
                "broke": at(knee.broke, breaches=steps[knee.broke].breaches) if knee.broke is not None else None,
                "limiter": at(knee.limiter, rejected=steps[knee.limiter].rejected)
                if knee.limiter is not None else None,
                "verdicts": [v.as_dict() for v in self.verdicts], "passed": self.passed,
                "interrupted": self.interrupted, "notes": self.notes})


def measurement_notes(report: CapacityReport) -> list[str]:
    """What a reader must know to trust the numbers: few samples, a client that fell behind."""
    notes = []
    few = [s for s in report.steps if s.latency_samples < FEW_SAMPLES]
    if few:
        notes.append(f"{len(few)} step(s) had fewer than {FEW_SAMPLES} answered calls (first: {few[0].rate:g}/s, "
                     f"{few[0].latency_samples}): their p99 is about their slowest call; lengthen --step-s")
    lagging = [s for s in report.steps if (s.client_lag_p99_ms or 0.0) > 5.0]
    if lagging:
        s = lagging[0]
        notes.append(f"the replayer itself sent late from {s.rate:g}/s (send lag p99 {s.client_lag_p99_ms:.1f} ms): "
                     "latency counts from the intended send, so that lag is in the p99; the client may be the "
                     "limit there, not the target")
    return notes


# ---- the PNG ----------------------------------------------------------------------------------------
def plot_capacity(report: CapacityReport, path: Path) -> None:
    """P99 (and P50) and goodput against offered load, the latency SLO lines, the knee and the first
    refusal marked. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, knee = report.steps, report.knee
    fig, (ax_lat, ax_rate) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    xs = [s.offered_rate for s in steps]
    for name, style in (("p50", "o--"), ("p99", "o-")):
        ys = [s.percentiles_ms.get(name) for s in steps]
        ax_lat.plot(xs, [math.nan if y is None else y for y in ys], style, label=f"{name.upper()} (from intended send)")
    for slo in (s for s in report.slos if s.quantile is not None):
        ax_lat.axhline(slo.limit, color="red", linewidth=1, label=f"SLO {slo.text}")
    if any(s.percentiles_ms.get("p99") for s in steps):
        from matplotlib.ticker import ScalarFormatter

        ax_lat.set_yscale("log")           # a saturated step's P99 is 10-1000x the others'
        ax_lat.yaxis.set_major_formatter(ScalarFormatter())
    ax_lat.set_ylabel("latency (ms)")
    ax_rate.plot(xs, [s.goodput for s in steps], "o-", label="goodput (OK/s)")
    ax_rate.plot(xs, [s.rejected / s.duration_s for s in steps], "s:", label="refused/s")
    if xs:
        ax_rate.plot([0, max(xs)], [0, max(xs)], color="gray", linewidth=0.6, label="goodput = offered")
    ax_rate.set_ylabel("calls/s")
    ax_rate.set_xlabel("offered load (calls/s)")
    _marks(ax_lat, ax_rate, steps, knee)
    for ax in (ax_lat, ax_rate):
        ax.legend(fontsize=7, loc="upper left")
    head = "no knee" if knee.knee is None else f"knee {steps[knee.knee].rate:g}/s"
    ax_lat.set_title(f"shadowtest capacity: {head}" + ("" if knee.bounded else " (no step broke)")
                     + (f" -- interrupted ({report.interrupted})" if report.interrupted else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _marks(ax_lat: Any, ax_rate: Any, steps: list[StepResult], knee: Knee) -> None:
    """The knee (green), the break (red) and the first refusal (purple) as vertical lines on both axes."""
    marks = [(knee.knee, "green", "-", "knee"), (knee.broke, "red", "--", "broke"),
             (knee.limiter, "purple", ":", "limiter first refused")]
    for index, colour, style, label in marks:
        if index is None:
            continue
        x = steps[index].offered_rate
        for ax in (ax_lat, ax_rate):
            ax.axvline(x, color=colour, linestyle=style, linewidth=1.2,
                       label=f"{label}: {steps[index].rate:g}/s")


# ---- the chaos runner's report writers (JUnit, Markdown) --------------------------------------------
def run_result(report: CapacityReport, scenario: Any) -> Any:
    """The report as the chaos runner's RunResult: one phase (and one period) per step, so its JUnit and
    Markdown writers show the verdicts and, per step, offered/s, goodput/s, outcomes, P50 and P99."""
    from harness.report import RunResult
    from harness.scenario import Phase
    from harness.timeline import PeriodStats, Timeline

    names = [f"step{s.index + 1}@{s.rate:g}/s" for s in report.steps]
    phases = [(n, i * report.step_s, (i + 1) * report.step_s) for i, n in enumerate(names)]
    threshold = next((s.limit for s in report.slos if s.metric == "p99"),
                     next((s.limit for s in report.slos if s.quantile is not None), 0.0))
    timeline = Timeline(report.step_s, threshold, phases, partial=report.interrupted is not None)
    timeline.periods = [PeriodStats(i, a, b, n, s.offered, s.ok, s.ok, s.rejected, s.errors, s.timeouts,
                                    s.not_sent, s.percentiles_ms.get("p50"), s.percentiles_ms.get("p95"),
                                    s.percentiles_ms.get("p99"))
                        for i, ((n, a, b), s) in enumerate(zip(phases, report.steps, strict=True))]
    scenario = replace(scenario, phases=tuple(Phase(n, report.step_s) for n in names))
    return RunResult(scenario, timeline, report.verdicts, interrupted=report.interrupted,
                     notes=list(report.notes))
