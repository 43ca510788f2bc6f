"""Replay over TLS to real servers started here on loopback: nginx (HTTPS) and grpcio (TLS, mTLS).

Certificates are made by the test with the openssl CLI: a CA, a server certificate for 127.0.0.1 and
localhost, and a client certificate (mTLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
from click.testing import CliRunner

from capture.recording import Call, Flow, Message, RecordingWriter
from harness.cli import cli
from replay.engine import ReplayRun
from replay.options import ReplayOptions
from replay.senders.headers import HeaderPolicy
from replay.senders.tls import TlsConfig
from replay.testing import SERVICE, write_unary_recording
from tests.nginx import NGINX, PREAMBLE, TEMP_PATHS, running_nginx

MS = 1_000_000
BASE = 10_000_000_000
needs_nginx = pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; scripts/setup.sh does)")
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI (apt-get install openssl)")


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here: verification against it must fail


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_ca(d: Path, name: str) -> tuple[Path, Path]:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN=shadowtest test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


def _make_leaf(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial", "-days", "2",
             "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI (apt-get install openssl)")
    d = tmp_path_factory.mktemp("pki")
    ca = _make_ca(d, "ca")
    other, _ = _make_ca(d, "other")
    server = _make_leaf(d, "localhost", ca, "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
    client = _make_leaf(d, "client", ca, "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                        "extendedKeyUsage=clientAuth\n")
    return Pki(ca[0], server[0], server[1], client[0], client[1], other)


@dataclass
class Nginx:
    address: str
    log: Path

    def lines(self) -> list[list[str]]:
        return [line.split("|") for line in self.log.read_text().splitlines()]


_NGINX_CONF = PREAMBLE + """
http {{
    log_format replay '$request_method|$request_uri|$status|$http_authorization|$content_type|$http_traceparent|'
                      '$http_b3|$http_x_shadowtest_replay|$http_accept_encoding|$http_user_agent|$http_x_team';
    access_log {d}/access.log replay;""" + TEMP_PATHS + """    keepalive_requests 1000;
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location / {{ return 200 "ok\\n"; }}
    }}
}}
"""


@pytest.fixture
def nginx(tmp_path: Path, pki: Pki) -> Iterator[Nginx]:
    if NGINX is None:
        pytest.skip("needs nginx (apt-get install nginx; scripts/setup.sh does)")
    d = tmp_path / "nginx"
    d.mkdir()
    conf = lambda port: _NGINX_CONF.format(d=d, port=port, cert=pki.server_cert, key=pki.server_key)  # noqa: E731
    with running_nginx(d, conf) as port:
        yield Nginx(f"127.0.0.1:{port}", d / "access.log")


def _http_recording(path: Path, n: int = 4) -> None:
    """HTTP/1 POSTs as a capture records them: JSON bodies, gzip accepted, a trace, a redacted credential."""
    with RecordingWriter(path) as w:
        fid = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 443), protocol="http1"))
        for i in range(n):
            ts = BASE + i * 5 * MS
            body = b'{"order": %d}' % i
            w.add_call(Call(protocol="http1", method=f"POST /orders/{i}", request_ts_ns=ts, flow_id=fid, kind="request",
                            request_metadata=[("Host", "shop.example"), ("Content-Type", "application/json"),
                                              ("Accept-Encoding", "gzip"), ("User-Agent", "shop-client/2"),
                                              ("Authorization", "<redacted>"),
                                              ("traceparent", f"00-{i:032x}-{i:016x}-01"), ("b3", f"{i:016x}-1"),
                                              ("Connection", "keep-alive, x-team"), ("X-Team", "hop"),
                                              ("Content-Length", str(len(body)))],
                            status=200, requests=[Message("c2s", 0, ts, body)]))


def _replay(args: list[str]) -> tuple[int, str]:
    res = CliRunner().invoke(cli, ["replay", *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    return res.exit_code, res.output


@needs_nginx
@needs_openssl
def test_https_replay_to_nginx_carries_shadow_credentials_and_recorded_headers(tmp_path: Path, nginx: Nginx,
                                                                               pki: Pki) -> None:
    _http_recording(tmp_path / "web.rec")
    code, out = _replay([str(tmp_path / "web.rec"), "--target", nginx.address, "--tls", "--ca", str(pki.ca),
                         "--set-header", "authorization=Bearer shadow", "--speed", "10"])
    assert code == 0, out
    assert "ok: 4" in out
    lines = nginx.lines()
    assert [(m, uri, status) for m, uri, status, *_ in lines] == [("POST", f"/orders/{i}", "200") for i in range(4)]
    for _, _, _, auth, ctype, traceparent, b3, marker, accept, agent, team in lines:
        assert auth == "Bearer shadow"            # the shadow credential, not the redacted production one
        assert ctype == "application/json"        # end-to-end headers as recorded
        assert accept == "gzip" and agent == "shop-client/2"
        assert traceparent == "-" and b3 == "-"   # trace context stripped
        assert marker == "1"                      # x-shadowtest-replay: 1
        assert team == "-"                        # named by the recorded Connection header: hop-by-hop


@needs_nginx
@needs_openssl
def test_https_insecure_needs_no_ca_and_wrong_server_name_fails_in_one_line(tmp_path: Path, nginx: Nginx,
                                                                            pki: Pki) -> None:
    _http_recording(tmp_path / "web.rec", n=2)
    code, out = _replay([str(tmp_path / "web.rec"), "--target", nginx.address, "--insecure", "--no-marker",
                         "--keep-trace-context", "--speed", "10"])
    assert code == 0, out
    lines = nginx.lines()
    assert [line[2] for line in lines] == ["200", "200"]
    assert all(line[5].startswith("00-") and line[7] == "-" and line[3] == "-" for line in lines)

    code, out = _replay([str(tmp_path / "web.rec"), "--target", nginx.address, "--tls", "--ca", str(pki.ca),
                         "--server-name", "wrong.example", "--speed", "10"])
    assert code == 1
    reason = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(reason) == 1 and "TLS: certificate verify failed for wrong.example" in reason[0], out
    assert "Traceback" not in out
    assert len(nginx.lines()) == 2  # nothing reached nginx

    code, out = _replay([str(tmp_path / "web.rec"), "--target", nginx.address, "--tls", "--ca", str(pki.other_ca),
                         "--speed", "10"])
    assert code == 1 and "TLS: certificate verify failed for 127.0.0.1" in out, out


@pytest.mark.parametrize("args, says", [
    (["--tls", "--ca", "{missing}"], "--ca {missing}: no such file"),
    (["--tls", "--ca", "{notpem}"], "not a PEM file"),
    (["--cert", "{ca}", "--key", "{notpem}"], "--key {notpem}: not a PEM file"),
    (["--tls", "--cert", "{client}", "--key", "{otherkey}"], "TLS files:"),
    (["--insecure", "--sender", "grpc"], "--insecure is not possible with --sender grpc"),
    (["--set-header", "noequals"], "use NAME=VALUE"),
    (["--set-header", "host=evil"], "hop-by-hop"),
])
@needs_openssl
def test_bad_tls_files_and_header_values_are_one_line_usage_errors(tmp_path: Path, pki: Pki, args: list[str],
                                                                   says: str) -> None:
    write_unary_recording(tmp_path / "r.rec", [0])
    (tmp_path / "notpem.txt").write_text("hello\n")
    names = {"missing": str(tmp_path / "missing.pem"), "notpem": str(tmp_path / "notpem.txt"), "ca": str(pki.ca),
             "client": str(pki.client_cert), "otherkey": str(pki.server_key)}
    code, out = _replay([str(tmp_path / "r.rec"), "--target", "127.0.0.1:9", *[a.format(**names) for a in args]])
    assert code == 2, out
    assert says.format(**names) in out
    assert "Traceback" not in out


# ---- gRPC over TLS: grpcio server as the target, both senders ---------------------------------------------
class TlsGrpcServer:
    """A grpc.aio server with TLS credentials on 127.0.0.1 port 0 (its own thread): Decide echoes the
    request bytes and records each call's invocation metadata. `require_client_cert` makes it mTLS."""

    def __init__(self, pki: Pki, require_client_cert: bool = False) -> None:
        self.pki, self.require = pki, require_client_cert
        self.metadata: list[dict[str, str]] = []
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> TlsGrpcServer:
        self._thread.start()
        assert self._ready.wait(10), "the TLS gRPC server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        self._thread.join(10)

    async def _stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        import grpc
        import grpc.aio

        async def decide(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            self.metadata.append(dict(context.invocation_metadata()))
            return request

        self._server = server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"Decide": grpc.unary_unary_rpc_method_handler(decide)}),))
        creds = grpc.ssl_server_credentials([(self.pki.server_key.read_bytes(), self.pki.server_cert.read_bytes())],
                                            root_certificates=self.pki.ca.read_bytes() if self.require else None,
                                            require_client_auth=self.require)
        self.port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        self._ready.set()
        await server.wait_for_termination()


def _grpc_replay(path: Path, address: str, sender: str, tls: TlsConfig, headers: HeaderPolicy | None = None):  # noqa: ANN202
    opts = ReplayOptions(sender=sender, tls=tls, headers=headers, timeout_s=5.0)
    return ReplayRun(path, address, opts).run()


@needs_openssl
@pytest.mark.parametrize("sender", ["grpc", "h2"])
def test_grpc_replay_over_tls_every_call_ok_with_set_metadata(tmp_path: Path, pki: Pki, sender: str) -> None:
    n = write_unary_recording(tmp_path / "g.rec", [i * 2 * MS for i in range(12)], flows=2)
    policy = HeaderPolicy.from_options(("authorization=Bearer shadow", "x-tenant=shadow"))
    with TlsGrpcServer(pki) as server:
        rep = _grpc_replay(tmp_path / "g.rec", server.address, sender, TlsConfig(ca=str(pki.ca)), policy)
    assert rep.ok == n and rep.scheduled == n and rep.invariant_ok, rep.error_reasons
    assert len(server.metadata) == n
    assert sorted(int(md["x-replay-test"]) for md in server.metadata) == list(range(n))
    assert all(md["authorization"] == "Bearer shadow" and md["x-tenant"] == "shadow"
               and md["x-shadowtest-replay"] == "1" for md in server.metadata)


@needs_openssl
@pytest.mark.parametrize("sender", ["grpc", "h2"])
def test_grpc_mtls_needs_the_client_certificate(tmp_path: Path, pki: Pki, sender: str) -> None:
    n = write_unary_recording(tmp_path / "g.rec", [i * 2 * MS for i in range(4)])
    with TlsGrpcServer(pki, require_client_cert=True) as server:
        with_cert = _grpc_replay(tmp_path / "g.rec", server.address, sender,
                                 TlsConfig(ca=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key)))
        without = _grpc_replay(tmp_path / "g.rec", server.address, sender, TlsConfig(ca=str(pki.ca)))
        seen = len(server.metadata)
    assert with_cert.ok == n and with_cert.invariant_ok, with_cert.error_reasons
    assert without.ok == 0 and without.invariant_ok and sum(without.errors.values()) + without.timeouts == n
    assert seen == n  # the calls without a certificate never reached the service
    reasons = " ".join(without.error_reasons.values())
    assert "TLS" in reasons or "certificate" in reasons.lower() or "handshake" in reasons.lower(), reasons


@needs_openssl
def test_h2_sender_refuses_a_tls_server_without_alpn_h2(tmp_path: Path, nginx: Nginx) -> None:
    """nginx here speaks HTTP/1.1 only: the h2 sender must say so, not send a preface into HTTP/1."""
    n = write_unary_recording(tmp_path / "g.rec", [0, MS])
    rep = _grpc_replay(tmp_path / "g.rec", nginx.address, "h2", TlsConfig(insecure=True))
    assert rep.ok == 0 and rep.invariant_ok and sum(rep.errors.values()) == n
    assert any("did not negotiate ALPN h2" in r for r in rep.error_reasons.values()), rep.error_reasons
    assert nginx.lines() == []



@needs_openssl
def test_h2_sender_fails_when_the_tls_server_chooses_no_alpn(tmp_path: Path, pki: Pki) -> None:
    """A TLS server that ignores ALPN: the handshake succeeds, but no h2 preface goes into its HTTP/1."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.server_cert, pki.server_key)
    received: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    done = threading.Event()

    def serve() -> None:  # one connection at a time until the test ends (the sender may reconnect)
        while not done.is_set():
            try:
                raw, _ = listener.accept()
            except OSError:
                continue
            with contextlib.suppress(OSError), ctx.wrap_socket(raw, server_side=True) as conn:
                conn.settimeout(1)
                while data := conn.recv(65536):
                    received.append(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        n = write_unary_recording(tmp_path / "g.rec", [0])
        rep = _grpc_replay(tmp_path / "g.rec", f"127.0.0.1:{listener.getsockname()[1]}", "h2",
                           TlsConfig(ca=str(pki.ca)))
    finally:
        done.set()
        thread.join(10)
        listener.close()
    assert rep.ok == 0 and sum(rep.errors.values()) == n and rep.invariant_ok
    assert any("did not negotiate ALPN h2 (it chose none)" in r for r in rep.error_reasons.values()), rep.error_reasons
    assert b"PRI * HTTP/2.0" not in b"".join(received)


@needs_openssl
def test_tcp_flow_replayed_inside_tls(tmp_path: Path, pki: Pki) -> None:
    """A raw TCP flow's client bytes go out TLS-wrapped; a wrong name is a one-line TLS error per flow."""
    import ssl

    from capture.recording import Chunk

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.server_cert, pki.server_key)
    received: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                raw, _ = listener.accept()
            except OSError:
                continue
            with contextlib.suppress(OSError), ctx.wrap_socket(raw, server_side=True) as conn:
                conn.settimeout(1)
                while data := conn.recv(65536):
                    received.append(data)
                    conn.sendall(data.upper())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with RecordingWriter(tmp_path / "t.rec") as w:
        fid = w.add_flow(Flow(("127.0.0.1", 40001), ("127.0.0.1", 7000), protocol="tcp"))
        for gap, data in [(0, b"hello "), (20, b"tls")]:
            w.add_chunk(Chunk(fid, "c2s", BASE + gap * MS, data))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        ok = ReplayRun(tmp_path / "t.rec", address, ReplayOptions(tls=TlsConfig(ca=str(pki.ca)))).run()
        wrong = ReplayRun(tmp_path / "t.rec", address,
                          ReplayOptions(tls=TlsConfig(ca=str(pki.ca), server_name="wrong.example"))).run()
    finally:
        done.set()
        thread.join(10)
        listener.close()
    assert b"".join(received) == b"hello tls"
    assert ok.ok == 1 and ok.invariant_ok
    assert wrong.ok == 0 and wrong.errors == {"TLS": 1} and wrong.invariant_ok
    assert wrong.error_reasons["TLS"].startswith("TLS: certificate verify failed for wrong.example")


@needs_openssl
def test_traffic_command_speaks_tls(pki: Pki) -> None:
    with TlsGrpcServer(pki) as server:
        args = ["traffic", "--target", server.address, "--rate", "40", "--duration", "0.5", "--stream-share", "0",
                "--connect-timeout", "5", "--json", "-"]
        ok = CliRunner().invoke(cli, [*args, "--tls", "--ca", str(pki.ca)])
        refused = CliRunner().invoke(cli, [*args, "--insecure"])
        wrong = CliRunner().invoke(cli, [*args, "--ca", str(pki.ca), "--server-name", "wrong.example",
                                         "--connect-timeout", "1"])
    assert ok.exit_code == 0, ok.output
    assert len(server.metadata) > 0
    assert refused.exit_code == 2 and "--insecure is not possible" in refused.output
    assert wrong.exit_code == 1 and "over TLS" in wrong.output and "Traceback" not in wrong.output, wrong.output


@needs_openssl
def test_chaos_traffic_run_speaks_tls(pki: Pki) -> None:
    """The chaos harness's traffic (harness.traffic.TrafficRun) over TLS with shadow metadata."""
    from harness.scenario import GeneratorTraffic
    from harness.traffic import TrafficRun

    with TlsGrpcServer(pki) as server:
        run = TrafficRun(GeneratorTraffic(rate=40, pattern="constant"), [(0.0, 0.5, 1.0)], server.address,
                         time.monotonic_ns() + 200 * MS, seed=1, tls=TlsConfig(ca=str(pki.ca), server_name="localhost"),
                         headers=HeaderPolicy.from_options(("authorization=Bearer shadow",)))
        run.start()
        assert run.join(20)
    outcomes = {c.outcome for c in run.calls}
    assert run.error is None and len(run.calls) == 20 and outcomes == {"ok"}, run.report.get("error_reasons")
    assert len(server.metadata) == 20 and all(md["authorization"] == "Bearer shadow" for md in server.metadata)


@needs_nginx
@needs_openssl
def test_tls_and_header_rules_reach_every_worker(tmp_path: Path, nginx: Nginx, pki: Pki) -> None:
    _http_recording(tmp_path / "web.rec", n=4)
    code, out = _replay([str(tmp_path / "web.rec"), "--target", nginx.address, "--ca", str(pki.ca), "--workers", "2",
                         "--set-header", "authorization=Bearer shadow", "--speed", "10"])
    assert code == 0, out
    lines = nginx.lines()
    assert sorted(line[1] for line in lines) == [f"/orders/{i}" for i in range(4)]
    assert all(line[3] == "Bearer shadow" and line[7] == "1" and line[5] == "-" for line in lines)
