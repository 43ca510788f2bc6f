"""Go crypto/tls read by the recorder: uprobes on a Go binary's tls.(*Conn) Read/Write (their return
instructions) and handshake, the socket found through the conn's field offsets (capture/ebpf/goelf.py).

The peer is tests/interop/go/https_roundtrip.go (its serve and get modes), built here with the Debian Go toolchain: a stdlib
net/http service over TLS (HTTP/1.1 and, through ALPN, HTTP/2) that prints every call it answered, and
a stdlib client. Ground truth is the service's own log and curl's view of the answers; the recording
must hold the same calls in plaintext, credentials masked, no flow left as ciphertext.
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any, cast

import pytest

from capture.backends import RecordOptions
from capture.ebpf.tls import find_libssl
from capture.ebpf.tlslibs import Inspector
from capture.record import Recorder
from capture.recording import Recording
from tests.golang import GO, GO_SRC, GRPC_GO, NO_GO, NO_GRPC_GO
from tests.nginx import make_cert
from tests.test_capture_tls import Nginx, _calls, _file_bytes
from wire.process import spawn

pytestmark = [pytest.mark.root, pytest.mark.ebpf,
              pytest.mark.skipif(GO is None, reason=NO_GO),
              pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl (apt-get install curl)"),
              pytest.mark.skipif(find_libssl() is None, reason="no system libssl.so.3")]

SERVER_SRC = GO_SRC / "https_roundtrip.go"   # its serve and get modes
TOKEN = "go-tls-secret-5c1e9a7d3b"
BIG = 40_000     # one Write of the service, many Reads of a client


class GoService:
    """https_roundtrip serve DIR: its port, its certificate, the calls it logged."""

    def __init__(self, binary: Path, d: Path, port: int = 0) -> None:
        self.cert = d / "cert.pem"
        self.binary = binary
        self.proc = spawn([str(binary), "serve", str(d), str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=None, text=True)
        out = cast(IO[str], self.proc.stdout)
        first = out.readline().split()
        assert first[:1] == ["listening"], first
        self.port = int(first[1])
        self._lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self._lines.extend(iter(out.readline, "")), daemon=True)
        self._reader.start()

    def calls(self, expect: int) -> list[tuple[str, int, int]]:
        """(method + path, status, answer bytes) of each call the service answered."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(self._lines) < expect:
            time.sleep(0.05)
        out = []
        for line in list(self._lines):
            _, method, path, status, size = line.split()
            out.append((f"{method} {path}", int(status), int(size)))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            cast(IO[str], self.proc.stdin).close()     # the service ends when its stdin closes
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(params=["exe", "pie"])
def service(request: pytest.FixtureRequest, build: Any, tmp_path: Path) -> Any:
    """The service built as a plain executable and as a position-independent one (loaded at a random
    address: the probes' fd path must add the process's load bias to the itab it checks)."""
    binary = build("https", SERVER_SRC) if request.param == "exe" else \
        build("https_pie", SERVER_SRC, "-buildmode=pie")
    (tmp_path / "svc").mkdir()
    svc = GoService(binary, tmp_path / "svc")
    yield svc
    svc.stop()


def _curl(svc: GoService, *args: str) -> None:
    subprocess.run(["curl", "-sS", "--fail-with-body", "--cacert", str(svc.cert), "-H", f"Authorization: Bearer {TOKEN}",
                    *args], check=False, capture_output=True, timeout=30)


def _traffic(svc: GoService) -> None:
    base = f"https://127.0.0.1:{svc.port}"
    # HTTP/1.1 on one keep-alive connection: a GET, a large answer, a POST with a body, a 404
    _curl(svc, "--http1.1", "-o", "/dev/null", f"{base}/go/one", "-o", "/dev/null", f"{base}/size/{BIG}",
          "-o", "/dev/null", f"{base}/missing")
    _curl(svc, "--http1.1", "-o", "/dev/null", "-X", "POST", "-H", "Content-Type: application/json",
          "--data-binary", '{"name": "gopher"}', f"{base}/items")
    # HTTP/2 (ALPN h2) on one connection
    _curl(svc, "--http2", "-o", "/dev/null", f"{base}/h2/first", "-o", "/dev/null", f"{base}/h2/second")


def _body(messages: list[Any]) -> bytes:
    return b"".join(m.data for m in messages)


def _check(out: Path, svc: GoService, expect: int) -> dict[str, Any]:
    logged = svc.calls(expect)
    assert len(logged) == expect, logged
    calls = _calls(out)
    got = collections.Counter((c.method, c.status, len(_body(c.responses))) for c in calls)
    assert got == collections.Counter(logged), (sorted(got.elements()), sorted(logged))
    post = next(c for c in calls if c.method == "POST /items")
    assert _body(post.requests) == b'{"name": "gopher"}'
    assert _body(post.responses) == b"go saw POST /items with 18 bytes"
    big = next(c for c in calls if c.method == f"GET /size/{BIG}")
    assert _body(big.responses) == (b"0123456789" * (BIG // 10 + 1))[:BIG]
    assert {c.protocol for c in calls} == {"http1", "http2"}
    auth = [v for c in calls for k, v in c.request_metadata if k.lower() == "authorization"]
    assert len(auth) == expect and not any(TOKEN in v for v in auth), auth
    assert TOKEN.encode() not in _file_bytes(out)
    with Recording(out) as r:
        meta = r.meta
    tls = cast(dict[str, Any], meta["tls"])
    assert tls["capture"] == "on" and tls["encrypted_flows"] == 0, meta["tls_flows"]
    assert {row[1] for row in cast(list[list[Any]], meta["tls_flows"])} == {"plaintext"}
    return tls


def test_a_go_service_is_recorded_in_plaintext(service: GoService, tmp_path: Path) -> None:
    out = tmp_path / "go.rec"
    rec = Recorder(RecordOptions(output=str(out), port=service.port)).start()
    try:
        _traffic(service)
        time.sleep(0.3)
    finally:
        stats = rec.stop()
    tls = _check(out, service, 6)
    (go,) = [lib for lib in tls["libraries"] if lib["kind"] == "go"]
    assert go["attached"] is True and service.proc.pid in go["pids"], go
    assert stats["lost_events"] == 0
    info = Inspector().process(service.proc.pid).files[0].go
    assert info is not None and info.pie == service.binary.name.endswith("_pie")


def test_a_go_service_started_while_recording_is_read_from_its_first_connection(
        build: Any, tmp_path: Path) -> None:
    """A non-PIE Go binary once probed is read in every process that runs it, before the recorder has
    looked at the new process (it does so every second): a restarted service's first call is plaintext."""
    binary = build("https", SERVER_SRC)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = GoService(binary, tmp_path / "a")
    out = tmp_path / "restart.rec"
    second: GoService | None = None
    try:
        rec = Recorder(RecordOptions(output=str(out), port=first.port)).start()
        try:
            _curl(first, "--http1.1", "-o", "/dev/null", f"https://127.0.0.1:{first.port}/before")
            before = first.calls(1)
            first.stop()
            second = GoService(binary, tmp_path / "b", port=first.port)
            _curl(second, "--http1.1", "-o", "/dev/null", f"https://127.0.0.1:{second.port}/after")
            after = second.calls(1)
            time.sleep(0.3)
        finally:
            rec.stop()
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert [(m, s) for m, s, _ in before + after] == [("GET /before", 200), ("GET /after", 200)]
    assert [(c.method, c.status) for c in _calls(out)] == [("GET /before", 200), ("GET /after", 200)]
    with Recording(out) as r:
        assert {row[1] for row in cast(list[list[Any]], r.meta["tls_flows"])} == {"plaintext"}


def test_a_go_client_is_recorded_in_plaintext(build: Any, tmp_path: Path) -> None:
    """Client side: the Go client's requests to nginx, read from the Go binary (not nginx's libssl)."""
    if shutil.which("nginx") is None:
        pytest.skip("needs nginx (apt-get install nginx)")
    binary = build("https", SERVER_SRC)
    (tmp_path / "nginx").mkdir()
    n = Nginx(tmp_path / "nginx")
    out = tmp_path / "client.rec"
    try:
        base = f"https://127.0.0.1:{n.port}"
        client = spawn([str(binary), "get", str(n.cert), f"{base}/go/a", f"{base}/go/b"],
                       stdout=subprocess.PIPE, stdin=subprocess.PIPE, stderr=None, text=True)
        rec = Recorder(RecordOptions(output=str(out), port=n.port, side="client", pid=client.pid)).start()
        try:
            stdout, _ = client.communicate("go\n", timeout=30)
            time.sleep(0.3)
        finally:
            rec.stop()
    finally:
        n.stop()
    assert client.returncode == 0 and stdout.split("\n")[:2] == ["GOT 200 12", "GOT 200 12"], stdout
    calls = _calls(out)
    assert [(c.method, c.status, _body(c.responses)) for c in calls] == [
        ("GET /go/a", 200, b"hello /go/a\n"), ("GET /go/b", 200, b"hello /go/b\n")]
    with Recording(out) as r:
        libs = cast(dict[str, Any], r.meta["tls"])["libraries"]
    assert [lib["path"] for lib in libs if lib["kind"] == "go"] == [str(binary)], libs


@pytest.mark.skipif(not GRPC_GO.is_dir(), reason=NO_GRPC_GO)
def test_a_grpc_go_server_called_by_grpcio_is_recorded_in_plaintext(build: Any, tmp_path: Path) -> None:
    """grpc-go (Debian's golang-google-grpc-dev) over TLS, called by grpcio: gRPC over HTTP/2 over Go's
    crypto/tls, every call decoded with its method, status and messages."""
    import grpc

    binary = build("grpc_tls_server", GO_SRC / "grpc_tls_server.go")
    cert = make_cert(tmp_path)
    proc = spawn([str(binary), str(cert), str(tmp_path / "key.pem")], stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE, stderr=None, text=True)
    out = tmp_path / "grpc-go.rec"
    try:
        stdout = cast(IO[str], proc.stdout)
        port = int(stdout.readline().split()[1])
        rec = Recorder(RecordOptions(output=str(out), port=port)).start()
        try:
            creds = grpc.ssl_channel_credentials(cert.read_bytes())
            with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
                echo = channel.unary_unary("/t.S/Echo")
                answers = [echo(f"ping {i}".encode(), timeout=10, metadata=[("authorization", f"Bearer {TOKEN}")])
                           for i in range(5)]
                with pytest.raises(grpc.RpcError) as missing:
                    channel.unary_unary("/t.S/Nope")(b"x", timeout=10)
            time.sleep(0.3)
        finally:
            rec.stop()
        served = [stdout.readline().split()[1:] for _ in range(6)]
    finally:
        cast(IO[str], proc.stdin).close()
        proc.wait(10)
    assert answers == [f"echo:ping {i}".encode() for i in range(5)]
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert served == [["/t.S/Echo", "0"]] * 5 + [["/t.S/Nope", "5"]]
    calls = _calls(out)
    assert [(c.method, c.status) for c in calls] == [("/t.S/Echo", 0)] * 5 + [("/t.S/Nope", 5)]
    assert [_body(c.requests) for c in calls[:5]] == [f"ping {i}".encode() for i in range(5)]
    assert [_body(c.responses) for c in calls[:5]] == answers
    assert TOKEN.encode() not in _file_bytes(out)
    with Recording(out) as r:
        assert {row[1] for row in cast(list[list[Any]], r.meta["tls_flows"])} == {"plaintext"}


def test_a_stripped_go_service_is_recorded_as_ciphertext_with_the_reason(build: Any, tmp_path: Path) -> None:
    binary = build("https_stripped", SERVER_SRC, "-ldflags=-s -w")
    (tmp_path / "svc").mkdir()
    svc = GoService(binary, tmp_path / "svc")
    out = tmp_path / "stripped.rec"
    try:
        rec = Recorder(RecordOptions(output=str(out), port=svc.port)).start()
        try:
            _curl(svc, "--http1.1", "-o", "/dev/null", f"https://127.0.0.1:{svc.port}/x")
            time.sleep(0.3)
        finally:
            rec.stop()
        assert [c[0] for c in svc.calls(1)] == ["GET /x"]
    finally:
        svc.stop()
    with Recording(out) as r:
        rows = cast(list[list[Any]], r.meta["tls_flows"])
        assert list(r.calls()) == []
    assert len(rows) == 1 and rows[0][1] == "encrypted", rows
    assert rows[0][2].startswith(f"encrypted: Go binary {binary} (go1.") and "stripped Go binary" in rows[0][2], rows


def test_a_close_racing_a_write_in_flight_loses_nothing_silently(build: Any, tmp_path: Path) -> None:
    """A Go service closes a connection from one goroutine while another's Write is returning (as
    net/http's HTTP/2 server does when its client goes): the close(2) can run before that Write's probe
    fires, even inside the Write at the socket's last unref. Ground truth is what each Python client
    received before its EOF: every flow's recorded answer is exactly that, or ends in a counted gap;
    never a shorter answer that looks whole, never bytes of another connection."""
    import socket
    import ssl

    binary = build("https", SERVER_SRC)
    proc = spawn([str(binary), "closerace", str(tmp_path)], stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE, stderr=None, text=True)
    out = tmp_path / "race.rec"
    received: dict[int, bytes] = {}
    try:
        port = int(cast(IO[str], proc.stdout).readline().split()[1])
        ctx = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
        rec = Recorder(RecordOptions(output=str(out), port=port, pid=proc.pid)).start()
        try:
            def client() -> None:
                for _ in range(15):
                    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
                        local = conn.getsockname()[1]
                        conn.sendall(b"ping\n")
                        got = bytearray()
                        try:
                            while chunk := conn.recv(65536):
                                got += chunk
                        except (ssl.SSLError, OSError):
                            pass      # closed without close_notify: what came before is what was sent
                        received[local] = bytes(got)

            clients = [threading.Thread(target=client) for _ in range(8)]
            for t in clients:
                t.start()
            for t in clients:
                t.join(60)
            time.sleep(0.3)
        finally:
            rec.stop()
    finally:
        cast(IO[str], proc.stdin).close()
        proc.wait(10)
    with Recording(out) as r:
        flows = {f.src[1]: f for f in r.flows()}
        gaps = {(g[0], g[1]) for g in r.gaps()}
        answers = {f.id: b"".join(c.data for c in r.chunks(f.id) if c.direction == "s2c") for f in flows.values()}
        tls = cast(dict[str, Any], r.meta["tls"])
    assert set(flows) == set(received), (len(flows), len(received))
    exact = short = 0
    for port_, got in received.items():
        fid = flows[port_].id
        answer = answers[fid]
        assert got.startswith(answer), (port_, len(answer), len(got))     # never another's bytes
        if answer == got:
            exact += 1
        else:
            assert (fid, "s2c") in gaps, (port_, len(answer), len(got), tls)   # short: a counted gap
            short += 1
    assert tls["encrypted_flows"] == 0 and tls["plaintext_flows"] == len(received)
    print(f"{exact} exact, {short} short with a gap, {tls['late_calls']} late calls, {tls}")
