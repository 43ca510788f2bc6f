"""TLS over memory buffers read by the recorder: Node.js (the OpenSSL probes on the node binary, whose
OpenSSL is linked in and exported) and Python's asyncio (SSLObject, as uvicorn and aiohttp use it).

Both feed OpenSSL from memory buffers, so no syscall happens inside an SSL call: the SSL* is joined to
the socket its event loop writes the handshake to right after the call (tls.bpf.c, bind_pending), and a
server's flow, whose client hello was read before any SSL call, is held until that is decided
(tls_join.py). The Node peers are tests/interop/node/tls_peer.js: Node's own `https` server and client
and a @grpc/grpc-js TLS server and client, each printing its own tally. The recording must hold the
same calls, in plaintext, credentials masked, both `--side server` and `--side client`.
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import pytest

from capture.backends import RecordOptions
from capture.ebpf.tls import find_libssl
from capture.ebpf.tlslibs import Inspector
from capture.record import Recorder
from capture.recording import Recording
from tests.nginx import make_cert
from tests.test_capture_tls import Nginx, _calls, _file_bytes
from wire.process import spawn

NODE = shutil.which("node")
PEER = Path(__file__).parent / "interop" / "node" / "tls_peer.js"
GRPC_JS = Path(__file__).parent / "interop" / "node" / "node_modules" / "@grpc" / "grpc-js"
needs_node = pytest.mark.skipif(NODE is None, reason="needs node (apt-get install nodejs; the CI image has it)")
pytestmark = [pytest.mark.root, pytest.mark.ebpf,
              pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl (apt-get install curl)"),
              pytest.mark.skipif(find_libssl() is None, reason="no system libssl.so.3")]
TOKEN = "curl-to-node-secret-61d0b4"
BIG = 50_000


class NodePeer:
    """node tls_peer.js MODE ARGS: its JSON lines, collected as they come."""

    def __init__(self, *args: str) -> None:
        assert NODE is not None
        self.proc = spawn([NODE, str(PEER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                          text=True, cwd=str(PEER.parent))
        self.lines: list[dict[str, Any]] = []
        out = cast(IO[str], self.proc.stdout)
        self._reader = threading.Thread(target=lambda: self.lines.extend(json.loads(x) for x in iter(out.readline, "")),
                                        daemon=True)
        self._reader.start()

    def wait_lines(self, n: int, timeout: float = 20) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self.lines) < n:
            time.sleep(0.05)
        assert len(self.lines) >= n, (self.lines, self.proc.poll())
        return self.lines

    @property
    def port(self) -> int:
        return int(self.wait_lines(1)[0]["port"])

    def go(self) -> None:
        """For the client modes: start now."""
        stdin = cast(IO[str], self.proc.stdin)
        stdin.write("go\n")
        stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            cast(IO[str], self.proc.stdin).close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)


@pytest.fixture
def peers() -> Iterator[list[NodePeer]]:
    started: list[NodePeer] = []
    yield started
    for p in started:
        p.stop()


def _start(peers: list[NodePeer], *args: str) -> NodePeer:
    p = NodePeer(*args)
    peers.append(p)
    return p


def _body(messages: list[Any]) -> bytes:
    return b"".join(m.data for m in messages)


def _plaintext_only(out: Path) -> dict[str, Any]:
    with Recording(out) as r:
        meta = r.meta
    tls = cast(dict[str, Any], meta["tls"])
    assert tls["capture"] == "on" and tls["encrypted_flows"] == 0 and tls["plaintext_flows"] >= 1, meta["tls_flows"]
    assert {row[1] for row in cast(list[list[Any]], meta["tls_flows"])} == {"plaintext"}
    return tls


@needs_node
def test_a_node_https_server_is_recorded_in_plaintext(tmp_path: Path, peers: list[NodePeer]) -> None:
    cert = make_cert(tmp_path)
    server = _start(peers, "https-server", str(cert), str(tmp_path / "key.pem"))
    port = server.port
    proc = Inspector().process(server.proc.pid)
    assert [f.kind for f in proc.files if f.readable] == ["node"], proc
    out = tmp_path / "node.rec"
    base = f"https://127.0.0.1:{port}"
    rec = Recorder(RecordOptions(output=str(out), port=port)).start()
    try:
        subprocess.run(["curl", "-sS", "--http1.1", "--cacert", str(cert), "-H", f"Authorization: Bearer {TOKEN}",
                        "-o", "/dev/null", f"{base}/node/one", "-o", "/dev/null", f"{base}/size/{BIG}",
                        "-o", "/dev/null", f"{base}/missing"], check=True, capture_output=True, timeout=30)
        subprocess.run(["curl", "-sS", "--http1.1", "--cacert", str(cert), "-H", f"Authorization: Bearer {TOKEN}",
                        "-o", "/dev/null", "--data-binary", '{"name": "node"}', "-H", "Content-Type: application/json",
                        f"{base}/items"], check=True, capture_output=True, timeout=30)
        tally = server.wait_lines(5)[1:]
        time.sleep(0.3)
    finally:
        stats = rec.stop()
    calls = _calls(out)
    got = collections.Counter((c.method, c.status, len(_body(c.responses))) for c in calls)
    assert got == collections.Counter((t["call"], t["status"], t["bytes"]) for t in tally), (got, tally)
    post = next(c for c in calls if c.method == "POST /items")
    assert _body(post.requests) == b'{"name": "node"}'
    assert _body(post.responses) == b"node saw POST /items with 16 bytes"
    big = next(c for c in calls if c.method == f"GET /size/{BIG}")
    assert _body(big.responses) == (b"0123456789" * (BIG // 10 + 1))[:BIG]
    auth = [v for c in calls for k, v in c.request_metadata if k.lower() == "authorization"]
    assert len(auth) == 4 and not any(TOKEN in v for v in auth)
    assert TOKEN.encode() not in _file_bytes(out)
    tls = _plaintext_only(out)
    assert tls["plaintext_flows"] == 2 and stats["lost_events"] == 0
    (node,) = [lib for lib in tls["libraries"] if lib["kind"] == "node"]
    assert node["attached"] is True and server.proc.pid in node["pids"], node


@needs_node
def test_a_node_https_client_is_recorded_in_plaintext(tmp_path: Path, peers: list[NodePeer]) -> None:
    if shutil.which("nginx") is None:
        pytest.skip("needs nginx (apt-get install nginx)")
    (tmp_path / "nginx").mkdir()
    n = Nginx(tmp_path / "nginx")
    out = tmp_path / "client.rec"
    try:
        base = f"https://127.0.0.1:{n.port}"
        client = _start(peers, "https-client", str(n.cert), f"{base}/node/a", f"{base}/node/b", f"{base}/node/c")
        rec = Recorder(RecordOptions(output=str(out), port=n.port, side="client", pid=client.proc.pid)).start()
        try:
            client.go()
            tally = client.wait_lines(3)
            time.sleep(0.3)
        finally:
            rec.stop()
    finally:
        n.stop()
    assert [t["status"] for t in tally] == [200, 200, 200], tally
    assert [(c.method, c.status, _body(c.responses)) for c in _calls(out)] == [
        (f"GET /node/{x}", 200, f"hello /node/{x}\n".encode()) for x in "abc"]
    assert b"node-client-secret-8e2f" not in _file_bytes(out)
    assert _plaintext_only(out)["plaintext_flows"] == 1


@needs_node
@pytest.mark.skipif(not GRPC_JS.is_dir(), reason="needs tests/interop/node/node_modules (make test runs npm ci)")
@pytest.mark.parametrize("side", ["server", "client"])
def test_grpc_js_over_tls_is_recorded_on_either_side(tmp_path: Path, peers: list[NodePeer], side: str) -> None:
    cert = make_cert(tmp_path)
    server = _start(peers, "grpc-server", str(cert), str(tmp_path / "key.pem"))
    port = server.port
    client = _start(peers, "grpc-client", str(cert), str(port), "5")
    out = tmp_path / f"grpc-{side}.rec"
    options = RecordOptions(output=str(out), port=port) if side == "server" else \
        RecordOptions(output=str(out), port=port, side="client", pid=client.proc.pid)
    rec = Recorder(options).start()
    try:
        client.go()
        answers = client.wait_lines(6)
        served = server.wait_lines(7)[1:]
        time.sleep(0.3)
    finally:
        rec.stop()
    assert [(a["call"], a["code"]) for a in answers] == [("/interop.Tls/Echo", 0)] * 5 + [("/interop.Tls/Fail", 5)]
    assert [(s["call"], s["code"]) for s in served] == [(a["call"], a["code"]) for a in answers]
    calls = _calls(out)
    assert [(c.method, c.status) for c in calls] == [(a["call"], a["code"]) for a in answers], calls
    assert [_body(c.requests) for c in calls[:5]] == [f"hello {i}".encode() for i in range(5)]
    assert [_body(c.responses) for c in calls[:5]] == [f"echo:hello {i}".encode() for i in range(5)]
    assert b"grpc-js-secret-3a7c" not in _file_bytes(out)
    assert _plaintext_only(out)["plaintext_flows"] == 1


ASYNCIO_HTTPS_SERVER = """
import asyncio, ssl, sys

async def handle(reader, writer):
    try:
        while not reader.at_eof():
            head = await reader.readuntil(b"\\r\\n\\r\\n")
            path = head.split(b" ")[1]
            body = b"asyncio saw " + path
            writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body) + body)
            await writer.drain()
    except asyncio.IncompleteReadError:
        pass
    writer.close()

async def main():
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(sys.argv[1], sys.argv[2])
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main())
"""


def test_an_asyncio_https_server_is_recorded_in_plaintext(tmp_path: Path) -> None:
    """asyncio's TLS (ssl.SSLObject over MemoryBIOs): the server reads the client's hello before any SSL
    call, and writes its answer right after do_handshake."""
    cert = make_cert(tmp_path)
    proc = spawn([sys.executable, "-c", ASYNCIO_HTTPS_SERVER, str(cert), str(tmp_path / "key.pem")],
                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True)
    out = tmp_path / "asyncio.rec"
    try:
        port = int(cast(IO[str], proc.stdout).readline())
        base = f"https://127.0.0.1:{port}"
        rec = Recorder(RecordOptions(output=str(out), port=port)).start()
        try:
            answers = subprocess.run(["curl", "-sS", "--http1.1", "--cacert", str(cert), "-H",
                                      f"Authorization: Bearer {TOKEN}", f"{base}/a", f"{base}/b?q=1"],
                                     capture_output=True, text=True, timeout=30).stdout
            time.sleep(0.3)
        finally:
            rec.stop()
    finally:
        cast(IO[str], proc.stdin).close()
        proc.wait(10)
    assert answers == "asyncio saw /aasyncio saw /b?q=1"
    assert [(c.method, c.status, _body(c.responses)) for c in _calls(out)] == [
        ("GET /a", 200, b"asyncio saw /a"), ("GET /b?q=1", 200, b"asyncio saw /b?q=1")]
    assert TOKEN.encode() not in _file_bytes(out)
    assert _plaintext_only(out)["plaintext_flows"] == 1
