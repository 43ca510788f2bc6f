"""Secrets in query strings and bodies, end to end: recorded through a real server, replayed to another.

A real client talks HTTP/1.1 to a real `http.server` through the recorder's proxy backend (real socket
reads decide the chunks): an `?api_key=` query, a JSON body with a password at depth, a form body with
a client secret. The recording holds none of them, anywhere. Replayed to a second real server that
logs what it received: without options the target sees the recorded run of '*' in their place (never
the secret); with --set-query / --set-field it sees the shadow values, and nothing else changed.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from click.testing import CliRunner

from capture.backends import RecordOptions
from capture.record import Recorder
from capture.recording import Call, Flow, Message, RecordingWriter
from harness.cli import cli
from replay.schedule import ScheduleOptions, build_plan
from replay.shadow import ShadowError, ShadowValues

API_KEY = "K7fQ2mZ9xR4tW8yB3nV6"
PASSWORD = "p4ssW0rd-Hx9Lq2Zr"
CLIENT_SECRET = "cs-Yt5Ue8Io1Pa3Sd6F"
SECRETS = (API_KEY, PASSWORD, CLIENT_SECRET)
LOGIN = {"user": "ann", "account": {"method": "pw", "password": PASSWORD}, "remember": True}


class _Logged(BaseHTTPRequestHandler):
    """Answers 200 with a small JSON; logs (method, path, body) of every request."""

    protocol_version = "HTTP/1.1"
    log: list[tuple[str, str, bytes]]

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.log.append((self.command, self.path, body))
        reply = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def servers() -> Iterator[tuple[int, list[tuple[str, str, bytes]], int, list[tuple[str, str, bytes]]]]:
    """(production port, its log, shadow target port, its log)."""
    made = []
    for _ in range(2):
        handler = type("H", (_Logged,), {"log": []})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        made.append((srv, handler.log))
    yield made[0][0].server_address[1], made[0][1], made[1][0].server_address[1], made[1][1]
    for srv, _ in made:
        srv.shutdown()
        srv.server_close()


def _production_traffic(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for method, path, body, ctype in (
                ("GET", f"/items?page=2&api_key={API_KEY}&q=shoes", None, None),
                ("POST", "/login", json.dumps(LOGIN).encode(), "application/json"),
                ("POST", "/token", f"grant_type=client_credentials&client_secret={CLIENT_SECRET}".encode(),
                 "application/x-www-form-urlencoded")):
            conn.request(method, path, body=body, headers={"Content-Type": ctype} if ctype else {})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read() == b'{"ok": true}'
    finally:
        conn.close()


@pytest.fixture
def recording(tmp_path: Path, servers: tuple) -> Path:
    prod_port, prod_log, _, _ = servers
    out = tmp_path / "web.rec"
    with Recorder(RecordOptions(output=str(out), backend="proxy", port=prod_port)) as rec:
        _production_traffic(rec.backend.address[1])  # type: ignore[attr-defined]
    assert rec.result is not None and rec.result["calls"] == 3
    assert API_KEY in prod_log[0][1]                              # production got the real thing
    return out


def _no_secret_in(path: Path) -> None:
    for f in (path, Path(str(path) + "-wal")):
        if f.exists():
            blob = f.read_bytes()
            for secret in SECRETS:
                assert secret[:6].encode() not in blob, (f.name, secret)


def test_recording_holds_no_query_json_or_form_secret(recording: Path, tmp_path: Path) -> None:
    _no_secret_in(recording)
    res = CliRunner().invoke(cli, ["export", str(recording), "-o", str(tmp_path / "web.pcapng")])
    assert res.exit_code == 0, res.output
    pcap = (tmp_path / "web.pcapng").read_bytes()
    assert not any(s[:6].encode() in pcap for s in SECRETS)
    assert b"api_key=" + b"*" * len(API_KEY) in pcap                 # masked in place, same length


def test_replay_sends_the_placeholder_never_the_secret(recording: Path, servers: tuple) -> None:
    _, _, target, seen = servers
    res = CliRunner().invoke(cli, ["replay", str(recording), "--target", f"127.0.0.1:{target}"])
    assert res.exit_code == 0, res.output
    (_, items, _), (_, login_path, login), (_, _, form) = seen         # one connection: in recorded order
    assert parse_qs(urlsplit(items).query) == {"page": ["2"], "api_key": ["*" * len(API_KEY)], "q": ["shoes"]}
    assert json.loads(login)["account"]["password"] == "*" * len(PASSWORD)
    assert json.loads(login)["user"] == "ann" and login_path == "/login"
    assert parse_qs(form.decode()) == {"grant_type": ["client_credentials"], "client_secret": ["*" * len(CLIENT_SECRET)]}
    blob = repr(seen).encode()
    assert not any(s[:6].encode() in blob for s in SECRETS)


def test_set_query_and_set_field_give_shadow_values(recording: Path, servers: tuple) -> None:
    _, _, target, seen = servers
    res = CliRunner().invoke(cli, ["replay", str(recording), "--target", f"127.0.0.1:{target}",
                                   "--set-query", "api_key=shadow key&1", "--set-field", "account.password=shadow-\"pw\"",
                                   "--set-field", "client_secret=shadow-cs"])
    assert res.exit_code == 0, res.output
    (_, items, _), (_, _, login), (_, _, form) = seen
    assert parse_qs(urlsplit(items).query) == {"page": ["2"], "api_key": ["shadow key&1"], "q": ["shoes"]}
    assert json.loads(login) == {**LOGIN, "account": {"method": "pw", "password": 'shadow-"pw"'}}
    assert parse_qs(form.decode()) == {"grant_type": ["client_credentials"], "client_secret": ["shadow-cs"]}


@pytest.mark.parametrize("args", [["--set-query", "no-equals"], ["--set-query", "a&b=1"], ["--set-field", "a..b=1"],
                                  ["--set-field", "=x"], ["--set-field", "a=line\nbreak"]])
def test_bad_shadow_values_are_usage_errors(recording: Path, servers: tuple, args: list[str]) -> None:
    _, _, target, seen = servers
    res = CliRunner().invoke(cli, ["replay", str(recording), "--target", f"127.0.0.1:{target}", *args])
    assert res.exit_code == 2 and f"Error: {args[0]} " in res.output, res.output   # the option at fault, by name
    assert seen == []                                                  # nothing sent


def _call(method: str, body: bytes, ctype: str | None, protocol: str = "http1") -> Call:
    meta = [("content-type", ctype)] if ctype else []
    return Call(protocol=protocol, method=method, request_ts_ns=1, flow_id=1, kind="request", request_metadata=meta,
                requests=[Message("c2s", 0, 1, body)])


def _planned(calls: list[Call], shadow: ShadowValues) -> list[tuple[str | None, bytes]]:
    plan = build_plan(lambda: iter(calls), ScheduleOptions(shadow=shadow))
    return [(p.method, p.messages[0].data) for p in plan]


def test_shadow_values_where_recorded_only_and_never_in_grpc() -> None:
    shadow = ShadowValues.from_options(("api_key=S",), ("password=P", "pin=7", "items.token=T", "user[password]=F"))
    calls = [
        _call("GET /a?api_key=****&x=1&api_key=** HTTP", b"", None),
        _call("POST /b", b'{"password": "***", "pin": ****, "items": [{"token": ""}, {"token": "\\"x"}]}',
              "application/json"),
        _call("POST /c?x=1", b"user%5Bpassword%5D=***&password=&other=1", "application/x-www-form-urlencoded"),
        _call("POST /d", b'{"name": "no secret here"}', None),                  # sniffed JSON: nothing to set
        _call("/pkg.Svc/M?api_key=x", b'{"password": "***"}', "application/grpc", "grpc"),
    ]
    assert _planned(calls, shadow) == [
        ("GET /a?api_key=S&x=1&api_key=S HTTP", b""),
        ("POST /b", b'{"password": "P", "pin": 7, "items": [{"token": "T"}, {"token": "T"}]}'),
        ("POST /c?x=1", b"user%5Bpassword%5D=F&password=P&other=1"),
        ("POST /d", b'{"name": "no secret here"}'),
        ("/pkg.Svc/M?api_key=x", b'{"password": "***"}'),
    ]
    assert _planned(calls[:2], ShadowValues()) == [(c.method, c.requests[0].data) for c in calls[:2]]


def test_workers_and_dry_run_see_the_shadow_values(tmp_path: Path, servers: tuple) -> None:
    _, _, target, seen = servers
    path = tmp_path / "w.rec"
    with RecordingWriter(path) as w:
        fid = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 8080), protocol="http1"))
        for i in range(4):
            ts = 10_000_000_000 + i * 5_000_000
            w.add_call(Call(protocol="http1", method=f"GET /w{i}?sid=******", request_ts_ns=ts, flow_id=fid,
                            kind="request", status=200))
    res = CliRunner().invoke(cli, ["replay", str(path), "--target", f"127.0.0.1:{target}", "--workers", "2",
                                   "--set-query", "sid=shadow"])
    assert res.exit_code == 0, res.output
    assert sorted(p for _, p, _ in seen) == [f"/w{i}?sid=shadow" for i in range(4)]
    dry = CliRunner().invoke(cli, ["replay", str(path), "--target", f"127.0.0.1:{target}", "--dry-run", "--json", "-",
                                   "--set-query", "sid=shadow"])
    assert dry.exit_code == 0 and json.loads(dry.output)["first"][0]["method"] == "GET /w0?sid=shadow"


def test_bad_values_raise_one_line() -> None:
    for q, f in ((("x",), ()), ((), ("a.=1",)), (("n=" + "v" * 9000,), ())):
        with pytest.raises(ShadowError):
            ShadowValues.from_options(q, f)
