"""A request that waited in the kernel while the agent could not run is timed from its arrival.

The agent's own latency (what its P99 alert and limiter judge) used to start when the lean server read
a call's headers: a process stopped or throttled for 300 ms then answered in 1 ms reported 1 ms. The
loop's heartbeat (agent_under_test/stall.py) now dates such calls back to when they arrived.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time
import urllib.request

import pytest

from agent_under_test.stall import LoopStall, spread


def test_spread_puts_each_request_at_the_middle_of_its_share() -> None:
    assert spread(1_000, 2_000, 1) == [1_500]
    assert spread(1_000, 2_000, 4) == [1_125, 1_375, 1_625, 1_875]
    assert spread(1_000, 1_000, 3) == [1_000, 1_000, 1_000]
    assert spread(2_000, 1_000, 2) == [2_000, 2_000]   # nothing before the window's start


def test_a_blocked_loop_is_a_stall_and_a_free_one_is_not() -> None:
    async def main() -> tuple[object, object, object, int]:
        stall = LoopStall(interval_s=0.005, min_stall_s=0.002)
        stall.acquire()
        await asyncio.sleep(0.03)                 # the loop free: the heartbeat runs on time
        before = time.perf_counter_ns()
        quiet = stall.window(before - 20_000_000, before)
        time.sleep(0.08)                          # the loop blocked, as a throttled process's is
        now = time.perf_counter_ns()
        blocked = stall.window(before, now)       # read at once as the loop runs again
        await asyncio.sleep(0.03)
        later = stall.window(now, time.perf_counter_ns())   # read after it: the stall is over
        stall.release()
        return quiet, blocked, later, stall.stalls

    quiet, blocked, later, stalls = asyncio.run(main())
    assert quiet is None
    assert isinstance(blocked, tuple)
    lo, hi = blocked
    assert 0.07 <= (hi - lo) / 1e9 <= 0.2, blocked   # from when the beat was due (<= 5 ms in) to now
    assert later is None
    assert stalls == 1


def test_no_heartbeat_without_users() -> None:
    async def main() -> object:
        stall = LoopStall()
        stall.acquire()
        stall.release()
        before = time.perf_counter_ns()
        time.sleep(0.03)
        return stall.window(before, time.perf_counter_ns())

    assert asyncio.run(main()) is None


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_call_sent_while_the_agent_is_stopped_is_timed_from_its_arrival(event_loop: str) -> None:
    pytest.importorskip("torch", reason="needs torch (pip install 'shadowtest[agent]')")
    import grpc

    from agent_under_test.launch import AgentProcess
    from agent_under_test.market import MarketSim
    from agent_under_test.proto import agent_pb2_grpc

    sim = MarketSim(random.Random(3))
    with AgentProcess(tier="light", event_loop=event_loop, limiter="off") as agent, \
            grpc.insecure_channel(agent.grpc_address) as channel:
        stub = agent_pb2_grpc.TradingAgentStub(channel)
        warm = [stub.Decide(sim.next(i + 1), timeout=10).server_latency_ns for i in range(5)]
        os.kill(agent.proc.pid, signal.SIGSTOP)
        try:
            future = stub.Decide.future(sim.next(10), timeout=10)
            time.sleep(0.3)
        finally:
            os.kill(agent.proc.pid, signal.SIGCONT)
        stopped = future.result().server_latency_ns
        after = [stub.Decide(sim.next(20 + i), timeout=10).server_latency_ns for i in range(5)]
        assert agent.metrics_url is not None
        with urllib.request.urlopen(f"{agent.metrics_url}/metrics", timeout=10) as resp:
            exposition = resp.read().decode()
    found = re.search(r"^agent_loop_stalled_seconds (\S+)$", exposition, re.M)
    assert found is not None, exposition[-2000:]
    stalled = float(found.group(1))
    assert 0.25 <= stalled <= 5.0, stalled   # the stop, as the loop measured it (and any other stall)
    # it arrived ~300 ms before the agent could read it; the estimate is the middle of the window it
    # could have arrived in (from the stall's start to the connection's last data): half of it at least
    assert 0.15e9 <= stopped <= 1.0e9, (warm, stopped, after)
    # calls after the stall are not back-dated: they arrived after it
    assert max(after) < 0.1e9, (warm, stopped, after)
