"""The serving thread's saturation: real threads read from /proc, and how the guard reports it."""

from __future__ import annotations

import threading
import time

import pytest

from agent_under_test.hooks import GuardConfig
from agent_under_test.protection import ProtectionGuard
from agent_under_test.saturation import ThreadSaturation, read_schedstat
from wire.clock import FakeClock

pytestmark = pytest.mark.skipif(read_schedstat(threading.get_native_id()) is None,
                                reason="needs /proc/<pid>/task/<tid>/schedstat (Linux with schedstats)")


def _in_thread(work) -> float | None:
    """Saturation of a new thread over `work()` (0.3 s), sampled from this thread as the guard does,
    while the thread still exists."""
    ready, done, release, out = threading.Event(), threading.Event(), threading.Event(), {}

    def run() -> None:
        out["tid"] = threading.get_native_id()
        ready.set()
        work()
        done.set()
        release.wait(10)

    t = threading.Thread(target=run)
    t.start()
    ready.wait()
    sat = ThreadSaturation(out["tid"])
    done.wait(10)
    value = sat.sample()
    release.set()
    t.join()
    return value


def test_a_spinning_thread_reads_busy_and_a_sleeping_one_idle():
    def spin() -> None:
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            pass

    busy = _in_thread(spin)
    idle = _in_thread(lambda: time.sleep(0.3))
    # A spinning thread runs or waits for a CPU all the time (the GIL is released between its checks,
    # so this thread's sampling costs it nothing); a sleeping one neither.
    assert busy is not None and busy > 0.8
    assert idle is not None and idle < 0.1


def test_each_sample_covers_only_the_time_since_the_last():
    sat = ThreadSaturation()
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        pass
    first = sat.sample()
    time.sleep(0.2)
    second = sat.sample()
    assert first is not None and first > 0.8
    assert second is not None and second < 0.2


def test_a_thread_that_is_gone_reads_none_never_an_error():
    t = threading.Thread(target=lambda: None)
    t.start()
    tid = t.native_id
    t.join()
    assert tid is not None
    deadline = time.monotonic() + 5.0   # join() returns a moment before the OS thread is gone
    while read_schedstat(tid) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    sat = ThreadSaturation(tid)
    assert sat.sample() is None


def test_the_guard_puts_each_periods_saturation_in_the_event_and_the_gauge():
    clock = FakeClock.at(1000.0)
    g = ProtectionGuard(GuardConfig(limiter="off", min_samples=1), clock)
    readings = iter([0.42, None])
    g.set_saturation_source(lambda: next(readings))
    for _ in range(2):
        g.finish("Decide", 0.001, "ok")
        clock.advance(1.0)
        g.tick()
    first, second = g.events.since(0, "period")
    assert first["saturation"] == 0.42 and second["saturation"] is None
    # The gauge keeps the last reading there was (a period that could not be read does not zero it).
    assert "agent_loop_saturation 0.42" in g.metrics.exposition().decode()
