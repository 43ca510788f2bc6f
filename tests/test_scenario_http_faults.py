"""Chaos for your own HTTP service: the bundled scenarios/http-faults.yaml run end to end against the
example nginx (deploy/http-example/nginx.conf, on a free port), its own recorded traffic replayed
through the fault proxy; the proxy's upstream leg is the truth `fault_effective` judges HTTP faults on.
"""

from __future__ import annotations

import contextlib
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.checks import CHECKS
from harness.commands.chaos import command as chaos
from harness.scenario import CheckSpec
from harness.timeline import CallResult, FaultWindow, Timeline
from tests.nginx import NGINX, running_nginx

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "deploy" / "http-example" / "nginx.conf"
SCENARIO = ROOT / "scenarios" / "http-faults.yaml"
pytestmark = [pytest.mark.usefixtures("state_dir"), pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; scripts/setup.sh does)")]


@contextlib.contextmanager
def _example(d: Path, conf: str) -> Iterator[int]:
    """The example nginx config `conf` run in `d` on a free port instead of 18080."""
    d.mkdir()
    assert "listen 127.0.0.1:18080;" in conf
    with running_nginx(d, lambda port: conf.replace("18080", str(port))
                       .replace("pid nginx.pid", f"pid {d}/nginx.pid")
                       .replace("error_log error.log", f"error_log {d}/error.log")
                       .replace("access_log access.log", f"access_log {d}/access.log")
                       .replace("_temp_path ", f"_temp_path {d}/")) as port:
        yield port


@pytest.fixture
def web(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The example service as a user runs it, on a free port instead of 18080."""
    with _example(tmp_path / "web", EXAMPLE.read_text()) as port:
        yield f"127.0.0.1:{port}", tmp_path / "web" / "access.log"


@pytest.fixture
def changed_web(tmp_path: Path) -> Iterator[str]:
    """The example service after a change that breaks its answers: orders come back 'queued'."""
    with _example(tmp_path / "web2", EXAMPLE.read_text().replace('"state": "accepted"', '"state": "queued"')) as port:
        yield f"127.0.0.1:{port}"


def _run(tmp_path: Path, text: str, name: str) -> tuple[int, str, Path]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    (tmp_path / "http-faults.rec").write_bytes((ROOT / "scenarios" / "http-faults.rec").read_bytes())
    out = CliRunner().invoke(chaos, ["run", str(path), "--report-dir", str(tmp_path / name), "--no-png"])
    return out.exit_code, out.output, tmp_path / name


@pytest.mark.slow
def test_the_bundled_http_scenario_passes_against_the_example_service(tmp_path: Path, web: tuple[str, Path]) -> None:
    address, log = web
    code, output, reports = _run(tmp_path, SCENARIO.read_text().replace("127.0.0.1:18080", address), "http")
    data = json.loads((reports / "results.json").read_text())
    status = {v["id"]: (v["status"], v["summary"]) for v in data["verdicts"]}
    assert code == 0 and data["passed"], status
    assert all(s == "pass" for s, _ in status.values()), status
    # Each fault judged on the signal only it moves: failures for the 503s, the leg-based proxy_added
    # for the held calls and the latency toxic (the leg being nginx's side, the proxy's delay is not in it).
    errors = re.search(r"client_failures 0\.0 -> ([\d.]+)%", status["fault_effective[errors]"][1])
    assert errors and 2.0 <= float(errors.group(1)) <= 12.0, status["fault_effective[errors]"]
    slow = re.search(r"proxy_added ([\d.]+) -> ([\d.]+) ms", status["fault_effective[slow]"][1])
    jitter = re.search(r"proxy_added ([\d.]+) -> ([\d.]+) ms", status["fault_effective[jitter]"][1])
    assert slow and jitter
    assert 4.0 <= float(slow.group(2)) - float(slow.group(1)) <= 40.0, slow.group(0)    # ~1/8 of calls x 80 ms
    assert 20.0 <= float(jitter.group(2)) - float(jitter.group(1)) <= 45.0, jitter.group(0)  # 30 ms, every call
    # The 503s came from the proxy: nginx's log has only the calls that reached it.
    served = log.read_text().splitlines()
    sent = data["timeline"]["replay"]
    assert len(served) == sent["ok"] and sent["errors"] == {"HTTP_503": sent["sent"] - sent["ok"]}
    # JSON, Markdown and JUnit all say what each HTTP fault did.
    faults = {f["label"].split(" ")[0]: f for f in data["timeline"]["faults"]}
    assert "answered 503 Service Unavailable by the proxy" in faults["network:http_error"]["detail"]
    assert "50% of GET /search* requests held 80 ms +/- 20 ms" in faults["network:http_delay"]["detail"]
    md = (reports / "summary.md").read_text()
    assert "answered 503 Service Unavailable by the proxy" in md and "held 80 ms" in md
    junit = ET.parse(reports / "junit.xml").getroot()
    cases = {c.get("name"): c for c in junit.iter("testcase")}
    assert "fault_effective[slow]" in cases and cases["fault_effective[slow]"].find("failure") is None
    assert "network:http_delay" in ET.tostring(junit, encoding="unicode")


INERT = """\
name: inert
seed: 3
target: {external: {address: "ADDRESS", period_s: 0.5, p99_threshold_ms: 50}}
traffic: {recording: http-faults.rec, loop: until_end}
phases:
  - {name: baseline, duration: 2s}
  - name: fault
    duration: 2s
    faults: [{network: latency, latency_ms: 30, toxicity: 0}]
expect:
  - fault_effective: {phase: fault}
"""


def test_an_inert_latency_toxic_on_an_http_service_fails_fault_effective(tmp_path: Path,
                                                                        web: tuple[str, Path]) -> None:
    # toxicity 0: the toxic is on the proxy but touches no connection. The proxy's own count says so (it
    # held nothing); the HTTP leg's proxy_added, which saw nothing added either, stays as evidence.
    address, _ = web
    code, output, reports = _run(tmp_path, INERT.replace("ADDRESS", address), "inert")
    verdict = json.loads((reports / "results.json").read_text())["verdicts"][0]
    assert code == 99 and verdict["status"] == "fail", verdict
    assert re.search(r"toxicity draw \(0\) spared all \d+ connections \(\d+ chunks passed untouched\); client saw "
                     r"proxy_added -?\d+\.\d -> -?\d+\.\d ms", verdict["summary"]), verdict["summary"]


def test_without_leg_timings_a_latency_fault_is_skipped_with_the_reason() -> None:
    # A TLS target: the proxy carries its bytes unread and times no leg. The latency fault cannot be judged
    # on proxy_added: skipped, saying why, never failed with "no data".
    calls = [CallResult(t / 10, t / 10, t / 10 + 0.002, "GET /a", "ok") for t in range(100)]
    window = FaultWindow("network:latency (latency_ms=30)", "fault", "network", "latency", 5.0, 5.0, 10.0)
    why = "the traffic is TLS: the proxy carries it without reading it, so it cannot time the upstream leg of a call"
    for outside in ({"proxy_legs": [], "legs_unreadable": why}, {}):
        tl = Timeline(period_s=1.0, threshold_ms=20.0, phases=[("baseline", 0.0, 5.0), ("fault", 5.0, 10.0)],
                      calls=calls, faults=[window], outside=outside)
        v = CHECKS["fault_effective"].evaluate(tl, CheckSpec("fault_effective", {"phase": "fault"}))
        assert v.status == "skipped", v.summary
        assert "proxy_added cannot be measured: " + (why if outside else "the proxy timed no call's upstream leg") \
            in v.summary
        forced = CHECKS["fault_effective"].evaluate(tl, CheckSpec("fault_effective", {
            "phase": "fault", "signal": "proxy_added"}))
        assert forced.status == "skipped" and "cannot be measured" in forced.summary


TEMPLATE = """\
name: h
target: {external: {address: "127.0.0.1:18080"}}
traffic: {generator: {rate: 50}}
phases:
  - {name: base, duration: 2s}
  - name: fault
    duration: 3s
    faults:
      - {network: FAULT}
"""


@pytest.mark.parametrize(("fault", "message"), [
    ("http_error, status: 199", "phases[1].faults[0].status 199 must be a whole number between 200 and 599 (an HTTP"),
    ("http_error, status: 600", "phases[1].faults[0].status 600 must be a whole number between 200 and 599"),
    ("http_error, status: UNAVAILABLE", "phases[1].faults[0].status"),
    ("http_error, method: get", "phases[1].faults[0].method 'get' must be an HTTP method in capitals"),
    ("http_error, method: 'GET /x'", "phases[1].faults[0].method 'GET /x' must be an HTTP method"),
    ("http_error, path: api", "phases[1].faults[0].path 'api' must be a request path (starting with /) or a glob"),
    ("http_error, path: '/a b'", "phases[1].faults[0].path '/a b' must be a request path"),
    ("http_error, header: 'x canary'", "phases[1].faults[0].header 'x canary' must be a header name"),
    ("http_error, share: 0.5, share_pct: 50", "give share (0..1) or share_pct (0..100), not both"),
    ("http_error, message: x", "unknown key 'message'"),
    ("http_delay", "(network: http_delay): missing 'delay_ms'"),
    ("http_delay, delay_ms: 70000", "phases[1].faults[0].delay_ms 70000 must be a whole number between 0 and 60000"),
    ("http_delay, delay_ms: 5, body: x", "unknown key 'body'"),
])
def test_bad_http_faults_name_file_line_and_what_is_expected(fault: str, message: str) -> None:
    from harness.errors import ScenarioError
    from harness.scenario_load import load_scenario_text

    with pytest.raises(ScenarioError) as info:
        load_scenario_text(TEMPLATE.replace("FAULT", fault), "h.yaml")
    text = str(info.value)
    assert text.startswith("h.yaml:9: ") and message in text, text
    assert "\n" not in text


def test_good_http_faults_map_onto_the_proxys_call_toxics_and_are_refused_with_tls() -> None:
    from harness.errors import ScenarioError
    from harness.faultrun import toxic_of
    from harness.scenario_load import load_scenario_text

    s = load_scenario_text(TEMPLATE.replace("FAULT", "http_error, status: 429, share_pct: 25, method: POST, "
                                                     "path: /api/*, header: 'x-canary: b*', body: busy"))
    assert toxic_of(s.phases[1].faults[0]) == {
        "type": "http_error", "stream": "upstream", "toxicity": 1.0,
        "attributes": {"status": 429, "body": "busy", "share": 0.25, "method": "POST", "path": "/api/*",
                       "header": "x-canary: b*"}}
    d = load_scenario_text(TEMPLATE.replace("FAULT", "http_delay, delay_ms: 80, jitter_ms: 20, share: 0.5"))
    assert toxic_of(d.phases[1].faults[0])["attributes"] == {"delay": 80, "jitter": 20, "share": 0.5}
    tls = TEMPLATE.replace('"127.0.0.1:18080"}', '"127.0.0.1:18080", tls: {insecure: true}}')
    with pytest.raises(ScenarioError, match="http_delay cannot be applied to TLS traffic"):
        load_scenario_text(tls.replace("FAULT", "http_delay, delay_ms: 5"))


WATCHED = """\
name: watched
target: {external: {address: "ADDRESS", pid: PID, period_s: 0.5, p99_threshold_ms: 50}}
proxy: false
traffic: {recording: http-faults.rec, loop: until_end}
phases:
  - {name: only, duration: 4s}
expect:
  - memory_flat: {warmup_s: 0.5s}
"""


def test_an_external_service_is_watched_by_its_pid_and_never_touched(tmp_path: Path, web: tuple[str, Path]) -> None:
    address, log = web
    pid = int((log.parent / "nginx.pid").read_text())
    code, output, reports = _run(tmp_path, WATCHED.replace("ADDRESS", address).replace("PID", str(pid)), "watched")
    v = json.loads((reports / "results.json").read_text())["verdicts"][0]
    assert code == 0 and v["status"] == "pass", v
    assert v["evidence"]["of"] == f"process {pid} (RSS)" and v["evidence"]["samples"] >= 5
    assert 0 < v["evidence"]["first_mb"] < 200          # nginx's few MB, not the harness's own RSS


def test_a_cgroup_without_memory_accounting_is_refused_at_its_line(tmp_path: Path) -> None:
    from harness.errors import ScenarioError
    from harness.scenario_load import load_scenario_text

    text = WATCHED.replace("pid: PID", f"cgroup: {tmp_path}").replace("ADDRESS", "127.0.0.1:1")
    with pytest.raises(ScenarioError, match=r"^w.yaml:2: target.external.cgroup .*: no memory.current there"):
        load_scenario_text(text, "w.yaml")


MATCH = """\
name: match
seed: 3
target: {external: {address: "ADDRESS", period_s: 0.5, p99_threshold_ms: 50}}
traffic: {recording: http-faults.rec, loop: until_end}
phases:
  - {name: only, duration: 2s}
expect:
  - responses_match: {}
"""


def test_answers_are_compared_with_the_recorded_ones_field_by_field(tmp_path: Path, web: tuple[str, Path],
                                                                    changed_web: str) -> None:
    # The service as recorded answers every call as it did; after a change, its POST /api/ answers say
    # "queued" where the recording says "accepted": status 200 all the same, a wrong answer.
    address, _ = web
    code, output, reports = _run(tmp_path, MATCH.replace("ADDRESS", address), "same")
    same = json.loads((reports / "results.json").read_text())["verdicts"][0]
    assert code == 0 and same["status"] == "pass", same
    assert same["evidence"]["compared"] > 60 and same["evidence"]["mismatched"] == 0, same["evidence"]
    assert re.match(r"\d+ of \d+ responses match the recording$", same["summary"]), same["summary"]
    code, output, reports = _run(tmp_path, MATCH.replace("ADDRESS", changed_web), "changed")
    changed = json.loads((reports / "results.json").read_text())["verdicts"][0]
    assert code == 99 and changed["status"] == "fail", changed
    ev = changed["evidence"]
    assert ev["fields"] == {"state": ev["mismatched"]} and 0 < ev["mismatched"] < ev["compared"], ev
    assert 'differ from the recording' in changed["summary"]
    assert 'state: "accepted" != "queued"' in changed["summary"], changed["summary"]
