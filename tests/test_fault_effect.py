"""fault_effective judges each fault on what it was measured to do, not on what the client saw.

Network toxics: our proxy counts, per toxic, the chunks it held and for how long, the bytes it cut, the
connections it closed or reset, the calls it delayed or failed (`GET /proxies/{name}/effects`). CPU
faults: the contention workers' CPU time, the quota cgroup's throttling. Measured on loopback with
the real proxy and real processes; the judging rules on hand-built windows with exact verdicts.
"""

from __future__ import annotations

import http.client
import http.server
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest

from faults.network import NetworkFaults
from faults.proxy import EmbeddedToxiproxy
from faults.proxy.proxy import EffectLog
from faults.proxy.toxics import LatencyToxic, Toxic
from faults.testing import EchoServer, connect, read_exactly, wait_closed
from harness.checks import CHECKS, Verdict
from harness.checks.service import asked_mean_ms
from harness.faultrun import FaultSession, NetworkProxy
from harness.scenario import CheckSpec, FaultSpec
from harness.timeline import CallResult, FaultWindow, Timeline
from wire.process import spawn

pytestmark = pytest.mark.usefixtures("state_dir")   # SHADOWTEST_STATE_DIR in the test's tmp dir (tests/conftest.py)

PHASES = [("baseline", 0.0, 5.0), ("fault", 5.0, 10.0), ("recovery", 10.0, 15.0)]


def round_trips(listen: str, n: int, size: int = 64) -> None:
    """`n` echo round trips on one connection through the proxy, one at a time."""
    with connect(listen) as s:
        for i in range(n):
            s.sendall(bytes([i % 256]) * size)
            read_exactly(s, size)


def api(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def judge(effect: dict[str, Any] | None, kind: str = "latency", family: str = "network", **kw: Any) -> Verdict:
    """fault_effective over one fault window in phase `fault` holding `effect`."""
    w = FaultWindow(f"{family}:{kind}", "fault", family, kind, 5.0, 5.0, 10.0, effect=effect)
    tl = Timeline(period_s=1.0, threshold_ms=20.0, phases=PHASES, calls=kw.pop("calls", steady_calls(5.0)),
                  faults=[w], **kw)
    return CHECKS["fault_effective"].evaluate(tl, CheckSpec("fault_effective", {"phase": "fault",
                                                                                "baseline": "baseline"}))


def steady_calls(fault_ms: float, base_ms: float = 5.0) -> list[CallResult]:
    """20 calls a second for 15 s; those in the fault phase take `fault_ms`."""
    out = []
    for i in range(15):
        lat = fault_ms if 5 <= i < 10 else base_ms
        for j in range(20):
            t = i + j * 0.02
            out.append(CallResult(t, t, t + lat / 1000, "/Decide", "ok"))
    return out


def legs(ms: float = 4.5) -> list[tuple[float, float, bool]]:
    return [(i + j * 0.02, i + j * 0.02 + ms / 1000, True) for i in range(15) for j in range(20)]


def effect(type: str, attributes: dict[str, Any], **counts: Any) -> dict[str, Any]:
    """A proxy effect record as `GET /proxies/{name}/effects` gives it (counts not named are 0)."""
    base = {"type": type, "stream": "downstream", "toxicity": 1.0, "attributes": attributes, "connections": 1,
            "active_connections": 1, "chunks": 0, "bytes": 0, "bytes_out": 0, "bytes_dropped": 0, "pieces": 0,
            "held_chunks": 0, "held_ms_total": 0.0, "held_ms_max": 0.0, "busy_ms": 0.0, "bypassed_chunks": 0,
            "ends": 0, "end_held_ms_total": 0.0, "closed": 0, "reset": 0, "calls": 0, "calls_delayed": 0,
            "delay_ms_total": 0.0, "calls_failed": 0, "calls_cut": 0}
    return base | counts


# --- measured in the proxy, real loopback traffic --------------------------------------------------

def test_a_latency_toxics_measured_hold_is_what_was_asked(echo: EchoServer) -> None:
    """Through the harness's own path: the proxy child process, the applier, the window's effect."""
    with NetworkProxy(echo.addr, name="fx", seed=1, call_toxics=True) as proxy:
        session = FaultSession(SimpleNamespace(proxy=proxy, pid=None), seed=1, log=lambda _: None)
        session.apply(FaultSpec("network", "latency", {"latency_ms": 40}), key=1)
        round_trips(proxy.listen, 10)
        measured = session.remove(1)
    assert measured is not None and measured["type"] == "latency"
    assert measured["held_chunks"] == 10 and measured["chunks"] == 10 and measured["bytes_dropped"] == 0
    mean = measured["held_ms_total"] / measured["held_chunks"]
    # Tolerance: never under the 40 ms asked (1 ms timer slack); at most 40 ms late on a shared host.
    assert 39.0 <= mean <= 80.0 and measured["held_ms_max"] >= 39.0, measured
    v = judge(measured)
    assert v.passed and v.summary.startswith("network:latency: latency toxic held 10 chunks"), v.summary


def test_an_inert_latency_toxic_fails_whatever_the_client_saw(tp: EmbeddedToxiproxy, echo: EchoServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A latency toxic that silently holds nothing fails, though the client's timings look delayed."""
    monkeypatch.setattr(LatencyToxic, "pipe", Toxic.pipe)      # passes every chunk straight on
    listen = tp.create_proxy("inert", echo.addr)["listen"]
    tp.add_toxic("inert", "latency", {"latency": 40}, name="latency_1")
    round_trips(listen, 10)
    measured = (NetworkFaults(url=tp.url).effects("inert") or {})["latency_1"]
    assert measured["chunks"] == 10 and measured["held_ms_max"] < 20.0, measured
    # The client saw +40 ms over the same upstream leg: proxy_added says the toxic worked.
    looks_delayed = {"calls": steady_calls(45.0), "outside": {"proxy_legs": legs()}}
    v = judge(None, **looks_delayed)
    assert v.passed and "proxy_added 0.5 -> 40.5 ms" in v.summary, v.summary
    assert "the proxy's own measure was not available" in v.summary
    v = judge(measured, **looks_delayed)
    assert not v.passed, v.summary
    assert v.summary.startswith("network:latency: latency toxic held 10 chunks ")
    assert "asked 40 ms +/- 0 ms (needed >= 20.0 ms), whatever the client saw; client saw proxy_added 0.5 -> 40.5 ms: " \
           "the fault did not do what was asked" in v.summary
    assert v.evidence["faults"][0]["client"]["during"] == 40.5


def test_effects_survive_removal_and_toxiproxy_answers_are_unchanged(tp: EmbeddedToxiproxy,
                                                                     echo: EchoServer) -> None:
    status, made = api(tp.url, "POST", "/proxies", {"name": "keep", "upstream": echo.addr, "listen": "127.0.0.1:0"})
    assert status == 201 and set(made) == {"name", "listen", "upstream", "enabled", "toxics"}
    status, toxic = api(tp.url, "POST", "/proxies/keep/toxics",
                        {"type": "latency", "name": "lat", "attributes": {"latency": 10}})
    assert status == 200 and toxic == {"attributes": {"latency": 10, "jitter": 0}, "name": "lat",
                                       "type": "latency", "stream": "downstream", "toxicity": 1.0}
    round_trips(made["listen"], 3)
    assert api(tp.url, "DELETE", "/proxies/keep/toxics/lat") == (204, None)
    assert api(tp.url, "GET", "/proxies/keep/toxics") == (200, [])
    status, shown = api(tp.url, "GET", "/proxies/keep")
    assert status == 200 and "effects" not in shown and shown["toxics"] == []
    status, effects = api(tp.url, "GET", "/proxies/keep/effects")
    assert status == 200 and list(effects) == ["lat"]
    assert effects["lat"]["held_chunks"] == 3 and effects["lat"]["attributes"] == {"latency": 10, "jitter": 0}
    assert api(tp.url, "GET", "/proxies/nope/effects") == (404, '{"error":"proxy not found","status":404}\n')


def test_the_effect_log_keeps_the_newest_names_only() -> None:
    from faults.proxy.model import spec_from_json

    log = EffectLog(limit=3)
    for i in range(5):
        log.start(spec_from_json({"type": "noop", "name": f"t{i}"}))
    assert list(log.to_json()) == ["t2", "t3", "t4"]
    log.start(spec_from_json({"type": "noop", "name": "t2"}))      # added again: a fresh record, newest
    assert list(log.to_json()) == ["t3", "t4", "t2"]


def test_cuts_and_resets_are_counted(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    listen = tp.create_proxy("cut", echo.addr)["listen"]
    tp.add_toxic("cut", "reset_peer", {"timeout": 0}, stream="upstream", name="rst")
    with connect(listen) as s:
        s.sendall(b"x" * 100)
        assert wait_closed(s, 5)
    tp.remove_toxic("cut", "rst")
    tp.add_toxic("cut", "limit_data", {"bytes": 150}, stream="upstream", name="lim")
    with connect(listen) as s:
        s.sendall(b"y" * 100)
        read_exactly(s, 100)
        s.sendall(b"z" * 100)
        assert wait_closed(s, 5)
    e = NetworkFaults(url=tp.url).effects("cut") or {}
    assert (e["rst"]["reset"], e["rst"]["bytes_dropped"], e["rst"]["chunks"]) == (1, 100, 1)
    assert (e["lim"]["closed"], e["lim"]["bytes_out"], e["lim"]["bytes_dropped"]) == (1, 150, 50)
    assert judge(e["rst"], "reset_peer").passed and judge(e["lim"], "limit_data").passed


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


def test_call_toxics_count_the_calls_they_delayed_and_failed(tp: EmbeddedToxiproxy) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        listen = tp.create_proxy("web", f"127.0.0.1:{server.server_address[1]}")["listen"]
        tp.add_toxic("web", "http_delay", {"delay": 30, "path": "/slow"}, stream="upstream", name="hold")
        tp.add_toxic("web", "http_error", {"status": 503, "path": "/bad"}, stream="upstream", name="fail")
        host, port = listen.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        statuses = []
        for path in ["/slow"] * 4 + ["/bad"] * 3 + ["/fine"]:
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            statuses.append(resp.status)
        conn.close()
    finally:
        server.shutdown()
        server.server_close()
    assert statuses == [200] * 4 + [503] * 3 + [200]
    e = NetworkFaults(url=tp.url).effects("web") or {}
    assert (e["hold"]["calls"], e["hold"]["calls_delayed"], e["hold"]["calls_failed"]) == (4, 4, 0)
    assert 4 * 29.0 <= e["hold"]["delay_ms_total"] <= 4 * 30.0 + 0.001, e["hold"]
    assert (e["fail"]["calls"], e["fail"]["calls_failed"], e["fail"]["calls_delayed"]) == (3, 3, 0)
    v = judge(e["hold"], "http_delay")
    assert v.passed and "http_delay toxic delayed 4 of 4 calls 3" in v.summary, v.summary
    assert judge(e["fail"], "http_error").summary.startswith(
        "network:http_error: http_error toxic failed 3 of 3 calls (3.0 expected at share 1; needed at least 1)")


# --- CPU faults, measured on real processes ----------------------------------------------------------

class _Sleepers:
    """Contention 'workers' that burn nothing: `sleep` in their place."""

    def argv(self, workers: int, load_pct: int, cpus: list[int], seconds: float) -> list[list[str]]:
        return [["sleep", str(max(1, int(seconds)))] for _ in range(workers)]


def _contend(params: dict[str, Any]) -> dict[str, Any] | None:
    session = FaultSession(SimpleNamespace(proxy=None, pid=None), seed=1, log=lambda _: None)
    session.apply(FaultSpec("cpu", "contention", params), key=1)
    time.sleep(1.0)
    return session.remove(1)


def test_contention_workers_that_burn_nothing_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    import faults.cpu
    from wire.registry import Registry

    # every method's workers only sleep (the module's registry replaced for this test alone)
    monkeypatch.setattr(faults.cpu, "METHODS", Registry("contention method", {"stress-ng": _Sleepers(),
                                                                              "builtin": _Sleepers()}))
    measured = _contend({"workers": 1, "load_pct": 100, "pin": False})
    assert measured is not None and measured["cpu_s"] < 0.05 and measured["asked_cores"] == 1.0, measured
    v = judge(measured, "contention", "cpu")
    assert not v.passed and v.summary.startswith("cpu:contention: workers burned 0.00 of 1.00 cores asked"), v.summary
    assert "run-queue not measured" in v.summary and v.summary.endswith("the fault did not do what was asked")


def test_contention_workers_that_burn_pass_on_their_cpu_time() -> None:
    measured = _contend({"workers": 1, "load_pct": 100, "pin": False})
    assert measured is not None and measured["burned_cores"] >= 0.25, measured
    assert judge(measured, "contention", "cpu").passed


def _quota(pid: int, pct: int) -> dict[str, Any] | None:
    session = FaultSession(SimpleNamespace(proxy=None, pid=pid), seed=1, log=lambda _: None)
    session.apply(FaultSpec("cpu", "quota", {"pct": pct, "period_ms": 10}), key=1)
    time.sleep(1.0)
    return session.remove(1)


@pytest.mark.root
def test_a_quota_that_never_binds_fails_and_one_that_throttles_passes() -> None:
    from faults.cpu import cgroup_version

    if cgroup_version() == 0:
        pytest.skip("no cgroup cpu controller on this host")
    idle = spawn(["sleep", "30"])
    # a CPU burner: in the test's session, as the harness starts its burners
    busy = spawn([sys.executable, "-m", "faults.busy", "--load", "100", "--seconds", "30"], stderr=None, session=False)
    try:
        loose, tight = _quota(idle.pid, 100), _quota(busy.pid, 20)
    finally:
        for p in (idle, busy):
            p.kill()
            p.wait()
    assert loose is not None and loose["nr_throttled"] == 0 and loose["nr_periods"] >= 0, loose
    v = judge(loose, "quota", "cpu")
    assert not v.passed and v.summary.startswith("cpu:quota: throttled in 0 of ") and "the quota never bound" in v.summary
    assert tight is not None and tight["nr_throttled"] > 10 and tight["throttled_us"] > 0, tight
    assert judge(tight, "quota", "cpu").passed


# --- the judging rules, exact --------------------------------------------------------------------

def test_asked_mean_counts_negative_draws_as_zero() -> None:
    assert asked_mean_ms(50, 0) == 50.0 and asked_mean_ms(50, 20) == 50.0
    assert asked_mean_ms(5, 15) == pytest.approx(20 * 20 / 60)     # uniform on [-10, 20), clipped at 0
    assert asked_mean_ms(0, 0) == 0.0 and asked_mean_ms(-5, 5) == 0.0


def test_latency_verdicts() -> None:
    ok = effect("latency", {"latency": 5, "jitter": 15}, chunks=300, held_chunks=300, held_ms_total=2000.0,
                held_ms_max=19.5)
    v = judge(ok)
    assert v.passed and v.summary == ("network:latency: latency toxic held 300 chunks 6.7 ms on average (max 19.5 "
                                      "ms), asked 5 ms +/- 15 ms (needed >= 3.3 ms); client saw no proxy_added "
                                      "(not measured)")
    short = effect("latency", {"latency": 40, "jitter": 0}, chunks=10, held_chunks=10, held_ms_total=150.0,
                   held_ms_max=19.0)
    v = judge(short, outside={"proxy_legs": legs()})
    assert not v.passed and v.summary == ("network:latency: latency toxic held 10 chunks 15.0 ms on average (max "
                                          "19.0 ms), asked 40 ms +/- 0 ms (needed >= 20.0 ms), whatever the client "
                                          "saw; client saw proxy_added 0.5 -> 0.5 ms: the fault did not do what was asked")
    assert v.evidence["faults"][0]["measured"] == short


def test_nothing_flowed_is_skipped_and_a_toxicity_draw_that_spared_everything_fails() -> None:
    v = judge(effect("latency", {"latency": 40}))
    assert v.skipped and v.summary == ("nothing to judge: network:latency: latency toxic: nothing flowed through "
                                       "it while it was on (no chunk and no connection end)")
    # Traffic flowed and the toxic touched none of it: not "nothing to judge", a fault that did nothing.
    v = judge(effect("latency", {"latency": 40}, toxicity=0.5, connections=3, active_connections=0,
                     bypassed_chunks=12))
    assert not v.passed and v.summary == ("network:latency: latency toxic: the toxicity draw (0.5) spared all 3 "
                                          "connections (12 chunks passed untouched); client saw no proxy_added (not "
                                          "measured): the fault did not do what was asked")
    v = judge(effect("grpc_delay", {"delay": 50, "share": 1.0}))
    assert v.skipped and v.summary.endswith("nothing flowed through it while it was on (no call matched it)")


def test_bandwidth_timeout_and_slow_close_verdicts() -> None:
    held = effect("bandwidth", {"rate": 100}, chunks=50, bytes=50_000, bytes_out=50_000, busy_ms=480.0)
    assert judge(held, "bandwidth").summary.startswith("network:bandwidth: bandwidth toxic passed 50000 bytes in 480.0 ms of "
                                          "holding: 104 KB/s, asked 100 KB/s (needed <= 200)")
    free = held | {"busy_ms": 5.0}
    assert not judge(free, "bandwidth").passed
    cut = effect("timeout", {"timeout": 0}, chunks=4, bytes=400, bytes_dropped=400)
    assert judge(cut, "timeout").summary.startswith("network:timeout: timeout toxic dropped 400 of 400 bytes and "
                                                    "closed 0 of 1 connections")
    assert not judge(cut | {"bytes_dropped": 0}, "timeout").passed
    slow = effect("slow_close", {"delay": 100}, chunks=2, ends=2, end_held_ms_total=30.0)
    v = judge(slow, "slow_close")
    assert not v.passed and "slow_close toxic held 2 connection ends 15.0 ms on average, asked 100 ms (needed " \
                           ">= 50.0 ms)" in v.summary


def test_call_toxic_verdicts() -> None:
    delayed = effect("grpc_delay", {"delay": 50, "jitter": 0, "share": 0.5}, calls=40, calls_delayed=19,
                     delay_ms_total=950.0)
    assert judge(delayed, "grpc_delay").summary.startswith(
        "network:grpc_delay: grpc_delay toxic delayed 19 of 40 calls 50.0 ms on average (0 cut short), asked 50 ms "
        "+/- 0 ms (needed >= 25.0 ms)")
    none = delayed | {"calls_delayed": 0, "delay_ms_total": 0.0}
    assert not judge(none, "grpc_delay").passed
    few = none | {"calls": 4}      # 2 expected at share 0.5: none delayed can be chance
    assert judge(few, "grpc_delay").skipped
    assert not judge(effect("grpc_error", {"status": 14, "share": 1.0}, calls=10), "grpc_error").passed


def test_cpu_verdicts_and_the_fallback_without_a_measure() -> None:
    quota = {"quota_us": 4000, "period_us": 100000, "cgroup": "/x", "nr_periods": 50, "nr_throttled": 43,
             "throttled_us": 2_130_000}
    v = judge(quota, "quota", "cpu")
    assert v.passed and v.summary.startswith("cpu:quota: throttled in 43 of 50 periods (2130 ms) under a 4% quota; "
                                             "no target_cpu data"), v.summary
    v = judge(quota | {"unreadable": "cannot read /x/cpu.stat"}, "quota", "cpu")
    assert not v.passed and "(cannot read /x/cpu.stat)" in v.summary
    burn = {"cpu_s": 9.5, "window_s": 5.0, "burned_cores": 1.9, "asked_cores": 2.0, "workers": 2, "load_pct": 100,
            "cpus": 2}
    assert judge(burn, "contention", "cpu").summary.startswith(
        "cpu:contention: workers burned 1.90 of 2.00 cores asked (9.5 CPU s in 5.0 s, needed >= 0.50); run-queue "
        "not measured")
    v = judge(None, "contention", "cpu")
    assert not v.passed and v.summary.endswith("(judged on the target's signal: the workers' CPU time was not "
                                               "measured): the fault did not reach the signal it alone moves")
