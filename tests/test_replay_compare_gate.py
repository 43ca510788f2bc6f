"""`replay --compare` is a gate: a response that differs from the recording fails the run, says which
call and where, unless --max-mismatch-pct allows it. The comparer follows the recording's protocol:
HTTP/1 bodies as JSON (by path) or bytes, gRPC by descriptors from reflection; an HTTP/1 target never
gets an HTTP/2 preface. --json is written on every exit, an error's too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from http_target import H2_PREFACE, JsonTarget, write_orders  # tests/ is on sys.path under pytest

from capture.recording import Call, Flow, Message, RecordingWriter
from harness.cli import cli
from replay.compare import first_difference, json_diff
from replay.testing import DECIDE, EchoServer, write_unary_recording

CALLS = 12
MS = 1_000_000


def _cheaper_every_third(n: int, doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "price": 11} if n % 3 == 0 else doc          # calls 0, 3, 6, 9 differ in one field


def _replay(path: Path, target: str, *extra: str) -> tuple[Result, dict[str, Any]]:
    out = path.with_name("report.json")
    out.unlink(missing_ok=True)
    res = CliRunner().invoke(cli, ["replay", str(path), "--target", target, "--speed", "20", "--compare",
                                   "--json", str(out), *extra])
    return res, json.loads(out.read_text())


@pytest.fixture
def orders(tmp_path: Path) -> Path:
    write_orders(tmp_path / "h.rec", CALLS)
    return tmp_path / "h.rec"


def test_an_http1_recording_compares_without_flags_and_sends_no_http2_preface(orders: Path) -> None:
    with JsonTarget() as target:
        res, report = _replay(orders, target.address)
    assert res.exit_code == 0, res.output
    assert report["passed"] and report["mismatches"]["compared"] == CALLS and report["mismatches"]["total"] == 0
    assert report["thresholds"][-1]["name"] == "max_mismatch_pct"
    # every connection the target accepted began with an HTTP/1 request line: no reflection probe
    assert target.first_bytes and all(b.startswith(b"POST ") for b in target.first_bytes), target.first_bytes
    assert not any(b.startswith(H2_PREFACE[:3]) for b in target.first_bytes)


def test_one_changed_field_fails_the_run_and_says_which_calls_and_where(orders: Path) -> None:
    with JsonTarget(change=_cheaper_every_third) as target:
        res, report = _replay(orders, target.address)
    assert res.exit_code == 99 and report["passed"] is False, res.output
    mism = report["mismatches"]
    assert (mism["total"], mism["compared"]) == (4, CALLS)
    assert [(c["index"], c["flow"], c["method"], c["diffs"]) for c in mism["calls"]] == [
        (n, 1, f"POST /orders/{n}", ["$.price: 10 != 11"]) for n in (0, 3, 6, 9)]
    assert mism["by_method"]["POST /orders/3"]["fields"] == {"$.price": 1}
    verdict = next(line for line in res.stdout.splitlines() if line.startswith("verdict:"))
    assert "max_mismatch_pct" in verdict and "4 of 12 compared calls differ" in verdict
    assert "call 3 (flow 1, POST /orders/3): $.price: 10 != 11" in verdict
    assert "mismatch: call 0 (flow 1, POST /orders/0): $.price: 10 != 11" in res.stdout
    assert not any(b.startswith(H2_PREFACE[:3]) for b in target.first_bytes)


def test_max_mismatch_pct_allows_a_share_exactly(orders: Path) -> None:
    with JsonTarget(change=_cheaper_every_third) as target:
        at_limit, report = _replay(orders, target.address, "--max-mismatch-pct", "33.3333")   # 4 of 12
        assert at_limit.exit_code == 0 and report["passed"], at_limit.output
        below, report = _replay(orders, target.address, "--max-mismatch-pct", "33.33")
    assert below.exit_code == 99 and "max_mismatch_pct failed: 33.3333 % > 33.33 %" in " ".join(report["failures"])


def test_ignore_field_applies_to_json_paths(orders: Path) -> None:
    with JsonTarget(change=lambda n, doc: {**doc, "price": n, "items": [{"sku": "other", "qty": 1}]}) as target:
        res, report = _replay(orders, target.address, "--ignore-field", "price", "--ignore-field", "items.sku")
        assert res.exit_code == 0 and report["mismatches"]["total"] == 0, res.output
        res, report = _replay(orders, target.address, "--ignore-field", "price")
    assert res.exit_code == 99
    assert report["mismatches"]["calls"][0]["diffs"] == ['$.items[0].sku: "sku-0" != "other"']


def test_a_body_that_is_not_json_is_compared_byte_wise(tmp_path: Path) -> None:
    path = tmp_path / "t.rec"
    with RecordingWriter(path) as w:
        fid = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 8080), protocol="http1"))
        ts = 10_000_000_000
        w.add_call(Call(protocol="http1", method="POST /orders/5", request_ts_ns=ts, flow_id=fid, kind="request",
                        status=200, requests=[Message("c2s", 0, ts, b"{}")],
                        responses=[Message("s2c", 0, ts + 1000, b'{"id": 5, but not JSON}')]))
    with JsonTarget() as target:
        res, report = _replay(path, target.address)
    assert res.exit_code == 99
    (diff,) = report["mismatches"]["calls"][0]["diffs"]
    assert diff.startswith("body: differs at byte 10 (recorded 23 bytes, replayed "), diff


def test_a_grpc_server_changing_a_field_fails_by_protobuf_field(tmp_path: Path) -> None:
    """The echo server answers a random server_latency_ns: one field differs on every call."""
    n = write_unary_recording(tmp_path / "g.rec", [i * 2 * MS for i in range(10)])
    with EchoServer(reflection=True) as server:
        res, report = _replay(tmp_path / "g.rec", server.address)
        assert res.exit_code == 99 and report["mismatches"]["total"] == n, res.output
        assert report["mismatches"]["by_method"][DECIDE]["fields"] == {"server_latency_ns": n}
        assert report["mismatches"]["calls"][0]["diffs"] == ["server_latency_ns"]
        assert "server_latency_ns" in " ".join(report["failures"])
        res, report = _replay(tmp_path / "g.rec", server.address, "--ignore-field", "server_latency_ns")
    assert res.exit_code == 0 and report["passed"], res.output


def test_json_is_written_on_error_exits(tmp_path: Path) -> None:
    write_unary_recording(tmp_path / "g.rec", [0, MS])
    with EchoServer() as server:      # no reflection: the comparison cannot start
        res, report = _replay(tmp_path / "g.rec", server.address)
    assert res.exit_code == 1 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert report["passed"] is False and report["exit_code"] == 1 and "reflection" in report["error"], report
    res, report = _replay(tmp_path / "g.rec", "192.0.2.1:50051")              # a refused target: usage
    assert res.exit_code == 2 and report["exit_code"] == 2 and "not loopback" in report["error"], report
    out = CliRunner().invoke(cli, ["replay", str(tmp_path / "missing.rec"), "--target", "127.0.0.1:1",
                                   "--json", "-"])
    assert out.exit_code == 1 and json.loads(out.stdout)["error"].endswith("no such recording")


def test_json_diff_and_first_difference() -> None:
    assert json_diff({"a": 1, "b": [1, 2], "c": {"d": True}}, {"a": 1.5, "b": [1], "c": {"d": 1}, "e": None}) == [
        "$.a: 1 != 1.5", "$.b[len]: 2 != 1", "$.c.d: true != 1", "$.e: not in the recording"]
    assert json_diff({"x y": 1}, {}) == ['$["x y"]: missing in the replay']
    big = bytes(100_000)
    assert first_difference(big, big[:-1] + b"\x01") == 99_999
    assert first_difference(b"abc", b"abcd") == 3 and first_difference(b"", b"x") == 0


def test_plain_http2_calls_are_compared_as_bodies_without_asking_for_reflection() -> None:
    """A recording of plain HTTP/2 calls: no reflection (the closed port would fail it), bodies by JSON path."""
    from replay.compare import CompareSpec
    from replay.schedule import PlannedCall
    from replay.senders import SendOutcome

    comparer = CompareSpec("reflection").build("127.0.0.1:1", frozenset({"http2"}))
    assert comparer.descriptors is None
    planned = PlannedCall(index=4, due_ns=0, connection="f2", protocol="http2", method="POST /api/quote",
                          kind="request", messages=[], flow_id=2, expected_status=200,
                          expected_responses=[b'{"quote": {"price": 10}}'])
    assert comparer.compare(planned, SendOutcome("ok", "OK", 200, [b'{"quote": {"price": 12}}'])) == [
        "$.quote.price: 10 != 12"]
    assert comparer.compare(planned, SendOutcome("error", "HTTP_500", 500, [b"oops"])) == ["status: 200 != 500"]
    assert comparer.summary()["calls"][0] == {"index": 4, "call_id": None, "flow": 2, "connection": "f2",
                                              "method": "POST /api/quote", "protocol": "http2",
                                              "diffs": ["$.quote.price: 10 != 12"]}


def test_workers_merge_the_mismatched_calls_in_plan_order(orders: Path) -> None:
    with JsonTarget(change=_cheaper_every_third) as target:
        res, report = _replay(orders, target.address, "--workers", "2")
    assert res.exit_code == 99, res.output
    assert [c["index"] for c in report["mismatches"]["calls"]] == [0, 3, 6, 9]
    assert report["mismatches"]["total"] == 4 and report["mismatches"]["compared"] == CALLS
