"""The agent's heap tracer names the line whose allocations stay alive, through its /heap endpoints,
and only when asked; bad arguments get a 400 and one line."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator

import pytest
from test_agent_metrics_hostile import get

from agent_under_test.heap import TRACER, HeapTracer
from agent_under_test.hooks import GuardConfig
from agent_under_test.metrics_http import MetricsServer
from agent_under_test.protection import ProtectionGuard
from harness.observe import heap_call

KEPT: list[bytes] = []


def _keep(n: int) -> int:
    """Keep n blocks of 32 KB alive; returns the line that allocates them."""
    for _ in range(n):
        KEPT.append(bytes(32 * 1024) + b"x")   # the allocating line: _keep's first line + 2
    return _keep.__code__.co_firstlineno + 3


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    guard = ProtectionGuard(GuardConfig(period_s=3600.0))
    s = MetricsServer("127.0.0.1", 0, guard.metrics, guard.events, guard.set_threshold)
    s.start()
    yield s
    s.stop()
    TRACER.stop()
    KEPT.clear()


def test_the_growing_site_is_named_with_its_size_and_blocks() -> None:
    tracer = HeapTracer()
    assert not tracemalloc.is_tracing()
    tracer.start()
    try:
        line = _keep(100)
        g = tracer.growth(top=3)
    finally:
        tracer.stop()
        KEPT.clear()
    assert not tracemalloc.is_tracing()                 # it stops what it started
    top = g["sites"][0]
    assert top["site"] == f"{__file__}:{line}", g
    assert top["blocks"] >= 100 and 3200 <= top["grown_kb"] < 3400, top
    assert g["grown_mb"] >= 3.1 and len(g["sites"]) <= 3


def test_growth_before_start_and_out_of_range_arguments_are_refused() -> None:
    tracer = HeapTracer()
    with pytest.raises(ValueError, match="heap tracing is off: POST /heap/start first"):
        tracer.growth()
    with pytest.raises(ValueError, match="frames must be between 1 and 8, got 9"):
        tracer.start(frames=9)
    assert not tracemalloc.is_tracing()


def test_the_endpoints_trace_on_demand_and_answer_bad_requests_with_400(server: MetricsServer) -> None:
    status, body = get(server, "/heap/growth")
    assert (status, body) == (400, b"heap tracing is off: POST /heap/start first\n")
    assert get(server, "/heap/start?frames=x", method="POST") == (400, b"frames must be a small non-negative "
                                                                        b"integer, got 'x'\n")
    assert not tracemalloc.is_tracing()
    start = heap_call(server.url + "/metrics", "/heap/start?frames=2", post=True)
    assert start["tracing"] is True and start["frames"] == 2
    line = _keep(40)
    grown = heap_call(server.url + "/metrics", "/heap/growth?top=5")
    assert grown["sites"][0]["site"] == f"{__file__}:{line}" and grown["sites"][0]["blocks"] >= 40
    assert get(server, "/heap/growth?top=51")[0] == 400
    assert json.loads(get(server, "/heap/stop", method="POST")[1]) == {"tracing": False}
    assert not tracemalloc.is_tracing()
