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
        assert rec.meta["redaction_rules"] == ["default:credential-headers", "default:credential-fields"]
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
    assert doc["user"] == {"ssn": "***********", "name": "ann"}     # same length, as in the raw chunks
    assert dict(call.request_metadata)["x-session"] == "<redacted>"
    assert dict(call.response_metadata)["set-cookie"] == "<redacted>"
    for secret in (b"abc\r\n", b"Zm9v", b"id=42", b"4111111111111111", b"123-45-6789"):
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
        assert rec.meta["redaction_rules"] == ["default:credential-headers", "default:credential-fields",
                                               "header:x-trace"]
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


TOKEN = b"QWERTYUIOPASDFGHJKLZXCVBNM"


def _chunks(path: Path) -> bytes:
    with Recording(path) as rec:
        return b"".join(c.data for c in rec.chunks())


def test_http1_header_split_across_reads_and_request_line_split_after_the_path(tmp_path: Path) -> None:
    """The first read ends right after `GET /hello `, a header value is split over two reads, a name
    over two more: the call is still decoded, and no byte of the secrets reaches the chunks."""
    req = (b"GET /hello HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN + b"\r\nX-Api-Key: " + TOKEN[::-1]
           + b"\r\n\r\n")
    cut1 = req.index(b"HTTP/1.1")
    cut2 = req.index(TOKEN) + 5
    cut3 = req.index(b"Api-Key")
    parts = [("c2s", req[:cut1]), ("c2s", req[cut1:cut2]), ("c2s", req[cut2:cut3]), ("c2s", req[cut3:]),
             ("s2c", b"HTTP/1.1 200 OK\r\nSet-Cookie: sid="), ("s2c", TOKEN[:9]),
             ("s2c", TOKEN[9:] + b"\r\nContent-Length: 0\r\n\r\n")]
    _record(tmp_path / "h1.rec", parts, [])
    raw = _chunks(tmp_path / "h1.rec")
    assert len(raw) == sum(len(d) for _, d in parts)
    for secret in (TOKEN, TOKEN[::-1]):
        assert not any(secret[i:i + 6] in raw for i in range(len(secret) - 5)), raw
    with Recording(tmp_path / "h1.rec") as rec:
        [call] = list(rec.calls())
        assert [f.protocol for f in rec.flows()] == ["http1"]
    assert (call.method, call.status) == ("GET /hello", 200)
    meta = dict(call.request_metadata)
    assert meta["authorization"] == meta["x-api-key"] == "<redacted>" and meta["host"] == "x"
    assert dict(call.response_metadata)["set-cookie"] == "<redacted>"


def test_raw_tcp_credentials_by_pattern_across_chunk_boundaries(tmp_path: Path) -> None:
    stream = b"HELLO\nauth: Bearer " + TOKEN + b"\n{\"api_key\": \"" + TOKEN[::-1] + b"\"}\nuser=ann token=" + TOKEN[3:]
    parts = [("c2s", stream[i:i + 7]) for i in range(0, len(stream), 7)]
    _record(tmp_path / "tcp.rec", parts, [])
    raw = _chunks(tmp_path / "tcp.rec")
    assert len(raw) == len(stream) and b"user=ann" in raw and b"HELLO" in raw
    for secret in (TOKEN, TOKEN[::-1], TOKEN[3:]):
        assert not any(secret[i:i + 6] in raw for i in range(len(secret) - 5)), raw


def _old_style_recording(path: Path) -> None:
    """A file as an older version stored it: chunks masked per chunk (a split header value and a 20 KB
    metadata block over CONTINUATION in clear), calls already redacted."""
    big = [(f"x-meta-{i}", "v" * 100) for i in range(200)] + [("authorization", "Bearer " + TOKEN.decode())]
    h2 = h2_conversation([GrpcCall(M, [b"a"], [b"b"], metadata=big)])
    h1 = [("c2s", b"GET / HTTP/1.1\r\nCookie: s=" + TOKEN[:10]), ("c2s", TOKEN[10:] + b"\r\n\r\n"),
          ("s2c", b"HTTP/1.1 204 No Content\r\n\r\n")]
    with RecordingWriter(path, meta={"redaction_rules": ["default:credential-headers"]}) as w:
        for proto, parts in (("grpc", h2), ("http1", h1)):
            fid = w.add_flow(Flow(src=("127.0.0.1", 40000), dst=("127.0.0.1", 50051), protocol=proto))
            for i, (d, data) in enumerate(parts):
                w.add_chunk_data(fid, d, 1000 + i, data)  # type: ignore[arg-type]


def test_redact_and_export_clean_a_file_stored_with_split_secrets(tmp_path: Path) -> None:
    src = tmp_path / "old.rec"
    _old_style_recording(src)
    from hpack.huffman import HuffmanEncoder
    from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
    coded = bytes(HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(b"Bearer " + TOKEN))
    assert coded in _chunks(src) and TOKEN[10:] in _chunks(src)           # the damage being repaired
    res = CliRunner().invoke(cli, ["redact", str(src), "-o", str(tmp_path / "safe.rec"), "--rule", "header:x-none"])
    assert res.exit_code == 0, res.output
    safe = tmp_path / "safe.rec"
    raw = safe.read_bytes() + _chunks(safe)
    for form in (TOKEN, coded[6:]):
        assert not any(form[i:i + 6] in raw for i in range(len(form) - 5))
    with Recording(safe) as rec:
        assert rec.meta["redaction_rules"] == ["default:credential-headers", "header:x-none"]
        again = FlowDecoder(1)
        calls = [c for ch in rec.chunks(1) for c in again.feed(ch.direction, ch.ts_ns, ch.data)] + again.finish()
    meta = dict(calls[0].request_metadata)                                # still valid HTTP/2 that decodes
    assert set(meta["authorization"]) == {"*"} and meta["x-meta-199"] == "v" * 100
    from capture.pcap_export import export_file
    export_file(str(src), str(tmp_path / "old.pcapng"))                   # export applies the file's rules too
    pcap = (tmp_path / "old.pcapng").read_bytes()
    for form in (TOKEN, coded[6:]):
        assert not any(form[i:i + 6] in pcap for i in range(len(form) - 5))


# ---- credential fields (default:credential-fields, json-field) ------------------------------------------
def test_credential_field_names_mask_what_they_should_and_leave_the_rest() -> None:
    from capture.fields import is_credential_name

    for name in ("password", "Passwd", "pwd", "api_key", "apiKey", "X-Api-Key", "client_secret", "access_token",
                 "refresh_token", "id_token", "csrf_token", "x-amz-security-token", "X-Amz-Signature", "session_id",
                 "sid", "private_key", "aws_secret_access_key", "new_password", "password_confirmation",
                 "user[password]", "credentials"):
        assert is_credential_name(name), name
    for name in ("key", "sort_key", "pageToken", "next_page_token", "nextToken", "continuationToken",
                 "prompt_tokens", "user", "grant_type", "id", "monkey", "keyboard", "passenger_count"):
        assert not is_credential_name(name), name


def test_json_bodies_masked_at_any_depth_numbers_escapes_and_subtrees() -> None:
    from capture.fields import JSON, FieldPolicy, mask_body

    body = (b'{"a": [{"b": {"Password": "x\\"y\\\\z"}}], "pin": 1, "token": -12.5e3, "ok": true, '
            b'"session": {"id": "s1", "n": [7, "v"], "on": false}, "nextPageToken": "cur", "tokens": 5}')
    assert mask_body(body, JSON, FieldPolicy(names=True)) == (
        b'{"a": [{"b": {"Password": "*******"}}], "pin": 1, "token": *******, "ok": true, '
        b'"session": {"id": "**", "n": [*, "*"], "on": false}, "nextPageToken": "cur", "tokens": 5}')
    # json-field paths: exact key path, arrays transparent, the whole value below it
    assert mask_body(b'{"u": [{"ssn": "123"}, {"ssn": {"x": "9"}}], "ssn": "keep"}', JSON,
                     FieldPolicy(paths=frozenset({("u", "ssn")}))) == b'{"u": [{"ssn": "***"}, {"ssn": {"x": "*"}}], "ssn": "keep"}'
    assert mask_body(b'not json "password": "x"', JSON, FieldPolicy(names=True)) == b'not json "password": "x"'


def _h1(parts: list[tuple[str, bytes]], tmp_path: Path, rules: list[str] | None = None,
        default: bool = True) -> tuple[bytes, list]:
    path = tmp_path / "f.rec"
    _record(path, parts, rules or [], default)
    with Recording(path) as rec:
        return b"".join(c.data for c in rec.chunks()), list(rec.calls())


def test_grpc_and_compressed_bodies_are_never_scanned(tmp_path: Path) -> None:
    """A protobuf message whose bytes happen to read `"password": "x"`, and a gzip body labelled JSON,
    pass untouched: masking them would corrupt them (and gRPC costs nothing extra)."""
    proto = b'\x0a\x10{"password": "x"}'
    parts = h2_conversation([GrpcCall(M, [proto], [proto])])
    raw, calls = _h1(parts, tmp_path)
    assert raw.count(proto) == 2 and calls[0].requests[0].data == proto
    gz = b'\x1f\x8b{"password": "hunter22"}'
    req = b"POST /x HTTP/1.1\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(gz)
    raw, calls = _h1([("c2s", req + gz), ("s2c", b"HTTP/1.1 204 No Content\r\n\r\n")], tmp_path / "..")
    assert gz in raw and calls[0].requests[0].data == gz


def test_http2_huffman_path_is_coded_again_to_the_same_length(tmp_path: Path) -> None:
    """A Huffman-coded :path with a secret in its query: the masked block is valid HPACK that a strict
    decoder reads (the query value now '*'s, the rest as sent), of the same length, and the table
    entry it made still resolves for the next request that refers to it."""
    import hpack

    from wire.h2 import PREFACE, Flag, FrameType, frame

    enc = hpack.Encoder()
    path = "/v1/search?q=shoes&access_token=aB3dE5fG7hJ9kL1mN3pQ&page=2"
    c2s = PREFACE + frame(int(FrameType.SETTINGS), 0, 0, b"")
    for sid in (1, 3):          # the second request refers to the first one's table entry
        block = enc.encode([(":method", "GET"), (":scheme", "http"), (":path", path), (":authority", "a")],
                           huffman=True)
        c2s += frame(int(FrameType.HEADERS), int(Flag.END_HEADERS | Flag.END_STREAM), sid, block)
    s2c = b"".join(frame(int(FrameType.HEADERS), int(Flag.END_HEADERS | Flag.END_STREAM), sid, b"\x88")
                   for sid in (1, 3))
    parts = [("c2s", c2s[i:i + 5]) for i in range(0, len(c2s), 5)] + [("s2c", s2c)]
    raw, calls = _h1(parts, tmp_path)
    assert len(raw) == len(c2s) + len(s2c)
    stored = raw[:len(c2s)]
    dec = hpack.Decoder()
    pos, paths = len(PREFACE) + 9, []
    while pos < len(stored):
        n = int.from_bytes(stored[pos:pos + 3], "big")
        paths.append(dict(dec.decode(stored[pos + 9:pos + 9 + n]))[":path"])
        pos += 9 + n
    masked = paths[0]
    assert paths == [masked, masked] and len(masked) <= len(path)
    head, _, tail = masked.partition("access_token=")
    assert head == "/v1/search?q=shoes&" and tail.endswith("&page=2") and set(tail[:-7]) == {"*"}
    assert all(c.method == f"GET {path}".replace("aB3dE5fG7hJ9kL1mN3pQ", "*" * 20) for c in calls)


def test_json_field_rule_masks_the_chunks_too_and_redact_defaults_clean_an_old_file(tmp_path: Path) -> None:
    body = b'{"user": {"ssn": "123-45-6789"}, "password": "hunter2hunter2"}'
    req = (b"POST /p?api_key=QWERTYUIOPAS HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
           % len(body)) + body
    parts = [("c2s", req[i:i + 3]) for i in range(0, len(req), 3)] + [("s2c", b"HTTP/1.1 204 No Content\r\n\r\n")]
    raw, _ = _h1(parts, tmp_path, ["json-field:user.ssn"], default=False)
    assert b"123-45-6789" not in raw and b"hunter2hunter2" in raw and b"QWERTYUIOPAS" in raw
    src, dst = tmp_path / "f.rec", tmp_path / "clean.rec"
    res = CliRunner().invoke(cli, ["redact", str(src), "-o", str(dst), "--defaults"])
    assert res.exit_code == 0, res.output
    with Recording(dst) as rec:
        raw = b"".join(c.data for c in rec.chunks())
        [call] = list(rec.calls())
    for secret in (b"123-45-6789", b"hunter2hunter2", b"QWERTYUIOPAS"):
        assert secret not in raw and secret not in call.requests[0].data + call.method.encode()
    assert call.method == "POST /p?api_key=************" and len(raw) == len(req) + 27


def test_pcap_import_masks_credential_fields(tmp_path: Path) -> None:
    """A capture taken elsewhere (here: a recording kept in clear, exported) imports masked by default."""
    from capture.pcap_export import export_file
    from capture.pcap_import import import_capture

    body = b"grant_type=password&password=ZXCVBNMASDFG&user=ann"
    req = (b"POST /t?sid=QWERTYUIOPLK HTTP/1.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body
    rbody = b'{"id_token": "POIUYTREWQLKJ"}'
    resp = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(rbody) + rbody
    _record(tmp_path / "clear.rec", [("c2s", req[:40]), ("c2s", req[40:]), ("s2c", resp)], [], default=False)
    export_file(str(tmp_path / "clear.rec"), str(tmp_path / "clear.pcapng"))
    assert b"ZXCVBNMASDFG" in (tmp_path / "clear.pcapng").read_bytes()
    import_capture(str(tmp_path / "clear.pcapng"), str(tmp_path / "in.rec"))
    blob = (tmp_path / "in.rec").read_bytes()
    for secret in (b"ZXCVBNMASDFG", b"QWERTYUIOPLK", b"POIUYTREWQLKJ"):
        assert secret not in blob
    with Recording(tmp_path / "in.rec") as rec:
        [call] = list(rec.calls())
    assert call.method == "POST /t?sid=" + "*" * 12 and call.requests[0].data == body.replace(b"ZXCVBNMASDFG", b"*" * 12)
    assert call.responses[0].data == b'{"id_token": "*************"}'


def test_json_masks_match_a_parser_and_do_not_depend_on_where_the_reads_cut() -> None:
    """Random JSON (credential keys at random depth, subtrees, escapes in values and keys, unicode):
    masked whole, the text still parses, every value under a credential name is '*' and nothing else
    changed; masked in random pieces (one byte at a time included), the bytes are the same."""
    import random

    from capture.fields import JSON, FieldPolicy, JsonScanner, is_credential_name, mask_body, mask_spans

    rng = random.Random(5)
    names = ("password", "api_key", "apiKey", "Access-Token", "client_secret", "sid", "credentials", "session",
             "user", "name", "page_token", "items", "key_id", "monkey", "tokens", "x")

    def value(depth: int) -> object:
        roll = rng.random()
        if depth <= 0 or roll < 0.4:
            return rng.choice(("plain", 'q"uo\\te', "caf\u00e9 \u2603", "", "pass word", True, None, "key"))
        if roll < 0.6:
            return [value(depth - 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(names): value(depth - 1) for _ in range(rng.randint(0, 4))}

    def check(orig: object, masked: object, secret: bool) -> None:
        if isinstance(orig, dict):
            assert isinstance(masked, dict) and list(orig) == list(masked)
            for k in orig:
                check(orig[k], masked[k], secret or is_credential_name(k))
        elif isinstance(orig, list):
            assert isinstance(masked, list) and len(orig) == len(masked)
            for o, m in zip(orig, masked, strict=True):
                check(o, m, secret)
        elif secret and isinstance(orig, str):
            assert set(masked) <= {"*"}
        else:
            assert masked == orig

    policy = FieldPolicy(names=True)
    for _ in range(300):
        doc = {rng.choice(names): value(4) for _ in range(rng.randint(1, 5))}
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice((None, 2))).encode()
        if rng.random() < 0.2:                      # an escaped key: "p\u0061ssword"
            text = text.replace(b'"password"', b'"p\\u0061ssword"')
        whole = mask_body(text, JSON, policy)
        check(doc, json.loads(whole), False)
        scan, spans, pos = JsonScanner(policy), [], 0
        while pos < len(text):
            step = rng.choice((1, 1, 2, 7, 50))
            scan.feed(text, pos, min(pos + step, len(text)), spans)
            pos += step
        assert mask_spans(text, spans) == whole


def test_opaque_bodies_are_kept_byte_for_byte_and_the_heads_around_them_still_masked() -> None:
    """A binary download (application/octet-stream, a chunked upload, a gzip body) holds no header
    lines: the line masker does not read it, so the file comes out as it was, even where its bytes
    happen to read 'Authorization: ...'; the heads before and after it are masked as always, however
    the reads cut the stream."""
    import random

    from capture.decode.streammask import FlowMasker

    rng = random.Random(5)
    blob = rng.randbytes(3000) + b"\nAuthorization: Bearer looks-like-a-header\n" + rng.randbytes(3000)
    size = f"{len(blob):x}".encode()
    c2s = (b"PUT /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
           b"Content-Type: application/octet-stream\r\n\r\n" + size + b"\r\n" + blob + b"\r\n0\r\n\r\n"
           b"GET /next HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer req-Zk81hQ2v\r\n\r\n")
    s2c = (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: "
           + str(len(blob)).encode() + b"\r\n\r\n" + blob
           + b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Type: text/plain\r\nContent-Length: "
           + str(len(blob)).encode() + b"\r\n\r\n" + blob
           + b"HTTP/1.1 200 OK\r\nSet-Cookie: sid=resp-Qw73nB5x\r\nContent-Length: 0\r\n\r\n")
    for trial in range(40):
        masker = FlowMasker(build_redactor(True, []), joined=False)
        out = {"c2s": bytearray(), "s2c": bytearray()}
        for direction, stream in (("c2s", c2s), ("s2c", s2c)):
            pos = 0
            while pos < len(stream):
                n = 1 if trial % 8 == 0 else rng.randint(1, 5000)
                for d, _ts, chunk in masker.feed(direction, pos, stream[pos:pos + n], "http1"):  # type: ignore[arg-type]
                    out[d] += chunk
                pos += n
        for d, _ts, chunk in masker.flush():
            out[d] += chunk
        assert len(out["c2s"]) == len(c2s) and len(out["s2c"]) == len(s2c)
        assert bytes(out["c2s"]).count(blob) == 1 and bytes(out["s2c"]).count(blob) == 2, trial
        for secret in (b"req-Zk81hQ2v", b"resp-Qw73nB5x"):
            assert secret not in out["c2s"] + out["s2c"], (trial, secret)


def test_a_whole_message_in_one_read_is_scanned_when_any_credential_name_may_be_in_it() -> None:
    """The one-read fast path skips a body only when no credential name can be in it: an escaped JSON
    key (\\u0061) or a percent-encoded form name (%61) is still read, and still masked."""
    from capture.decode.streammask import FlowMasker

    def one_read(ctype: str, body: bytes) -> bytes:
        head = b"POST /login HTTP/1.1\r\nHost: x\r\n" + (b"Content-Type: %s\r\n" % ctype.encode() if ctype else b"")
        msg = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        masker = FlowMasker(build_redactor(True, []), joined=False)
        out = masker.feed("c2s", 1, msg, "http1") + masker.flush()
        return b"".join(chunk for _d, _ts, chunk in out)

    plain = b'{"user": "ann", "note": "no names to mask here"}'
    assert one_read("application/json", plain).endswith(plain)
    for ctype, body, secret in (
            ("application/json", b'{"user": "ann", "p\\u0061ssword": "Zq7Kx9Lw2"}', b"Zq7Kx9Lw2"),
            ("application/json", b'{"user": "ann", "password": "Zq7Kx9Lw2"}', b"Zq7Kx9Lw2"),
            ("application/x-www-form-urlencoded", b"user=ann&p%61ssword=Zq7Kx9Lw2", b"Zq7Kx9Lw2"),
            ("", b"user=ann&api_k%65y=Zq7Kx9Lw2", b"Zq7Kx9Lw2")):       # no type: sniffed as a form
        got = one_read(ctype, body)
        assert secret not in got and len(got) > len(body), (ctype, body, got)


def test_a_header_block_seen_before_is_masked_as_the_first_time_and_its_neighbours_read_afresh() -> None:
    """Header blocks are remembered by hash (a client repeats its headers): the same block later masks
    the same values; a block that differs only in its credential is read again; the line before the
    block (a text protocol's first line may be a header) and the lines after it are read every time."""
    from capture.decode.streammask import FlowMasker

    def masked(data: bytes, proto: str = "http1") -> bytes:
        masker = FlowMasker(build_redactor(True, []), joined=False)
        out = masker.feed("c2s", 1, data, proto) + masker.flush()
        return b"".join(chunk for _d, _ts, chunk in out)

    def request(path: bytes, token: bytes, after: bytes = b"") -> bytes:
        return (b"GET %s HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer %s\r\nAccept: */*\r\n\r\n%s"
                % (path, token, after))

    first = masked(request(b"/a", b"tok-AAAA1111"))
    assert b"tok-AAAA1111" not in first and b"Authorization: " + b"*" * 17 in first
    for _ in range(3):       # the same block behind another request line: masked from the memo alike
        again = masked(request(b"/a/much/longer/path?x=1", b"tok-AAAA1111"))
        assert b"tok-AAAA1111" not in again and again.count(b"*" * 17) == 1
    other = masked(request(b"/a", b"tok-BBBB2222"))               # same length, other token: read again
    assert b"tok-BBBB2222" not in other
    swapped = masked(b"GET /a HTTP/1.1\r\nAccept: */*\r\nHost: api\r\nAuthorization: Bearer tok-AAAA1111\r\n\r\n")
    assert b"tok-AAAA1111" not in swapped            # the same length, its lines in another order
    longer = masked(request(b"/a", b"tok-CCCC3333-and-more"))
    assert b"tok-CCCC3333-and-more" not in longer
    # what follows the block is read each time: a second message in the same read
    two = masked(request(b"/a", b"tok-AAAA1111", request(b"/b", b"tok-DDDD4444")))
    assert b"tok-AAAA1111" not in two and b"tok-DDDD4444" not in two
    # a raw-TCP text whose first line is itself a credential line, then a remembered block
    block = b"Host: api\r\nAccept: */*\r\n\r\n"
    masked(b"HELLO\r\n" + block, "tcp")
    tcp = masked(b"Proxy-Authorization: Digest k-EEEE5555\r\n" + block, "tcp")   # no raw-TCP pattern for it
    assert b"k-EEEE5555" not in tcp
    # an HTTP/1 head whose second read starts with a credential line
    masker = FlowMasker(build_redactor(True, []), joined=False)
    out = masker.feed("c2s", 1, b"GET /a HTTP/1.1\r\n", "http1")
    out += masker.feed("c2s", 2, b"Cookie: sid-FFFF6666\r\n" + block, "http1") + masker.flush()
    assert b"sid-FFFF6666" not in b"".join(chunk for _d, _ts, chunk in out)
