"""The eBPF recorder on a real nginx (Debian's) under real wrk: what nginx logged is what was recorded.

nginx serves files with sendfile (its shipped default): the response head goes out with writev, the
body with sendfile, which the recorder cannot read. The recording must still pair every response with
its request, keep the status, and say on the call how many body bytes went by sendfile. With sendfile
off the same files go out as 32 KiB writes, recorded whole. Either way the recorded (method, path,
status, response body bytes) equal nginx's access log line for line.
"""

from __future__ import annotations

import collections
import http.client
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nginx import PREAMBLE  # tests/ is on sys.path under pytest

from capture.backends import RecordOptions
from capture.record import Recorder
from capture.recording import Call, Recording
from capture.summary import summarize
from wire.process import free_port, spawn

pytestmark = [pytest.mark.root, pytest.mark.ebpf,
              pytest.mark.skipif(shutil.which("nginx") is None or shutil.which("wrk") is None,
                                 reason="needs nginx and wrk (apt-get install nginx wrk; scripts/setup.sh does)")]

FILES = {"1k.bin": 1024, "100k.bin": 100 * 1024, "1m.bin": 1024 * 1024}
POST_BODY = b"p" * 3000
_NOT_CAPTURED = re.compile(r"not captured: (sendfile|splice), (\d+) bytes")

# wrk: every write pipelines three requests on a keep-alive connection (wrk needs the same number in
# each: it counts them once), 10 ms apart; every file, a 404 and a POST come round in turn. Each of the
# two threads (one connection each) stops itself after 150 responses, at the end of a batch.
WRK_SCRIPT = """
local reqs = {}
local n = 0
init = function(args)
  local posts = {["Content-Type"] = "text/plain"}
  local post = wrk.format("POST", "/post", posts, string.rep("p", 3000))
  reqs = {
    wrk.format("GET", "/1k.bin") .. post .. wrk.format("GET", "/missing"),
    wrk.format("GET", "/100k.bin") .. wrk.format("GET", "/1m.bin") .. wrk.format("GET", "/1k.bin"),
    post .. wrk.format("GET", "/nothing/here") .. wrk.format("GET", "/100k.bin"),
  }
end
request = function()
  n = n + 1
  return reqs[(n % #reqs) + 1]
end
delay = function()
  return 10   -- ms between writes: a few hundred requests/s, tens of MB/s of bodies
end
local answered = 0
response = function(status, headers, body)
  answered = answered + 1
  -- stop after whole batches only: a connection cut mid-response would differ from nginx's log by design
  if answered >= 150 and answered % 3 == 0 then
    wrk.thread:stop()
  end
end
"""

CONF = PREAMBLE + """http {{
    log_format st '$request_method $uri $status $body_bytes_sent';
    access_log {d}/access.log st;
    sendfile {sendfile};
    keepalive_requests 100000;
    client_body_temp_path {d}/tmp;
    proxy_temp_path {d}/tmp;
    fastcgi_temp_path {d}/tmp;
    uwsgi_temp_path {d}/tmp;
    scgi_temp_path {d}/tmp;
    types {{ application/octet-stream bin; }}
    server {{
        listen 127.0.0.1:{port};
        root {d}/html;
        location = /post {{ return 200 "posted\\n"; }}
    }}
}}
"""



class Nginx:
    """nginx in the foreground (master_process off: one process, ended by its PID)."""

    def __init__(self, d: Path, sendfile: bool) -> None:
        self.dir, self.port = d, free_port()
        (d / "html").mkdir()
        (d / "tmp").mkdir()
        for name, size in FILES.items():
            (d / "html" / name).write_bytes(os.urandom(size))
        (d / "nginx.conf").write_text(CONF.format(d=d, port=self.port, sendfile="on" if sendfile else "off"))
        self.proc = spawn(["nginx", "-p", str(d), "-c", str(d / "nginx.conf")], stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"nginx exited: {self.proc.stderr.read().decode() if self.proc.stderr else ''}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise AssertionError("nginx did not listen within 10 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)     # graceful: finishes writing its log
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log(self) -> list[tuple[str, str, int, int]]:
        out = []
        for line in (self.dir / "access.log").read_text().splitlines():
            method, uri, status, sent = line.split(" ")
            out.append((method, uri, int(status), int(sent)))
        return out


def _pipelined(port: int) -> bytes:
    """Four requests in one write on a raw socket, then read until nginx closes (the last asks it to)."""
    reqs = (b"GET /1k.bin HTTP/1.1\r\nHost: t\r\n\r\n"
            b"POST /post HTTP/1.1\r\nHost: t\r\nContent-Length: 3000\r\n\r\n" + POST_BODY +
            b"GET /none HTTP/1.1\r\nHost: t\r\n\r\n"
            b"GET /100k.bin HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    got = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(reqs)
        while chunk := s.recv(65536):
            got += chunk
    return bytes(got)


def _body_size(call: Call) -> int:
    """Response body bytes: those recorded plus those the call says went by sendfile."""
    size = sum(len(m.data) for m in call.responses)
    if call.status_message and (m := _NOT_CAPTURED.search(call.status_message)):
        size += int(m.group(2))
    return size


def _recorded(calls: list[Call]) -> list[tuple[str, str, int | None, int]]:
    out = []
    for c in calls:
        method, _, path = (c.method or "").partition(" ")
        out.append((method, path, c.status, _body_size(c)))
    return out


@pytest.fixture(scope="module", params=["sendfile-on", "sendfile-off"])
def nginx_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    sendfile = request.param == "sendfile-on"
    tmp_path = tmp_path_factory.mktemp(request.param)
    server = Nginx(tmp_path, sendfile)
    try:
        (tmp_path / "mix.lua").write_text(WRK_SCRIPT)
        out = tmp_path / "nginx.rec"
        with Recorder(RecordOptions(output=str(out), port=server.port)) as rec:
            wrk = subprocess.run(["wrk", "-t2", "-c2", "-d3s", "--timeout", "5s", "-s", str(tmp_path / "mix.lua"),
                                  f"http://127.0.0.1:{server.port}/"], capture_output=True, text=True, timeout=30)
            raw = _pipelined(server.port)
            time.sleep(0.5)       # the last syscalls reach the ring and the poller
        server.stop()
        yield {"sendfile": sendfile, "out": out, "log": server.log(), "wrk": wrk, "raw": raw,
               "result": rec.result or {}}
    finally:
        server.stop()


@pytest.mark.slow
def test_recorded_calls_equal_nginx_access_log(nginx_run: dict) -> None:
    assert nginx_run["wrk"].returncode == 0, nginx_run["wrk"].stderr
    log = nginx_run["log"]
    with Recording(nginx_run["out"]) as r:
        calls = sorted(r.calls(), key=lambda c: c.request_ts_ns)
        summary = summarize(r)
    recorded = _recorded(calls)
    # every kind of request was served, and many of them
    kinds = collections.Counter((m, u, s) for m, u, s, _ in log)
    assert kinds[("GET", "/1m.bin", 200)] >= 2 and kinds[("GET", "/missing", 404)] >= 2
    assert kinds[("POST", "/post", 200)] >= 2 and kinds[("GET", "/100k.bin", 200)] >= 2
    assert len(log) >= 100
    # exactly nginx's log: same requests, statuses and body sizes (order: nginx logs when a response
    # is done, connections interleave; as multisets they must be equal)
    assert collections.Counter(recorded) == collections.Counter(log)
    result = nginx_run["result"]
    assert result["lost_events"] == 0 and result["truncated_events"] == 0
    file_bytes = sum(s for m, u, st, s in log if u.endswith(".bin") and st == 200)
    if nginx_run["sendfile"]:
        # the file bodies went by sendfile: accounted, not stored, and said on each call
        assert result["not_captured_bytes"] == file_bytes
        by_file = [c for c in calls if c.method and c.method.endswith(".bin") and c.status == 200]
        assert by_file and all(c.responses == [] and c.status_message and
                               "not captured: sendfile" in c.status_message for c in by_file)
    else:
        assert result["not_captured_bytes"] == 0
        # recorded whole: the 1 MB bodies are byte-identical to the file
        ones = [c for c in calls if c.method == "GET /1m.bin" and c.status == 200]
        body = (nginx_run["out"].parent / "html" / "1m.bin").read_bytes()
        assert ones and all(b"".join(m.data for m in c.responses) == body for c in ones)
    assert not [c for c in calls if c.status is None]
    assert summary["calls"] == len(log)


@pytest.mark.slow
def test_pipelined_raw_requests_pair_with_their_responses(nginx_run: dict) -> None:
    raw = nginx_run["raw"]
    assert raw.count(b"HTTP/1.1 ") == 4
    with Recording(nginx_run["out"]) as r:
        flows = list(r.flows())
        last = max(flows, key=lambda f: f.opened_ns or 0)
        calls = [c for c in r.calls() if c.flow_id == last.id]
    assert [(c.method, c.status) for c in calls] == [("GET /1k.bin", 200), ("POST /post", 200), ("GET /none", 404),
                                                     ("GET /100k.bin", 200)]
    assert [m.data for m in calls[1].requests] == [POST_BODY]
    assert [m.data for m in calls[1].responses] == [b"posted\n"]


def _churn(port: int, stop: threading.Event, seen: list[int]) -> None:
    """Short keep-alive connections, one after another, each a few requests 10 ms apart."""
    paths = ["/1k.bin", "/missing", "/100k.bin"]
    n = 0
    while not stop.is_set() and n < 5000:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        for _ in range(4):
            conn.request("GET", paths[n % 3])
            conn.getresponse().read()
            n += 1
            time.sleep(0.01)
        conn.close()
    seen.append(n)


@pytest.mark.slow
def test_connections_opened_while_the_recorder_starts_are_never_mispaired(tmp_path: Path) -> None:
    # bcc attaches the syscall probes one by one over hundreds of ms. A connection accepted half-way
    # used to have its requests recorded and its responses not (yet), and every request was then paired
    # with a later answer: 315 of 360 calls on a recording of a busy service. Now a connection enters the
    # capture only once every probe is on, and one opened before is joined with its unasked answers dropped.
    server = Nginx(tmp_path, sendfile=False)
    stop, seen = threading.Event(), []
    threads = [threading.Thread(target=_churn, args=(server.port, stop, seen)) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.2)                       # traffic is flowing before the recorder starts
        with Recorder(RecordOptions(output=str(tmp_path / "busy.rec"), port=server.port)):
            time.sleep(1.5)
            stop.set()
            for t in threads:
                t.join(10)
            time.sleep(0.5)
    finally:
        stop.set()
        server.stop()
    expect = {"/1k.bin": (200, 1024), "/missing": (404, None), "/100k.bin": (200, 100 * 1024)}
    with Recording(tmp_path / "busy.rec") as rec:
        calls = list(rec.calls())
    assert len(calls) > 50 and sum(seen) > len(calls) // 2, (len(calls), seen)
    wrong = [(m, p, status, size) for m, p, status, size in _recorded(calls)
             if status != expect[p][0] or (expect[p][1] is not None and size != expect[p][1])]
    assert wrong == [], f"{len(wrong)} of {len(calls)} calls paired with another call's answer: {wrong[:5]}"
