"""Start (or reach) what a scenario targets, and the fault proxy in front of it.

    traffic --> proxy (127.0.0.1:0, toxics) --> target gRPC address
                                               target metrics URL: /metrics and /events

`open_target` enters everything into the caller's ExitStack, so the agent and the proxy are always
stopped, whatever happens to the run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from harness.errors import RunError
from harness.faultspecs import CALL_FAULTS
from harness.scenario import AgentTarget, ExternalTarget, MetricNames, Scenario


@dataclass
class Running:
    """What the runner talks to."""

    grpc_address: str                  # the service itself
    traffic_address: str               # where traffic goes (the proxy when there is one)
    metrics_url: str | None            # full URL of /metrics
    events_url: str | None             # full URL of /events
    pid: int | None                    # the target process when we started it
    names: MetricNames
    proxy: object | None = None        # harness.faultrun.NetworkProxy when traffic goes through one
    log_tail: object | None = None     # callable returning the agent's last log lines
    watch_pid: int | None = None       # a process only observed (an external service's `pid:`)
    watch_cgroup: str | None = None    # or its cgroup directory
    # The scenario's dependencies by name (harness.dependencies.RunningDependency): each behind its own proxy
    dependencies: dict[str, Any] = field(default_factory=dict)


def open_target(scenario: Scenario, stack: contextlib.ExitStack, startup_timeout_s: float = 120.0,
                agent_class: type[Any] | None = None, dependencies: dict[str, Any] | None = None) -> Running:
    """Start the agent (or use the external service) and, unless `proxy: false`, a proxy in front.
    `dependencies` (already running, harness.dependencies): the bundled agent is handed a redis one's
    proxy address (cache=redis, redis_url=redis://PROXY/0).

    Raises RunError when the agent cannot start or the proxy cannot be created.
    """
    target = scenario.target
    dependencies = dependencies or {}
    if isinstance(target, AgentTarget):
        running = start_agent(agent_with(target, dependencies), stack, startup_timeout_s, agent_class)
    else:
        running = _external(target)
    running.dependencies = dict(dependencies)
    if scenario.proxy:
        from harness.faultrun import NetworkProxy

        calls = any(f.kind in CALL_FAULTS and f.on is None for p in scenario.phases for f in p.faults + scenario.faults)
        proxy = stack.enter_context(NetworkProxy(running.grpc_address, name=f"st-{scenario.name}"[:40],
                                                 seed=scenario.seed, call_toxics=calls))
        running.proxy = proxy
        running.traffic_address = proxy.listen
    return running


def agent_with(target: AgentTarget, dependencies: dict[str, Any]) -> AgentTarget:
    """The agent's options with its dependencies' addresses: a redis dependency makes it cache=redis
    with redis_url the dependency's proxy (its other cache options as the scenario gives them)."""
    redis = dependencies.get("redis")
    if redis is None:
        return target
    return AgentTarget({**target.options, "cache": "redis", "redis_url": redis.url})


def start_agent(target: AgentTarget, stack: contextlib.ExitStack, startup_timeout_s: float,
                 agent_class: type[Any] | None = None) -> Running:
    from agent_under_test.errors import AgentError
    from agent_under_test.launch import AgentProcess

    options = {"device": "cpu", **target.options}
    try:
        # agent_class: an AgentProcess subclass (the tests' deliberately broken agents), else the agent itself.
        agent = stack.enter_context((agent_class or AgentProcess)(startup_timeout_s=startup_timeout_s, **options))
    except AgentError as exc:
        raise RunError(f"the agent did not start: {exc}") from exc
    base = agent.metrics_url
    return Running(agent.grpc_address, agent.grpc_address, f"{base}/metrics" if base else None,
                   f"{base}/events" if base else None, agent.pid, MetricNames(), log_tail=agent.log_tail)


def _external(target: ExternalTarget) -> Running:
    metrics = target.metrics_url
    events = target.events_url
    if metrics and not metrics.rstrip("/").endswith("/metrics") and not events:
        base = metrics.rstrip("/")
        metrics, events = base + "/metrics", base + "/events"
    return Running(target.address, target.address, metrics, events, None, target.metrics,
                   watch_pid=target.pid, watch_cgroup=target.cgroup)
