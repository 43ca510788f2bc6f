"""What the chaos harness costs the replayer: send lag with and without the harness around it.

Three runs of the same seeded open-loop plan against the same agent, in one process run:
  bare      replay.engine.ReplayRun straight to the agent (the peer)
  embedded  ReplayRun through a Toxiproxy-compatible proxy in the SAME process (the harness's first
            design: proxy loop and replayer share the GIL)
  harness   harness.runner.Runner with an external target: proxy in a child process, /metrics and
            /events followers, CPU sampler, live view (plain lines to /dev/null), checks

Prints send lag (actual send - intended send) p50/p99/max and client latency p50/p99, and each run's
lag ratio to bare. Usage: .venv/bin/python bench/harness_overhead.py [--rate 300] [--seconds 12]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_under_test.launch import AgentProcess  # noqa: E402
from harness.live import LiveView  # noqa: E402
from harness.runner import Runner, RunOptions  # noqa: E402
from harness.scenario import GeneratorTraffic  # noqa: E402
from harness.scenario_load import load_scenario_text  # noqa: E402
from harness.traffic import generator_plan  # noqa: E402
from replay.engine import ReplayRun  # noqa: E402
from replay.options import ReplayOptions  # noqa: E402
from wire.stats import percentile  # noqa: E402


def _stats(lags_us: list[float], lat_ms: list[float]) -> dict[str, float]:
    lags_us, lat_ms = sorted(lags_us), sorted(lat_ms)
    return {"lag_p50_us": percentile(lags_us, 0.5), "lag_p99_us": percentile(lags_us, 0.99),
            "lag_max_us": lags_us[-1], "lat_p50_ms": percentile(lat_ms, 0.5), "lat_p99_ms": percentile(lat_ms, 0.99),
            "calls": len(lat_ms)}


def bare(target: str, rate: float, seconds: float) -> dict[str, float]:
    results = []
    plan = generator_plan(GeneratorTraffic(rate=rate), seconds, seed=1)
    ReplayRun(plan, target, ReplayOptions(), on_result=results.append).run()
    sent = [r for r in results if r.sent_ns]
    return _stats([(r.sent_ns - r.intended_ns) / 1e3 for r in sent],
                  [(r.done_ns - r.intended_ns) / 1e6 for r in sent if r.outcome == "ok"])


def embedded(target: str, rate: float, seconds: float) -> dict[str, float]:
    from faults.proxy import EmbeddedToxiproxy

    with EmbeddedToxiproxy() as proxy:
        made = proxy.create_proxy("bench", upstream=target)
        return bare(str(made["listen"]), rate, seconds)


def harness(target: str, metrics: str, rate: float, seconds: float) -> dict[str, float]:
    text = f"""
name: bench
seed: 1
target: {{external: {{address: "{target}", metrics_url: "{metrics}", period_s: 1.0}}}}
traffic: {{generator: {{rate: {rate}}}}}
phases: [{{name: only, duration: {seconds}s}}]
expect: [{{no_loss: {{}}}}]
"""
    scenario = load_scenario_text(text)
    view = LiveView("bench", stream=io.StringIO(), rich=False)
    result = Runner(scenario, RunOptions(view=view)).run()
    sent = [c for c in result.timeline.calls if c.sent_s is not None]
    return _stats([(c.sent_s - c.intended_s) * 1e6 for c in sent],
                  [c.latency_ms for c in sent if c.outcome == "ok" and c.latency_ms is not None])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=300.0)
    ap.add_argument("--seconds", type=float, default=12.0)
    args = ap.parse_args()
    os.environ.setdefault("SHADOWTEST_STATE_DIR", tempfile.mkdtemp(prefix="bench-state-"))
    with AgentProcess(device="cpu", limiter="off") as agent:
        runs = {}
        bare(agent.grpc_address, args.rate, 2.0)   # warm the agent up; not measured
        for name, fn in (("bare", lambda: bare(agent.grpc_address, args.rate, args.seconds)),
                         ("embedded", lambda: embedded(agent.grpc_address, args.rate, args.seconds)),
                         ("harness", lambda: harness(agent.grpc_address, f"{agent.metrics_url}/metrics",
                                                     args.rate, args.seconds))):
            t = time.monotonic()
            runs[name] = fn()
            print(f"{name:9s} {runs[name]['calls']:5d} calls in {time.monotonic() - t:5.1f}s", flush=True)
    print(f"\n{args.rate:g} calls/s for {args.seconds:g} s, same seeded plan, same agent")
    print(f"{'run':9s} {'lag p50':>9s} {'lag p99':>10s} {'lag max':>10s} {'lat p50':>9s} {'lat p99':>9s} "
          f"{'p50 x bare':>10s} {'p99 x bare':>10s}")
    b = runs["bare"]
    for name, r in runs.items():
        print(f"{name:9s} {r['lag_p50_us']:7.0f}us {r['lag_p99_us']:8.0f}us {r['lag_max_us']:8.0f}us "
              f"{r['lat_p50_ms']:7.1f}ms {r['lat_p99_ms']:7.1f}ms {r['lag_p50_us'] / b['lag_p50_us']:10.2f} "
              f"{r['lag_p99_us'] / b['lag_p99_us']:10.2f}")


if __name__ == "__main__":
    main()
