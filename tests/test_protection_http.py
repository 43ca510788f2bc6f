"""The guard's HTTP endpoint on a real port: /metrics, /events (streamed, resumable), /healthz, /threshold."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from agent_under_test.errors import ServeError
from agent_under_test.hooks import GuardConfig
from agent_under_test.protection import ProtectionGuard


@pytest.fixture
def guard() -> Iterator[ProtectionGuard]:
    # A period of an hour: the ticker never fires by itself, the test ticks explicitly.
    g = ProtectionGuard(GuardConfig(limiter="seed", metrics_port=0, period_s=3600.0, min_samples=5,
                                    alert_periods=1))
    g.start()
    try:
        yield g
    finally:
        g.stop()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def load_period(g: ProtectionGuard, ms: float, calls: int = 10) -> None:
    for _ in range(calls):
        g.admit("Decide")
        g.finish("Decide", ms / 1000.0, "ok")
    g.tick()


def test_metrics_healthz_and_unknown_paths(guard):
    assert guard.metrics_url.startswith("http://127.0.0.1:")
    assert get(guard.metrics_url + "/healthz") == "ok\n"
    load_period(guard, 50.0)
    text = get(guard.metrics_url + "/metrics")
    assert 'agent_alert_firing{alert="P99High"} 1.0' in text and 'agent_requests_total{outcome="ok"} 10.0' in text
    assert 'agent_request_latency_seconds_bucket{le="0.02"} 0.0' in text
    with pytest.raises(urllib.error.HTTPError) as err:
        get(guard.metrics_url + "/nope")
    assert err.value.code == 404


def test_events_follow_0_returns_what_exists_and_since_resumes(guard):
    load_period(guard, 50.0)
    lines = [json.loads(x) for x in get(guard.metrics_url + "/events?follow=0").splitlines()]
    assert [e["type"] for e in lines] == ["period", "alert", "limiter", "tier"]
    assert [e["seq"] for e in lines] == [1, 2, 3, 4]
    rest = [json.loads(x) for x in get(guard.metrics_url + "/events?follow=0&since=2").splitlines()]
    assert [e["seq"] for e in rest] == [3, 4]
    with pytest.raises(urllib.error.HTTPError):
        get(guard.metrics_url + "/events?since=x")


def test_events_stream_as_they_happen_and_end_when_the_guard_stops(guard):
    url = urlsplit(guard.metrics_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", "/events?since=0")
    resp = conn.getresponse()
    assert resp.getheader("Transfer-Encoding") == "chunked"
    timer = threading.Timer(0.3, load_period, (guard, 1.0))
    start = time.monotonic()
    timer.start()
    first = json.loads(resp.readline())
    # Generous: the machine is shared; a streamed event must not wait for the 0.5 s poll, let alone a period.
    assert first["type"] == "period" and first["seq"] == 1 and time.monotonic() - start < 5.0
    guard.stop()
    rest = [json.loads(x) for x in resp.read().splitlines()]   # returns: the stream ended with its last chunk
    assert [e["seq"] for e in rest] == [2] and rest[0]["type"] == "limiter"
    conn.close()


def test_post_threshold_applies_from_the_next_period(guard):
    load_period(guard, 50.0)
    assert guard.alert_state() == "firing"
    req = urllib.request.Request(guard.metrics_url + "/threshold?p99_ms=100", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert json.loads(resp.read()) == {"p99_threshold_ms": 100.0}
    assert load_period(guard, 50.0) is None and guard.last_summary.state == "healthy"
    assert guard.events.since(0, "limiter")[-1]["reason"].endswith("<= 100 ms: x1.1")
    bad = urllib.request.Request(guard.metrics_url + "/threshold?p99_ms=-1", method="POST", data=b"")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(bad, timeout=5)
    assert err.value.code == 400


def test_a_busy_metrics_port_fails_with_a_hint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        g = ProtectionGuard(GuardConfig(metrics_port=s.getsockname()[1], period_s=3600.0))
        with pytest.raises(ServeError, match="pick a free --metrics-port"):
            g.start()
        g.stop()


def test_the_ticker_closes_periods_on_a_fixed_grid_in_real_time():
    g = ProtectionGuard(GuardConfig(period_s=0.1))        # no endpoint: metrics_port None
    g.start()
    try:
        g.finish("Decide", 0.001, "ok")
        deadline = time.monotonic() + 10.0                # generous: the machine is shared
        while len(g.events.since(0, "period")) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        g.stop()
    periods = g.events.since(0, "period")
    assert [e["period"] for e in periods[:3]] == [1, 2, 3] and periods[0]["count"] == 1
    # Ticks land on start + n x period_s whatever the thread's wake-up jitter (a whole period missed
    # while the process was starved is skipped, so the gap is a multiple of period_s, usually 2).
    gap = periods[2]["mono"] - periods[0]["mono"]
    assert gap >= 0.2 - 1e-9 and gap / 0.1 == pytest.approx(round(gap / 0.1), abs=1e-6)
    assert g.metrics_url is None
    n = len(g.events.since(0, "period"))
    time.sleep(0.3)
    assert len(g.events.since(0, "period")) == n          # stopped: no more ticks
