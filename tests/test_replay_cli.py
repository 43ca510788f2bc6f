"""`shadowtest replay`: exit codes, --json fields, --dry-run sends nothing, the allowlist refuses."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from harness.cli import cli
from replay.testing import EchoServer, write_unary_recording

MS = 1_000_000
FIELDS = {"scheduled", "sent", "ok", "rejected", "errors", "timeouts", "not_sent", "duration_s", "achieved_rate",
          "latency_ms", "latency_from_send_ms", "lag_us", "mismatches"}


def test_json_report_has_every_field_and_exit_0(tmp_path: Path) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 4 * MS for i in range(50)], flows=2)
    with EchoServer(reject_every=10) as server:
        res = CliRunner().invoke(cli, ["replay", str(tmp_path / "r.rec"), "--target", server.address, "--speed",
                                       "2", "--json", str(tmp_path / "out.json")])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "out.json").read_text())
    assert FIELDS <= set(data)
    assert data["scheduled"] == n and data["ok"] == n - n // 10 and data["rejected"] == n // 10
    assert set(data["latency_ms"]) == {"p50", "p95", "p99", "max"} and set(data["lag_us"]) == {"p50", "p99", "max"}
    assert "invariant: ok" in res.output


def test_dry_run_sends_nothing(tmp_path: Path) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * MS for i in range(30)], flows=3)
    with EchoServer() as server:
        res = CliRunner().invoke(cli, ["replay", str(tmp_path / "r.rec"), "--target", server.address,
                                       "--dry-run", "--loop", "2", "--json", "-"])
        assert not server.received
    assert res.exit_code == 0
    data = json.loads(res.stdout)
    assert data["dry_run"] and data["scheduled"] == 2 * n and data["connections"] == 3


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    write_unary_recording(tmp_path / "r.rec", [0])
    runner = CliRunner()
    refused = runner.invoke(cli, ["replay", str(tmp_path / "r.rec"), "--target", "192.0.2.1:50051"])
    assert refused.exit_code == 2 and "--allow-target" in refused.output
    assert runner.invoke(cli, ["replay", str(tmp_path / "r.rec"), "--target", "127.0.0.1:1",
                               "--speed", "500"]).exit_code == 2
    assert runner.invoke(cli, ["replay", str(tmp_path / "r.rec"), "--target", "127.0.0.1:1",
                               "--window", "oops"]).exit_code == 2


def test_missing_recording_is_one_line_and_exit_1(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["replay", str(tmp_path / "nope.rec"), "--target", "127.0.0.1:1"])
    assert res.exit_code == 1 and "no such recording" in res.output and "Traceback" not in res.output


def test_workers_through_the_cli(tmp_path: Path) -> None:
    n = write_unary_recording(tmp_path / "r.rec", [i * 3 * MS for i in range(60)], flows=4)
    with EchoServer() as server:
        res = CliRunner().invoke(cli, ["replay", str(tmp_path / "r.rec"), "--target", server.address,
                                       "--workers", "2", "--json", "-"])
        assert sorted(s for _, _, s in server.received) == list(range(n))
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # progress lines go to stderr
    assert data["workers"] == 2 and data["ok"] == n and data["invariant_ok"]


def test_unfinished_decode_later_recording_is_refused_until_finished(tmp_path: Path) -> None:
    import grpc

    from capture.backends import RecordOptions
    from capture.record import Recorder
    from replay.testing import DECIDE, snapshot_bytes

    out = tmp_path / "later.rec"
    with EchoServer() as server:
        with Recorder(RecordOptions(output=str(out), backend="proxy", port=server.port, decode="later")) as rec:
            with grpc.insecure_channel(f"127.0.0.1:{rec.backend.address[1]}") as ch:  # type: ignore[attr-defined]
                for i in range(5):
                    ch.unary_unary(DECIDE)(snapshot_bytes(i), timeout=5)
        for extra in (["--json", "-"], ["--dry-run", "--json", "-"], ["--workers", "2"]):   # one red line, nothing sent
            res = CliRunner().invoke(cli, ["replay", str(out), "--target", server.address, *extra])
            line = " ".join(res.output.split())   # rich wraps the red line at the terminal width
            assert res.exit_code == 1 and f"shadowtest record --finish -o {out}" in line, res.output
            assert "Traceback" not in res.output and len(server.received) == 5
        assert CliRunner().invoke(cli, ["record", "--finish", "-o", str(out)]).exit_code == 0
        res = CliRunner().invoke(cli, ["replay", str(out), "--target", server.address, "--json", "-"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["ok"] == 5 and len(server.received) == 10
