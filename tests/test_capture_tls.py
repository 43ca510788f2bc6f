"""TLS plaintext capture (uprobes on the system libssl) against a real nginx with HTTPS (root + bcc).

nginx (Debian's, linked to libssl.so.3) serves HTTPS with a certificate made here, keep-alive on; curl
(several URLs on one connection, HTTP/1.1 and, by ALPN, HTTP/2) and Python's http.client over ssl are the
clients, each with an Authorization header. The recording must hold the calls nginx logged (method, path,
status, for HTTP/1 and HTTP/2 alike), the token nowhere in the file, and no ciphertext stored for those
flows. `--tls off` records the same traffic as ciphertext only, each flow listed as encrypted with the
reason; a TLS server that does not use the system libssl (Node.js links its own OpenSSL) is listed with
that reason.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from capture.backends import RecordOptions
from capture.ebpf.tls import find_libssl
from capture.record import Recorder
from capture.recording import Call, Recording
from capture.summary import summarize
from tests.nginx import make_cert
from wire.process import end_child, free_port, spawn

pytestmark = [pytest.mark.root, pytest.mark.ebpf,
              pytest.mark.skipif(shutil.which("nginx") is None or shutil.which("curl") is None,
                                 reason="needs nginx and curl (apt-get install nginx curl; scripts/setup.sh does)"),
              pytest.mark.skipif(find_libssl() is None, reason="no system libssl.so.3")]

REPO = Path(__file__).resolve().parents[1]
TOKEN_CURL = "curl-secret-7f3a9c1e5b"
TOKEN_PY = "python-secret-2d8e4b6a0c"
TOKEN_H2 = "curl-h2-secret-94b1d07e3f"

CONF = """
daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 64; }}
http {{
    log_format calls '$request_method $request_uri $status';
    access_log {d}/access.log calls;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_timeout 30s;
    default_type text/plain;
    server {{
        listen 127.0.0.1:{port} ssl http2;
        ssl_certificate {d}/cert.pem;
        ssl_certificate_key {d}/key.pem;
        location / {{ return 200 "hello $uri\\n"; }}
        location /missing {{ return 404; }}
        location = /items {{ return 201 "created\\n"; }}
    }}
}}
"""



class Nginx:
    """nginx serving HTTPS on a free port from `d`; `wrap(argv)` gives the command that starts it (in its
    own mount namespace, say), which must end by exec'ing nginx so that SIGQUIT reaches it."""

    def __init__(self, d: Path, wrap: Callable[[list[str]], list[str]] = lambda argv: argv, port: int = 0) -> None:
        self.dir = d
        self.port = port or free_port()
        self.cert = make_cert(d)
        (d / "nginx.conf").write_text(CONF.format(d=d, port=self.port))
        argv = ["nginx", "-c", str(d / "nginx.conf"), "-p", str(d), "-e", str(d / "error.log")]
        self.proc = spawn(wrap(argv), stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        err = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else b""
        self.stop()
        raise RuntimeError(f"nginx did not listen within 10 s: {err!r}")

    def log_lines(self) -> list[tuple[str, int]]:
        """(method + path, status) of every request nginx logged."""
        out = []
        for line in (self.dir / "access.log").read_text().splitlines():
            method, path, status = line.split()
            out.append((f"{method} {path}", int(status)))
        return out

    def clear_log(self) -> None:
        (self.dir / "access.log").write_text("")
        self.proc.send_signal(signal.SIGUSR1)   # reopen the log file
        time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def nginx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    n = Nginx(tmp_path_factory.mktemp("nginx-tls"))
    try:
        yield n
    finally:
        n.stop()


def _curl(n: Nginx) -> None:
    """Three HTTP/1.1 requests on one keep-alive connection (curl reuses it for URLs of one host)."""
    base = f"https://127.0.0.1:{n.port}"
    subprocess.run(["curl", "-sS", "--http1.1", "--fail-with-body", "--cacert", str(n.cert), "-H",
                    f"Authorization: Bearer {TOKEN_CURL}", "-o", "/dev/null", "-o", "/dev/null", "-o", "/dev/null",
                    f"{base}/curl/one", f"{base}/curl/two?x=1", f"{base}/curl/three"],
                   check=True, capture_output=True, timeout=30)


def _curl_h2(n: Nginx) -> None:
    """Two HTTP/2 requests on one connection (ALPN h2): the plaintext is HTTP/2 frames."""
    base = f"https://127.0.0.1:{n.port}"
    subprocess.run(["curl", "-sS", "--http2", "--fail-with-body", "--cacert", str(n.cert), "-H",
                    f"Authorization: Bearer {TOKEN_H2}", "-o", "/dev/null", "-o", "/dev/null",
                    f"{base}/h2/first", f"{base}/h2/second"], check=True, capture_output=True, timeout=30)


def _python_client(n: Nginx) -> list[int]:
    """http.client over ssl (SSL_read_ex / SSL_write_ex): GET, POST with a JSON body, a 404."""
    ctx = ssl.create_default_context(cafile=str(n.cert))
    conn = http.client.HTTPSConnection("127.0.0.1", n.port, context=ctx, timeout=10)
    auth = {"Authorization": f"Bearer {TOKEN_PY}"}
    statuses = []
    try:
        for method, path, body in (("GET", "/py/first", None), ("POST", "/items", b'{"name": "widget"}'),
                                   ("GET", "/missing", None), ("GET", "/py/last", None)):
            headers = dict(auth, **({"Content-Type": "application/json"} if body else {}))
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            statuses.append(resp.status)
    finally:
        conn.close()
    return statuses


def _record(out: Path, port: int, traffic: list, **options: object) -> dict[str, object]:
    rec = Recorder(RecordOptions(output=str(out), port=port, **options)).start()  # type: ignore[arg-type]
    try:
        for fn in traffic:
            fn()
        time.sleep(0.3)    # the last syscalls reach the ring buffers
    finally:
        stats = rec.stop()
    return stats


def _calls(path: Path) -> list[Call]:
    with Recording(path) as rec:
        return sorted(rec.calls(), key=lambda c: c.request_ts_ns)


def _file_bytes(path: Path) -> bytes:
    """The recording and any SQLite side file beside it."""
    return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))


@pytest.fixture(scope="module")
def recorded(nginx: Nginx, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    nginx.clear_log()
    out = tmp_path_factory.mktemp("tls-rec") / "https.rec"
    statuses: list[int] = []
    stats = _record(out, nginx.port, [lambda: _curl(nginx), lambda: _curl_h2(nginx),
                                      lambda: statuses.extend(_python_client(nginx))])
    return {"out": out, "stats": stats, "log": nginx.log_lines(), "py_statuses": statuses}


def test_https_calls_are_recorded_as_http1_equal_to_nginx_access_log(recorded: dict) -> None:
    calls = _calls(recorded["out"])
    h1 = [c for c in calls if c.protocol == "http1"]
    h2 = [c for c in calls if c.protocol == "http2"]
    assert recorded["py_statuses"] == [200, 201, 404, 200]
    log = recorded["log"]
    assert len(log) == 9 and len(h1) + len(h2) == len(calls)
    assert collections.Counter((c.method, c.status) for c in h1) == collections.Counter(
        line for line in log if not line[0].startswith("GET /h2/"))
    # HTTP/2 over TLS goes to the HTTP/2 decoder: plain HTTP/2 calls named and statused as HTTP/1's
    assert collections.Counter((c.method, c.status) for c in h2) == collections.Counter(
        line for line in log if line[0].startswith("GET /h2/"))
    post = next(c for c in calls if c.method == "POST /items")
    assert [m.data for m in post.requests] == [b'{"name": "widget"}']
    assert ("content-type", "application/json") in [(k.lower(), v) for k, v in post.request_metadata]
    get = next(c for c in calls if c.method == "GET /curl/one")
    assert [m.data for m in get.responses] == [b"hello /curl/one\n"]


def test_keep_alive_connections_are_one_flow_each_and_no_ciphertext_is_stored(recorded: dict) -> None:
    with Recording(recorded["out"]) as rec:
        flows = list(rec.flows())
        calls_per_flow = collections.Counter(c.flow_id for c in rec.calls(with_messages=False))
        first = [rec.first_bytes(f.id, "c2s", 8) for f in flows if f.id is not None]
        meta = rec.meta
    # curl's HTTP/2 requests share a connection, its HTTP/1.1 ones another, Python's a third
    assert sorted(calls_per_flow.values()) == [2, 3, 4]
    assert sorted(f.protocol for f in flows) == ["http1", "http1", "http2"]
    assert all(b[:1] != b"\x16" for b in first), first       # no TLS record: plaintext only
    assert sorted(b.split(b" ")[0] for b in first) == [b"GET", b"GET", b"PRI"]   # PRI: the HTTP/2 preface
    tls = meta["tls"]
    assert tls["capture"] == "on" and tls["plaintext_flows"] == 3 and tls["encrypted_flows"] == 0
    assert tls["ciphertext_bytes_not_stored"] > 0
    assert [r[1] for r in meta["tls_flows"]] == ["plaintext"] * 3
    with Recording(recorded["out"]) as rec:
        summary = summarize(rec)
    assert summary["tls"]["plaintext_flows"] == 3 and not any("TLS" in p for p in summary["problems"])
    assert recorded["stats"]["lost_events"] == 0


def test_credentials_are_masked_and_the_tokens_appear_nowhere_in_the_file(recorded: dict) -> None:
    raw = _file_bytes(recorded["out"])
    for token in (TOKEN_CURL, TOKEN_PY, TOKEN_H2):
        assert token.encode() not in raw
    calls = _calls(recorded["out"])
    auth = [v for c in calls for k, v in c.request_metadata if k.lower() == "authorization"]
    assert len(auth) == 9 and not any(t in v for v in auth for t in (TOKEN_CURL, TOKEN_PY, TOKEN_H2))


def test_client_side_recording_of_python_client_uses_ssl_read_ex_write_ex(nginx: Nginx, tmp_path: Path) -> None:
    out = tmp_path / "client.rec"
    statuses: list[int] = []
    _record(out, nginx.port, [lambda: statuses.extend(_python_client(nginx))], side="client", pid=os.getpid())
    calls = _calls(out)
    assert [(c.method, c.status) for c in calls] == [("GET /py/first", 200), ("POST /items", 201),
                                                     ("GET /missing", 404), ("GET /py/last", 200)]
    assert TOKEN_PY.encode() not in _file_bytes(out)


def _wait_started(out: Path, proc: subprocess.Popen[str]) -> None:
    """Until the recorder's backend is up (it writes its settings into the file then)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists():
            try:
                with Recording(out) as r:
                    if "backend_settings" in r.meta:
                        return
            except Exception:  # noqa: BLE001 - being created
                pass
        time.sleep(0.1)
    raise AssertionError("the recorder did not start")


def test_tls_off_records_no_plaintext_and_says_why_per_flow(nginx: Nginx, tmp_path: Path) -> None:
    out = tmp_path / "off.rec"
    rec = spawn([sys.executable, "-m", "harness.cli", "record", "--port", str(nginx.port), "--tls", "off",
                 "--duration", "30", "--json", "-o", str(out)], cwd=str(REPO), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)
    try:
        _wait_started(out, rec)
        _curl(nginx)
        time.sleep(0.5)
    finally:
        rec.send_signal(signal.SIGINT)
        stdout, stderr = rec.communicate(timeout=30)
    assert rec.returncode == 0, stderr
    result = json.loads(stdout)
    assert result["calls"] == 0 and result["flows"] == 1
    assert result["tls"]["capture"] == "off"
    with Recording(out) as r:
        flows = list(r.flows())
        assert len(flows) == 1 and flows[0].protocol in ("tcp", "tls")    # raw bytes, no calls
        assert r.first_bytes(flows[0].id or 0, "c2s", 1) == b"\x16"     # the ClientHello: ciphertext
        assert r.meta["tls_flows"] == [[flows[0].id, "encrypted", "encrypted: TLS capture is off (--tls off)", 0]]
        problems = summarize(r)["problems"]
    assert f"flow {flows[0].id} is TLS recorded as ciphertext (raw TCP, no calls): encrypted: TLS capture is off " \
        "(--tls off)" in problems
    assert TOKEN_CURL.encode() not in _file_bytes(out)


GRPCIO_TLS_SERVER = """
import sys, grpc
from concurrent import futures
key, cert = (open(p, "rb").read() for p in sys.argv[1:3])
server = grpc.server(futures.ThreadPoolExecutor(2))
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
    "t.S", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)})])
port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
server.start()
print(port, flush=True)
sys.stdin.read()
server.stop(None)
"""


def test_tls_of_a_process_without_a_readable_library_is_reported_with_the_reason(nginx: Nginx, tmp_path: Path) -> None:
    """grpcio's TLS is BoringSSL linked into cygrpc with its symbols hidden: the flow is stored as
    ciphertext, and says so, naming what was found."""
    import grpc

    proc = spawn([sys.executable, "-c", GRPCIO_TLS_SERVER, str(nginx.dir / "key.pem"), str(nginx.cert)],
                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, cwd=str(REPO))
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        out = tmp_path / "grpcio.rec"

        def call() -> None:
            creds = grpc.ssl_channel_credentials(nginx.cert.read_bytes())
            with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
                echo = channel.unary_unary("/t.S/Echo")
                assert echo(b"ping", timeout=10, metadata=[("authorization", "Bearer grpcio-token")]) == b"ping"

        _record(out, port, [call])
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)
    with Recording(out) as r:
        rows = r.meta["tls_flows"]
        assert r.meta["tls"]["capture"] == "on"
        calls = list(r.calls())
        (flow,) = list(r.flows())
        # held while undecided, then stored as it came: the client's hello, the server's answer
        hello = [r.first_bytes(flow.id or 0, d, 1) for d in ("c2s", "s2c")]
    assert len(rows) == 1 and rows[0][1] == "encrypted" and calls == []
    assert hello == [b"\x16", b"\x16"]
    assert rows[0][2].startswith("encrypted: BoringSSL linked statically into cygrpc"), rows[0][2]
    assert b"grpcio-token" not in _file_bytes(out)


def test_doctor_reports_tls_capture() -> None:
    from harness import doctor

    checks = doctor.run_checks()
    check = next(c for c in checks if c.name == "TLS capture (uprobes on libssl)")
    assert check.ok, check.detail
    assert (find_libssl() or "no libssl") in check.detail and "fired" in check.detail
    assert doctor.capture_backends(checks)["ebpf TLS"].startswith("plaintext")


def test_print_bpf_shows_the_tls_program_unless_tls_is_off() -> None:
    def bpf(*extra: str) -> str:
        return subprocess.run([sys.executable, "-m", "harness.cli", "record", "--print-bpf", "--port", "443", *extra],
                              cwd=REPO, capture_output=True, text=True, check=True, timeout=60).stdout

    assert "int ssl_rw_exit(struct pt_regs *ctx)" in bpf()
    assert "ssl_rw_exit" not in bpf("--tls", "off")


GRPC_SERVER = """
import sys
from concurrent import futures

import grpc

key, cert, port = open(sys.argv[1], "rb").read(), open(sys.argv[2], "rb").read(), int(sys.argv[3])
handler = grpc.method_handlers_generic_handler(
    "t.Echo", {"Say": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)})
server = grpc.server(futures.ThreadPoolExecutor(2))
server.add_generic_rpc_handlers((handler,))
server.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials([(key, cert)]))
server.start()
print("ready", flush=True)
server.wait_for_termination()
"""


def test_grpcio_tls_server_is_reported_encrypted_with_the_reason(nginx: Nginx, tmp_path: Path) -> None:
    """grpcio's TLS is its own BoringSSL: no plaintext from the uprobes, the flow listed with why."""
    import grpc

    from capture.ebpf.tlslibs import Inspector

    port = free_port()
    proc = spawn([sys.executable, "-c", GRPC_SERVER, str(nginx.dir / "key.pem"), str(nginx.cert),
                  str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        maps = any(f.kind == "openssl" for f in Inspector().process(proc.pid).files)
        out = tmp_path / "grpc.rec"

        def call() -> None:
            creds = grpc.ssl_channel_credentials(root_certificates=nginx.cert.read_bytes())
            with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
                say = ch.unary_unary("/t.Echo/Say")
                assert say(b"secret-payload", timeout=10) == b"secret-payload"

        _record(out, port, [call])
    finally:
        end_child(proc)
    with Recording(out) as r:
        rows = r.meta["tls_flows"]
        calls = list(r.calls())
    assert calls == [] and len(rows) == 1 and rows[0][1] == "encrypted"
    assert rows[0][2].startswith("encrypted: BoringSSL linked statically into cygrpc"), rows[0][2]
    # a Python process imports the ssl module with grpc, so it maps libssl.so.3, probed and still not used
    assert ("it also maps" in rows[0][2]) == bool(maps), rows[0][2]
