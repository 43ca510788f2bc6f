"""Benchmark: does `shadowtest capacity` find the knee bench/agent_latency.py calls "sustained", and twice alike?

One agent of the chosen tier, configured as agent_latency.py configures it (the tier pinned: no queue-depth
degradation, no alerts, limiter off, lean h2 server), then on that same agent (--fresh: each on an agent
started for it):

  1. `shadowtest capacity --target ADDR --pid PID` over the rates, SLO p99<=20ms and errors<=0% (the
     sustained rule: p99 <= 20 ms and no errors), Poisson arrivals, unary Decide calls;
  2. agent_latency.py's own method at the same rates: `open_loop` (its lean client by default,
     or grpc.aio with --open-loop-client grpcio) per rate and `_best_rate` ("highest offered rate with p99 <= 20 ms and no errors";
     it returns that step's achieved rate), at every rate up to two steps past run 1's knee (the best
     passing rate counts, as in agent_latency.py, so one noisy rate does not end it);
  3. `shadowtest capacity` once more.

It prints both knees and their ratio, the sustained rate and the step it was measured at, and the issue's
acceptance: the knee within one step of the sustained rate, the two knees within 10 % of each other.

    .venv/bin/python bench/capacity_knee.py                          # light tier, 400..1600 by 100, 5 s steps
    .venv/bin/python bench/capacity_knee.py --tier full --start 200 --step 100 --max 1200
    .venv/bin/python bench/capacity_knee.py --pin --fresh --tier full --confirm --start 4000 --step 250 --max 7000

On a 2-core host, --pin gives the agent a core of its own: unpinned, the clients' CPU is part of what
saturates the machine, so the knee is the machine's (the replay engine behind `capacity` costs several
times the bench's lean client per call), and it wandered from run to run. --fresh starts each measurement
from an agent that was not just pushed past its knee.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import agent_latency  # noqa: E402
from agent_latency import _best_rate, open_loop  # noqa: E402
from cpus import pin  # noqa: E402

from agent_under_test.launch import AgentProcess  # noqa: E402

PINNED = {"queue_light_depth": 0, "alerts": False}   # agent_latency.py's pinned tier
SLOS = ("p99<=20ms", "errors<=0%")


def capacity(address: str, pid: int, rates: list[float], step_s: float, confirm: bool = False) -> dict:
    """One `shadowtest capacity` run (a child process, as a user runs it); its --json."""
    with tempfile.TemporaryDirectory(prefix="capacity-knee-") as tmp:
        out = Path(tmp) / "cap.json"
        cmd = [sys.executable, "-m", "harness.cli", "capacity", "--target", address, "--pid", str(pid),
               "--steps", ",".join(f"{r:g}" for r in rates), "--step-s", f"{step_s:g}", "--json", str(out)]
        for slo in SLOS:
            cmd += ["--slo", slo]
        cmd += ["--confirm"] if confirm else []
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60 + len(rates) * (step_s + 6))
        if not out.exists():
            raise RuntimeError(f"capacity failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        print(done.stderr.rstrip(), flush=True)
        return json.loads(out.read_text())


def sustained(address: str, pid: int, rates: list[float], duration_s: float) -> tuple[float, float | None, list]:
    """agent_latency.py's method at `rates`: (its sustained rate, the step rate it came from, the rows)."""
    open_loop(address, pid, rates[0], 2.0)          # warm-up, as capacity's own --warmup-s
    rows: list[dict] = []
    for rate in rates:
        row = open_loop(address, pid, rate, duration_s)
        rows.append(row)
        ok = row["p99_ms"] is not None and row["p99_ms"] <= 20.0 and not row["errors"]
        print(f"open-loop {rate:g}/s: achieved {row['achieved']:.1f}/s, p99 {row['p99_ms']} ms, errors "
              f"{row['errors']}, client send lag p99 {row['send_lag_p99_ms']} ms -> {'ok' if ok else 'over'}",
              flush=True)
    best = _best_rate({"open_loop": rows})
    step = next((r["rate"] for r in rows if r["achieved"] == best and best > 0), None)
    return best, step, rows


def _announce(args: argparse.Namespace, agent: AgentProcess, rates: list[float]) -> None:
    if args.pin:
        print(pin(agent.pid), flush=True)
    print(f"agent {args.tier} pid {agent.pid} at {agent.grpc_address}; steps {rates[0]:g}..{rates[-1]:g} "
          f"by {args.step:g}/s, {args.step_s:g}s each", flush=True)


def _knee(data: dict) -> float | None:
    return data["knee"]["rate"] if data["knee"] else None


def _bound(data: dict) -> str:
    """How far the run's knee is known: a break above it, or none up to the last step."""
    return f"broke at {data['broke']['rate']:g}/s" if data["bounded"] else "no step broke: at least this"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", choices=["light", "full"], default="light")
    ap.add_argument("--start", type=float, default=400.0)
    ap.add_argument("--step", type=float, default=100.0)
    ap.add_argument("--max", type=float, default=1600.0)
    ap.add_argument("--step-s", type=float, default=5.0)
    ap.add_argument("--confirm", action="store_true", help="capacity --confirm: a break stands when its re-run breaks")
    ap.add_argument("--open-loop-client", choices=agent_latency.OPEN_LOOP_CLIENTS, default="lean",
                    help="agent_latency.py's open-loop client for the sustained rate")
    ap.add_argument("--pin", action="store_true",
                    help="the agent on the last CPU, both clients on the others: neither client's own CPU cost "
                         "takes from the agent (on a 2-core host the grpcio client's does, and lowers what it "
                         "measures)")
    ap.add_argument("--fresh", action="store_true",
                    help="each of the three measurements on an agent started for it, not one agent for all: an "
                         "agent just pushed past its knee (queues of seconds, its heap grown) is not the agent the "
                         "next measurement should start from")
    args = ap.parse_args()
    agent_latency.OPEN_LOOP_CLIENT = args.open_loop_client
    rates = [args.start + i * args.step for i in range(int((args.max - args.start) / args.step + 1e-9) + 1)]
    started = time.monotonic()
    def start(stack: contextlib.ExitStack) -> AgentProcess:
        agent = stack.enter_context(AgentProcess(tier=args.tier, device="cpu", metrics_port=None, server="h2", **PINNED))
        _announce(args, agent, rates)
        return agent

    with contextlib.ExitStack() as stack:
        shared = None if args.fresh else start(stack)

        def on_agent(step: Callable[[AgentProcess], Any]) -> Any:
            """Run one of the three measurements on the shared agent, or (--fresh) on one started for it."""
            if shared is not None:
                return step(shared)
            with contextlib.ExitStack() as own:
                return step(start(own))

        first = on_agent(lambda a: capacity(a.grpc_address, a.pid, rates, args.step_s, args.confirm))
        reach = rates.index(_knee(first)) + 3 if _knee(first) in rates else 3   # to two steps past the knee
        best, best_step, _ = on_agent(lambda a: sustained(a.grpc_address, a.pid, rates[:reach], args.step_s))
        second = on_agent(lambda a: capacity(a.grpc_address, a.pid, rates, args.step_s, args.confirm))
    print(f"\nrun 1: {_bound(first)}; run 2: {_bound(second)}")
    _summary(args, rates, _knee(first), _knee(second), best, best_step, time.monotonic() - started)


def _summary(args: argparse.Namespace, rates: list[float], k1: float | None, k2: float | None, best: float,
             best_step: float | None, elapsed: float) -> None:
    print(f"\n== capacity knee vs agent_latency sustained, tier {args.tier} ({elapsed:.0f} s)")
    print(f"knee run 1   {k1}/s")
    print(f"knee run 2   {k2}/s")
    ratio = min(k1, k2) / max(k1, k2) if k1 and k2 else None
    print(f"ratio        {'-' if ratio is None else f'{ratio:.3f}'} (run 1 / run 2: "
          f"{'-' if not (k1 and k2) else f'{k1 / k2:.3f}'})")
    print(f"sustained    {best:.1f} calls/s achieved, at the {best_step}/s step (agent_latency.py's _best_rate)")
    if k1 is None or k2 is None or best_step is None:
        print("acceptance   cannot judge: a knee or the sustained rate is missing")
        return
    index = {r: i for i, r in enumerate(rates)}
    apart = [abs(index[k] - index[best_step]) for k in (k1, k2)]
    print(f"acceptance   knee within one step of sustained: {'yes' if max(apart) <= 1 else 'NO'} "
          f"(steps apart: {apart[0]}, {apart[1]}); two runs within 10%: {'yes' if ratio and ratio >= 0.9 else 'NO'}")


if __name__ == "__main__":
    main()
