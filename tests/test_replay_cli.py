"""`shadowtest replay`: exit codes, --json fields, --dry-run sends nothing, the allowlist refuses.
Thresholds and the first error's reason: tests/test_replay_thresholds.py."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from harness.cli import cli
from replay.testing import EchoServer, write_unary_recording

MS = 1_000_000
FIELDS = {"scheduled", "sent", "ok", "rejected", "errors", "timeouts", "not_sent", "duration_s", "achieved_rate",
          "latency_ms", "latency_from_send_ms", "lag_us", "mismatches", "error_reasons", "thresholds", "failures",
          "passed"}


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
    assert "invariant: ok" in res.output and "verdict: passed" in res.output
    assert data["thresholds"] == [{"name": "min_ok", "limit": 1, "actual": n - n // 10, "passed": True,
                                   "unit": "calls", "detail": f"{n - n // 10} ok of {n} scheduled"}]
    assert data["passed"] and data["failures"] == []


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
    assert [w["worker"] for w in data["workers"]] == [0, 1] and data["ok"] == n and data["invariant_ok"]


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


def _write_unknown_methods(path: Path, n: int = 6, flows: int = 2) -> list[int]:
    """Calls of joined connections whose :path the recorder never saw: group hpack:5,4 on every flow."""
    from capture.recording import Call, Flow, Message, RecordingWriter
    from replay.testing import decision_bytes, snapshot_bytes

    with RecordingWriter(path, meta={"host": "test"}) as w:
        fids = [w.add_flow(Flow(("127.0.0.1", 40000 + i), ("127.0.0.1", 50051), joined_midstream=True,
                                protocol="grpc")) for i in range(flows)]
        for i in range(n):
            ts = 10_000_000_000 + i * 2 * MS
            w.add_call(Call(protocol="grpc", method=None, request_ts_ns=ts, flow_id=fids[i % flows], status=0,
                            method_unknown=True, method_ref="hpack:5,4",
                            requests=[Message("c2s", 0, ts, snapshot_bytes(i))],
                            responses=[Message("s2c", 0, ts + MS, decision_bytes(i))]))
    return fids


def test_calls_with_an_unknown_method_are_never_sent_blind(tmp_path: Path) -> None:
    _write_unknown_methods(tmp_path / "j.rec")
    with EchoServer() as server:
        res = CliRunner().invoke(cli, ["replay", str(tmp_path / "j.rec"), "--target", server.address, "--json", "-"])
        plain = CliRunner().invoke(cli, ["replay", str(tmp_path / "j.rec"), "--target", server.address])
        assert server.received == []
    assert res.exit_code == 99, res.output     # nothing succeeded: the run fails, and says why
    data = json.loads(res.stdout)
    assert (data["scheduled"], data["sent"], data["ok"], data["not_sent"]) == (6, 0, 0, 6)
    assert data["not_sent_reasons"] == {"unknown_method": 6} and data["invariant_ok"]
    assert any("--method-map FLOW:REF=METHOD" in p for p in data["problems"])
    assert data["failures"] == ["no call succeeded: 0 ok of 6 scheduled; not sent: unknown_method 6"]
    assert plain.exit_code == 99
    assert "not sent: unknown_method 6" in plain.output and "invariant: ok" in plain.output
    assert "verdict: FAILED: no call succeeded: 0 ok of 6 scheduled; not sent: unknown_method 6" in plain.output


def test_method_map_names_groups_for_one_replay(tmp_path: Path) -> None:
    from replay.testing import DECIDE

    fids = _write_unknown_methods(tmp_path / "j.rec")
    with EchoServer() as server:
        every = CliRunner().invoke(cli, ["replay", str(tmp_path / "j.rec"), "--target", server.address,
                                         "--method-map", f"hpack:5,4={DECIDE}", "--json", "-"])
        assert sorted(s for _, m, s in server.received if m == "Decide") == list(range(6))
        one = CliRunner().invoke(cli, ["replay", str(tmp_path / "j.rec"), "--target", server.address,
                                       "--method-map", f"{fids[0]}:hpack:5,4={DECIDE}", "--json", "-"])
        assert len(server.received) == 9          # flow 1's three calls only
    assert every.exit_code == 0 and one.exit_code == 0, every.output + one.output
    data = json.loads(every.stdout)
    assert data["ok"] == 6 and data["not_sent"] == 0 and data["problems"] == []
    data = json.loads(one.stdout)
    assert data["ok"] == 3 and data["not_sent_reasons"] == {"unknown_method": 3} and data["invariant_ok"]
    # --method-map does not change the file: a plain replay still sends nothing
    from capture.recording import Recording
    with Recording(tmp_path / "j.rec") as rec:
        assert [g.method for g in rec.method_groups()] == [None, None]


def test_the_files_method_map_is_replayed_and_bad_maps_are_usage_errors(tmp_path: Path) -> None:
    from capture.recording import set_group_methods
    from replay.testing import DECIDE

    fids = _write_unknown_methods(tmp_path / "j.rec")
    set_group_methods(tmp_path / "j.rec", [(f, "hpack:5,4", DECIDE, "--method-map") for f in fids])
    with EchoServer() as server:
        res = CliRunner().invoke(cli, ["replay", str(tmp_path / "j.rec"), "--target", server.address, "--json", "-"])
        assert len(server.received) == 6
        for bad in ("hpack:5,4", "hpack:5,4=Decide", "5,4=/a.B/C", "hpack:5,4=/a b"):
            refused = CliRunner().invoke(cli, ["replay", str(tmp_path / "j.rec"), "--target", server.address,
                                               "--method-map", bad])
            assert refused.exit_code == 2 and "--method-map" in refused.output, (bad, refused.output)
        assert len(server.received) == 6
    assert res.exit_code == 0 and json.loads(res.stdout)["ok"] == 6


def test_parse_method_map() -> None:
    import pytest

    from replay.method_map import MethodMapError
    from replay.plan import parse_method_map

    assert parse_method_map(["3:hpack:5,4,3=/p.S/M", "hpack:1=/p.S/N", "hpack@2:7=/a?b=c"]) == {
        (3, "hpack:5,4,3"): "/p.S/M", (None, "hpack:1"): "/p.S/N", (None, "hpack@2:7"): "/a?b=c"}
    assert parse_method_map(["hpack:1=/p.S/N", "hpack:1=/p.S/N"]) == {(None, "hpack:1"): "/p.S/N"}
    for bad, why in (("hpack:1", "no '='"), ("x:1=/p.S/M", "not a group ref"), ("hpack:1=p.S/M", "a path"),
                     ("1:hpack:=/p.S/M", "not a group ref")):
        with pytest.raises(MethodMapError, match=why):
            parse_method_map([bad])
    with pytest.raises(ValueError, match="two methods"):
        parse_method_map(["1:hpack:1=/p.S/M", "1:hpack:1=/p.S/N"])
