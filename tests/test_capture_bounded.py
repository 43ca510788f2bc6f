"""A recorder that can be left running: connection sampling (`--sample`, `replay --scale-to-full`) and a
file size cap (`--max-file-mb`), against nginx on loopback.

Ground truth for sampling is the client: it knows each connection's 4-tuple, so the connections a seed
keeps are computed here from the same function and must be exactly the ones recorded, each whole.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest

from capture.backends import RecordOptions
from capture.errors import CaptureError
from capture.record import Recorder
from capture.recording import Recording
from capture.sample import Sampler
from tests.nginx import NGINX, PREAMBLE, TEMP_PATHS, running_nginx
from tests.polling import recording_meta
from wire.process import spawn

REPO = Path(__file__).resolve().parents[1]
CONNECTIONS = 400


def _conf(d: Path) -> Any:
    def conf(port: int) -> str:
        # 1,024 connections: a replay at 4x opens the recorded connections four times over, side by side
        preamble = PREAMBLE.format(d=d).replace("worker_connections 64", "worker_connections 1024")
        return (preamble + "http {\n" + TEMP_PATHS.format(d=d) + "    access_log off;\n"
                f"    server {{ listen 127.0.0.1:{port}; client_max_body_size 1m;\n"
                "        location / { return 200 'ok'; } }\n}\n")
    return conf


def test_sampler_keeps_the_share_asked_and_the_same_connections_for_a_seed() -> None:
    rng = random.Random(1)
    tuples = [((f"10.0.{rng.randrange(256)}.{rng.randrange(256)}", rng.randrange(1024, 65536)),
               ("10.1.0.1", 443)) for _ in range(20_000)]
    a, b, c = Sampler(25, seed=7), Sampler(25, seed=7), Sampler(25, seed=8)
    kept_a = [a.keeps(*t) for t in tuples]
    assert kept_a == [b.keeps(*t) for t in tuples]                      # same seed, same connections
    share = sum(kept_a) / len(tuples)
    assert 0.24 < share < 0.26, share
    kept_c = [c.keeps(*t) for t in tuples]
    both = sum(x and y for x, y in zip(kept_a, kept_c, strict=True)) / len(tuples)
    assert 0.05 < both < 0.08, both                                      # another seed: independent (~1/16)
    assert all(Sampler(100).keeps(*t) for t in tuples[:100])
    for bad in (0, -1, 100.5):
        with pytest.raises(CaptureError, match="--sample"):
            Sampler(bad)


def _get_on_new_connection(port: int, path: str) -> int:
    """One GET on a connection of its own; returns the client port it used."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.connect()
    assert conn.sock is not None
    cport = int(conn.sock.getsockname()[1])
    conn.request("GET", path)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == b"ok"
    conn.close()
    return cport


@pytest.mark.root
@pytest.mark.ebpf
@pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; scripts/setup.sh does)")
def test_sample_keeps_exactly_the_connections_its_hash_chooses_whole_and_replay_scales_to_full(
        tmp_path: Path) -> None:
    out = tmp_path / "sampled.rec"
    with running_nginx(tmp_path, _conf(tmp_path)) as port:
        rec = Recorder(RecordOptions(output=str(out), port=port, sample_pct=25, sample_seed=7)).start()
        try:
            cports = [_get_on_new_connection(port, f"/c/{i}") for i in range(CONNECTIONS)]
            time.sleep(0.5)
        finally:
            stats = rec.stop()
        sampler = Sampler(25, seed=7)
        expected = {p for p in cports if sampler.keeps(("127.0.0.1", p), ("127.0.0.1", port))}
        assert 0.15 * CONNECTIONS <= len(expected) <= 0.35 * CONNECTIONS, len(expected)   # 25 % +/- 4.6 sigma
        with Recording(out) as r:
            flows = list(r.flows())
            calls = list(r.calls())
            sampling = cast(dict[str, Any], r.meta["sampling"])
        assert {f.src[1] for f in flows} == expected                    # exactly the chosen ones
        assert len(flows) == len(expected) and stats["sampled_out_flows"] == CONNECTIONS - len(expected)
        assert sampling == {"pct": 25, "seed": 7, "kept_flows": len(expected),
                            "dropped_flows": CONNECTIONS - len(expected), "by_process": 0, "by": "4-tuple"}
        by_flow = {c.flow_id: c for c in calls}
        assert len(calls) == len(expected) and set(by_flow) == {f.id for f in flows}   # whole: one call each
        assert all(c.status == 200 and b"".join(m.data for m in c.responses) == b"ok" for c in calls)

        report = tmp_path / "replay.json"
        run = subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(out), "--target",
                              f"127.0.0.1:{port}", "--scale-to-full", "--json", str(report)],
                             capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "x4 connections (25 % of connections were recorded)" in run.stderr
    result = json.loads(report.read_text())
    assert result["scheduled"] == result["ok"] == 4 * len(expected), result   # every recorded call, 4 times


@pytest.mark.root
@pytest.mark.ebpf
@pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; scripts/setup.sh does)")
def test_max_file_mb_stops_at_the_cap_with_everything_before_it_complete(tmp_path: Path) -> None:
    out = tmp_path / "capped.rec"
    body = os.urandom(48 << 10).hex().encode()[: 64 << 10]      # 64 KiB that no compression shrinks
    with running_nginx(tmp_path, _conf(tmp_path)) as port:
        rec = spawn([sys.executable, "-m", "harness.cli", "record", "--port", str(port), "--max-file-mb",
                     "1", "--json", "--duration", "120", "-o", str(out)], cwd=str(REPO),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 90
            while not out.exists() or "backend_settings" not in recording_meta(out):
                assert rec.poll() is None and time.monotonic() < deadline, rec.stderr.read() if rec.stderr else ""
                time.sleep(0.1)
            sent = 0
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            while rec.poll() is None and sent < 100:      # 6.4 MiB offered, bounded
                conn.request("POST", f"/up/{sent}", body=body)
                assert conn.getresponse().read() == b"ok"
                sent += 1
                time.sleep(0.01)
            conn.close()
            stdout, stderr = rec.communicate(timeout=60)  # it stops on its own, long before --duration 120
        finally:
            if rec.poll() is None:
                rec.kill()
                rec.wait(10)
    assert rec.returncode == 0, stderr
    result = json.loads(stdout)
    assert result["capped"] is True and result["bytes_after_cap"] > 0, result
    size = out.stat().st_size
    assert size <= (1 << 20) + (768 << 10), size                        # the cap, and at most one check's worth
    with Recording(out) as r:
        meta = r.meta
        calls = list(r.calls())
    assert meta["capped"]["max_file_bytes"] == 1 << 20 and meta["capped"]["file_bytes_at_cap"] >= 1 << 20
    assert 0 < len(calls) < sent
    complete = [c for c in calls if c.status == 200]
    assert len(complete) >= len(calls) - 1, [(c.method, c.status) for c in calls]   # at most the one cut at the cap
    assert all(b"".join(m.data for m in c.requests) == body for c in complete)



@pytest.mark.root
@pytest.mark.ebpf
@pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; scripts/setup.sh does)")
def test_rotation_splits_no_call_and_the_set_reads_and_replays_as_one(tmp_path: Path) -> None:
    """Four keep-alive connections stay open across every boundary: each call is stored whole in one
    file, the set holds every call the clients made exactly once, and `inspect`/`replay` of the
    directory see one recording with four flows."""
    import threading

    out = tmp_path / "set"
    per_conn, conns = 150, 4
    bodies = {(k, i): (f"{k}-{i}:".encode() + os.urandom(1024).hex().encode()) for k in range(conns)
              for i in range(per_conn)}
    with running_nginx(tmp_path, _conf(tmp_path)) as port:
        rec = Recorder(RecordOptions(output=str(out), port=port, rotate_mb=0.5)).start()
        errors: list[BaseException] = []

        def client(k: int) -> None:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                for i in range(per_conn):
                    conn.request("POST", f"/k{k}/{i}", body=bodies[(k, i)])
                    assert conn.getresponse().read() == b"ok"
                    time.sleep(0.005)
                conn.close()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        try:
            threads = [threading.Thread(target=client, args=(k,)) for k in range(conns)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            time.sleep(0.5)
        finally:
            stats = rec.stop()
        assert not errors, errors
        files = sorted(out.glob("*.rec"))
        assert len(files) >= 3 and stats["files"] == len(files), (files, stats)
        seen: list[tuple[str, bytes]] = []
        for f in files:
            with Recording(f) as r:
                assert r.meta["rotation"]["index"] == int(f.stem)
                seen += [(c.method or "", b"".join(m.data for m in c.requests)) for c in r.calls()
                         if c.status == 200]
        expected = sorted((f"POST /k{k}/{i}", bodies[(k, i)]) for k in range(conns) for i in range(per_conn))
        assert sorted(seen) == expected                               # every call once, whole, none split

        inspect = subprocess.run([sys.executable, "-m", "harness.cli", "inspect", str(out), "--json"],
                                 capture_output=True, text=True, timeout=120, cwd=REPO)
        assert inspect.returncode == 0, inspect.stderr
        report = json.loads(inspect.stdout)
        assert (report["calls"], report["flows"], report["set_files"]) == (conns * per_conn, conns, len(files))
        replayed = tmp_path / "replay.json"
        run = subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(out), "--target", f"127.0.0.1:{port}",
                              "--speed", "4", "--json", str(replayed)], capture_output=True, text=True, timeout=300,
                             cwd=REPO)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert json.loads(replayed.read_text())["ok"] == conns * per_conn


ALERT = {"version": "4", "status": "firing", "receiver": "shadowtest", "groupLabels": {"alertname": "P99High"},
         "commonLabels": {"alertname": "P99High", "severity": "page"},
         "alerts": [{"status": "firing", "labels": {"alertname": "P99High", "severity": "page", "service": "agent"},
                     "annotations": {"summary": "P99 over 20 ms"}, "startsAt": "2026-12-05T10:00:00Z"}]}


def _post(url: str, body: bytes) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.mark.root
@pytest.mark.ebpf
@pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; scripts/setup.sh does)")
def test_flight_recorder_dumps_the_last_window_on_an_alertmanager_webhook(tmp_path: Path) -> None:
    """A 4 s ring while calls run for 12 s; an Alertmanager webhook at ~8 s writes a recording of the
    calls of the last 4 s before it, less at most one 1 s slice, named after the alert; a malformed payload and a second trigger
    at once are refused; the ring's files are gone at the end."""
    import socket
    import threading

    out = tmp_path / "incidents"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        hook_port = s.getsockname()[1]
    with running_nginx(tmp_path, _conf(tmp_path)) as port:
        rec = Recorder(RecordOptions(output=str(out), port=port, ring_s=4.0,
                                     trigger_listen=f"127.0.0.1:{hook_port}")).start()
        sent: list[tuple[int, float]] = []       # (call number, when sent: monotonic)
        stop = threading.Event()

        def load() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            i = 0
            while not stop.is_set() and i < 400:    # bounded: 12 s at 20 calls/s is 240
                sent.append((i, time.monotonic()))
                conn.request("GET", f"/n/{i}")
                assert conn.getresponse().read() == b"ok"
                i += 1
                time.sleep(0.05)
            conn.close()

        t = threading.Thread(target=load)
        try:
            t0 = time.monotonic()
            t.start()
            time.sleep(8.0)
            url = f"http://127.0.0.1:{hook_port}/"
            assert _post(url, b'{"alerts": "nope"}') == 400
            trigger_at = time.monotonic()
            assert _post(url, json.dumps(ALERT).encode()) == 202
            assert _post(url, json.dumps(ALERT).encode()) == 429      # one dump per 10 s at most
            time.sleep(4.0)
            stop.set()
            t.join(30)
        finally:
            stop.set()
            result = rec.stop()
    assert time.monotonic() - t0 < 60
    (dump,) = cast(list[dict[str, Any]], result["dumps"])
    assert dump["name"] == "P99High" and dump["file"], dump
    assert result["triggers"] == {"accepted": 1, "malformed": 1, "rate_limited": 1}
    path = Path(cast(str, dump["file"]))
    assert path.parent == out and path.name.endswith("-P99High.rec") and (path.stat().st_mode & 0o777) == 0o600
    assert not (out / ".ring").exists()                                 # the ring's files: gone
    with Recording(path) as r:
        numbers = sorted(int((c.method or "").rsplit("/", 1)[1]) for c in r.calls())
        trigger = cast(dict[str, Any], r.meta["trigger"])
    assert trigger["name"] == "P99High" and trigger["labels"]["service"] == "agent" and trigger["window_s"] == 4.0
    when = dict(sent)
    assert numbers == list(range(numbers[0], numbers[-1] + 1))          # no call missing inside the window
    assert all(trigger_at - 4.3 <= when[n] <= trigger_at + 0.3 for n in numbers), \
        [(n, round(when[n] - trigger_at, 2)) for n in (numbers[0], numbers[-1])]
    # the window less at most one slice (1 s, rotated on the 0.25 s tick): the last 2.4 s are all in
    assert {n for n, at in sent if trigger_at - 2.4 <= at <= trigger_at - 0.3} <= set(numbers)


@pytest.mark.root
@pytest.mark.ebpf
@pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; scripts/setup.sh does)")
def test_a_cpu_budget_sheds_whole_connections_and_says_so(tmp_path: Path) -> None:
    """A budget far below what the recorder needs (1 % of a core): it sheds, and every connection is
    either recorded whole or counted as shed; none is half recorded."""
    out = tmp_path / "budget.rec"
    with running_nginx(tmp_path, _conf(tmp_path)) as port:
        rec = Recorder(RecordOptions(output=str(out), port=port, max_cpu_pct=1.0)).start()
        try:
            made = 0
            t0 = time.monotonic()
            while (elapsed := time.monotonic() - t0) < 6.0 and made < 3000:     # bounded
                if made > 1000 * elapsed:
                    # paced at ~1,000 connections/s, so that they last past the recorder's CPU judgments
                    # (once a second): a fast host made all 3,000 in 0.7 s, before the first
                    time.sleep(0.002)
                    continue
                _get_on_new_connection(port, f"/b/{made}")
                made += 1
            time.sleep(0.5)
        finally:
            result = rec.stop()
    budget = cast(dict[str, Any], result["cpu_budget"])
    assert budget["shed_flows"] > 0 and budget["times_over"] >= 1 and budget["shedding_s"] > 0, budget
    assert budget["peak_cpu_pct"] > 1.0
    with Recording(out) as r:
        flows = list(r.flows())
        calls = list(r.calls())
        assert cast(dict[str, Any], r.meta["cpu_budget"])["shed_flows"] == budget["shed_flows"]
    assert len(flows) + budget["shed_flows"] == made, (len(flows), budget, made)
    assert len(calls) == len(flows) and all(c.status == 200 for c in calls)    # each kept one whole
