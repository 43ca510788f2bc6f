"""Call-level HTTP toxics on plain HTTP/2 (h2c, prior knowledge) and the proxy's upstream-leg timing,
against a real Debian nginx, with nghttp2's clients (h2load, nghttp) and curl: none shares code with us.

nginx answers fixed bodies on a few locations and logs `URI|STATUS` per request it served: the log is
the server's own word on which requests reached it. Every client here keeps ONE h2 connection, so the
toxics must pick calls inside a connection, not connections.
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from faults.proxy import EmbeddedToxiproxy
from faults.proxy.h2tap import LEG_LOG_ENV
from harness.checks.truth import read_leg_log
from tests.nginx import NGINX, PREAMBLE, TEMP_PATHS, running_nginx

pytestmark = [pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; scripts/setup.sh does)"),
              pytest.mark.timeout(60)]
H2LOAD = shutil.which("h2load")
NGHTTP = shutil.which("nghttp")
CURL = shutil.which("curl")
_NGHTTP2 = "needs h2load and nghttp (Debian package nghttp2-client; scripts/setup.sh installs it)"

API_BODY, STATIC_BODY = "api says hi", "static bytes"
_CONF = PREAMBLE + """
http {{
    log_format calls '$request_uri|$status';
    access_log {d}/access.log calls;""" + TEMP_PATHS + """    server {{
        listen 127.0.0.1:{port} http2;
        keepalive_requests 10000;
        location /api/ {{ return 200 "{api}"; }}
        location /static/ {{ return 200 "{static}"; }}
        location /empty {{ return 204; }}
        location /missing {{ return 404 "gone\\n"; }}
        location /down {{ return 503 "down\\n"; }}
        location /trailers {{ add_trailer x-checksum done; return 200 "with trailers\\n"; }}
    }}
}}
"""


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    d = tmp_path / "nginx"
    d.mkdir()
    with running_nginx(d, lambda port: _CONF.format(d=d, port=port, api=API_BODY, static=STATIC_BODY)) as port:
        yield port, d / "access.log"


def _served(log: Path) -> list[str]:
    """The URIs nginx served, from its access log."""
    return [line.split("|")[0] for line in log.read_text().splitlines()]


def _h2load(listen: str, uris: list[str], n: int, streams: int, log_file: Path) -> tuple[dict[str, int], list[str]]:
    """h2load over ONE connection (`streams` concurrent), `n` requests cycling through `uris`: its
    summary counts and its per-request log rows (start us, status, duration us)."""
    assert H2LOAD is not None
    cmd = [H2LOAD, "-n", str(n), "-c", "1", "-m", str(streams), f"--log-file={log_file}",
           *[f"http://{listen}{u}" for u in uris]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    req = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                    r"(\d+) errored, (\d+) timeout", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    data = re.search(r"traffic: .* \((\d+)\) data", out)
    assert req and codes and data and "Application protocol: h2c" in out, out[-3000:]
    names = ("total", "started", "done", "succeeded", "failed", "errored", "timeout", "2xx", "3xx", "4xx", "5xx",
             "data")
    counts = dict(zip(names, map(int, req.groups() + codes.groups() + data.groups()), strict=True))
    return counts, log_file.read_text().splitlines()


def _seconds(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


def _nghttp(listen: str, paths: list[str]) -> list[tuple[str, int, float]]:
    """nghttp fetches all `paths` at once, multiplexed on ONE connection: (path, status, seconds from
    its request's start to its response's end) per path, in the order given."""
    assert NGHTTP is not None
    proc = subprocess.run([NGHTTP, "-ns", *[f"http://{listen}{p}" for p in paths]], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.fullmatch(r"\s*\d+\s+\+\S+\s+\+\S+\s+(\S+)\s+(\d+)\s+\S+\s+(\S+)", line)
        if m:
            rows[m.group(3)] = (int(m.group(2)), _seconds(m.group(1)))
    assert sorted(rows) == sorted(paths), proc.stdout[-3000:]
    return [(p, *rows[p]) for p in paths]


def _curl(listen: str, path: str) -> tuple[int, float]:
    """(status, seconds) of one GET by curl over h2c. (curl 7.88 cannot fetch several URLs over one
    prior-knowledge connection, with or without --parallel: the others fail in its framing layer.)"""
    assert CURL is not None
    proc = subprocess.run([CURL, "-sS", "--http2-prior-knowledge", "--max-time", "10", "-o", "/dev/null",
                           "-w", "%{http_code} %{time_total}", f"http://{listen}{path}"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    status, took = proc.stdout.split()
    return int(status), float(took)


@pytest.mark.skipif(H2LOAD is None, reason=_NGHTTP2)
def test_http_error_fails_a_share_of_one_path_on_one_h2_connection(tp: EmbeddedToxiproxy, nginx: tuple[int, Path],
                                                                    tmp_path: Path) -> None:
    port, log = nginx
    listen = tp.create_proxy("web", f"127.0.0.1:{port}")["listen"]
    tp.add_toxic("web", "http_error", {"status": 503, "share": 0.2, "path": "/api", "body": "chaos"},
                 stream="upstream")
    n = 800   # h2load cycles through its URIs: 400 /api, 400 /static, 8 in flight at a time
    counts, rows = _h2load(listen, ["/api/v1/items", "/static/app.js"], n, 8, tmp_path / "h2load.log")
    failed = counts["5xx"]   # (h2load counts a 5xx as done, not succeeded)
    assert counts["done"] == n and counts["succeeded"] == n - failed and counts["errored"] == counts["timeout"] == 0
    statuses = Counter(row.split("\t")[1] for row in rows)
    assert statuses == Counter({"200": n - failed, "503": failed}) and counts["2xx"] == n - failed
    # share 0.2 of 400 calls: mean 80, sd 8; 15..25% is +-2.5 sd (and the proxy is seeded: stable)
    assert 60 <= failed <= 100, failed
    # nginx served exactly the calls the proxy did not fail: every /static one, and the other /api ones.
    served = Counter(_served(log))
    assert served == Counter({"/static/app.js": 400, "/api/v1/items": 400 - failed})
    assert sum(served.values()) == counts["2xx"]
    # Response bodies: nginx's, whole, and the proxy's own "chaos" for each failed call.
    assert counts["data"] == 400 * len(STATIC_BODY) + (400 - failed) * len(API_BODY) + failed * len("chaos")
    stats = tp.call_stats("web")
    assert stats["connections"] == 1 and stats["calls_seen"] == n and stats["calls_failed"] == failed


@pytest.mark.skipif(NGHTTP is None, reason=_NGHTTP2)
def test_http_delay_holds_bodiless_calls_responses_but_not_their_upstream_leg(
        tp: EmbeddedToxiproxy, nginx: tuple[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    legs_file = tmp_path / "legs.log"
    monkeypatch.setenv(LEG_LOG_ENV, str(legs_file))
    port, log = nginx
    listen = tp.create_proxy("web", f"127.0.0.1:{port}")["listen"]
    paths = [p for i in range(6) for p in (f"/api/{i}", f"/static/{i}")]   # GETs: no request body
    before = _nghttp(listen, paths)
    tp.add_toxic("web", "http_delay", {"delay": 150, "share": 1.0, "method": "GET", "path": "/api"},
                 stream="upstream")
    after = _nghttp(listen, [f"{p}?again" for p in paths])
    assert all(status == 200 for _, status, _ in before + after)
    api_before = statistics.median(t for p, _, t in before if p.startswith("/api"))
    api_after = [t for p, _, t in after if p.startswith("/api")]
    static_after = [t for p, _, t in after if p.startswith("/static")]
    # Held from when the proxy saw the request: never less than the delay as the client times it.
    assert api_before < 0.1 and min(api_after) >= 0.148, (api_before, api_after)
    assert statistics.median(api_after) - api_before >= 0.12
    # /static shares the connection with the held /api calls and is not held behind them.
    assert max(static_after) < 0.1, static_after
    assert tp.call_stats("web")["calls_delayed"] == 6 and len(_served(log)) == 2 * len(paths)
    # The leg is the server's side of the proxy: one line per call, none holding the proxy's 150 ms.
    legs = read_leg_log(legs_file, 0.0)
    assert len(legs) == 2 * len(paths)
    assert max(done - sent for sent, done, _ in legs) < 0.1
    assert all(served for _, _, served in legs)


@pytest.mark.skipif(H2LOAD is None or CURL is None, reason=_NGHTTP2 + " and curl")
def test_bodiless_response_arrives_whole_after_the_delay(tp: EmbeddedToxiproxy, nginx: tuple[int, Path],
                                                          tmp_path: Path) -> None:
    port, log = nginx
    listen = tp.create_proxy("web", f"127.0.0.1:{port}")["listen"]
    tp.add_toxic("web", "http_delay", {"delay": 150, "path": "/empty"}, stream="upstream")
    # nginx ends a 204 in its HEADERS frame; the client must still get a whole 204, after the delay.
    status, took = _curl(listen, "/empty")
    assert status == 204 and took >= 0.145
    n = 16
    counts, rows = _h2load(listen, ["/empty"], n, 4, tmp_path / "h2load.log")
    assert counts["succeeded"] == counts["2xx"] == n and counts["errored"] == counts["failed"] == 0
    assert [row.split("\t")[1] for row in rows] == ["204"] * n
    assert min(int(row.split("\t")[2]) for row in rows) >= 145_000       # microseconds
    assert _served(log) == ["/empty"] * (n + 1)


@pytest.mark.skipif(NGHTTP is None, reason=_NGHTTP2)
def test_trailers_take_the_held_data_out_before_them(tp: EmbeddedToxiproxy, nginx: tuple[int, Path]) -> None:
    port, _ = nginx
    listen = tp.create_proxy("web", f"127.0.0.1:{port}")["listen"]
    tp.add_toxic("web", "http_delay", {"delay": 2000, "path": "/trailers"}, stream="upstream")
    # nginx sends the body, then trailers (HEADERS with END_STREAM): trailers cannot wait (HPACK), so
    # the held body goes right before them, whole and in order, and the delay is cut short.
    assert NGHTTP is not None
    proc = subprocess.run([NGHTTP, "-v", f"http://{listen}/trailers"], capture_output=True, text=True, timeout=30)
    out = proc.stdout
    assert proc.returncode == 0 and "[ERROR]" not in out, out[-3000:]
    trailer = re.search(r"recv \(stream_id=\d+\) x-checksum: done", out)
    body = out.find("with trailers\n")
    assert trailer and 0 < body < trailer.start(), out[-3000:]
    took = float(re.findall(r"^\[\s*([\d.]+)\] recv HEADERS frame <length=\d+, flags=0x05", out, re.M)[-1])
    assert took < 1.0, out[-3000:]   # the trailers' arrival, seconds after connecting


@pytest.mark.skipif(H2LOAD is None, reason=_NGHTTP2)
def test_upstream_leg_served_is_the_status_of_plain_http2_calls(
        tp: EmbeddedToxiproxy, nginx: tuple[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    legs_file = tmp_path / "legs.log"
    monkeypatch.setenv(LEG_LOG_ENV, str(legs_file))
    port, log = nginx
    listen = tp.create_proxy("web", f"127.0.0.1:{port}")["listen"]
    tp.add_toxic("web", "http_error", {"status": 503, "path": "/static"}, stream="upstream")
    tp.add_toxic("web", "http_delay", {"delay": 100, "path": "/empty"}, stream="upstream")
    paths = ["/api/1", "/missing", "/down", "/empty", "/trailers", "/static/never", "/api/2"]
    # One stream at a time on one connection, in this order: the legs come in the same order.
    counts, rows = _h2load(listen, paths, len(paths), 1, tmp_path / "h2load.log")
    assert [int(row.split("\t")[1]) for row in rows] == [200, 404, 503, 204, 200, 503, 200]
    assert tp.call_stats("web")["connections"] == 1
    assert _served(log) == [p for p in paths if p != "/static/never"]   # the proxy's own 503 never reached nginx
    # One leg per call that reached nginx, in order; served is its status below 400: a 404 with a
    # body is not served, a 204 without one is (a DATA rule would say the opposite of both).
    legs = read_leg_log(legs_file, 0.0)
    assert [served for _, _, served in legs] == [True, False, False, True, True, True]
    assert max(done - sent for sent, done, _ in legs) < 0.08   # the held /empty too: the leg is the server's
