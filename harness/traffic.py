"""Traffic for a run: a recording replayed, or the built-in generator, both through the open-loop replayer.

The generator is turned into a replay plan (seeded arrivals + realistic snapshots from the agent's
market model), so both kinds give the same per-call results, the client-side truth the checks use:

    RecordingTraffic --plan_from_recording--+
                                             +--> warp (per-phase load) --> replay.engine.ReplayRun
    GeneratorTraffic --generator_plan-------+        --on_result--> TrafficRun.calls
                                                       (own thread; stop() at the end of the run)

How long the traffic lasts (`recording_span`, `coverage`): the generator is planned for the whole
run; a recording lasts its loop period / speed x loop, which `chaos validate` compares with what the
phases consume (their durations x load), and `loop: until_end` turns into as many passes as needed.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from typing import Any

from harness.errors import RunError
from harness.responses import INVALID
from harness.scenario import GeneratorTraffic, RecordingTraffic, Scenario, Traffic
from harness.timeline import CallResult

log = logging.getLogger(__name__)
DECIDE = "/shadowtest.agent.v1.TradingAgent/Decide"
DECIDE_STREAM = "/shadowtest.agent.v1.TradingAgent/DecideStream"
_CONNECTIONS = 4          # the generator spreads calls over a few connections, as several clients would
_STREAM_MESSAGES = 3
_STREAM_GAP_NS = 20_000_000


def generator_plan(traffic: GeneratorTraffic, duration_s: float, seed: int) -> Iterator[Any]:
    """PlannedCalls for `duration_s` of open-loop traffic; every random draw from one seeded Random."""
    from agent_under_test import arrivals
    from agent_under_test.market import MarketSim
    from replay.schedule import PlannedCall, PlannedMessage

    rng = random.Random(traffic.seed if traffic.seed is not None else seed)
    sim = MarketSim(random.Random(rng.random()))
    times = arrivals.PATTERNS.get(traffic.pattern)(traffic.rate, duration_s, rng)
    repeats = _Repeats(traffic, rng) if traffic.repeat_pct > 0 else None
    for index, offset in enumerate(times):
        stream = rng.random() < traffic.stream_share
        count = _STREAM_MESSAGES if stream else 1
        messages = [PlannedMessage(i * _STREAM_GAP_NS,
                                   (repeats.next(sim, index * 8 + i) if repeats else
                                    sim.next(index * 8 + i)).SerializeToString())
                    for i in range(count)]
        yield PlannedCall(index=index, due_ns=int(offset * 1e9), connection=f"gen-{index % _CONNECTIONS}",
                          protocol="grpc", method=DECIDE_STREAM if stream else DECIDE,
                          kind="bidi" if stream else "unary", messages=messages)


class _Repeats:
    """`repeat_pct`: that share of the snapshots is one sent before (drawn uniformly from the latest
    `repeat_pool` distinct ones, with this call's sequence id), the rest new from the market model. A
    repeat is the same book, ticks and position: what a response cache answers without the model."""

    def __init__(self, traffic: GeneratorTraffic, rng: random.Random) -> None:
        self.share, self.pool_size, self.rng = traffic.repeat_pct / 100.0, traffic.repeat_pool, rng
        self.pool: list[Any] = []
        self._next = 0

    def next(self, sim: Any, sequence_id: int) -> Any:
        if self.pool and self.rng.random() < self.share:
            msg = type(self.pool[0])()
            msg.CopyFrom(self.rng.choice(self.pool))
            msg.sequence_id = sequence_id
            return msg
        msg = sim.next(sequence_id)
        if len(self.pool) < self.pool_size:
            self.pool.append(msg)
        else:                                 # the oldest goes: repeats follow the market along
            self.pool[self._next] = msg
            self._next = (self._next + 1) % self.pool_size
        return msg


def base_duration(profile: list[tuple[float, float, float]]) -> float:
    """How much traffic (in seconds at load 1) the phases consume: each phase's duration times its load."""
    return sum((end - start) * load for start, end, load in profile)


def warp(plan: Iterator[Any], profile: list[tuple[float, float, float]]) -> Generator[Any, None, bool]:
    """Replay time-warped per phase: inside a phase with load L, base time runs L times as fast.

    A call due at base time u in phase i (base start b_i) is sent at start_i + (u - b_i) / L_i; its
    stream messages' offsets shrink by L_i too. Calls beyond the last phase are not planned. Returns
    (as the generator's value) True when the plan went on past the last phase, False when it ran dry.
    """
    bounds, b = [], 0.0
    for start, end, load in profile:
        bounds.append((b, b + (end - start) * load, start, load))
        b += (end - start) * load
    i = 0
    for call in plan:
        u = call.due_ns / 1e9
        while i < len(bounds) and u >= bounds[i][1]:
            i += 1
        if i >= len(bounds):
            return True
        base, _, start, load = bounds[i]
        if load == 1.0 and base == start:
            yield call
            continue
        msgs = [replace(m, offset_ns=int(m.offset_ns / load)) for m in call.messages]
        yield replace(call, due_ns=int((start + (u - base) / load) * 1e9), messages=msgs)
    return False


def run_time(base_s: float, profile: list[tuple[float, float, float]]) -> float:
    """The run time at which base (load-1) time `base_s` is played: `warp`'s mapping, for one instant
    (the end of the run for base time the phases never reach)."""
    b = 0.0
    for start, end, load in profile:
        span = (end - start) * load
        if base_s < b + span:
            return start + (base_s - b) / load
        b += span
    return profile[-1][1] if profile else 0.0


@dataclass(frozen=True)
class RecordingSpan:
    """One pass of a recording as the schedule plays it, in seconds of base time (its speed applied).

    pass_s: the loop period (the window's length, else the span of the calls plus their mean gap, as
    replay.schedule.build_plan loops); last_s: when the pass's last planned call is due (after the
    `methods` filter); gap_s: the mean gap between its planned calls; calls: how many it plans."""

    pass_s: float
    last_s: float
    gap_s: float
    calls: int

    def lasts_s(self, loops: int) -> float:
        """How long `loops` passes keep calls coming: to one mean gap after the last pass's last call."""
        if not self.calls:
            return 0.0
        return round((loops - 1) * self.pass_s + min(self.pass_s, self.last_s + self.gap_s), 6)

    def loops_for(self, base_s: float) -> int:
        """Passes enough to cover `base_s` of base time (one spare: the plan is cut at the last phase)."""
        if not self.calls or self.pass_s <= 0:
            return 1
        return max(1, math.ceil(base_s / self.pass_s) + 1)


def recording_span(traffic: RecordingTraffic) -> RecordingSpan:
    """How one pass of `traffic`'s recording plays, read without its messages (the plan's own rules:
    window, methods, speed). Raises capture's errors (RecordingError, ...) or replay's PlanError when the
    file cannot be read or its calls are not decoded yet."""
    from capture.deferred import calls_pending, pending_message
    from capture.recording import Recording
    from replay.errors import PlanError
    from replay.options import schedule_options
    from replay.schedule import build_plan
    from replay.source import tcp_calls, tcp_flow_starts

    rec = Recording(traffic.path)
    try:
        if calls_pending(rec.meta):
            raise PlanError(f"cannot replay {traffic.path}: {pending_message(traffic.path, rec.meta)}")

        def light() -> Iterator[Any]:       # calls without their messages, TCP flows as pseudo-calls
            calls = (c for c in rec.calls(with_messages=False) if c.protocol != "tcp")
            return heapq.merge(calls, tcp_calls(rec, tcp_flow_starts(rec)), key=lambda c: c.request_ts_ns)

        options = schedule_options(traffic.replay_values(loop=2))
        first: int | None = None
        last: int | None = None
        second: int | None = None
        count = 0
        for call in build_plan(light, options):
            if call.loop == 0:
                first = call.due_ns if first is None else first
                last, count = call.due_ns, count + 1
            else:                      # the same first call, one loop period later
                second = call.due_ns
                break
    finally:
        rec.close()
    if first is None or last is None or second is None:
        return RecordingSpan(0.0, 0.0, 0.0, 0)
    pass_s = (second - first) / 1e9
    gap_s = (last - first) / 1e9 / (count - 1) if count > 1 else pass_s - (last - first) / 1e9
    return RecordingSpan(pass_s, last / 1e9, gap_s, count)


@dataclass(frozen=True)
class Coverage:
    """How long a scenario's traffic lasts against what its phases consume.

    lasts_s / needs_s: base (load-1) seconds; ends_s: the run time at which the calls stop (the run's
    end when they last); phase: the phase it ends in (None when it lasts); how: how its length was
    worked out, for the message; loops_needed: for a recording that is short, the `loop` that covers
    the run (None: no number of passes would, it plays no calls)."""

    lasts_s: float
    needs_s: float
    ends_s: float
    run_s: float
    phase: str | None
    how: str
    loops_needed: int | None = None

    @property
    def short(self) -> bool:
        return self.phase is not None


def coverage(scenario: Scenario, span: RecordingSpan | None = None, slack_s: float | None = None) -> Coverage:
    """Whether the traffic lasts the run: the generator always does (it is planned for the run); a
    recording lasts `loop` passes (`span` read from the file when not given). It is short when it ends
    more than `slack_s` (default one period) before the run does."""
    profile = scenario.load_profile()
    needs = base_duration(profile)
    run_s = scenario.duration_s
    traffic = scenario.traffic
    if isinstance(traffic, GeneratorTraffic):
        return Coverage(needs, needs, run_s, run_s, None, "the generator is planned for the whole run")
    span = span if span is not None else recording_span(traffic)
    loops = span.loops_for(needs) if traffic.until_end else int(traffic.loop)
    lasts = span.lasts_s(loops)
    if not span.calls:
        how = "the recording plays no calls" + (" in its window" if traffic.window else "") + \
            (f" for methods {', '.join(traffic.methods)}" if traffic.methods else "")
    elif traffic.until_end:
        how = f"loop: until_end, {loops} passes of {span.pass_s:.3g}s"
    else:
        speed = "" if traffic.speed == 1.0 else f" at speed {traffic.speed:g}"
        how = f"{span.pass_s:.3g}s a pass{speed}" + (f" x loop {loops}" if loops != 1 else "")
    ends = round(run_time(lasts, profile), 6)
    slack = scenario.period_s if slack_s is None else slack_s
    if run_s - ends <= slack:
        return Coverage(lasts, needs, run_s, run_s, None, how)
    phase = next((p.name for p, (a, b) in zip(scenario.phases, scenario.phase_bounds().values(), strict=True)
                  if a <= ends < b), scenario.phases[-1].name)
    enough = None
    if span.calls and span.pass_s > 0:
        least = max(1, math.ceil(needs / span.pass_s))
        enough = least if run_s - run_time(span.lasts_s(least), profile) <= slack else least + 1
    return Coverage(lasts, needs, ends, run_s, phase, how, enough)


class TrafficRun:
    """Plays the scenario's traffic to `target` in a background thread, keeping every call's result.

    Args:
        traffic: what to play. profile: (start_s, end_s, load) per phase; the plan is warped to it.
        target: "host:port" (usually the fault proxy). t0_ns: the run's start on CLOCK_MONOTONIC;
        the replayer schedules from it and results are converted to seconds from it.
        tls: a replay.senders.tls.TlsConfig when the target speaks TLS (through the proxy, which only
        forwards TCP, the name to verify is the target's: set its server_name). headers: a
        replay.senders.headers.HeaderPolicy (None: the default, with the replay marker).

    Raises RunError (on start) when the replayer cannot be built, e.g. the recording is unreadable.
    """

    def __init__(self, traffic: Traffic, profile: list[tuple[float, float, float]], target: str, t0_ns: int,
                 seed: int, timeout_s: float = 5.0, *, tls: Any = None, headers: Any = None,
                 compare: Any = None) -> None:
        from capture.errors import CaptureError
        from replay.engine import ReplayRun
        from replay.errors import ReplayError
        from replay.options import ReplayOptions, schedule_options
        from replay.schedule import ScheduleOptions

        self.t0_ns = t0_ns
        self.calls: list[CallResult] = []
        self.counts: dict[str, int] = {}        # by outcome, kept as results arrive (for the live view)
        self.report: dict[str, Any] = {}
        self.error: BaseException | None = None
        # The plan as the replayer pulls it (its thread): how many calls, when the last was due, whether
        # it ran dry before the last phase ended (`ran_out`). The generator is planned for the whole run.
        self.planned = 0
        self.first_due_s: float | None = None
        self.last_due_s: float | None = None
        self.plan_done = False
        self.plan_cut = False
        self.loops: int | None = None
        self._lock = threading.Lock()
        try:
            if isinstance(traffic, RecordingTraffic):
                from replay.plan import plan_from_recording

                # until_end: as many passes as the phases consume (the plan is cut at the last phase).
                self.loops = recording_span(traffic).loops_for(base_duration(profile)) if traffic.until_end \
                    else int(traffic.loop)
                schedule = schedule_options(traffic.replay_values(loop=self.loops, seed=seed))
                recording, plan = plan_from_recording(traffic.path, schedule)
                self._recording: Any = recording
            else:
                schedule = ScheduleOptions(seed=seed)
                self._recording, plan = None, generator_plan(traffic, base_duration(profile), seed)
                self.plan_cut = True
            source: Any = self._follow(warp(plan, profile))
            options = ReplayOptions(schedule=schedule, start_at_ns=t0_ns, timeout_s=timeout_s, tls=tls, headers=headers,
                                    compare=compare)
            self._run = ReplayRun(source, target, options, on_result=self._on_result)
        except (ReplayError, CaptureError) as exc:
            raise RunError(f"cannot set up the traffic: {exc}") from exc
        self._thread = threading.Thread(target=self._main, name="shadowtest-traffic", daemon=True)

    def _follow(self, warped: Generator[Any, None, bool]) -> Iterator[Any]:
        """The warped plan, noting each call's due time and whether it was cut at the end of the run."""
        while True:
            try:
                call = next(warped)
            except StopIteration as end:
                self.plan_cut = self.plan_cut or bool(end.value)
                self.plan_done = True
                return
            due = call.due_ns / 1e9
            if self.first_due_s is None:
                self.first_due_s = due
            self.last_due_s = due
            self.planned += 1
            yield call

    def ran_out(self, run_s: float, slack_s: float) -> float | None:
        """When the traffic's last call was due, if the plan ran dry early: more than `slack_s` (and two
        of its mean gaps) before `run_s`; 0.0 for a plan with no calls at all. None while the replayer is
        still reading the plan, or when the traffic lasts the run."""
        if not self.plan_done or self.plan_cut:
            return None
        if self.last_due_s is None or self.first_due_s is None:
            return 0.0
        gap = (self.last_due_s - self.first_due_s) / (self.planned - 1) if self.planned > 1 else 0.0
        return self.last_due_s if run_s - self.last_due_s > max(slack_s, 2 * gap) else None

    def _on_result(self, r: Any) -> None:
        def rel(ns: int) -> float | None:
            return (ns - self.t0_ns) / 1e9 if ns else None
        outcome = "error" if r.outcome == "connection_error" else r.outcome
        call = CallResult(intended_s=(r.intended_ns - self.t0_ns) / 1e9, sent_s=rel(r.sent_ns),
                          done_s=rel(r.done_ns) if r.sent_ns else None, method=r.method or "?",
                          outcome=outcome, code=r.code,
                          invalid=tuple(m for m in r.mismatch if m.startswith(INVALID + "[")) if r.mismatch else ())
        with self._lock:
            self.calls.append(call)
            self.counts[outcome] = self.counts.get(outcome, 0) + 1

    def _main(self) -> None:
        try:
            report = self._run.run()
            self.report = report.to_json() if hasattr(report, "to_json") else dict(vars(report))
        except BaseException as exc:  # noqa: BLE001 -- reported by the runner, never lost in a thread
            self.error = exc
            log.exception("traffic failed")
        finally:
            if self._recording is not None:
                self._recording.close()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End early: unsent calls are counted not_sent (stopped), in-flight ones get a grace period."""
        self._run.stop()

    def join(self, timeout_s: float) -> bool:
        """Wait for the replayer to finish; True when it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def snapshot(self) -> list[CallResult]:
        with self._lock:
            return list(self.calls)

    def recent(self, since_s: float) -> list[CallResult]:
        """Calls due at or after `since_s`, found from the end (results arrive in about that order)."""
        with self._lock:
            i = len(self.calls)
            while i > 0 and self.calls[i - 1].intended_s >= since_s - 5.0:   # 5 s: late completions
                i -= 1
            return [c for c in self.calls[i:] if c.intended_s >= since_s]
