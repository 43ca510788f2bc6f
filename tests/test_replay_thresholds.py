"""`shadowtest replay` thresholds and exit codes (k6-style): each threshold passes at its exact value and
fails just under it with its numbers, the default fails a run in which nothing succeeded, the first
error's reason is shown, and a fixed-choice option refuses a typo (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from harness.cli import cli
from replay.report import ReplayReport, Thresholds, error_reason, judge
from replay.stats import EXAMPLE_CHARS, EXAMPLE_KINDS, CallResult, RunStats
from replay.testing import DECIDE, SERVICE, EchoServer, decision_bytes, snapshot_bytes, write_unary_recording

MS = 1_000_000
CLOSED = "127.0.0.1:1"  # nothing listens on port 1: the connection is refused at once
NOPE = f"/{SERVICE}/Nope"  # not served by the EchoServer: UNIMPLEMENTED


def _replay(rec: Path, target: str, *extra: str) -> tuple[Result, dict[str, Any]]:
    res = CliRunner().invoke(cli, ["replay", str(rec), "--target", target, "--speed", "4", *extra, "--json", "-"])
    return res, (json.loads(res.stdout) if res.stdout.startswith("{") else {})


def _mixed(path: Path) -> Path:
    """20 calls 1 ms apart: 4 of unknown method (never sent), 4 to a method the server lacks
    (UNIMPLEMENTED: errors), 12 Decide (with EchoServer(reject_every=3): 4 rejected, 8 ok)."""
    from capture.recording import Call, Flow, Message, RecordingWriter

    with RecordingWriter(path, meta={"host": "test"}) as w:
        named = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 50051), protocol="grpc"))
        joined = w.add_flow(Flow(("127.0.0.1", 40001), ("127.0.0.1", 50051), joined_midstream=True, protocol="grpc"))
        for i in range(20):
            ts = 10_000_000_000 + i * MS
            unknown = i % 5 == 4
            w.add_call(Call(protocol="grpc", method=None if unknown else (NOPE if i % 5 == 3 else DECIDE),
                            request_ts_ns=ts, flow_id=joined if unknown else named, status=0,
                            method_unknown=unknown, method_ref="hpack:5,4" if unknown else None,
                            requests=[Message("c2s", 0, ts, snapshot_bytes(i))],
                            responses=[Message("s2c", 0, ts + MS, decision_bytes(i))]))
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _mixed(tmp_path_factory.mktemp("mixed") / "m.rec")


# name, flag, the exact actual value for _mixed against EchoServer(reject_every=3), a limit just under it
EXACT = [("max_error_pct", "--max-error-pct", 25.0, "24.99"),        # 4 UNIMPLEMENTED of 16 sent
         ("max_rejected_pct", "--max-rejected-pct", 25.0, "24.99"),  # 4 rejected of 16 sent
         ("max_not_sent_pct", "--max-not-sent-pct", 20.0, "19.99"),  # 4 unknown_method of 20 scheduled
         ("min_ok", "--min-ok", 8, "9")]                             # 8 ok (at least: just above)


@pytest.mark.parametrize(("name", "flag", "actual", "under"), EXACT, ids=[e[0] for e in EXACT])
def test_each_count_threshold_passes_at_its_value_and_fails_past_it(mixed: Path, name: str, flag: str,
                                                                    actual: float, under: str) -> None:
    with EchoServer(reject_every=3) as server:
        ok_res, ok = _replay(mixed, server.address, flag, f"{actual:g}")
        bad_res, bad = _replay(mixed, server.address, flag, under)
    assert ok_res.exit_code == 0, ok_res.output
    assert (ok["scheduled"], ok["sent"], ok["ok"], ok["rejected"], ok["errors"], ok["not_sent_reasons"]) == \
        (20, 16, 8, 4, {"UNIMPLEMENTED": 4}, {"unknown_method": 4})
    [mine] = [t for t in ok["thresholds"] if t["name"] == name]
    assert (mine["actual"], mine["limit"], mine["passed"]) == (actual, float(f"{actual:g}"), True)
    assert ok["passed"] and ok["failures"] == []
    assert bad_res.exit_code == 99, bad_res.output
    [mine] = [t for t in bad["thresholds"] if t["name"] == name]
    assert (mine["actual"], mine["limit"], mine["passed"]) == (actual, float(under), False)
    assert not bad["passed"] and len(bad["failures"]) == 1
    expected = {"max_error_pct": "threshold max_error_pct failed: 25 % > 24.99 % "
                                 "(4 errors + 0 timeouts of 16 sent)",
                "max_rejected_pct": "threshold max_rejected_pct failed: 25 % > 24.99 % (4 rejected of 16 sent)",
                "max_not_sent_pct": "threshold max_not_sent_pct failed: 20 % > 19.99 % "
                                    "(4 not sent of 20 scheduled: unknown_method 4)",
                "min_ok": "too few calls succeeded (min_ok 9): 8 ok of 20 scheduled; 4 calls UNIMPLEMENTED: "
                          "first: Method not found!; 4 rejected; not sent: unknown_method 4"}[name]
    assert bad["failures"] == [expected]
    assert f"replay FAILED: {expected}" in bad_res.stderr   # --json -: the reason goes to stderr


def test_rejections_are_not_errors(mixed: Path) -> None:
    with EchoServer(reject_every=1) as server:   # every Decide rejected: the service protecting itself
        res, data = _replay(mixed, server.address, "--max-error-pct", "25", "--min-ok", "0")
    assert res.exit_code == 0, res.output
    assert (data["rejected"], data["ok"], data["thresholds"][0]["actual"]) == (12, 0, 25.0)


def test_latency_and_lag_thresholds_fail_with_their_numbers(tmp_path: Path) -> None:
    rec = tmp_path / "r.rec"
    write_unary_recording(rec, [0] * 100 + [i * MS for i in range(1, 11)])  # a burst: the later sends lag
    with EchoServer(delay_s=0.03) as server:
        passed, ok = _replay(rec, server.address, "--max-p99-ms", "10000", "--max-lag-p99-us", "10000000")
        failed, bad = _replay(rec, server.address, "--max-p99-ms", "29", "--max-lag-p99-us", "1")
    assert passed.exit_code == 0, passed.output
    assert [(t["name"], t["passed"]) for t in ok["thresholds"]] == \
        [("max_p99_ms", True), ("max_lag_p99_us", True), ("min_ok", True)]
    assert failed.exit_code == 99, failed.output
    p99, lag = bad["latency_ms"]["p99"], bad["lag_us"]["p99"]
    assert p99 >= 30 and lag > 1   # the server sleeps 30 ms per call; 100 calls due at once
    assert [(t["name"], t["actual"], t["passed"]) for t in bad["thresholds"]] == \
        [("max_p99_ms", p99, False), ("max_lag_p99_us", lag, False), ("min_ok", 110, True)]
    assert bad["failures"] == [
        f"threshold max_p99_ms failed: {_num(p99)} ms > 29 ms (latency from the intended send time, 110 calls sent)",
        f"threshold max_lag_p99_us failed: {_num(lag)} us > 1 us (the replayer's send lag, 110 calls sent)"]
    assert "threshold: FAILED max_p99_ms" not in failed.stdout   # --json -: stdout is the JSON alone


def _num(x: float) -> str:
    return f"{x:,.4f}".rstrip("0").rstrip(".")


def test_timeouts_count_as_errors(tmp_path: Path) -> None:
    rec = tmp_path / "r.rec"
    write_unary_recording(rec, [i * MS for i in range(5)])
    with EchoServer(delay_s=1.0) as server:
        res, data = _replay(rec, server.address, "--timeout", "0.1", "--max-error-pct", "99.9")
    assert res.exit_code == 99
    assert data["timeouts"] == 5 and data["ok"] == 0
    assert data["failures"][0] == "threshold max_error_pct failed: 100 % > 99.9 % (0 errors + 5 timeouts of 5 sent)"
    assert data["failures"][1] == "no call succeeded: 0 ok of 5 scheduled; 5 timeouts"


@pytest.mark.parametrize("sender", ["auto", "grpc"])
def test_a_closed_port_fails_with_the_reason(tmp_path: Path, sender: str) -> None:
    rec = tmp_path / "r.rec"
    write_unary_recording(rec, [i * MS for i in range(20)])
    res = CliRunner().invoke(cli, ["replay", str(rec), "--target", CLOSED, "--sender", sender,
                                   "--json", str(tmp_path / "out.json"), "--max-error-pct", "5"])
    assert res.exit_code == 1, res.output      # the service was never reached: not a measurement of it (99)
    first = "20 calls UNAVAILABLE: first: connection refused by 127.0.0.1:1"
    assert f"error: {first}" in res.stdout
    assert "threshold: FAILED max_error_pct: 100 % (limit <= 5 %): 20 errors + 0 timeouts of 20 sent" in res.stdout
    assert "verdict: FAILED: threshold max_error_pct failed: 100 % > 5 %" in res.stdout
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["error_reasons"] == {"UNAVAILABLE": "connection refused by 127.0.0.1:1"}
    assert data["thresholds"] == [
        {"name": "max_error_pct", "limit": 5.0, "actual": 100.0, "passed": False, "unit": "%",
         "detail": "20 errors + 0 timeouts of 20 sent"},
        {"name": "min_ok", "limit": 1, "actual": 0, "passed": False, "unit": "calls", "detail": "0 ok of 20 scheduled"}]
    assert data["failures"][1] == f"no call succeeded: 0 ok of 20 scheduled; {first}"
    assert data["passed"] is False and data["invariant_ok"] is True


def test_no_flag_fails_when_nothing_succeeded_also_with_workers(tmp_path: Path) -> None:
    rec = tmp_path / "r.rec"
    write_unary_recording(rec, [i * MS for i in range(12)], flows=4)
    res, data = _replay(rec, CLOSED, "--workers", "2")
    assert res.exit_code == 1, res.output
    assert data["failures"] == ["no call succeeded: 0 ok of 12 scheduled; 12 calls UNAVAILABLE: first: "
                                "connection refused by 127.0.0.1:1"]
    assert "replay FAILED: no call succeeded" in res.stderr
    off, data = _replay(rec, CLOSED, "--min-ok", "0")   # turned off: the run itself was sound
    assert off.exit_code == 0 and data["thresholds"] == [] and data["passed"]


def test_an_all_ok_run_exits_0_with_every_threshold_passed(tmp_path: Path) -> None:
    rec = tmp_path / "r.rec"
    n = write_unary_recording(rec, [i * MS for i in range(20)], flows=2)
    with EchoServer() as server:
        res = CliRunner().invoke(cli, ["replay", str(rec), "--target", server.address, "--max-error-pct", "0",
                                       "--max-rejected-pct", "0", "--max-not-sent-pct", "0",
                                       "--max-p99-ms", "60000", "--max-lag-p99-us", "60000000"])
    assert res.exit_code == 0, res.output
    assert f"ok: {n}" in res.stdout and "verdict: passed" in res.stdout
    assert res.stdout.count("threshold: passed ") == 6 and "FAILED" not in res.stdout


def test_fixed_choices_and_ranges_are_usage_errors(tmp_path: Path) -> None:
    rec = tmp_path / "r.rec"
    write_unary_recording(rec, [0])
    runner = CliRunner()
    typo = runner.invoke(cli, ["replay", str(rec), "--target", CLOSED, "--sender", "h3"])
    assert typo.exit_code == 2 and "'h3' is not one of 'auto', 'h2', 'grpc', 'http1', 'tcp'" in typo.output
    for bad in (["--max-error-pct", "150"], ["--max-not-sent-pct", "-1"], ["--max-p99-ms", "-5"],
                ["--min-ok", "-1"], ["--event-loop", "trio"]):
        res = runner.invoke(cli, ["replay", str(rec), "--target", CLOSED, *bad])
        assert res.exit_code == 2 and bad[0] in res.output, (bad, res.output)


# ---- pure parts ------------------------------------------------------------------------------

def _report(**kw: Any) -> ReplayReport:
    base: dict[str, Any] = dict(scheduled=10, sent=10, ok=10, rejected=0, errors={}, timeouts=0, not_sent=0,
                                not_sent_reasons={}, duration_s=1.0, achieved_rate=10.0,
                                latency_ms={"p50": 1.0, "p95": 2.0, "p99": 12.5, "max": 13.0},
                                latency_from_send_ms={"p50": 1.0, "p95": 2.0, "p99": 3.0, "max": 4.0},
                                lag_us={"p50": 50.0, "p99": 250.0, "max": 300.0}, drift_pct=0.0, end_lag_us=0.0,
                                mismatches={}, invariant_ok=True)
    return ReplayReport(**{**base, **kw})


def test_judge_compares_p99_and_lag_exactly() -> None:
    at = judge(_report(), Thresholds(max_p99_ms=12.5, max_lag_p99_us=250))
    assert at.passed and [t["passed"] for t in at.thresholds] == [True, True, True]
    over = judge(_report(), Thresholds(max_p99_ms=12.4, max_lag_p99_us=249.9))
    assert over.failures == [
        "threshold max_p99_ms failed: 12.5 ms > 12.4 ms (latency from the intended send time, 10 calls sent)",
        "threshold max_lag_p99_us failed: 250 us > 249.9 us (the replayer's send lag, 10 calls sent)"]


def test_judge_keeps_the_invariant_and_judges_nothing_scheduled_as_nothing() -> None:
    assert _report().passed is None   # not judged yet
    broken = judge(_report(ok=9, invariant_ok=False), Thresholds())
    assert not broken.passed and broken.failures[0].startswith("invariant broken: 10 calls scheduled but 9 accounted")
    died = judge(_report(invariant_ok=False, problems=["worker 1 died (exit -9); its calls are missing"]), Thresholds())
    assert died.failures == ["invariant broken: worker 1 died (exit -9); its calls are missing"]
    empty = judge(_report(scheduled=0, sent=0, ok=0), Thresholds(max_error_pct=0, max_not_sent_pct=0))
    assert empty.passed and [t["actual"] for t in empty.thresholds] == [0.0, 0.0]   # no min_ok: nothing to judge


def test_error_reasons_for_each_sender() -> None:
    t = "127.0.0.1:1"
    refused = {("UNAVAILABLE", "cannot connect: [Errno 111] Connect call failed ('127.0.0.1', 1)"),   # h2
               ("UNAVAILABLE", "cannot connect: [Errno 111] Connection refused"),                     # h2 on uvloop
               ("UNAVAILABLE", "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
                               "Failed to connect to remote host: Connection refused"),               # grpcio
               ("CONNECTION", "[Errno 111] Connect call failed ('127.0.0.1', 1)"),                    # http1
               ("CONNECTION_REFUSED", "[Errno 111] Connect call failed ('127.0.0.1', 1)")}            # tcp
    assert {error_reason(code, d, t) for code, d in refused} == {"connection refused by 127.0.0.1:1"}
    assert error_reason("UNAVAILABLE", "cannot connect: [Errno 113] Connect call failed ('10.0.0.9', 1)", t) == \
        "cannot connect to 127.0.0.1:1: no route to host"
    # the server's own message is kept as it is, even when it speaks of a refused connection
    assert error_reason("UNAVAILABLE", "upstream: connection refused", t) == "upstream: connection refused"
    assert error_reason("UNAVAILABLE", "connection lost: [Errno 104]\nConnection reset by peer", t) == \
        "connection lost: [Errno 104] Connection reset by peer"


def test_error_examples_are_bounded_and_survive_merge_and_the_wire() -> None:
    a, b = RunStats(), RunStats()
    for i in range(EXAMPLE_KINDS + 5):
        a.add(CallResult(i, DECIDE, "c", 1, 0, 1, 2, "error", f"E{i}", detail="x" * 1000))
    a.add(CallResult(99, DECIDE, "c", 1, 0, 1, 2, "error", "E0", detail="a later one"))
    b.add(CallResult(0, DECIDE, "c", 1, 0, 1, 2, "connection_error", "UNAVAILABLE", detail="b's reason"))
    assert len(a.error_examples) == EXAMPLE_KINDS and a.error_examples["E0"] == "x" * EXAMPLE_CHARS
    back = RunStats.from_wire(b.to_wire())
    back.merge(RunStats.from_wire(a.to_wire()))
    assert back.error_examples["UNAVAILABLE"] == "b's reason" and len(back.error_examples) == EXAMPLE_KINDS
    assert back.errors["E0"] == 2
