"""Traffic for a run: a recording replayed, or the built-in generator, both through the open-loop replayer.

The generator is turned into a replay plan (seeded arrivals + realistic snapshots from the agent's
market model), so both kinds give the same per-call results, the client-side truth the checks use:

    RecordingTraffic --plan_from_recording--+
                                             +--> replay.engine.ReplayRun --on_result--> TrafficRun.calls
    GeneratorTraffic --generator_plan-------+          (own thread; stop() at the end of the run)
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from harness.errors import RunError
from harness.scenario import GeneratorTraffic, RecordingTraffic, Traffic
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
    pattern = arrivals.bursty if traffic.pattern == "bursty" else arrivals.poisson
    times = _constant(traffic.rate, duration_s) if traffic.pattern == "constant" else \
        pattern(traffic.rate, duration_s, rng)
    for index, offset in enumerate(times):
        stream = rng.random() < traffic.stream_share
        count = _STREAM_MESSAGES if stream else 1
        messages = [PlannedMessage(i * _STREAM_GAP_NS, sim.next(index * 8 + i).SerializeToString())
                    for i in range(count)]
        yield PlannedCall(index=index, due_ns=int(offset * 1e9), connection=f"gen-{index % _CONNECTIONS}",
                          protocol="grpc", method=DECIDE_STREAM if stream else DECIDE,
                          kind="bidi" if stream else "unary", messages=messages)


def base_duration(profile: list[tuple[float, float, float]]) -> float:
    """How much traffic (in seconds at load 1) the phases consume: each phase's duration times its load."""
    return sum((end - start) * load for start, end, load in profile)


def warp(plan: Iterator[Any], profile: list[tuple[float, float, float]]) -> Iterator[Any]:
    """Replay time-warped per phase: inside a phase with load L, base time runs L times as fast.

    A call due at base time u in phase i (base start b_i) is sent at start_i + (u - b_i) / L_i; its
    stream messages' offsets shrink by L_i too. Calls beyond the last phase are not planned.
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
            return
        base, _, start, load = bounds[i]
        if load == 1.0 and base == start:
            yield call
            continue
        msgs = [replace(m, offset_ns=int(m.offset_ns / load)) for m in call.messages]
        yield replace(call, due_ns=int((start + (u - base) / load) * 1e9), messages=msgs)


def _constant(rate: float, duration_s: float) -> Iterator[float]:
    for i in itertools.count():
        t = i / rate
        if t >= duration_s:
            return
        yield t


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
                 seed: int, timeout_s: float = 5.0, *, tls: Any = None, headers: Any = None) -> None:
        from capture.errors import CaptureError
        from replay.engine import ReplayOptions, ReplayRun
        from replay.errors import ReplayError
        from replay.schedule import ScheduleOptions

        self.t0_ns = t0_ns
        self.calls: list[CallResult] = []
        self.counts: dict[str, int] = {}        # by outcome, kept as results arrive (for the live view)
        self.report: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        try:
            if isinstance(traffic, RecordingTraffic):
                from replay.plan import plan_from_recording

                schedule = ScheduleOptions(speed=traffic.speed, window=traffic.window, loop=traffic.loop,
                                           methods=frozenset(traffic.methods), seed=seed)
                recording, plan = plan_from_recording(traffic.path, schedule)
                self._recording: Any = recording
            else:
                schedule = ScheduleOptions(seed=seed)
                self._recording, plan = None, generator_plan(traffic, base_duration(profile), seed)
            source: Any = warp(plan, profile)
            options = ReplayOptions(schedule=schedule, start_at_ns=t0_ns, timeout_s=timeout_s, tls=tls, headers=headers)
            self._run = ReplayRun(source, target, options, on_result=self._on_result)
        except (ReplayError, CaptureError) as exc:
            raise RunError(f"cannot set up the traffic: {exc}") from exc
        self._thread = threading.Thread(target=self._main, name="shadowtest-traffic", daemon=True)

    def _on_result(self, r: Any) -> None:
        def rel(ns: int) -> float | None:
            return (ns - self.t0_ns) / 1e9 if ns else None
        outcome = "error" if r.outcome == "connection_error" else r.outcome
        call = CallResult(intended_s=(r.intended_ns - self.t0_ns) / 1e9, sent_s=rel(r.sent_ns),
                          done_s=rel(r.done_ns) if r.sent_ns else None, method=r.method or "?",
                          outcome=outcome, code=r.code)
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
