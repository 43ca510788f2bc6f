"""Redaction at record time (calls and raw chunks) and afterwards with `shadowtest redact`."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from capture.decode import FlowDecoder
from capture.errors import CaptureError
from capture.record import build_redactor
from capture.recording import Flow, Recording, RecordingWriter
from capture.sink import FlowSink
from capture.testing import GrpcCall, h2_conversation
from harness.cli import cli

M = "/shadowtest.agent.v1.TradingAgent/Decide"
SECRET_META = [("authorization", "Bearer s3cret-token-value"), ("x-api-key", "k-123456"),
               ("cookie", "session=abcdef"), ("x-session-token", "tok-999"), ("x-trace", "keep-me")]


def _record(path: Path, parts: list[tuple[str, bytes]], rules: list[str], default: bool = True) -> None:
    with RecordingWriter(path) as w:
        sink = FlowSink(w, build_redactor(default, rules))
        sink.open_flow("k", Flow(src=("127.0.0.1", 40000), dst=("127.0.0.1", 50051)))
        for i, (d, data) in enumerate(parts):
            sink.data("k", d, 1000 + i, data)  # type: ignore[arg-type]
        sink.close_flow("k", 99999)
        sink.close()


def _redecode(rec: Recording) -> list:
    dec = FlowDecoder(1)
    calls = []
    for c in rec.chunks():
        calls += dec.feed(c.direction, c.ts_ns, c.data)
    return calls + dec.finish()


def test_default_rules_mask_credentials_in_calls_and_raw_http2_chunks(tmp_path: Path) -> None:
    parts = h2_conversation([GrpcCall(M, [b"a"], [b"b"], metadata=SECRET_META), GrpcCall(M, [b"c"], [b"d"],
                                                                                           metadata=SECRET_META)])
    path = tmp_path / "r.rec"
    _record(path, parts, [])
    with Recording(path) as rec:
        calls = list(rec.calls())
        meta = dict(calls[0].request_metadata)
        assert {meta[k] for k in ("authorization", "x-api-key", "cookie", "x-session-token")} == {"<redacted>"}
        assert meta["x-trace"] == "keep-me"
        assert rec.meta["redaction_rules"] == ["default:credential-headers"]
        # raw chunks: same lengths, still valid HTTP/2, and the secrets are gone from them too
        assert [len(c.data) for c in rec.chunks()] == [len(d) for _, d in parts]
        again = _redecode(rec)
    assert [c.method for c in again] == [M, M] and [c.requests[0].data for c in again] == [b"a", b"c"]
    for call in again:
        m = dict(call.request_metadata)
        assert set(m["authorization"]) == {"*"}   # Huffman-coded before: as many stars as bytes
        assert m["x-trace"] == "keep-me"


def test_no_default_redaction_keeps_credentials(tmp_path: Path) -> None:
    path = tmp_path / "r.rec"
    _record(path, h2_conversation([GrpcCall(M, [b"a"], [b"b"], metadata=SECRET_META)]), [], default=False)
    with Recording(path) as rec:
        assert dict(next(rec.calls()).request_metadata)["authorization"] == "Bearer s3cret-token-value"


def test_user_rules_on_http1_headers_json_fields_and_body_regex(tmp_path: Path) -> None:
    body = json.dumps({"user": {"ssn": "123-45-6789", "name": "ann"}, "card": "4111111111111111"}).encode()
    req = (b"POST /pay HTTP/1.1\r\nHost: x\r\nX-Session: abc\r\nAuthorization: Basic Zm9v\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body
    resp = b"HTTP/1.1 200 OK\r\nSet-Cookie: id=42\r\nContent-Length: 2\r\n\r\nok"
    path = tmp_path / "h1.rec"
    _record(path, [("c2s", req), ("s2c", resp)], ["header:x-session", "json-field:user.ssn", r"body-regex:\d{16}"])
    with Recording(path) as rec:
        call = next(rec.calls())
        raw = b"".join(c.data for c in rec.chunks())
    doc = json.loads(call.requests[0].data)
    assert doc["user"] == {"ssn": "<redacted>", "name": "ann"}
    assert dict(call.request_metadata)["x-session"] == "<redacted>"
    assert dict(call.response_metadata)["set-cookie"] == "<redacted>"
    for secret in (b"abc\r\n", b"Zm9v", b"id=42", b"4111111111111111"):
        assert secret not in raw
    assert len(raw) == len(req) + len(resp)


def test_redact_command_applies_rules_later_and_records_them(tmp_path: Path) -> None:
    src, dst = tmp_path / "r.rec", tmp_path / "safe.rec"
    _record(src, h2_conversation([GrpcCall(M, [b"a"], [b"b"], metadata=SECRET_META)]), [], default=False)
    res = CliRunner().invoke(cli, ["redact", str(src), "-o", str(dst), "--rule", "header:x-trace", "--defaults",
                                   "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["calls_changed"] == 1
    assert stat.S_IMODE(dst.stat().st_mode) == 0o600
    with Recording(dst) as rec:
        meta = dict(next(rec.calls()).request_metadata)
        assert meta["x-trace"] == meta["authorization"] == "<redacted>"
        assert rec.meta["redaction_rules"] == ["default:credential-headers", "header:x-trace"]
        assert set(dict(_redecode(rec)[0].request_metadata)["x-trace"]) == {"*"}


def test_redact_in_place_and_usage_errors(tmp_path: Path) -> None:
    src = tmp_path / "r.rec"
    _record(src, h2_conversation([GrpcCall(M, [b"a"], [b"b"], metadata=SECRET_META)]), [], default=False)
    runner = CliRunner()
    assert runner.invoke(cli, ["redact", str(src), "--in-place", "--defaults"]).exit_code == 0
    with Recording(src) as rec:
        assert dict(next(rec.calls()).request_metadata)["cookie"] == "<redacted>"
    assert runner.invoke(cli, ["redact", str(src), "--in-place"]).exit_code == 2          # no rules
    bad = runner.invoke(cli, ["redact", str(src), "--in-place", "--rule", "nonsense"])
    assert bad.exit_code == 1 and "KIND:ARG" in bad.output


def test_bad_rule_specs_say_what_is_accepted() -> None:
    with pytest.raises(CaptureError, match="header, body-regex or json-field"):
        build_redactor(True, ["cookie:x"])
    with pytest.raises(CaptureError, match="bad regex"):
        build_redactor(True, ["body-regex:(unclosed"])
