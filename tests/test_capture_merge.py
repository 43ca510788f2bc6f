"""`shadowtest merge`: recordings of several hosts into one, aligned by wall clock.

The alignment is checked exactly on files written here whose monotonic clocks start at different
points (as on hosts booted at different times); the whole path (three servers in three network
namespaces, each recorded by its own recorder under its own host name, merged, replayed by two Locust
workers) on real processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest

from capture.errors import RecordingError
from capture.merge import merge_recordings
from capture.recording import Call, Chunk, Flow, Message, Recording, RecordingWriter
from tests.polling import recording_meta
from wire.process import end_child, spawn

REPO = Path(__file__).resolve().parents[1]
S = 1_000_000_000


def _host_file(path: Path, host: str, boot_wall_ns: int, calls_at_wall_s: list[float], rules: list[str]) -> None:
    """A recording as a host booted at `boot_wall_ns` writes it: stamps on its monotonic clock."""
    start_wall = 1_700_000_000 * S
    start_mono = start_wall - boot_wall_ns
    meta = {"host": host, "started_wall_ns": start_wall, "started_mono_ns": start_mono, "redaction_rules": rules,
            "clock": "CLOCK_MONOTONIC"}
    with RecordingWriter(path, meta=meta) as w:
        for i, at in enumerate(calls_at_wall_s):
            mono = start_mono + int(at * S)
            fid = w.add_flow(Flow(src=("10.0.0.9", 40000 + i), dst=("10.0.0.1", 80), pid=1, comm="srv",
                                  opened_ns=mono, closed_ns=mono + 5_000_000, protocol="http1"))
            w.add_chunk(Chunk(fid, "c2s", mono, f"GET /{host}/{i} HTTP/1.1\r\n\r\n".encode()))
            w.add_call(Call(protocol="http1", method=f"GET /{host}/{i}", request_ts_ns=mono, flow_id=fid,
                            kind="request", request_metadata=[("authorization", "*****")], status=200,
                            response_ts_ns=mono + 1_000_000, end_ts_ns=mono + 2_000_000,
                            requests=[], responses=[Message("s2c", 0, mono + 1_000_000, f"from {host}".encode())]))


def test_merge_aligns_hosts_by_wall_clock_exactly(tmp_path: Path) -> None:
    a, b, out = tmp_path / "a.rec", tmp_path / "b.rec", tmp_path / "ab.rec"
    # host a booted 1000 s before the epoch second the recordings start at, host b 5 s before: their
    # monotonic stamps differ by 995 s for the same instant
    _host_file(a, "web-a", 1000 * S, [0.0, 2.0, 4.0], ["header:authorization"])
    _host_file(b, "web-b", 5 * S, [1.0, 3.0], ["header:authorization", "json-field:ssn"])
    counts = merge_recordings([str(b), str(a)], str(out))
    assert (counts["flows"], counts["calls"], counts["chunks"]) == (5, 5, 5)
    with Recording(out) as r:
        calls = list(r.calls())
        flows = {f.id: f for f in r.flows()}
        meta = r.meta
    assert [c.method for c in calls] == ["GET /web-a/0", "GET /web-b/0", "GET /web-a/1", "GET /web-b/1",
                                         "GET /web-a/2"]
    t0 = calls[0].request_ts_ns
    assert [c.request_ts_ns - t0 for c in calls] == [0, S, 2 * S, 3 * S, 4 * S]     # to the nanosecond
    assert all(c.response_ts_ns == c.request_ts_ns + 1_000_000 and c.responses[0].ts_ns == c.response_ts_ns
               for c in calls)
    assert all(flows[c.flow_id].opened_ns == c.request_ts_ns for c in calls if c.flow_id is not None)
    assert meta["redaction_rules"] == ["header:authorization", "json-field:ssn"]
    merged = cast(dict[str, Any], meta["merged"])
    by_host = {m["host"]: m for m in merged["from"]}
    assert by_host["web-a"]["shift_ns"] == 0 and by_host["web-b"]["shift_ns"] == -(1000 - 5) * S   # b on a's clock
    first, last = by_host["web-b"]["flows"]
    assert {flows[c.flow_id].id for c in calls if "web-b" in (c.method or "")} == set(range(first, last + 1))
    assert "wall clock" in merged["alignment"] and str(a) in merged["alignment"]
    assert [m.data for c in calls for m in c.responses][:2] == [b"from web-a", b"from web-b"]


def test_merge_refuses_what_it_cannot_align_or_that_does_not_overlap(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.rec", tmp_path / "b.rec", tmp_path / "c.rec"
    _host_file(a, "web-a", 100 * S, [0.0, 1.0], [])
    _host_file(b, "web-b", 100 * S, [60.0, 61.0], [])            # a minute later: disjoint
    with pytest.raises(RecordingError, match="do not overlap; pass --allow-disjoint"):
        merge_recordings([str(a), str(b)], str(tmp_path / "x.rec"))
    assert not (tmp_path / "x.rec").exists()
    done = merge_recordings([str(a), str(b)], str(tmp_path / "x.rec"), allow_disjoint=True)
    assert done["calls"] == 4
    with RecordingWriter(c, meta={"host": "imported"}) as w:     # no clock readings (a pcap import)
        w.add_flow(Flow(src=("1.1.1.1", 1), dst=("2.2.2.2", 2)))
    with pytest.raises(RecordingError, match="no clock readings"):
        merge_recordings([str(a), str(c)], str(tmp_path / "y.rec"))
    with pytest.raises(RecordingError, match="at least two"):
        merge_recordings([str(a)], str(tmp_path / "z.rec"))
    with pytest.raises(RecordingError, match="already exists"):
        merge_recordings([str(a), str(b)], str(tmp_path / "x.rec"), allow_disjoint=True)
    cli = subprocess.run([sys.executable, "-m", "harness.cli", "merge", str(a), str(b), "-o", str(tmp_path / "w.rec")],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert cli.returncode == 1 and cli.stderr.count("\n") == 1 and "--allow-disjoint" in cli.stderr, cli.stderr


# --- three hosts: three network namespaces, each with its own server and its own recorder -------------------

SERVER = """
import http.server, sys
name = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = f"{name} {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), H)
print("ready", flush=True)
srv.serve_forever()
"""

# Each client says "ready" once started, then reads its start time: a start fixed before the clients ran
# left a client that started late on a loaded host (imports, `ip netns exec`) behind the others. Call i
# goes at start + i * gap (not gap after the last answer), so a slow answer does not shift the rest.
CLIENT = """
import http.client, sys, time
name, n, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
print("ready", flush=True)
start = float(sys.stdin.readline())
for i in range(n):
    time.sleep(max(0.0, start + i * gap - time.time()))
    conn = http.client.HTTPConnection("127.0.0.1", 8080, timeout=10)
    conn.request("GET", f"/{name}/{i}")
    assert conn.getresponse().read() == f"{name} /{name}/{i}".encode()
    conn.close()
"""


@contextlib.contextmanager
def _netns(name: str) -> Iterator[str]:
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True,
                       capture_output=True, timeout=30)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.mark.root
@pytest.mark.ebpf
@pytest.mark.skipif(shutil.which("ip") is None or shutil.which("unshare") is None,
                    reason="needs iproute2 and util-linux (ip netns, unshare)")
def test_three_hosts_recorded_apart_merge_into_one_replayed_by_two_locust_workers(tmp_path: Path) -> None:
    hosts = [f"web-{i}" for i in (1, 2, 3)]
    with contextlib.ExitStack() as stack:
        spaces = [stack.enter_context(_netns(f"stm{os.getpid()}-{i}")) for i in (1, 2, 3)]
        procs: list[subprocess.Popen[Any]] = []
        stack.callback(lambda: [end_child(p) for p in reversed(procs)])
        servers = []
        for host, ns in zip(hosts, spaces, strict=True):
            p = spawn(["ip", "netns", "exec", ns, sys.executable, "-c", SERVER, host, "8080"],
                      stdout=subprocess.PIPE, stderr=None, text=True)
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            servers.append(p)
        recorders = []
        for host, srv in zip(hosts, servers, strict=True):
            out = tmp_path / f"{host}.rec"
            r = spawn(["unshare", "--uts", "sh", "-c", f"hostname {host} && exec \"$@\"", "sh",
                       sys.executable, "-m", "harness.cli", "record", "--port", "8080", "--pid",
                       str(srv.pid), "--json", "-o", str(out)], cwd=str(REPO), stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
            procs.append(r)
            recorders.append((r, out))
        deadline = time.monotonic() + 120
        for r, out in recorders:
            while "backend_settings" not in recording_meta(out):
                assert r.poll() is None and time.monotonic() < deadline, r.stderr.read() if r.stderr else ""
                time.sleep(0.2)
        clients = [spawn(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, host, "6", "0.45"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True)
                   for host, ns in zip(hosts, spaces, strict=True)]
        procs.extend(clients)
        for c in clients:
            assert c.stdout is not None and c.stdout.readline().strip() == "ready"
        start = time.time() + 0.5
        for k, c in enumerate(clients):     # the hosts take turns, 0.15 s apart
            assert c.stdin is not None
            c.stdin.write(f"{start + k * 0.15}\n")
            c.stdin.flush()
        for c in clients:
            assert c.wait(60) == 0
        time.sleep(0.5)
        for r, _ in recorders:
            r.send_signal(signal.SIGINT)
        for r, _ in recorders:
            _, err = r.communicate(timeout=120)
            assert r.returncode == 0, err
        merged = tmp_path / "fleet.rec"
        run = subprocess.run([sys.executable, "-m", "harness.cli", "merge", *(str(o) for _, o in recorders), "-o",
                              str(merged), "--json"], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert run.returncode == 0, run.stderr
        result = json.loads(run.stdout)

        # replayed into one server of this namespace by two Locust workers
        local = spawn([sys.executable, "-c", SERVER, "local", "0"], stdout=subprocess.PIPE, stderr=None, text=True)
        procs.append(local)
        assert local.stdout is not None and local.stdout.readline().strip() == "ready"
        port = _listening_port(local.pid)
        report = tmp_path / "replay.json"
        replay = subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(merged), "--target",
                                 f"127.0.0.1:{port}", "--workers", "2", "--speed", "4", "--json", str(report)],
                                capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result["calls"] == 18 and result["flows"] == 18
    assert sorted(src["host"] for src in result["from"]) == hosts
    assert all(abs(src["shift_ns"]) < 50_000_000 for src in result["from"])   # one machine: one clock, +-ms
    with Recording(merged) as r:
        calls = list(r.calls())
        meta = r.meta
    stamps = [c.request_ts_ns for c in calls]
    assert stamps == sorted(stamps)
    order = [(c.method or "").split("/")[1] for c in calls]
    assert order == hosts * 6, order                       # by time: the three hosts take turns
    ranges = {m["host"]: m["flows"] for m in cast(dict[str, Any], meta["merged"])["from"]}
    for c in calls:
        host = (c.method or "").split("/")[1]
        assert c.flow_id is not None and ranges[host][0] <= c.flow_id <= ranges[host][1]
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
    done = json.loads(report.read_text())
    assert done["scheduled"] == done["ok"] == 18, done


def _listening_port(pid: int) -> int:
    import psutil

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ports = [c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == "LISTEN"]
        if ports:
            return int(ports[0])
        time.sleep(0.05)
    raise AssertionError("the local server does not listen")


def test_a_rotated_sets_tls_report_names_the_merged_flows(tmp_path: Path) -> None:
    """The recorder writes its TLS report (meta tls_flows) into the set's last file, naming each flow by
    its id in the file the connection was opened in (the row's fifth field). Read as one, the set's
    report must name the merged flows: before, it was dropped, and `inspect DIR` listed no encrypted flow."""
    d = tmp_path / "set"
    d.mkdir()
    wall, mono = 1_700_000_000 * S, 50 * S
    base = {"host": "h", "started_wall_ns": wall, "started_mono_ns": mono, "clock": "CLOCK_MONOTONIC"}

    def flow(port: int, at: int) -> Flow:
        return Flow(src=("10.0.0.9", port), dst=("10.0.0.1", 443), pid=1, comm="srv", opened_ns=mono + at * S,
                    protocol="tls")

    with RecordingWriter(d / "000001.rec", meta=base | {"rotation": {"set": "s", "index": 1}}) as w:
        a = w.add_flow(flow(40001, 0))        # 1: ended in file 1
        b = w.add_flow(flow(40002, 1))        # 2: still open at the rotation
        w.update_flow(a, closed_ns=mono + 2 * S)
    with RecordingWriter(d / "000002.rec", meta=base | {"rotation": {"set": "s", "index": 2}}) as w:
        b2 = w.add_flow(replace(flow(40002, 1), joined_midstream=True))   # B again, 1 here
        c = w.add_flow(flow(40003, 3))                                     # 2 here: opened in file 2
        w.set_meta({"continues": {str(b2): b},
                    "tls": {"capture": "on", "plaintext_flows": 1, "encrypted_flows": 2},
                    "tls_flows": [[a, "encrypted", "Go binary stripped", 0, 1], [b, "plaintext", None, 10, 1],
                                  [c, "encrypted", "a JVM (JSSE)", 0, 2]]})
    out = tmp_path / "one.rec"
    merge_recordings([str(d / "000001.rec"), str(d / "000002.rec")], str(out), allow_disjoint=True)
    with Recording(out) as r:
        ports = {f.id: f.src[1] for f in r.flows()}
        rows = cast(list[list[Any]], r.meta["tls_flows"])
        tls = cast(dict[str, Any], r.meta["tls"])
    assert len(ports) == 3 and tls["encrypted_flows"] == 2
    assert [(ports[row[0]], row[1], row[2]) for row in rows] == [
        (40001, "encrypted", "Go binary stripped"), (40002, "plaintext", None), (40003, "encrypted", "a JVM (JSSE)")]
    # the user's path: the directory read as one names each ciphertext flow with its reason
    from click.testing import CliRunner

    from harness.cli import cli

    res = CliRunner().invoke(cli, ["inspect", str(d), "--json"])
    problems = json.loads(res.output)["problems"]
    by_port = {p: i for i, p in ports.items()}
    assert f"flow {by_port[40003]} is TLS recorded as ciphertext (raw TCP, no calls): a JVM (JSSE)" in problems
    assert f"flow {by_port[40001]} is TLS recorded as ciphertext (raw TCP, no calls): Go binary stripped" in problems
