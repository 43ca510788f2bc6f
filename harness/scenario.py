"""The scenario model: what to start, what traffic to play, which faults in which phase, what to expect.

A scenario is plain data (frozen dataclasses); `harness.scenario_load` builds one from YAML and
validates it with file and line numbers. The runner and the checks read only this model.

    Scenario
     +-- target:  AgentTarget (the bundled agent, started by the runner) | ExternalTarget (yours)
     +-- traffic: RecordingTraffic (replay a recording) | GeneratorTraffic (built-in generator)
     +-- phases:  [Phase(name, duration_s, faults=[FaultSpec])]   played back to back
     +-- expect:  [CheckSpec(kind, params)]                          evaluated on the timeline
     +-- dependencies: [DependencySpec(name, kind, address, listen)] each behind its own fault proxy
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class MetricNames:
    """Prometheus names the harness reads from a target's /metrics (the agent's by default)."""

    latency_histogram: str = "agent_request_latency_seconds"
    requests_total: str = "agent_requests_total"
    limiter_rate: str = "agent_limiter_rate"
    alert_firing: str = "agent_alert_firing"
    model_tier: str = "agent_model_tier"
    queue_depth: str = "agent_queue_depth"
    expired_calls: str = "agent_expired_calls_total"
    # The response cache and its dependencies (dependency checks: harness/checks/dependency.py)
    cache_total: str = "agent_cache_total"                       # {result=hit_local|hit_redis|stale|miss}
    dependency_seconds: str = "agent_dependency_seconds"         # histogram {dependency, op}
    dependency_errors: str = "agent_dependency_errors_total"     # {dependency, op, kind}
    circuit_state: str = "agent_dependency_circuit_state"        # {dependency}: 0 closed, 1 half_open, 2 open


@dataclass(frozen=True)
class AgentTarget:
    """The bundled agent, started by the runner; `options` go to `AgentProcess(**options)`."""

    options: dict[str, Any] = field(default_factory=dict)

    @property
    def p99_threshold_ms(self) -> float:
        return float(self.options.get("p99_threshold_ms", 20.0))

    @property
    def alert_periods(self) -> int:
        return int(self.options.get("alert_periods", 3))

    @property
    def period_s(self) -> float:
        return float(self.options.get("period_s", 1.0))


@dataclass(frozen=True)
class ExternalTarget:
    """A service the user runs: gRPC address plus where to read its metrics and events."""

    address: str
    metrics_url: str | None = None
    events_url: str | None = None
    metrics: MetricNames = MetricNames()
    p99_threshold_ms: float = 20.0
    alert_periods: int = 3
    period_s: float = 1.0
    tls: Any = None                                  # replay.senders.tls.TlsConfig: traffic speaks TLS
    set_headers: tuple[tuple[str, str], ...] = ()    # metadata added to every call (shadow credentials)
    pid: int | None = None                           # the service's process, watched (memory, CPU), never touched
    cgroup: str | None = None                        # or its cgroup v2 directory (memory.current)


Target = AgentTarget | ExternalTarget


UNTIL_END = "until_end"       # `loop: until_end`: repeat the recording until the scenario ends


@dataclass(frozen=True)
class RecordingTraffic:
    """Replay a recording file (path resolved relative to the scenario file).

    `loop` is a count, or UNTIL_END (as many passes as the phases need; the runner works it out from
    the recording's span). `line`: where the scenario file says how long it plays (the `loop` entry,
    else the traffic's), for warnings."""

    path: str
    speed: float = 1.0
    loop: int | str = 1
    methods: tuple[str, ...] = ()
    window: tuple[float, float] | None = None   # seconds into the recording
    flows: tuple[int, ...] = ()
    method_map: tuple[str, ...] = ()            # [FLOW:]REF=METHOD, as `replay --method-map`
    scale: float = 1.0                          # flow multiplier, as `replay --scale`
    line: int | None = None
    timeout_ms: float | None = None             # each call's deadline; None: the runner's default

    def replay_values(self, **more: object) -> dict[str, object]:
        """The replay options (replay/options.py) this traffic sets, with `more` (loop, seed)."""
        return {"speed": self.speed, "window": self.window, "methods": self.methods, "flows": self.flows,
                "method_map": self.method_map, "scale": self.scale, **more}

    @property
    def until_end(self) -> bool:
        return self.loop == UNTIL_END


@dataclass(frozen=True)
class GeneratorTraffic:
    """The built-in production-like generator, open loop."""

    rate: float
    pattern: str = "poisson"
    seed: int | None = None                    # None: the scenario's seed
    stream_share: float = 0.0
    timeout_ms: float | None = None            # each call's deadline (grpc-timeout); None: the runner's default
    repeat_pct: float = 0.0                    # share of calls that resend an earlier snapshot (cache hits)
    repeat_pool: int = 200                     # drawn from this many of the latest distinct snapshots


Traffic = RecordingTraffic | GeneratorTraffic


@dataclass(frozen=True)
class FaultSpec:
    """One fault held for a whole phase (or part of it: `after_s`, `for_s`).

    `family` is network | cpu | process, `kind` e.g. latency | contention | quota | pause,
    `params` the rest of the YAML mapping (already validated).
    """

    family: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    after_s: float = 0.0
    for_s: float | None = None
    line: int | None = None
    on: str | None = None           # a network fault on a dependency's link (`on: redis`); None: the target's

    @property
    def label(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        where = f" on {self.on}" if self.on else ""
        return f"{self.family}:{self.kind}{where}" + (f" ({shown})" if shown else "")


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    faults: tuple[FaultSpec, ...] = ()
    load: float = 1.0                # traffic speed in this phase (2.0: twice the calls per second)
    line: int | None = None


@dataclass(frozen=True)
class CheckSpec:
    """One expectation: `kind` names a registered check, `params` its validated arguments."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    line: int | None = None

    @property
    def id(self) -> str:
        where = self.params.get("phase")
        return f"{self.kind}[{where}]" if where else self.kind


@dataclass(frozen=True)
class PrometheusSpec:
    """`prometheus:` in a scenario: rule files (absolute) a real Prometheus evaluates during the run."""

    rules: tuple[str, ...]
    interval_s: float = 1.0          # scrape and rule evaluation


DEPENDENCY_KINDS = ("redis",)


@dataclass(frozen=True)
class DependencySpec:
    """`dependencies: {redis: {...}}`: a service the target depends on, behind its own fault proxy.

    Without `address` the runner starts one (redis-server on loopback, a temp dir, no persistence);
    with it (an external target's, or an existing Redis) nothing is started and the proxy forwards to it.
    `listen`: where that proxy listens (default 127.0.0.1, a free port); the bundled agent is handed
    the proxy's address, an external service must be pointed at `listen` by its owner."""

    name: str                        # the key, also what `on:` names
    kind: str = "redis"
    address: str | None = None       # HOST:PORT the dependency listens on (None: the runner starts it)
    listen: str | None = None        # HOST:PORT the harness's proxy for it listens on (None: 127.0.0.1:0)
    line: int | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    target: Target
    traffic: Traffic
    phases: tuple[Phase, ...]
    expect: tuple[CheckSpec, ...] = ()
    seed: int = 0
    description: str = ""
    proxy: bool = True               # route traffic through the fault proxy
    source: str | None = None        # the file it came from
    faults: tuple[FaultSpec, ...] = ()   # held for the whole run (e.g. a small CPU quota: the container)
    prometheus: PrometheusSpec | None = None   # judge alerts as a real Prometheus evaluates the rules
    dependencies: tuple[DependencySpec, ...] = ()   # started (or reached) before the target, each behind a proxy
    # The run's policy, not the file's: `chaos run --strict` (a skipped check fails the run).
    strict: bool = False

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    @property
    def period_s(self) -> float:
        return self.target.period_s

    @property
    def p99_threshold_ms(self) -> float:
        return self.target.p99_threshold_ms

    @property
    def alert_periods(self) -> int:
        return self.target.alert_periods

    def dependency(self, name: str) -> DependencySpec | None:
        return next((d for d in self.dependencies if d.name == name), None)

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)

    def phase_bounds(self) -> dict[str, tuple[float, float]]:
        """Each phase's (start, end) in seconds from the start of the run."""
        out, t = {}, 0.0
        for p in self.phases:
            out[p.name] = (t, t + p.duration_s)
            t += p.duration_s
        return out

    def load_profile(self) -> list[tuple[float, float, float]]:
        """(start_s, end_s, load) per phase, for the traffic's time warp."""
        return [(start, end, p.load) for p, (start, end) in zip(self.phases, self.phase_bounds().values(), strict=True)]

    def scaled(self, factor: float) -> Scenario:
        """The same scenario with every phase (and fault offset) `factor` times as long (for CI runs)."""
        def scale(faults: tuple[FaultSpec, ...]) -> tuple[FaultSpec, ...]:
            return tuple(replace(f, after_s=f.after_s * factor, for_s=None if f.for_s is None else f.for_s * factor)
                         for f in faults)
        phases = tuple(replace(p, duration_s=p.duration_s * factor, faults=scale(p.faults)) for p in self.phases)
        return replace(self, phases=phases, faults=scale(self.faults))
