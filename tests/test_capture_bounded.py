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

REPO = Path(__file__).resolve().parents[1]
CONNECTIONS = 400


def _conf(d: Path) -> Any:
    def conf(port: int) -> str:
        return (PREAMBLE.format(d=d) + "http {\n" + TEMP_PATHS.format(d=d) + "    access_log off;\n"
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
        assert 0.20 * CONNECTIONS <= len(expected) <= 0.30 * CONNECTIONS, len(expected)
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
        rec = subprocess.Popen([sys.executable, "-m", "harness.cli", "record", "--port", str(port), "--max-file-mb",
                                "1", "--json", "--duration", "120", "-o", str(out)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 90
            while not out.exists() or "backend_settings" not in _meta(out):
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


def _meta(path: Path) -> dict[str, Any]:
    try:
        with Recording(path) as r:
            return dict(r.meta)
    except Exception:  # noqa: BLE001 - being created
        return {}
