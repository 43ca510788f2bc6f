"""Run a scenario: start the target, play the traffic, apply faults on schedule, follow, judge, report.

    check leftovers --> start agent + proxy --> scrape once (counters before)
        t0: traffic starts (open loop, own thread)
        phase 1 .. n: faults applied at phase start (+after), removed at phase end (or after `for`),
                      each logged with when it really took effect; live view 4x a second;
                      one line when the traffic runs out before the last phase ends
        end: faults off, traffic stopped and drained, final scrape and events
    --> timeline --> checks --> RunResult (reports are written by the caller)

Everything is entered into one ExitStack, so the agent, the proxy, every fault and every follower
are undone on success, on failure, on Ctrl-C and on SIGTERM (turned into the same path). An
interrupted run still returns a result (marked partial), which the CLI turns into reports.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from faults.proxy.h2tap import LEG_LOG_ENV
from harness.checks import Verdict, evaluate_all
from harness.checks.truth import read_leg_log
from harness.errors import RunError
from harness.faultrun import FaultSession, check_leftovers
from harness.live import LiveView, Snapshot
from harness.matching import against_references, send_again
from harness.observe import CpuFollower, EventsFollower, MetricsFollower, heap_call, scrape
from harness.prom import PrometheusServer
from harness.report import RunResult
from harness.scenario import AgentTarget, RecordingTraffic, Scenario
from harness.scenario_load import RUN_PHASE
from harness.target import Running, open_target, start_agent
from harness.timeline import FaultWindow, MetricSample, Timeline
from harness.traffic import TrafficRun
from wire.clock import Clock, MonotonicClock

_TICK_S = 0.1            # fault schedule resolution
_VIEW_S = 0.5            # live view refresh: cheap, but it shares the GIL with the replayer
_VIEW_PERIODS = 30       # sparkline length
_START_DELAY_S = 0.3     # lets the traffic thread build its senders before the first due send


class Interrupted(BaseException):
    """Raised in the main thread by SIGTERM (SIGINT raises KeyboardInterrupt): end with a partial report.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way (a fault that
    fails to apply is logged and the run goes on) can swallow the signal and keep the run going."""


@dataclass
class _Action:
    at_s: float
    apply: bool
    window: FaultWindow
    spec: Any


@dataclass
class RunOptions:
    startup_timeout_s: float = 120.0
    drain_s: float | None = None          # after the last phase; default one period + 1 s
    view: LiveView | None = None
    # A crashed run's faults are undone on the next start (logged); False refuses to start instead.
    clear_leftovers: bool = True
    notes: list[str] = field(default_factory=list)
    agent_class: type[Any] | None = None    # an AgentProcess subclass to start instead (tests' broken agents)


class Runner:
    """Runs one scenario. `run()` returns a RunResult; RunError when the run cannot start at all."""

    def __init__(self, scenario: Scenario, options: RunOptions | None = None, clock: Clock | None = None) -> None:
        self.scenario = scenario
        self.options = options or RunOptions()
        self.clock = clock or MonotonicClock()
        self.view = self.options.view or LiveView(scenario.name, rich=False)
        self.log_lines: list[str] = []
        self.windows: list[FaultWindow] = []
        self._done_periods: list[Any] = []
        self.t0 = 0.0
        self._leg_log = ""
        self._prom: PrometheusServer | None = None
        self._heap: dict[str, Any] | None = None   # the agent's heap growth, when memory_flat traced it
        self._heap_plans: list[tuple[float, float, float, float]] = []
        self._heap_on = False
        self._heap_url = ""
        self._answers: Any = None     # harness.responses.Validator when the run judges answers
        self.ran_out: str | None = None      # the line said when the traffic ran out early (also a note)

    def log(self, message: str) -> None:
        t = self.clock.now() - self.t0 if self.t0 else 0.0
        line = f"[{t:7.2f}s] {message}" if self.t0 else f"[  setup ] {message}"
        self.log_lines.append(line)
        self.view.log(line)

    def run(self) -> RunResult:
        self._leftovers()
        started_wall = time.time()
        with _signals_to_exceptions(), contextlib.ExitStack() as stack:
            self.log(f"scenario {self.scenario.name} (seed {self.scenario.seed}, "
                     f"{self.scenario.duration_s:g}s in {len(self.scenario.phases)} phases)")
            self._leg_log = _leg_log_path(stack)
            dependencies = self._dependencies(stack)     # before the target, which connects to them
            running = _with_env(LEG_LOG_ENV, self._leg_log,
                                lambda: open_target(self.scenario, stack, self.options.startup_timeout_s,
                                                    self.options.agent_class, dependencies))
            self.log(f"target {running.grpc_address} (pid {running.pid}); traffic to {running.traffic_address}")
            self._prom = self._prometheus(running, stack)
            result = self._play(running, stack)
        result.started_wall = started_wall
        return result

    def _dependencies(self, stack: contextlib.ExitStack) -> dict[str, Any]:
        """Start each dependency (a Redis) and its fault proxy; logged with PIDs and addresses."""
        if not self.scenario.dependencies:
            return {}
        from harness.dependencies import start_dependencies

        started = start_dependencies(self.scenario, stack)
        for dep in started.values():
            what = f"started (pid {dep.pid})" if dep.pid is not None else "external"
            self.log(f"dependency {dep.name} at {dep.address}, {what}; its proxy listens on {dep.listen} "
                     f"({dep.proxy.kind})")
        return started

    def _prometheus(self, running: Running, stack: contextlib.ExitStack) -> PrometheusServer | None:
        spec = self.scenario.prometheus
        if spec is None:
            return None
        if not running.metrics_url:
            raise RunError("the scenario names Prometheus rules but the target has no metrics endpoint to scrape")
        prom = stack.enter_context(PrometheusServer(spec, running.metrics_url))
        self.log(f"prometheus {prom.url} (pid {prom.pid}) scraping {running.metrics_url} every "
                 f"{spec.interval_s:g}s; rules: {', '.join(os.path.basename(r) for r in spec.rules)}")
        return prom

    def _prometheus_alerts(self) -> dict[str, Any] | None:
        """What the run's Prometheus fired, read once the run is over (after one more evaluation)."""
        if self._prom is None:
            return None
        self.clock.sleep(self._prom.spec.interval_s + 0.2)
        wall_at_t0 = time.time() - (self.clock.now() - self.t0)
        try:
            return self._prom.firing(wall_at_t0 - 1.0, time.time(), wall_at_t0)
        except (OSError, ValueError) as exc:
            self.log(f"cannot read the alerts from Prometheus: {exc}")
            return None

    def _leftovers(self) -> None:
        left = check_leftovers()
        if left and not self.options.clear_leftovers:
            raise RunError(f"a previous run left faults behind ({'; '.join(left)}); run `shadowtest faults "
                           "clear` (or chaos run without --refuse-leftovers) first")
        if left:
            from harness.faultrun import clear_leftovers
            self.log(f"a previous run left faults behind; undone first: {'; '.join(clear_leftovers())}")
        if self.scenario.dependencies:
            from harness.dependencies import sweep_stale_redis

            swept = sweep_stale_redis()
            if swept:
                self.log(f"a previous run left its Redis behind; ended first: {'; '.join(swept)}")

    def _play(self, running: Running, stack: contextlib.ExitStack) -> RunResult:
        s = self.scenario
        before = self._scrape(running)
        self.t0 = self.clock.now() + _START_DELAY_S
        followers = self._followers(running, stack)
        timeout_s = s.traffic.timeout_ms / 1000 if s.traffic.timeout_ms else max(2.0, s.period_s * 4)
        self._answers = _validator(s)
        traffic = TrafficRun(s.traffic, s.load_profile(), running.traffic_address, int(self.t0 * 1e9), s.seed,
                             timeout_s=timeout_s, compare=self._answers, **_tls_and_headers(s))
        self._heap_plans = self._heap_watches(running)
        traffic.start()
        stack.callback(traffic.stop)
        faults = FaultSession(running, s.seed, self.log)
        if "cpu" in followers:
            faults.ctx.cpu_use = followers["cpu"].recent_pct
        stack.callback(faults.close)
        interrupted = None
        with self.view:
            try:
                self._schedule(traffic, faults, followers)
            except (KeyboardInterrupt, Interrupted) as exc:
                interrupted = "SIGINT" if isinstance(exc, KeyboardInterrupt) else "SIGTERM"
                self.log(f"interrupted by {interrupted}: removing faults, stopping traffic")
            end = min(self.clock.now() - self.t0, s.duration_s)
            self._remove_all(faults)
            self._finish(traffic, interrupted)
        if self._heap_on:
            self._heap = self._heap_growth(running)
        after = self._scrape(running)
        for f in followers.values():
            f.stop()
        return self._result(running, traffic, followers, before, after, end, interrupted)

    def _match_answers(self, answers: Any) -> dict[str, Any]:
        """Per responses_match check: the compared calls with their differences and the noise. Against
        references, the sampled calls are sent again to them now (the bundled agent started twice, or
        the two addresses the check names)."""
        out: dict[str, Any] = {}
        for key, spec in answers.matches.items():
            if spec.against == "recording":
                out[key] = {"calls": answers.matched[key], "noise": sorted(answers.noise[key].noise),
                            "unmatched": answers.unmatched[key]}
                continue
            sample = answers.samples[key]
            try:
                primary, secondary, names = self._ask_references(spec, sample.items)
            except RunError as exc:
                self.log(f"{key}: {exc}")
                out[key] = {"error": str(exc)}
                continue
            out[key] = against_references(spec, sample.items, primary, secondary, answers.decode_response) | {
                "sampled": len(sample.items), "of": sample.seen, "references": names}
        return out

    def _ask_references(self, spec: Any, samples: list[Any]) -> tuple[list[Any], list[Any], list[str]]:
        """The references' answers to the sampled requests: (primary, secondary, their names)."""
        if not samples:
            return [], [], []
        with contextlib.ExitStack() as stack:
            if spec.references == ("agent",):
                if not isinstance(self.scenario.target, AgentTarget):
                    raise RunError("references: [agent] starts the bundled agent, but the target is not the agent")
                options = dict(self.scenario.target.options)
                if options.get("cache") == "redis":      # its Redis is the run's; references compute every answer
                    options["cache"] = "off"
                known_good = AgentTarget({**options, "limiter": "off"})
                addresses = []
                for _ in range(2):
                    addresses.append(start_agent(known_good, stack, self.options.startup_timeout_s).grpc_address)
                names = [f"the bundled agent at {a}" for a in addresses]
            else:
                addresses, names = list(spec.references), list(spec.references)
            self.log(f"{spec.id}: sending {len(samples)} sampled calls again to {len(addresses)} reference(s)")
            # The first reference gets the sample 16 calls in flight, the second one call at a time: a field
            # that depends on how calls arrive together (the batch a call rode in, a queue depth) then
            # differs between them and counts as noise. Sent alike, both references batched the same calls
            # the same way, agreed with each other, and every answer of the run, whose calls came at its
            # own pace, "differed" in batch_size.
            answers = [send_again(a, samples, in_flight=16 if i == 0 else 1) for i, a in enumerate(addresses)]
        return answers[0], answers[1] if len(answers) > 1 else [None] * len(samples), names

    def _heap_watches(self, running: Running) -> list[tuple[float, float, float, float]]:
        """For each memory_flat check on the bundled agent (allocations on): (window start after its
        warm-up, when to look, slope bound MB/min, growth floor MB). Tracing the agent's heap costs it
        ~50 % more CPU a call and doubles its P99 at 100 calls/s, so it starts only once the memory is
        seen growing (`_heap_watch`), a third of the way into the window: a healthy agent is never
        traced, a leaking one is traced long enough to name its sites."""
        if not running.metrics_url or not isinstance(self.scenario.target, AgentTarget):
            return []
        self._heap_url = running.metrics_url
        bounds = self.scenario.phase_bounds()
        out = []
        for c in self.scenario.expect:
            if c.kind != "memory_flat" or not c.params.get("allocations", True):
                continue
            a, b = bounds.get(c.params["phase"], (0.0, 0.0)) if c.params.get("phase") else (0.0, self.scenario.duration_s)
            first = a + c.params.get("warmup_s", 2.0)
            out.append((first, first + max(1.5, (b - first) / 3), c.params.get("max_mb_per_min", 20.0),
                        c.params.get("min_growth_mb", 8.0)))
        return out

    def _heap_watch(self, now: float, followers: dict[str, Any]) -> None:
        """Start tracing the agent's heap once a memory_flat window shows growth: over its slope bound
        and half its growth floor in the samples so far (a healthy agent's first seconds can grow a few
        MB; the leak the tests plant grows 6 MB a second)."""
        if self._heap_on or not self._heap_plans or "cpu" not in followers:
            return
        from harness.checks.memory import slope_per_min

        for first, look, bound, floor in self._heap_plans:
            points = [(t, mb) for t, mb in list(followers["cpu"].memory) if first <= t <= now]
            if now < look or len(points) < 3:
                continue
            slope, growth = slope_per_min(points), points[-1][1] - points[0][1]
            if slope > bound and growth > floor / 2:
                try:
                    heap_call(self._heap_url, "/heap/start?frames=1", post=True)
                except (OSError, ValueError) as exc:
                    self.log(f"cannot trace the agent's heap: {exc}")
                    self._heap_plans = []
                    return
                self._heap_on = True
                self.log(f"memory grows ({slope:+.0f} MB/min, +{growth:.1f} MB since {first:.1f}s): tracing the "
                         "agent's heap to name the sites")
                return

    def _heap_growth(self, running: Running) -> dict[str, Any] | None:
        """Where the agent's Python heap grew since tracing started, then tracing off again."""
        try:
            growth = heap_call(str(running.metrics_url), "/heap/growth?top=10")
            heap_call(str(running.metrics_url), "/heap/stop", post=True)
        except (OSError, ValueError) as exc:
            self.log(f"cannot read the agent's heap growth: {exc}")
            return None
        return growth

    def _followers(self, running: Running, stack: contextlib.ExitStack) -> dict[str, Any]:
        out: dict[str, Any] = {}
        every = min(0.5, self.scenario.period_s / 2)
        if running.metrics_url:
            out["metrics"] = MetricsFollower(running.metrics_url, running.names, self.t0, every)
        if running.events_url:
            out["events"] = EventsFollower(running.events_url, self.t0, min(0.2, every))
        out["cpu"] = CpuFollower(running.pid or running.watch_pid, self.t0, every, cgroup=running.watch_cgroup)
        for f in out.values():
            f.start()
            stack.callback(f.stop)
        return out

    def _scrape(self, running: Running) -> MetricSample | None:
        if not running.metrics_url:
            return None
        try:
            return MetricSample(self.clock.now() - self.t0 if self.t0 else -0.0,
                                scrape(running.metrics_url, running.names))
        except OSError as exc:
            self.log(f"cannot scrape {running.metrics_url}: {exc}")
            return None

    def _actions(self) -> list[_Action]:
        out = []
        spans = [(RUN_PHASE, 0.0, self.scenario.duration_s, self.scenario.faults)]
        spans += [(p.name, a, b, p.faults) for p, (a, b) in zip(self.scenario.phases,
                                                                self.scenario.phase_bounds().values(), strict=True)]
        for name, start, end, specs in spans:
            for spec in specs:
                on = start + spec.after_s
                off = min(end, on + spec.for_s) if spec.for_s is not None else end
                window = FaultWindow(spec.label, name, spec.family, spec.kind, on, on=spec.on)
                self.windows.append(window)
                out += [_Action(on, True, window, spec), _Action(off, False, window, spec)]
        # At a phase boundary, remove the old phase's faults before applying the next one's.
        return sorted(out, key=lambda a: (a.at_s, a.apply, a.window.phase != RUN_PHASE))

    def _schedule(self, traffic: TrafficRun, faults: FaultSession, followers: dict[str, Any]) -> None:
        actions = self._actions()
        phases = list(self.scenario.phase_bounds().items())
        current = None
        last_view = -1e9
        while (now := self.clock.now() - self.t0) < self.scenario.duration_s:
            phase = next((n for n, (a, b) in phases if a <= now < b), phases[-1][0])
            if phase != current and now >= 0:
                current = phase
                self.log(f"phase {phase} starts")
            while actions and actions[0].at_s <= now:
                self._do(actions.pop(0), faults)
            if traffic.error is not None:
                raise RunError(f"the traffic stopped: {traffic.error}") from traffic.error
            if self.ran_out is None:
                self._check_ran_out(now, traffic)
            self._heap_watch(now, followers)
            if now - last_view >= _VIEW_S:
                last_view = now
                self.view.update(self._snapshot(now, current or phases[0][0], traffic, followers, faults))
            self.clock.sleep(min(_TICK_S, max(0.0, self.scenario.duration_s - now)))
        for action in actions:        # removals due exactly at the end
            if not action.apply:
                self._do(action, faults)

    def _check_ran_out(self, now: float, traffic: TrafficRun) -> None:
        """Say once, when it happens, that the traffic ran out before the run ends, and which phases
        get no calls (their checks are then skipped: see checks.base.no_calls)."""
        s = self.scenario
        last = traffic.ran_out(s.duration_s, s.period_s)
        if last is None or now < last:
            return
        empty = [n for n, (a, _) in s.phase_bounds().items() if a > last or not traffic.planned]
        if traffic.planned:
            what = (f"traffic ran out: its last call was due at {last:.2f}s, {s.duration_s - last:.1f}s "
                    "before the run ends")
        else:
            what = "traffic ran out: it planned no calls at all"
        if empty:
            what += f"; no calls in phase{'s' if len(empty) > 1 else ''} {', '.join(empty)}"
        traffic_spec = s.traffic
        if isinstance(traffic_spec, RecordingTraffic) and not traffic_spec.until_end and traffic.planned:
            what += (f" (the recording played {traffic.loops} time{'s' if traffic.loops != 1 else ''}; "
                     "'loop: until_end' repeats it until the scenario ends)")
        self.ran_out = what
        self.log(what)

    def _do(self, action: _Action, faults: FaultSession) -> None:
        w = action.window
        if action.apply:
            try:
                w.detail, applied_at = faults.apply(action.spec, key=id(w))
                w.applied_s = (applied_at if applied_at is not None else self.clock.now()) - self.t0
                self.log(f"fault {w.label} took effect ({(w.applied_s - w.requested_s) * 1000:+.0f} ms "
                         f"after schedule) {w.detail}")
            except Exception as exc:  # noqa: BLE001 -- a fault that fails is evidence, the run goes on
                w.error = f"{type(exc).__name__}: {exc}"
                self.log(f"fault {w.label} FAILED to apply: {w.error}")
        elif w.applied_s is not None and w.removed_s is None:
            w.effect = faults.remove(key=id(w))
            w.removed_s = self.clock.now() - self.t0
            self.log(f"fault {w.label} removed")

    def _remove_all(self, faults: FaultSession) -> None:
        """Undo every fault still in effect (end of run or interruption), logging each."""
        for w in self.windows:
            if w.applied_s is not None and w.removed_s is None:
                self._do(_Action(0.0, False, w, None), faults)
        faults.close()

    def _finish(self, traffic: TrafficRun, interrupted: str | None) -> None:
        if interrupted:
            traffic.stop()
        grace = self.options.drain_s if self.options.drain_s is not None else self.scenario.period_s + 1.0
        if not traffic.join(grace + 5.0):
            traffic.stop()
            traffic.join(5.0)
        # One more period so the agent's last period event and counters cover every call.
        self.clock.sleep(min(grace, self.scenario.period_s + 0.3))

    def _snapshot(self, now: float, phase: str, traffic: TrafficRun, followers: dict[str, Any],
                  faults: FaultSession) -> Snapshot:
        self._catch_up_periods(now, traffic)
        snap = live_snapshot(now, phase, self.scenario, self._done_periods[-_VIEW_PERIODS:],
                             followers.get("events"), followers.get("metrics"), faults.active_labels())
        snap.rejected = traffic.counts.get("rejected", 0)
        snap.errors = traffic.counts.get("error", 0) + traffic.counts.get("timeout", 0)
        return snap

    def _catch_up_periods(self, now: float, traffic: TrafficRun) -> None:
        """Client stats of each period once it has ended (one small slice of calls each, so the view
        costs the replayer, which shares the GIL, almost nothing)."""
        period = self.scenario.period_s
        while (len(self._done_periods) + 1) * period <= now:
            i = len(self._done_periods)
            calls = [c for c in traffic.recent(i * period) if c.intended_s < (i + 1) * period]
            tl = Timeline(period_s=period, threshold_ms=self.scenario.p99_threshold_ms,
                          phases=[("run", i * period, (i + 1) * period)], calls=calls)
            self._done_periods.append(tl.periods[i])

    def _result(self, running: Running, traffic: TrafficRun, followers: dict[str, Any],
                before: MetricSample | None, after: MetricSample | None, end: float,
                interrupted: str | None) -> RunResult:
        s = self.scenario
        phases = [(n, a, min(b, end)) for n, (a, b) in s.phase_bounds().items() if a < end or n == s.phases[0].name]
        samples = followers["metrics"].samples if "metrics" in followers else []
        samples = [x for x in (before, *samples, after) if x is not None]
        tl = Timeline(period_s=s.period_s, threshold_ms=s.p99_threshold_ms, phases=phases,
                      calls=traffic.snapshot(), events=followers["events"].events if "events" in followers else [],
                      samples=samples, cpu=followers["cpu"].samples, faults=self.windows,
                      replay_report=traffic.report, metric_names=vars(running.names),
                      partial=interrupted is not None, alert_periods=s.alert_periods)
        if running.dependencies:
            tl.outside["dependencies"] = [d.describe() for d in running.dependencies.values()]
        if running.proxy is not None and self._leg_log:
            tl.outside["proxy_legs"] = read_leg_log(self._leg_log, self.t0)
            if getattr(s.target, "tls", None) is not None:
                tl.outside["legs_unreadable"] = ("the traffic is TLS: the proxy carries it without reading it, so it "
                                                 "cannot time the upstream leg of a call")
        prom = self._prometheus_alerts()
        if prom is not None:
            tl.outside["prometheus"] = prom
        if "cpu" in followers and followers["cpu"].sched:
            tl.outside["sched"] = list(followers["cpu"].sched)
        if "cpu" in followers and followers["cpu"].memory:
            tl.outside["memory"] = list(followers["cpu"].memory)
            tl.outside["memory_of"] = followers["cpu"].memory_of
        if self._heap is not None:
            tl.outside["heap"] = self._heap
        if self._answers is not None and self._answers.matches:
            tl.outside["matches"] = self._match_answers(self._answers)
        verdicts = judge(tl, s)
        notes = list(self.options.notes)
        if self.ran_out is not None:
            notes.append(self.ran_out)
        for name, f in followers.items():
            if f.failures:
                notes.append(f"{name} follower failed {f.failures} time(s): {f.last_error}")
        return RunResult(s, tl, verdicts, log=self.log_lines, interrupted=interrupted, notes=notes)


def _leg_log_path(stack: contextlib.ExitStack) -> str:
    """A private temp file for the proxy's upstream-leg timings (removed with the run)."""
    from harness.childserver import sweep_stale

    sweep_stale("shadowtest-legs-")            # left by a run killed with kill -9
    folder = tempfile.mkdtemp(prefix=f"shadowtest-legs-{os.getpid()}-")
    stack.callback(shutil.rmtree, folder, True)
    return os.path.join(folder, "legs.txt")


def _with_env(name: str, value: str, start: Callable[[], Running]) -> Running:
    """Run `start` (which spawns the proxy child) with `name=value` in the environment it inherits."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return start()
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def judge(timeline: Timeline, scenario: Scenario) -> list[Verdict]:
    """Every check's verdict. A scenario without checks gets one failed verdict that says so: a run
    with nothing judged must neither pass nor end 'FAILED, 0/0 checks passed' without a reason."""
    verdicts: list[Verdict] = evaluate_all(timeline, scenario.expect)
    if not verdicts:
        verdicts.append(Verdict(id="no_checks", kind="no_checks", passed=False,
                                summary=f"nothing was judged: {scenario.source or 'the scenario'} has no 'expect' "
                                        "checks; add some (docs/harness.md, Checks) for a verdict"))
    return verdicts


def alert_column(events: list[Any]) -> str:
    """The live view's alert column: every alert not inactive, by name ("P99High:firing,RejectedRatioHigh:
    pending"), or "inactive". One state for all alerts would show one alert's state under another's name."""
    states: dict[str, str] = {}
    for e in events:
        if e.type == "alert":
            states[str(e.data.get("alert", "alert"))] = str(e.data.get("to"))
    return ",".join(f"{name}:{state}" for name, state in sorted(states.items()) if state != "inactive") or "inactive"


def live_snapshot(now: float, phase: str, scenario: Scenario, periods: list[Any], events: Any, metrics: Any,
                  faults: list[str]) -> Snapshot:
    """What the live view shows: the last completed periods' client stats and the latest events."""
    last = periods[-1] if periods else None
    snap = Snapshot(elapsed_s=max(0.0, now), total_s=scenario.duration_s, phase=phase,
                    offered=last.offered_rate if last else 0.0, achieved=last.achieved_rate if last else 0.0,
                    p50=[p.p50_ms for p in periods], p95=[p.p95_ms for p in periods],
                    p99=[p.p99_ms for p in periods], faults=faults)
    if events is not None:
        seen = list(events.events)
        latest = {e.type: e for e in seen}   # the latest of each type
        if "limiter" in latest:
            snap.limiter_rate = float(latest["limiter"].data.get("new_rate", 0.0))
        snap.alert = alert_column(seen)
        snap.tier = str(latest["tier"].data.get("to")) if "tier" in latest else "full"
    if snap.limiter_rate is None and metrics is not None and metrics.samples:
        snap.limiter_rate = metrics.samples[-1].values.get(scenario_rate_name(scenario))
    return snap


def scenario_rate_name(scenario: Scenario) -> str:
    names = getattr(scenario.target, "metrics", None)
    return names.limiter_rate if names is not None else "agent_limiter_rate"


@contextlib.contextmanager
def _signals_to_exceptions() -> Iterator[None]:
    """SIGTERM raises Interrupted in the main thread, SIGINT KeyboardInterrupt: installed explicitly,
    because a process started in the background by a non-interactive shell (a CI script's `run &`)
    inherits SIGINT ignored, and an interrupt must still undo the faults, as the recorder's does."""
    def on_term(signum: int, frame: Any) -> None:
        raise Interrupted("SIGTERM")
    try:
        previous: Callable[..., Any] | int | None = signal.signal(signal.SIGTERM, on_term)
    except ValueError:           # not the main thread: nothing to install, the caller handles stop
        yield
        return
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _validator(s: Scenario) -> Any:
    """The responses_valid checks' rules and the responses_match checks' settings, as the replay engine's
    comparer (None without such checks)."""
    from harness.checks.answers import match_spec
    from harness.responses import ResponseRules, Validator

    sets = {c.id: ResponseRules(c.params["rules"], c.params.get("method", "")) for c in s.expect
            if c.kind == "responses_valid"}
    matches = {c.id: match_spec(c) for c in s.expect if c.kind == "responses_match"}
    if not sets and not matches:
        return None
    from replay.compare import descriptors_from_modules

    # The bundled agent's messages are known; another service's responses are read as JSON bodies.
    descriptors = descriptors_from_modules("agent_under_test.proto.agent_pb2") \
        if isinstance(s.target, AgentTarget) else None
    return Validator(sets, descriptors, matches, seed=s.seed)


def _tls_and_headers(s: Scenario) -> dict[str, Any]:
    """An external target's TLS settings and shadow metadata, for the traffic's sender."""
    tls = getattr(s.target, "tls", None)
    set_headers = getattr(s.target, "set_headers", ())
    if tls is None and not set_headers:
        return {}
    from replay.senders.headers import HeaderPolicy

    return {"tls": tls, "headers": HeaderPolicy(set_headers=tuple(set_headers)) if set_headers else None}
