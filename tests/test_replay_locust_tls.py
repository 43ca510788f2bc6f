"""Locust mode speaks TLS and carries the header rules, as `shadowtest replay` does (real Locust, real TLS
gRPC server, loopback)."""

from __future__ import annotations

import json
from pathlib import Path

from replay.testing import write_unary_recording
from tests.test_replay_locust import _finish, _locust
from tests.test_replay_tls import Pki, TlsGrpcServer, needs_openssl, pki  # noqa: F401  (pki: the fixture)

MS = 1_000_000


@needs_openssl
def test_locust_replays_over_tls_with_shadow_credentials(tmp_path: Path, pki: Pki) -> None:  # noqa: F811
    n = write_unary_recording(tmp_path / "g.rec", [i * 5 * MS for i in range(10)])
    with TlsGrpcServer(pki) as server:
        proc = _locust("--headless", "-u", "1", "-r", "1", "--run-time", "30s", "--host", server.address,
                       "--only-summary", "--shadow-recording", str(tmp_path / "g.rec"), "--shadow-start-delay", "0.5",
                       "--shadow-tls", "--shadow-ca", str(pki.ca), "--shadow-set-header", "authorization=Bearer shadow",
                       "--shadow-json", str(tmp_path / "acc.json"))
        out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    acc = json.loads((tmp_path / "acc.json").read_text())
    assert acc["ok"] == n == acc["scheduled"], out[-3000:]
    assert len(server.metadata) == n
    assert all(md["authorization"] == "Bearer shadow" and md["x-shadowtest-replay"] == "1" for md in server.metadata)


@needs_openssl
def test_locust_bad_tls_option_is_one_line_and_exit_2(tmp_path: Path, pki: Pki) -> None:  # noqa: F811
    write_unary_recording(tmp_path / "g.rec", [0])
    proc = _locust("--headless", "-u", "1", "--run-time", "5s", "--host", "127.0.0.1:1",
                   "--shadow-recording", str(tmp_path / "g.rec"), "--shadow-insecure", "--shadow-ca", str(pki.ca))
    out = _finish(proc)
    assert proc.returncode == 2, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("shadowtest: ")]
    assert len(lines) == 1 and "--shadow-insecure" in lines[0] and "--shadow-ca" in lines[0], out[-3000:]
    assert "Traceback" not in out
