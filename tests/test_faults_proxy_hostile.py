"""The fault proxy against hostile or unusual input: bad addresses, bad toxic attributes, and the HTTP
details Toxiproxy 2.12's Go server has (100 Continue, chunked bodies, strict booleans, text/plain errors)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
import time
from typing import Any

import pytest
from toxiproxy import Toxiproxy
from toxiproxy.exceptions import InvalidToxic

from faults.proxy import EmbeddedToxiproxy
from faults.proxy.channel import DATA, EOF, Chunk
from faults.proxy.toxics import TOXICS, slice_offsets
from faults.testing import EchoServer, VirtualStub, connect, read_exactly, wait_closed

TP_SEED = 3   # the tp fixture's (tests/conftest.py) toxics' randomness


def raw_http(tp: EmbeddedToxiproxy, request: bytes, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes, read one response (Content-Length framed); returns status, headers, body."""
    with socket.create_connection((tp.host, tp.port), timeout=timeout) as s:
        s.sendall(request)
        return _response(s)


def _response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = s.recv(65536)
        assert data, f"connection closed before a response: {buf!r}"
        buf += data
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    size = int(headers.get("content-length", "0"))
    while len(body) < size:
        data = s.recv(65536)
        assert data
        body += data
    return int(lines[0].split()[1]), headers, body


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}"
            "Connection: close\r\n\r\n").encode() + body


# ---- addresses: refused at creation/update, a failing dial closes the client at once --------------
@pytest.mark.parametrize("field, value, problem", [
    ("upstream", "localhost", "missing port in address"),
    ("upstream", "127.0.0.1:http", "invalid port"),
    ("upstream", "127.0.0.1:70000", "invalid port"),
    ("upstream", ":5000", "missing host in address"),
    ("upstream", "::1:5000", "too many colons in address"),
    ("listen", "127.0.0.1", "missing port in address"),
    ("listen", "127.0.0.1:-1", "invalid port"),
])
def test_bad_addresses_are_refused_with_400(tp: EmbeddedToxiproxy, echo: EchoServer, field: str, value: str,
                                            problem: str) -> None:
    body = {"name": "p", "upstream": echo.addr, field: value}
    status, headers, out = raw_http(tp, post("/proxies", json.dumps(body).encode()))
    assert status == 400
    assert json.loads(out) == {"error": f"bad request body: {field}: address {value}: {problem}", "status": 400}
    assert raw_http(tp, b"GET /proxies HTTP/1.1\r\nConnection: close\r\n\r\n")[2] == b"{}"
    # and on update, leaving the proxy as it was
    tp.create_proxy("q", upstream=echo.addr)
    status, _, out = raw_http(tp, post("/proxies/q", json.dumps({field: value}).encode()))
    assert status == 400 and problem in json.loads(out)["error"]
    assert tp.proxies()["q"]["upstream"] == echo.addr


def test_client_drives_address_errors(tp: EmbeddedToxiproxy) -> None:
    client = Toxiproxy()
    client.update_api_consumer("127.0.0.1", tp.port)
    with pytest.raises(InvalidToxic):  # toxiproxy-python's name for any 400
        client.create(upstream="localhost", name="noport")
    assert client.proxies() == {}


def test_a_failing_dial_closes_the_client_at_once(tp: EmbeddedToxiproxy, echo: EchoServer,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    p = tp.create_proxy("dial", upstream=echo.addr)
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
    bad = {"upstream-refused": dead, "no-port (set behind the API's back)": "localhost"}
    assert tp.loop is not None and tp.collection is not None
    for _why, upstream in bad.items():
        tp.collection.proxies["dial"].upstream = upstream   # as a proxy created before validation was
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="faults.proxy.proxy"):
            start = time.monotonic()
            s = connect(p["listen"])
            s.sendall(b"hello")
            assert wait_closed(s, 3.0), upstream
            assert time.monotonic() - start < 2.0
            s.close()
            time.sleep(0.05)
        lines = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert not tp.collection.proxies["dial"].connections


# ---- Toxiproxy's JSON decoding and error format ---------------------------------------------------
@pytest.mark.parametrize("value, kind", [("no", "string"), (0, "number"), ([], "array"), ({}, "object")])
def test_enabled_must_be_a_json_boolean(tp: EmbeddedToxiproxy, echo: EchoServer, value: Any, kind: str) -> None:
    want = {"error": f"bad request body: json: cannot unmarshal {kind} into Go struct field Proxy.enabled "
                     "of type bool", "status": 400}
    body = json.dumps({"name": "p", "upstream": echo.addr, "enabled": value}).encode()
    status, _, out = raw_http(tp, post("/proxies", body))
    assert (status, json.loads(out)) == (400, want)
    tp.create_proxy("p", upstream=echo.addr)
    status, _, out = raw_http(tp, post("/proxies/p", json.dumps({"enabled": value}).encode()))
    assert (status, json.loads(out)) == (400, want)
    assert tp.proxies()["p"]["enabled"] is True
    status, _, out = raw_http(tp, post("/proxies/p", b'{"enabled": false}'))
    assert status == 200 and json.loads(out)["enabled"] is False


def test_error_bodies_are_go_http_error(tp: EmbeddedToxiproxy) -> None:
    status, headers, out = raw_http(tp, b"GET /proxies/none HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert status == 404
    assert headers["content-type"] == "text/plain; charset=utf-8"
    assert headers["x-content-type-options"] == "nosniff"
    assert out == b'{"error":"proxy not found","status":404}\n'
    status, headers, out = raw_http(tp, post("/proxies", b'{"name": "<&>"}'))
    assert status == 400 and out == b'{"error":"missing required field: upstream","status":400}\n'
    status, headers, _ = raw_http(tp, b"GET /version HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert status == 200 and headers["content-type"] == "application/json;charset=utf-8"


# ---- HTTP: Expect: 100-continue and chunked request bodies ----------------------------------------
def test_expect_100_continue_is_answered_before_the_body(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    body = json.dumps({"name": "c", "upstream": echo.addr}).encode()
    with socket.create_connection((tp.host, tp.port), timeout=5) as s:
        s.sendall(f"POST /proxies HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                  "Expect: 100-continue\r\nConnection: close\r\n\r\n".encode())
        assert read_exactly(s, 25, timeout=5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        status, _, out = _response(s)
    assert status == 201 and json.loads(out)["name"] == "c"
    status, _, _ = raw_http(tp, post("/reset", b"", "Expect: teapot\r\n"))
    assert status == 417


def test_chunked_request_bodies(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    body = json.dumps({"name": "ch", "upstream": echo.addr}).encode()
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    req = (b"POST /proxies HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
           + chunks + b"0\r\nX-Trailer: 1\r\n\r\n")
    status, _, out = raw_http(tp, req)
    assert status == 201 and json.loads(out)["name"] == "ch"
    head = b"POST /proxies HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert raw_http(tp, head + b"zz\r\n")[0] == 400
    assert raw_http(tp, head + b"%x\r\n" % ((8 << 20) + 1))[0] == 413  # bounded: refused before reading
    assert raw_http(tp, head.replace(b"chunked", b"gzip"))[0] == 501


# ---- toxic attributes ------------------------------------------------------------------------------
@pytest.mark.parametrize("ttype, attrs, message", [
    ("slicer", {"average_size": 64, "size_variation": -1}, "SlicerToxic.attributes.size_variation -1 must be"),
    ("slicer", {"average_size": 64, "size_variation": 128}, "size_variation 128 must be less than average_size"),
    ("slicer", {"average_size": 64, "size_variation": 64}, "must be less than average_size 64"),
    ("slicer", {"average_size": -5}, "average_size -5 must be at least 0"),
    ("latency", {"latency": -1}, "LatencyToxic.attributes.latency -1 must be at least 0"),
    ("bandwidth", {"rate": -10}, "rate -10 must be at least 0"),
    ("limit_data", {"bytes": -1}, "bytes -1 must be at least 0"),
    ("grpc_error", {"status": 99}, "status 99 must be between 1 and 16"),
    ("grpc_delay", {"share": 1.5}, "share 1.5 must be between 0 and 1"),
])
def test_toxic_attributes_out_of_range_are_400(tp: EmbeddedToxiproxy, echo: EchoServer, ttype: str,
                                               attrs: dict[str, Any], message: str) -> None:
    tp.create_proxy("t", upstream=echo.addr)
    body = json.dumps({"type": ttype, "attributes": attrs}).encode()
    status, _, out = raw_http(tp, post("/proxies/t/toxics", body))
    assert status == 400 and message in json.loads(out)["error"], out
    assert tp.proxies()["t"]["toxics"] == []


def test_patch_into_an_invalid_slicer_is_refused_and_keeps_the_old(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    tp.create_proxy("t", upstream=echo.addr)
    tp.add_toxic("t", "slicer", {"average_size": 100, "size_variation": 10})
    req = (b"PATCH /proxies/t/toxics/slicer_downstream HTTP/1.1\r\nContent-Length: 39\r\n"
           b"Connection: close\r\n\r\n" + b'{"attributes": {"size_variation": 500}}')
    assert raw_http(tp, req)[0] == 400
    assert tp.proxies()["t"]["toxics"][0]["attributes"]["size_variation"] == 10


# ---- the slicer: never more, fewer or different bytes than sent --------------------------------------
def test_slice_offsets_cover_exactly_for_any_input() -> None:
    rng = random.Random(int(os.environ.get("SLICER_SEED", "18")))
    for _ in range(2000):
        size = rng.choice([0, 1, 2, 3, rng.randrange(4, 100), rng.randrange(100, 70000)])
        average = rng.choice([-3, 0, 1, 2, rng.randrange(1, 50), rng.randrange(50, 5000)])
        variation = rng.choice([-50, 0, 1, average, average * 3, rng.randrange(0, 10000)])
        cuts = slice_offsets(random.Random(rng.getrandbits(32)), size, average, variation)
        assert cuts[0] == 0 and cuts[-1] == size, (size, average, variation)
        assert all(a < b for a, b in zip(cuts, cuts[1:], strict=False)) or size == 0, (size, average, variation)
    # the case of the report: 2,048 bytes, variation above the average
    cuts = slice_offsets(random.Random(1), 2048, 100, 400)
    assert cuts[-1] == 2048 and sorted(set(cuts)) == cuts
    assert slice_offsets(random.Random(1), 1 << 18, 1, 0)[-1] == 1 << 18  # 262,144 pieces: no RecursionError


def test_slicer_pipe_delivers_what_was_sent_even_past_validation() -> None:
    rng = random.Random(5)
    for _ in range(200):
        data = rng.randbytes(rng.randrange(1, 5000))
        attrs = {"average_size": rng.randrange(1, 300), "size_variation": rng.randrange(0, 2000), "delay": 0}
        toxic = TOXICS["slicer"](attrs)   # built directly: the API would refuse variation >= average
        stub = VirtualStub([Chunk(data, 0.0), Chunk(b"", 0.0, EOF)], seed=rng.getrandbits(32))
        asyncio.run(toxic.pipe(stub))
        assert b"".join(d for _, d, k in stub.sent if k == DATA) == data, attrs


def test_slicer_through_the_proxy_with_random_valid_inputs(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    rng = random.Random(7)
    p = tp.create_proxy("sl", upstream=echo.addr)
    for i in range(12):
        average = rng.randrange(1, 400)
        attrs = {"average_size": average, "size_variation": rng.randrange(0, average), "delay": 0}
        tp.add_toxic("sl", "slicer", attrs, name=f"s{i}")
        sent = rng.randbytes(rng.randrange(1, 20000))
        with connect(p["listen"]) as s:
            s.sendall(sent)
            s.shutdown(socket.SHUT_WR)   # the echo closes after the last byte: read to the end
            got = read_exactly(s, len(sent) + 1, timeout=5.0)
        assert got == sent, (attrs, len(got), len(sent))
        tp.remove_toxic("sl", f"s{i}")
