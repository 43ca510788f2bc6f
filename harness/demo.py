"""`shadowtest demo`: the whole story on one machine in about 80 seconds.

    1. production: start the agent, drive production-like traffic at it, record it with eBPF
       (falling back to pcap, then the recording proxy, each time saying why)
    2. shadow:     a fresh agent behind the fault proxy; replay the recording at 2x speed while
                   network jitter and CPU contention hit it (the jitter-and-cpu story); the agent
                   caches its answers (the recording loops, so its calls come again): in a Redis the
                   run starts behind its own fault proxy when redis-server is installed, else in its
                   local tier only (said so)
    3. verdicts:   alert, limiter, degradation, recovery and accounting checked; reports written
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from harness.errors import RunError
from wire.process import free_port

BACKENDS = ("ebpf", "pcap", "proxy")

SCENARIO = """\
name: demo
description: Recorded production traffic replayed at 2x with jitter and CPU contention.
seed: {seed}
{dependencies}
target:
  agent: {{limiter: seed, p99_threshold_ms: 20, alert_periods: 3, resolve_periods: 3, period_s: 1.0,
          initial_rate: 180, max_rate: 180,   # near the ~120/s replayed: a cut must shed load
          queue_light_depth: 0{cache}}}   # only P99High degrades, so `degrades` judges the alert's doing
traffic: {{recording: "{recording}", speed: 2.0, loop: {loop}}}
phases:
  - {{name: warmup, duration: 5s}}
  - {{name: baseline, duration: 10s}}
  - name: fault
    duration: 15s
    faults:
      - {{network: latency, latency_ms: 5, jitter_ms: 15}}
      - {{cpu: contention, workers: 4, load_pct: 100}}
      - {{cpu: quota, pct: 4}}
  - {{name: recovery, duration: 20s}}
expect:
  - alert_silent: {{phase: baseline}}
  - fault_effective: {{phase: fault, baseline: baseline}}   # each fault on the signal it alone moves
  - alert_fires: {{phase: fault, within_periods: 1}}
  - limiter_reduces: {{phase: fault, at_least_pct: 20}}
  - degrades: {{phase: fault, within_periods: 2}}
  - restores: {{phase: recovery, within_s: 15s}}
  - no_loss: {{}}
"""
RUN_S = 50.0


@dataclass
class Capture:
    backend: str
    path: str
    stats: dict[str, Any]
    fallbacks: list[str] = field(default_factory=list)   # "ebpf: why it could not run", ...



def _start_recorder(backend: str, port: int, output: Path) -> tuple[Any, str]:
    """A started Recorder and the address production clients must use. Raises CaptureError."""
    from capture.backends import RecordOptions
    from capture.record import Recorder

    listen = free_port() if backend == "proxy" else 0
    rec = Recorder(RecordOptions(output=str(output), backend=backend, port=port, listen_port=listen,
                                 overwrite=True)).start()
    return rec, (f"127.0.0.1:{listen}" if backend == "proxy" else f"127.0.0.1:{port}")


def record_production(workdir: Path, seconds: float, rate: float, seed: int, say: Any,
                      backends: tuple[str, ...] = BACKENDS) -> Capture:
    """Start a production agent, record `seconds` of generated traffic; try `backends` in order.

    Raises RunError when no backend can record here (each one's reason in the message).
    """
    from agent_under_test.launch import AgentProcess
    from agent_under_test.traffic import run_traffic
    from capture.errors import CaptureError

    output = workdir / "prod.rec"
    fallbacks: list[str] = []
    with AgentProcess(device="cpu", limiter="seed", hpack_table_size=0) as agent:
        port = int(agent.grpc_address.rsplit(":", 1)[1])
        say(f"production agent up at {agent.grpc_address} (pid {agent.pid})")
        for backend in backends:
            try:
                rec, address = _start_recorder(backend, port, output)
            except CaptureError as exc:
                fallbacks.append(f"{backend}: {exc}")
                say(f"capture backend {backend} cannot run here: {exc}")
                continue
            say(f"recording with {backend}" + (f" (fallback: {'; '.join(fallbacks)})" if fallbacks else ""))
            with contextlib.closing(_Stopper(rec)):
                report = run_traffic(address, rate=rate, duration_s=seconds, pattern="bursty", seed=seed,
                                     stream_share=0.0)
            stats = rec.result or {}
            say(f"production traffic: {report.sent} calls at {report.achieved_rate:.0f}/s, p99 "
                f"{report.p99_ms} ms; recorded {stats.get('calls')} calls in {stats.get('flows')} flow(s), "
                f"lost events {stats.get('lost_events')}")
            return Capture(backend, str(output), stats, fallbacks)
    raise RunError("no capture backend can record on this host: " + "; ".join(fallbacks))


class _Stopper:
    def __init__(self, rec: Any) -> None:
        self.rec = rec

    def close(self) -> None:
        self.rec.stop()


def demo_scenario(capture: Capture, seed: int, record_s: float, redis: bool | None = None) -> Any:
    """The jitter-and-cpu story over the recording, looped to cover the whole run at 2x. The agent
    caches: with a Redis the run starts (`redis`: default, when redis-server is installed), else in
    its local tier only."""
    from harness.dependencies import find_redis
    from harness.scenario_load import load_scenario_text

    if redis is None:
        redis = find_redis() is not None
    loop = max(1, math.ceil(RUN_S * 2.0 / max(record_s, 1.0)) + 1)
    text = SCENARIO.format(seed=seed, recording=capture.path, loop=loop,
                           dependencies="dependencies: {redis: {}}" if redis else "",
                           cache="" if redis else ", cache: local")
    return load_scenario_text(text, "<demo>")


def cache_line(result: Any) -> str:
    """What the agent's cache answered over the run, in one line (or why it cannot be told)."""
    from harness.checks.dependency import HITS, cache_counts

    tl = result.timeline
    counts = cache_counts(tl, 0.0, tl.duration_s + 60.0)
    where = "Redis behind its fault proxy + local tier" if tl.outside.get("dependencies") else "local tier only"
    if not counts or not sum(counts.values()):
        return f"cache ({where}): no lookups counted"
    hits = sum(counts[r] for r in HITS)
    total = hits + counts["miss"]
    return (f"cache ({where}): {hits:.0f} of {total:.0f} lookups answered from the cache "
            f"({hits / total * 100:.0f}%: local {counts['hit_local']:.0f}, redis {counts['hit_redis']:.0f}, "
            f"stale {counts['stale']:.0f}); the rest computed by the model")


def run_demo(report_dir: str, *, record_s: float = 12.0, rate: float = 60.0, seed: int = 7,
             stream: TextIO | None = None, backends: tuple[str, ...] = BACKENDS,
             scale: float = 1.0) -> tuple[Any, dict[str, str]]:
    """The whole demo; returns (RunResult, report paths). Raises RunError when it cannot run.

    `scale` shortens the chaos run (tests use 0.2); the recording is looped to cover it.
    """
    from harness.session import run_scenario

    out = stream or sys.stdout
    workdir = Path(report_dir)
    workdir.mkdir(parents=True, exist_ok=True)
    os.chmod(workdir, 0o700)   # the recording holds (demo) production data

    def say(line: str) -> None:
        print(f"[demo] {line}", file=out, flush=True)

    say(f"1/3 record {record_s:g}s of production traffic ({rate:g} calls/s, bursty)")
    capture = record_production(workdir, record_s, rate, seed, say, backends)
    if not capture.stats.get("calls"):
        raise RunError(f"the {capture.backend} recording holds no calls; see `shadowtest doctor`")
    say("2/3 replay it at 2x through the fault proxy: jitter 5+15 ms and CPU contention in the fault phase")
    notes = [f"capture backend: {capture.backend}"] + [f"capture fallback, {f}" for f in capture.fallbacks]
    from harness.dependencies import find_redis

    redis = find_redis() is not None
    if redis:
        say("the agent caches its answers in a Redis started for the run (loopback, behind its own fault proxy)")
    else:
        say("redis-server is not installed: the agent caches its answers in its local tier only "
            "(apt-get install redis-server for the Redis tier)")
        notes.append("redis-server not installed: the agent's cache ran with its local tier only")
    scenario = demo_scenario(capture, seed, record_s, redis)
    if scale != 1.0:
        scenario = scenario.scaled(scale)
    result, paths = run_scenario(scenario, report_dir=report_dir, stream=out, notes=notes)
    say(cache_line(result))
    say("3/3 verdicts")
    return result, paths
