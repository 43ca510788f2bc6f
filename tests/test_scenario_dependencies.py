"""Chaos on a service's dependencies: `dependencies: {redis: {}}` and faults `on: redis`.

Loading: every mistake in `dependencies:` and `on:` is an error with file and line (and `chaos validate`
refuses it). Running: a real redis-server behind its own fault proxy, started before the agent, which is
handed the proxy's address; a fault `on: redis` lands on that link only; Redis and its proxy are ended by
PID after the run, also an interrupted one, and a Redis left by a run killed with kill -9 is ended by the
next. Each dependency check passes on the unmodified agent and fails on the broken agent made for it
(tests/broken_agent.py):

    defect                    check that must fail
    cache_blocks              fallback_serves    (calls wait on the slow Redis: no budget)
    circuit_stuck             circuit_recovers   (the circuit never half-opens, so never closes)
    dependency_alert_never    dependency_alert   (DependencySlow never fires)

The runs use a compact scenario (period 0.5 s, 17 s of phases): Redis 100 ms slower on every reply for
5 s, the agent's Redis budget 10 ms, its circuit open 1 s at a time; 70% of the calls repeat a recent
snapshot (cache hits), 30% are new (misses that go to Redis).
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness.errors import ScenarioError
from harness.scenario_load import load_scenario, load_scenario_text
from wire.process import free_port, spawn

REDIS = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed")
ROOT = Path(__file__).resolve().parent.parent

BASE = """\
name: deps
seed: 3
%(deps)s
target: {%(target)s}
traffic: {generator: {rate: 50}}
phases:
  - {name: baseline, duration: 5s}
  - name: slow
    duration: 5s
    faults:
      - %(fault)s
expect:
  - %(check)s
"""


def scenario_text(deps: str = "dependencies: {redis: {}}", target: str = "agent: {period_s: 0.5}",
                  fault: str = "{network: latency, on: redis, latency_ms: 100}",
                  check: str = "fallback_serves: {phase: slow}") -> str:
    return BASE % {"deps": deps, "target": target, "fault": fault, "check": check}


def load_error(text: str) -> str:
    with pytest.raises(ScenarioError) as info:
        load_scenario_text(text, "d.yaml")
    return str(info.value)


# ---- loading -----------------------------------------------------------------------------------------

def test_a_redis_dependency_and_a_fault_on_it_load() -> None:
    s = load_scenario_text(scenario_text(), "d.yaml")
    (dep,) = s.dependencies
    assert (dep.name, dep.kind, dep.address, dep.listen, dep.line) == ("redis", "redis", None, None, 3)
    (f,) = s.phases[1].faults
    assert (f.family, f.kind, f.on) == ("network", "latency", "redis")
    assert f.label == "network:latency on redis (latency_ms=100)"
    # Without `on:` a network fault is the target's inbound link's, as before; `down` takes no parameters.
    s = load_scenario_text(scenario_text(fault="{network: down}"), "d.yaml")
    assert s.phases[1].faults[0].on is None and s.phases[1].faults[0].label == "network:down"
    s = load_scenario_text(scenario_text(fault="{network: down, on: redis, after: 1s, for: 2s}"), "d.yaml")
    f = s.phases[1].faults[0]
    assert (f.kind, f.on, f.after_s, f.for_s, f.label) == ("down", "redis", 1.0, 2.0, "network:down on redis")


@pytest.mark.parametrize("fault, line, message", [
    ("{network: latency, on: memcached, latency_ms: 5}", 11,
     "phases[1].faults[0].on: no dependency named 'memcached'; the scenario declares: redis"),
    ("{cpu: contention, on: redis}", 11,
     "phases[1].faults[0].on: only network faults act on a dependency's link (cpu: contention acts on the "
     "target's process)"),
    ("{network: grpc_delay, on: redis, delay_ms: 5}", 11,
     "phases[1].faults[0].on: network: grpc_delay is a call-level fault that reads gRPC/HTTP calls; a "
     "dependency's link takes bandwidth, down, latency, limit_data, reset_peer, slicer, slow_close, timeout"),
    ("{network: down, on: redis, latency_ms: 5}", 11,
     "phases[1].faults[0] (network: down): unknown key 'latency_ms'; expected one of: "),
])
def test_a_wrong_on_is_an_error_at_its_line(fault: str, line: int, message: str) -> None:
    assert load_error(scenario_text(fault=fault)) == f"d.yaml:{line}: {message}"


def test_on_without_declared_dependencies_says_how_to_declare_one() -> None:
    assert load_error(scenario_text(deps="", fault="{network: latency, on: redis, latency_ms: 5}")) == (
        "d.yaml:11: phases[1].faults[0].on: no dependency named 'redis'; the scenario declares none (add e.g. "
        "`dependencies: {redis: {}}`)")


@pytest.mark.parametrize("deps, target, line, message", [
    ("dependencies: {postgres: {}}", "agent: {}", 3,
     "dependencies: unknown dependency 'postgres'; expected one of: redis"),
    ("dependencies: {redis: {port: 1}}", "agent: {}", 3,
     "dependencies.redis: unknown key 'port'; expected one of: address, listen"),
    ("dependencies: {redis: {address: localhost}}", "agent: {}", 3,
     "dependencies.redis.address: expected HOST:PORT with a port 1..65535, like 127.0.0.1:6379, got 'localhost'"),
    ("dependencies: {redis: {address: '127.0.0.1:0'}}", "agent: {}", 3,
     "dependencies.redis.address: expected HOST:PORT with a port 1..65535, like 127.0.0.1:6379, got '127.0.0.1:0'"),
    ("dependencies: []", "agent: {}", 3, "dependencies: expected a mapping (key: value), got a list"),
    ("dependencies:", "agent: {}", 3, "dependencies: expected a mapping like {redis: {}}"),
    ("dependencies: {redis: {}}", "external: {address: '127.0.0.1:50051'}", 3,
     "dependencies.redis: an external target's dependency needs 'address' and 'listen' (address: where it "
     "listens; listen: where the harness's proxy for it listens, the address your service must use); the "
     "harness starts no dependency for a service it does not start"),
    ("dependencies: {redis: {address: '127.0.0.1:6379', listen: '127.0.0.1:0'}}",
     "external: {address: '127.0.0.1:50051'}", 3,
     "dependencies.redis.listen 127.0.0.1:0: an external service must be pointed at a fixed port; give one"),
    ("dependencies: {redis: {}}", "agent: {cache: local}", 4,
     "target.agent.cache local: the scenario declares a redis dependency, which the agent uses only with "
     "cache: redis (leave cache out: the runner sets it)"),
    ("", "agent: {cache: redis}", 4,
     "target.agent.cache redis: needs a Redis: add `dependencies: {redis: {}}` (the runner starts one behind a "
     "fault proxy and hands the agent its address)"),
    ("dependencies: {redis: {}}", "agent: {cache_local_ttl_s: 10, cache_redis_ttl_s: 5}", 4,
     "target.agent.cache_redis_ttl_s 5: cache_local_ttl_s 10 (soft TTL) must be at most cache_redis_ttl_s 5 "
     "(hard TTL)"),
    ("dependencies: {redis: {}}", "agent: {redis_url: 'redis://x:1/0'}", 4,
     "target.agent: unknown key 'redis_url'; expected one of: "),
])
def test_a_wrong_dependency_is_an_error_at_its_line(deps: str, target: str, line: int, message: str) -> None:
    fault = "{network: latency, latency_ms: 5}"
    assert load_error(scenario_text(deps=deps, target=target, fault=fault)).startswith(f"d.yaml:{line}: {message}")


def test_an_external_target_names_where_its_dependency_and_the_proxy_listen() -> None:
    s = load_scenario_text(scenario_text(
        deps="dependencies: {redis: {address: '127.0.0.1:6379', listen: '127.0.0.1:16379'}}",
        target="external: {address: '127.0.0.1:50051'}"), "d.yaml")
    (dep,) = s.dependencies
    assert (dep.address, dep.listen) == ("127.0.0.1:6379", "127.0.0.1:16379")


def test_the_new_checks_validate_their_parameters() -> None:
    check = "dependency_alert: {fault_phase: slow, quiet_phases: [baseline, later]}"
    assert load_error(scenario_text(check=check)) == (
        "d.yaml:13: expect[0].dependency_alert.quiet_phases: no phase named 'later'; the phases are: baseline, slow")
    assert load_error(scenario_text(check="cache_effective: {phase: slow}")) == (
        "d.yaml:13: expect[0].cache_effective: missing 'min_hit_pct' (number: hits of all lookups, %)")
    assert load_error(scenario_text(check="fallback_serves: {phase: slow, max_error_pct: 120}")) == (
        "d.yaml:13: expect[0].fallback_serves.max_error_pct 120 must be between 0 and 100%")
    s = load_scenario_text(scenario_text(check="circuit_recovers: {phase: slow, within_s: 3s}"), "d.yaml")
    assert s.expect[0].params == {"phase": "slow", "within_s": 3.0}


def test_chaos_validate_accepts_the_bundled_scenarios_and_refuses_a_wrong_on(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from harness.commands.chaos import command as chaos

    bundled = [str(ROOT / "scenarios" / f"redis-{n}.yaml") for n in ("slow", "down")]
    out = CliRunner().invoke(chaos, ["validate", *bundled])
    assert out.exit_code == 0, out.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(scenario_text(fault="{network: latency, on: mysql, latency_ms: 5}"))
    out = CliRunner().invoke(chaos, ["validate", str(bad)])
    assert out.exit_code == 1
    assert f"{bad}:11: phases[1].faults[0].on: no dependency named 'mysql'; the scenario declares: redis" in out.output


def test_the_generator_repeats_snapshots_when_asked() -> None:
    from agent_under_test.proto import agent_pb2
    from harness.scenario import GeneratorTraffic
    from harness.traffic import generator_plan

    def books(traffic: GeneratorTraffic) -> list[tuple[Any, ...]]:
        """Each call's snapshot without its sequence id and times (those of a plan differ run to run)."""
        out = []
        for call in generator_plan(traffic, 10.0, 5):
            msg = agent_pb2.MarketSnapshot.FromString(call.messages[0].data)
            out.append((msg.symbol, msg.position, tuple((x.bid_price, x.bid_size, x.ask_price, x.ask_size)
                                                        for x in msg.levels)))
        return out

    plain = books(GeneratorTraffic(rate=100))
    assert len(set(plain)) == len(plain)          # every snapshot new: nothing for a cache to hit
    repeated = books(GeneratorTraffic(rate=100, repeat_pct=70, repeat_pool=16))
    share = 1 - len(set(repeated)) / len(repeated)
    assert 0.65 <= share <= 0.75, share
    # The plan without repeats is what it was before the option existed (same seeded draws).
    assert books(GeneratorTraffic(rate=100, repeat_pct=0)) == plain


# ---- Redis and its proxy as processes ----------------------------------------------------------------

def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


def _ping(address: str) -> bytes:
    import socket

    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16)
    except OSError as exc:
        return type(exc).__name__.encode()


@needs_redis
def test_a_redis_behind_its_proxy_goes_down_and_up_and_is_ended_by_pid() -> None:
    from harness.dependencies import RedisServer
    from harness.faultimpl import NetworkProxy

    with RedisServer() as redis, NetworkProxy(redis.address, name="t-deps-redis", seed=1) as proxy:
        pid, folder, proxy_pid = redis.pid, redis.folder, proxy.pid
        assert pid is not None and proxy_pid is not None and os.path.isdir(folder)
        assert _ping(redis.address).startswith(b"+PONG") and _ping(proxy.listen).startswith(b"+PONG")
        with proxy.down():
            assert _ping(proxy.listen) == b"ConnectionRefusedError"
            assert _ping(redis.address).startswith(b"+PONG")      # Redis itself is fine: only its link is down
        assert _ping(proxy.listen).startswith(b"+PONG")           # back on the same address
    assert _gone(pid) and _gone(proxy_pid) and not os.path.exists(folder)


@needs_redis
def test_a_redis_left_by_a_killed_run_is_ended_by_the_next() -> None:
    from harness.dependencies import PREFIX, sweep_stale_redis

    dead = spawn(["true"])
    dead.wait()
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}{dead.pid}-")
    port = free_port()
    orphan = spawn([str(REDIS), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", folder])
    try:
        Path(folder, "redis.pid").write_text(str(orphan.pid))
        deadline = time.monotonic() + 10
        while not _ping(f"127.0.0.1:{port}").startswith(b"+PONG") and time.monotonic() < deadline:
            time.sleep(0.05)
        done = sweep_stale_redis()
        assert f"redis-server PID {orphan.pid} left by run PID {dead.pid}" in done
        assert orphan.wait(5) == -signal.SIGKILL and not os.path.exists(folder)
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
        shutil.rmtree(folder, ignore_errors=True)


# ---- real runs ---------------------------------------------------------------------------------------

RUN = """\
name: deps
seed: 5
dependencies: {redis: {}}
target: {agent: {limiter: seed, p99_threshold_ms: 50, alert_periods: 2, resolve_periods: 2, period_s: 0.5,
                 initial_rate: 400, max_rate: 600, min_samples: 5, redis_timeout_ms: 10, circuit_failures: 5,
                 circuit_open_s: 1, dependency_threshold_ms: 20}}
traffic: {generator: {rate: 80, repeat_pct: 70, repeat_pool: 16}}
phases:
  - {name: warmup, duration: 2s}
  - {name: baseline, duration: 4s}
  - {name: slow, duration: 5s, faults: [{network: latency, on: redis, latency_ms: 100}]}
  - {name: recovery, duration: 6s}
expect:
  - fallback_serves: {phase: slow, p99_ms: 50}
  - dependency_alert: {fault_phase: slow, quiet_phases: [baseline]}
  - circuit_recovers: {phase: slow, within_s: 3s}
  - cache_effective: {phase: baseline, min_hit_pct: 50}
  - error_rate: {max_pct: 0.5}
"""


def _run(agent_class: type[Any] | None = None, text: str = RUN, interrupt_on: str | None = None) -> Any:
    """Run `text`; with `interrupt_on`, SIGTERM this process 1 s after a log line containing it."""
    from harness.live import LiveView
    from harness.runner import Runner, RunOptions

    timers: list[threading.Timer] = []

    class View(LiveView):
        def log(self, line: str) -> None:
            super().log(line)
            if interrupt_on is not None and interrupt_on in line and not timers:
                timers.append(threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)))
                timers[0].start()

    scenario = load_scenario_text(text, "deps.yaml")
    runner = Runner(scenario, RunOptions(view=View(scenario.name, stream=io.StringIO(), rich=False),
                                         agent_class=agent_class))
    try:
        return runner.run()
    finally:
        for timer in timers:
            timer.cancel()


def _verdicts(result: Any) -> dict[str, Any]:
    return {v.kind: v for v in result.verdicts}


@needs_redis
@pytest.mark.slow
def test_the_unmodified_agent_falls_back_and_recovers_with_the_fault_on_the_redis_link_only() -> None:
    from agent_under_test.launch import AgentProcess

    seen: list[dict[str, Any]] = []

    class Recorded(AgentProcess):
        def __init__(self, **options: Any) -> None:
            seen.append(dict(options))
            super().__init__(**options)

    result = _run(Recorded)
    verdicts = _verdicts(result)
    assert result.passed, "\n".join(f"{v.mark} {v.id}: {v.summary}" for v in result.verdicts)
    # The agent was handed the proxy's address, not Redis's own.
    (dep,) = result.timeline.outside["dependencies"]
    assert dep["proxy"] != dep["address"] and dep["started_pid"]
    assert seen[0]["cache"] == "redis" and seen[0]["redis_url"] == f"redis://{dep['proxy']}/0"
    # The fault was applied to the dependency's proxy, and the client->agent link stayed clean: a 100 ms
    # toxic there would put every call above 100 ms.
    (window,) = [w for w in result.timeline.faults if w.on == "redis"]
    assert window.applied_s is not None and window.removed_s is not None and window.error is None
    assert "latency" in window.detail and window.effect
    assert verdicts["fallback_serves"].evidence["p99_ms"] < 50
    lat = sorted(c.latency_ms for c in result.timeline.calls if c.outcome == "ok"
                 and window.applied_s <= c.intended_s < window.removed_s)
    assert lat[len(lat) // 2] < 50, lat[len(lat) // 2]
    # Redis and its proxy are gone, by PID.
    assert _gone(dep["started_pid"]) and _gone(dep["proxy_pid"])
    assert not list(Path(tempfile.gettempdir()).glob(f"shadowtest-redis-{os.getpid()}-*"))


@needs_redis
@pytest.mark.slow
def test_an_interrupted_run_ends_redis_and_its_proxy() -> None:
    result = _run(interrupt_on="fault network:latency on redis (latency_ms=100) took effect")
    assert result.interrupted == "SIGTERM" and result.timeline.partial
    (dep,) = result.timeline.outside["dependencies"]
    assert _gone(dep["started_pid"]) and _gone(dep["proxy_pid"])
    assert not list(Path(tempfile.gettempdir()).glob(f"shadowtest-redis-{os.getpid()}-*"))
    assert any("fault network:latency on redis (latency_ms=100) removed" in line for line in result.log)


@needs_redis
@pytest.mark.slow
def test_a_cache_that_blocks_on_slow_redis_fails_fallback_serves() -> None:
    from broken_agent import broken  # tests/ is on sys.path under pytest

    # Without the near copy every miss is a lookup in Redis: with it, a lookup waits on Redis only in a
    # bucket the agent does not hold, and the few buckets of this traffic are all held before the fault.
    text = RUN.replace("dependency_threshold_ms: 20}", "dependency_threshold_ms: 20, redis_tracking: false}")
    assert text != RUN
    verdicts = _verdicts(_run(broken("cache_blocks"), text))
    v = verdicts["fallback_serves"]
    assert not v.passed and not v.skipped, v.summary
    assert "calls waited on the dependency instead of falling back" in v.summary or "failed" in v.summary


@needs_redis
@pytest.mark.slow
def test_a_stuck_circuit_and_a_silent_dependency_alert_fail_their_checks() -> None:
    from broken_agent import broken  # tests/ is on sys.path under pytest

    verdicts = _verdicts(_run(broken("circuit_stuck", "dependency_alert_never")))
    v = verdicts["circuit_recovers"]
    assert not v.passed and not v.skipped, v.summary
    assert v.summary.startswith("the redis circuit never closed after the fault was removed")
    v = verdicts["dependency_alert"]
    assert not v.passed and not v.skipped, v.summary
    assert v.summary.startswith("DependencySlow never fired while redis was faulted")
    assert verdicts["fallback_serves"].passed, verdicts["fallback_serves"].summary


def test_the_bundled_scenarios_judge_what_they_say() -> None:
    slow = load_scenario(ROOT / "scenarios" / "redis-slow.yaml")
    down = load_scenario(ROOT / "scenarios" / "redis-down.yaml")
    assert [d.name for d in slow.dependencies] == ["redis"] == [d.name for d in down.dependencies]
    assert {c.kind for c in slow.expect} >= {"fallback_serves", "dependency_alert", "circuit_recovers"}
    assert {c.kind for c in down.expect} >= {"fallback_serves", "circuit_recovers", "cache_effective"}
    assert [(f.kind, f.on) for p in slow.phases for f in p.faults] == [("latency", "redis")]
    assert [(f.kind, f.on) for p in down.phases for f in p.faults] == [("down", "redis")]
    assert 30 <= slow.duration_s <= 45 and 30 <= down.duration_s <= 45


def test_the_demo_caches_in_redis_when_it_can_and_says_so_when_it_cannot(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from harness.demo import Capture, cache_line, demo_scenario
    from harness.timeline import MetricSample, Timeline

    capture = Capture("proxy", str(tmp_path / "prod.rec"), {"calls": 10})
    with_redis = demo_scenario(capture, 7, 12.0, redis=True)
    assert [d.name for d in with_redis.dependencies] == ["redis"] and "cache" not in with_redis.target.options
    local = demo_scenario(capture, 7, 12.0, redis=False)
    assert local.dependencies == () and local.target.options["cache"] == "local"
    assert [c.kind for c in local.expect] == [c.kind for c in with_redis.expect]     # the same story judged
    counts = ({"hit_local": 0.0, "hit_redis": 0.0, "stale": 0.0, "miss": 0.0},
              {"hit_local": 60.0, "hit_redis": 15.0, "stale": 0.0, "miss": 25.0})
    samples = [MetricSample(t, {f'agent_cache_total{{result="{r}"}}': v for r, v in c.items()})
               for t, c in zip((0.0, 10.0), counts, strict=True)]
    tl = Timeline(period_s=1.0, threshold_ms=20.0, phases=[("run", 0.0, 10.0)], samples=samples)
    assert cache_line(SimpleNamespace(timeline=tl)) == (
        "cache (local tier only): 75 of 100 lookups answered from the cache (75%: local 60, redis 15, stale 0); "
        "the rest computed by the model")


@needs_redis
def test_an_external_dependency_gets_a_proxy_on_the_listen_address_and_nothing_started() -> None:
    import contextlib

    from harness.dependencies import RedisServer, start_dependencies

    with RedisServer() as theirs:
        listen = f"127.0.0.1:{free_port()}"
        scenario = load_scenario_text(scenario_text(
            deps=f"dependencies: {{redis: {{address: '{theirs.address}', listen: '{listen}'}}}}",
            target="external: {address: '127.0.0.1:50051'}"), "d.yaml")
        with contextlib.ExitStack() as stack:
            (dep,) = start_dependencies(scenario, stack).values()
            assert (dep.address, dep.listen, dep.pid) == (theirs.address, listen, None)
            assert dep.describe()["external"] is True
            assert _ping(listen).startswith(b"+PONG")          # the service's Redis, through the harness's proxy
        assert _ping(listen) == b"ConnectionRefusedError"      # the proxy went with the run
        assert _ping(theirs.address).startswith(b"+PONG")      # their Redis was never touched
