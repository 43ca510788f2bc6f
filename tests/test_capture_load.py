"""Capture under load: large downloads by concurrent clients, recorded whole, or with every loss a gap.

A real nginx (Debian's, linked to the system libssl) serves 1 MiB and 8 MiB files over HTTPS with a
certificate made here, and the same files over plain HTTP (sendfile off, so the bodies pass through
user space); four clients at once (two curl processes, each fetching several URLs over one keep-alive
connection, and two Python `http.client` connections, over `ssl` for HTTPS) download them, POST and hit
a 404, beside a connection of small calls, each with credentials in Authorization, X-Api-Key and Cookie
headers.

* With the recorder's default buffers, nothing is lost over TLS: the recorded calls are nginx's access
  log, call for call and connection by connection, every status and body length right, the bodies
  equal to the files, and no ciphertext is stored.
* With a ring shrunk on purpose (the TLS ring, `RecordOptions.tls_ring_pages`; the recorder's own ring
  for plain HTTP, `ring_pages` with a small `max_bytes`), records are lost. No recorded call may then be
  paired with another request's response: each one either equals its access-log line (and its body the
  file) or is marked (damaged, body not captured, outcome unknown). The losses are counted and listed,
  no TLS flow is called "encrypted" for them, and no 6-byte piece of any credential is in the file, its
  WAL or the exported pcapng.
"""

from __future__ import annotations

import collections
import http.client
import random
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from capture.backends import RecordOptions
from capture.ebpf.tls import find_libssl
from capture.pcap_export import export_file
from capture.record import Recorder
from capture.recording import Call, Recording, call_damage
from capture.summary import summarize
from tests.nginx import PREAMBLE, TEMP_PATHS, make_cert, running_nginx
from wire.process import free_port

pytestmark = [pytest.mark.root, pytest.mark.ebpf, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("nginx") is None or shutil.which("curl") is None,
                                 reason="needs nginx and curl (apt-get install nginx curl; scripts/setup.sh does)"),
              pytest.mark.skipif(find_libssl() is None, reason="no system libssl.so.3")]

# the credentials (no word of them is a header name or a word nginx or HTTP would write)
TOKENS = {"authorization": "ld7Q2xv9c1f9a2e8d4b7", "x-api-key": "kq0b5e93d71c24fZ8w", "cookie": "9f3b7c1e2a6d4085f1"}
SECRETS = {"authorization": f"Bearer {TOKENS['authorization']}", "x-api-key": TOKENS["x-api-key"],
           "cookie": f"sid={TOKENS['cookie']}"}
FILES = {"/1m.bin": 1 << 20, "/8m.bin": 8 << 20, "/small.txt": 1000}
SMALL_CALLS = 12
POSTED = b"posted ok\n"
CONF = PREAMBLE + """
http {{
    log_format calls '$remote_port $connection_requests $request_method $request_uri $status $body_bytes_sent';
    access_log {d}/access.log calls;
    default_type application/octet-stream;
    keepalive_requests 1000;
""" + TEMP_PATHS + """
    sendfile off;
    server {{
        listen 127.0.0.1:{port} ssl;
        listen 127.0.0.1:{plain};
        ssl_certificate {d}/cert.pem;
        ssl_certificate_key {d}/key.pem;
        root {d}/www;
        location = /post {{ return 200 "posted ok\\n"; }}
    }}
}}
"""


@dataclass(frozen=True)
class Logged:
    """One line of nginx's access log."""

    port: int
    nth: int          # the request's number on its connection (1, 2, ...)
    method: str       # "GET /1m.bin"
    status: int
    body_bytes: int


class Site:
    def __init__(self, d: Path, port: int, plain_port: int) -> None:
        self.dir, self.tls_port, self.plain_port = d, port, plain_port
        self.cert = d / "cert.pem"
        self.files = {p: (d / "www" / p.lstrip("/")).read_bytes() for p in FILES}

    def log(self) -> list[Logged]:
        out = []
        for line in (self.dir / "access.log").read_text().splitlines():
            port, nth, verb, path, status, size = line.split()
            out.append(Logged(int(port), int(nth), f"{verb} {path}", int(status), int(size)))
        return out

    def clear_log(self) -> None:
        (self.dir / "access.log").write_text("")

    def port(self, tls: bool) -> int:
        return self.tls_port if tls else self.plain_port

    def base(self, tls: bool) -> str:
        return f"https://127.0.0.1:{self.tls_port}" if tls else f"http://127.0.0.1:{self.plain_port}"

    def connect(self, tls: bool) -> http.client.HTTPConnection:
        if not tls:
            return http.client.HTTPConnection("127.0.0.1", self.plain_port, timeout=30)
        ctx = ssl.create_default_context(cafile=str(self.cert))
        return http.client.HTTPSConnection("127.0.0.1", self.tls_port, context=ctx, timeout=30)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    d = tmp_path_factory.mktemp("nginx-tls-load")
    make_cert(d)
    (d / "www").mkdir()
    rng = random.Random(23)
    for path, size in FILES.items():
        (d / "www" / path.lstrip("/")).write_bytes(rng.randbytes(size))
    plain: list[int] = []

    def conf(port: int) -> str:
        plain[:] = [free_port()]
        return CONF.format(d=d, port=port, plain=plain[0])

    with running_nginx(d, conf) as port:
        yield Site(d, port, plain[0])


def _headers() -> list[str]:
    return [f"{k}: {v}" for k, v in SECRETS.items()]


def _curl(site: Site, rounds: int, tls: bool) -> None:
    """One curl process per round: the two files and a 404 over one keep-alive connection."""
    base = site.base(tls)
    for _ in range(rounds):
        args = ["curl", "-sS", "--http1.1", "--cacert", str(site.cert)]
        for h in _headers():
            args += ["-H", h]
        urls = [f"{base}/1m.bin", f"{base}/8m.bin", f"{base}/missing"]
        args += [a for _ in urls for a in ("-o", "/dev/null")] + urls
        subprocess.run(args, check=True, capture_output=True, timeout=60)
        time.sleep(0.2)


def _python(site: Site, rounds: int, tls: bool) -> None:
    """http.client (over ssl: SSL_read_ex / SSL_write_ex): the two files and a POST per connection."""
    for _ in range(rounds):
        conn = site.connect(tls)
        try:
            for method, path in (("GET", "/1m.bin"), ("GET", "/8m.bin"), ("POST", "/post")):
                conn.request(method, path, body=b"qty=3" if method == "POST" else None, headers=dict(SECRETS))
                resp = conn.getresponse()
                body = resp.read()
                assert resp.status == 200 and (body == site.files.get(path) or body == POSTED)
        finally:
            conn.close()
        time.sleep(0.2)


def _small(site: Site, tls: bool) -> None:
    """Small GETs on one connection, from before the downloads start to after they end."""
    conn = site.connect(tls)
    try:
        for _ in range(SMALL_CALLS):
            conn.request("GET", "/small.txt", headers=dict(SECRETS))
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read() == site.files["/small.txt"]
            time.sleep(0.1)
    finally:
        conn.close()


def _record(site: Site, out: Path, rounds: int, tls: bool, **options: object) -> dict[str, object]:
    """Four downloading clients at once, beside a connection of small calls, while the recorder runs."""
    site.clear_log()
    rec = Recorder(RecordOptions(output=str(out), port=site.port(tls), **options)).start()  # type: ignore[arg-type]
    try:
        clients: list[Callable[[], None]] = [lambda: _curl(site, rounds, tls), lambda: _curl(site, rounds, tls),
                                             lambda: _python(site, rounds, tls), lambda: _python(site, rounds, tls)]
        threads = [threading.Thread(target=fn) for fn in [lambda: _small(site, tls), *clients]]
        for t in threads:
            t.start()
            time.sleep(0.3 if t is threads[0] else 0)   # a few small calls before the load
        for t in threads:
            t.join(120)
        time.sleep(0.5)     # the last syscalls reach the rings
    finally:
        result = rec.stop()
    return result


def _by_connection(path: Path) -> dict[int, list[Call]]:
    with Recording(path) as rec:
        ports = {f.id: f.src[1] for f in rec.flows()}
        out: dict[int, list[Call]] = collections.defaultdict(list)
        for call in sorted(rec.calls(), key=lambda c: c.request_ts_ns):
            out[ports[call.flow_id]].append(call)
    return out


def _body(call: Call) -> bytes:
    return b"".join(m.data for m in call.responses)


def _matches(call: Call, line: Logged, site: Site) -> bool:
    """The call is this request, with its own response: status, body length and bytes."""
    body = _body(call)
    want = site.files.get(call.method.split(" ", 1)[1], POSTED) if call.method else None
    return (call.method == line.method and call.status == line.status and len(body) == line.body_bytes
            and (line.status != 200 or body == want))


@pytest.fixture(scope="module")
def whole(site: Site, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("tls-load") / "downloads.rec"
    result = _record(site, out, rounds=3, tls=True)
    return {"out": out, "result": result, "log": site.log()}


def test_downloads_under_load_are_recorded_whole_and_equal_nginx_log(whole: dict, site: Site) -> None:
    log: list[Logged] = whole["log"]
    assert len(log) == 4 * 3 * 3 + SMALL_CALLS
    result = whole["result"]
    assert result["lost_events"] == 0 and result["truncated_events"] == 0, result
    calls = _by_connection(whole["out"])
    logged: dict[int, list[Logged]] = collections.defaultdict(list)
    for line in sorted(log, key=lambda x: (x.port, x.nth)):
        logged[line.port].append(line)
    assert sorted(calls) == sorted(logged)          # one flow per connection nginx saw
    for port, lines in logged.items():
        got = calls[port]
        assert [(c.method, c.status, len(_body(c))) for c in got] == \
            [(x.method, x.status, x.body_bytes) for x in lines], port
        assert all(_matches(c, x, site) for c, x in zip(got, lines, strict=True))
        assert all(call_damage(c.status, c.status_message, c.protocol) is None for c in got)
    with Recording(whole["out"]) as rec:
        meta = rec.meta
        summary = summarize(rec)
    tls = meta["tls"]
    assert tls["plaintext_flows"] == 12 + 1 and tls["encrypted_flows"] == 0
    assert tls["lost_plaintext_bytes"] == 0 and tls["flows_with_lost_plaintext"] == 0
    assert tls["ciphertext_bytes_not_stored"] > 3 * 4 * sum(FILES.values())   # counted, never stored
    assert summary["complete"], summary["problems"]


def _secret_pieces() -> set[bytes]:
    return {v.encode()[i:i + 6] for v in TOKENS.values() for i in range(len(v) - 5)}


# A ring too small: the TLS ring at 256 KiB (sixteen 16 KiB records); the recorder's own at its least
# for 64 KiB syscalls (512 KiB), drained every 100 ms, for plain HTTP
SHRUNK = {"tls": {"tls_ring_pages": 64}, "plain": {"max_bytes": 65536, "ring_pages": 1}}


@pytest.mark.parametrize("proto", sorted(SHRUNK))
def test_with_a_ring_too_small_losses_are_gaps_and_no_call_is_mispaired(site: Site, tmp_path: Path,
                                                                        proto: str) -> None:
    out = tmp_path / "lossy.rec"
    tls = proto == "tls"
    result = _record(site, out, rounds=2, tls=tls, **SHRUNK[proto])
    log = site.log()
    assert result["lost_events"] > 0, "the shrunk ring lost nothing: the test proves nothing"
    by_port: dict[int, list[Logged]] = collections.defaultdict(list)
    for line in log:
        by_port[line.port].append(line)
    calls = _by_connection(out)
    intact = marked = 0
    for port, got in calls.items():
        lines = sorted(by_port[port], key=lambda x: x.nth)
        at = 0
        for call in got:
            # whatever a call says is its own: a status line parsed from its response, or none and no
            # response bytes; a reason that is text (a body read as a status line is not)
            assert call.status is not None or not _body(call), (call.method, _body(call)[:40])
            assert (call.status_message or "").isprintable(), call.status_message
            if call_damage(call.status, call.status_message, call.protocol) is not None:
                marked += 1
                continue
            # an unmarked call is the next request of its connection that it equals, in order
            while at < len(lines) and not _matches(call, lines[at], site):
                at += 1
            assert at < len(lines), f"call {call.method} {call.status} {len(_body(call))} B on :{port} " \
                                    f"pairs with no request of its connection: {lines}"
            at += 1
            intact += 1
    assert marked > 0 and intact > 0, (marked, intact)
    with Recording(out) as rec:
        meta = rec.meta
        summary = summarize(rec)
    if tls:
        counts = meta["tls"]
        assert counts["encrypted_flows"] == 0 and counts["lost_events"] > 0
        assert counts["lost_plaintext_bytes"] > 0 and counts["flows_with_lost_plaintext"] > 0
    assert not summary["complete"] and any("gap" in p for p in summary["problems"])
    assert not any("libssl" in p for p in summary["problems"]), summary["problems"]
    pcap = tmp_path / "lossy.pcapng"
    export_file(out, pcap)
    files = [p for p in tmp_path.iterdir() if p.is_file()]    # the file, its WAL/SHM if left, the pcapng
    assert {out, pcap} <= set(files) and pcap.stat().st_size > 1 << 16
    stored = b"".join(p.read_bytes() for p in files)
    leaked = [piece for piece in _secret_pieces() if piece in stored]
    assert not leaked, leaked
