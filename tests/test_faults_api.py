"""The embedded proxy speaks Toxiproxy 2.x's HTTP API: toxiproxy-python through every endpoint it
has, raw HTTP for the rest (PATCH, populate, error bodies)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest
from toxiproxy import Toxiproxy
from toxiproxy.exceptions import InvalidToxic, NotFound, ProxyExists

from faults.proxy import EmbeddedToxiproxy
from faults.testing import EchoServer, connect, read_exactly

TP_SEED = 1   # the tp fixture's (tests/conftest.py) toxics' randomness


@pytest.fixture
def client(tp: EmbeddedToxiproxy) -> Toxiproxy:
    c = Toxiproxy()
    c.update_api_consumer("127.0.0.1", tp.port)
    return c


def http(tp: EmbeddedToxiproxy, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(tp.url + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read()
            return r.status, json.loads(text) if text.strip() else None
    except urllib.error.HTTPError as exc:
        text = exc.read()
        try:
            return exc.code, json.loads(text)
        except json.JSONDecodeError:
            return exc.code, text.decode()


def test_client_drives_every_endpoint(client: Toxiproxy, echo: EchoServer, tp: EmbeddedToxiproxy) -> None:
    assert json.loads(client.version()) == {"version": "2.12.0"}
    assert client.running()
    proxy = client.create(upstream=echo.addr, name="echo")
    assert proxy.listen.startswith("127.0.0.1:") and proxy.enabled is True
    with pytest.raises(ProxyExists):
        client.create(upstream=echo.addr, name="echo")
    assert set(client.proxies()) == {"echo"}
    assert client.get_proxy("echo").upstream == echo.addr
    proxy.add_toxic(type="latency", attributes={"latency": 10})
    toxics = proxy.toxics()
    assert list(toxics) == ["latency_downstream"]
    assert toxics["latency_downstream"].attributes == {"latency": 10, "jitter": 0}
    assert proxy.get_toxic("latency_downstream").stream == "downstream"
    with pytest.raises(InvalidToxic):
        proxy.add_toxic(type="no-such-toxic")
    assert proxy.destroy_toxic("latency_downstream")
    with pytest.raises(NotFound):
        proxy.destroy_toxic("latency_downstream")
    with proxy.down():  # disable: nothing listens
        with pytest.raises(OSError):
            connect(proxy.listen, timeout=1).close()
    with connect(proxy.listen) as s:  # enabled again, same address
        s.sendall(b"ping")
        assert read_exactly(s, 4) == b"ping"
    proxy.add_toxic(type="latency", attributes={"latency": 10})
    assert client.reset()
    assert proxy.toxics() == {}
    client.destroy_all()
    assert client.proxies() == {}


def test_shapes_defaults_and_patch(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    status, p = http(tp, "POST", "/proxies", {"name": "a", "upstream": echo.addr, "listen": "127.0.0.1:0"})
    assert status == 201 and p["toxics"] == [] and p["enabled"] is True
    status, t = http(tp, "POST", "/proxies/a/toxics", {"type": "slicer"})
    assert status == 200
    assert t == {"attributes": {"average_size": 0, "size_variation": 0, "delay": 0}, "name": "slicer_downstream",
                 "type": "slicer", "stream": "downstream", "toxicity": 1.0}
    status, t = http(tp, "PATCH", "/proxies/a/toxics/slicer_downstream", {"attributes": {"delay": 5}, "toxicity": 0.5})
    assert status == 200 and t["attributes"]["delay"] == 5 and t["attributes"]["average_size"] == 0
    assert t["toxicity"] == 0.5
    http(tp, "POST", "/proxies/a/toxics", {"type": "latency", "stream": "upstream", "name": "up"})
    status, arr = http(tp, "GET", "/proxies/a/toxics")
    assert [x["name"] for x in arr] == ["up", "slicer_downstream"]  # upstream toxics first, as Toxiproxy
    status, p = http(tp, "PATCH", "/proxies/a", {"enabled": False})
    assert status == 200 and p["enabled"] is False
    status, p = http(tp, "POST", "/proxies/a", {"enabled": True})  # POST is the deprecated alias
    assert status == 200 and p["enabled"] is True
    assert http(tp, "GET", "/proxies/a/toxics/up")[0] == 200
    assert http(tp, "DELETE", "/proxies/a/toxics/up") == (204, None)
    assert http(tp, "DELETE", "/proxies/a") == (204, None)


def test_populate_creates_keeps_and_replaces(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    body = [{"name": "x", "upstream": echo.addr, "listen": "127.0.0.1:0"},
            {"name": "y", "upstream": echo.addr, "enabled": False}]
    status, out = http(tp, "POST", "/populate", body)
    assert status == 201 and [p["name"] for p in out["proxies"]] == ["x", "y"]
    assert out["proxies"][1]["enabled"] is False
    status, out = http(tp, "POST", "/populate", [{"name": "x", "upstream": "127.0.0.1:1"}])
    assert status == 201 and out["proxies"][0]["upstream"] == "127.0.0.1:1"
    status, out = http(tp, "POST", "/populate", [{"name": "z"}])
    assert status == 400 and out["error"] == "missing required field: upstream at proxy 1"
    assert "z" not in http(tp, "GET", "/proxies")[1]


@pytest.mark.parametrize("method,path,body,code,error", [
    ("GET", "/proxies/nope", None, 404, "proxy not found"),
    ("POST", "/proxies", {"upstream": "127.0.0.1:1"}, 400, "missing required field: name"),
    ("POST", "/proxies", {"name": "n"}, 400, "missing required field: upstream"),
    ("POST", "/proxies/p/toxics", {"type": "latency", "stream": "sideways"}, 400,
     "stream was invalid, can be either upstream or downstream"),
    ("POST", "/proxies/p/toxics", {"type": "warp"}, 400, "invalid toxic type"),
    ("POST", "/proxies/p/toxics", {"type": "latency", "name": "dup"}, 409, "toxic already exists"),
    ("GET", "/proxies/p/toxics/none", None, 404, "toxic not found"),
    ("PATCH", "/proxies/p/toxics/none", {}, 404, "toxic not found"),
    ("DELETE", "/proxies/nope/toxics/x", None, 404, "proxy not found"),
    ("POST", "/proxies/p/toxics", {"type": "latency", "attributes": {"latency": "1s"}}, 400,
     "bad request body: json: cannot unmarshal string into Go struct field LatencyToxic.attributes.latency of type int64"),
])
def test_errors_match_toxiproxy(tp: EmbeddedToxiproxy, echo: EchoServer, method: str, path: str, body: Any,
                                code: int, error: str) -> None:
    http(tp, "POST", "/proxies", {"name": "p", "upstream": echo.addr})
    http(tp, "POST", "/proxies/p/toxics", {"type": "latency", "name": "dup"})
    status, out = http(tp, method, path, body)
    assert (status, out) == (code, {"error": error, "status": code})


def test_bad_json_unknown_route_and_listen_conflict(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    status, out = http(tp, "POST", "/proxies", raw=b"{nope")
    assert status == 400 and out["error"].startswith("bad request body")
    assert http(tp, "GET", "/nothing-here")[0] == 404
    assert http(tp, "PUT", "/proxies")[0] == 405
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        status, out = http(tp, "POST", "/proxies", {"name": "c", "upstream": echo.addr,
                                                    "listen": f"127.0.0.1:{busy.getsockname()[1]}"})
    assert status == 500 and out["status"] == 500
    assert "c" not in http(tp, "GET", "/proxies")[1]


def test_python_api_reports_when_applied(tp: EmbeddedToxiproxy, echo: EchoServer) -> None:
    import time

    listen = tp.create_proxy("e", echo.addr)["listen"]
    with connect(listen) as s:
        s.sendall(b"x")
        read_exactly(s, 1)
        before = time.monotonic()
        applied = tp.add_toxic("e", "latency", {"latency": 100})
        assert before <= applied.applied_at <= time.monotonic()
        t0 = time.monotonic()
        s.sendall(b"y")
        assert read_exactly(s, 1) == b"y"
        assert time.monotonic() - t0 >= 0.09  # already live on the open connection
        gone = tp.remove_toxic("e", applied.name)
        assert gone.applied_at >= applied.applied_at
    with pytest.raises(Exception, match="toxic not found"):
        tp.remove_toxic("e", applied.name)


def test_recorded_toxic_context_and_async_api(tp: EmbeddedToxiproxy, echo: EchoServer, tmp_path: Any) -> None:
    import asyncio

    from faults.state import FaultRegistry

    reg = FaultRegistry(tmp_path)
    tp.create_proxy("ctx", echo.addr)
    with tp.toxic("ctx", "latency", {"latency": 5}, registry=reg) as applied:
        entries = json.loads(reg.path.read_text())["entries"]
        assert [e["toxic"] for e in entries.values()] == [applied.name]
        assert [t["name"] for t in tp.proxies()["ctx"]["toxics"]] == ["latency_downstream"]
    assert tp.proxies()["ctx"]["toxics"] == [] and not reg.path.exists()

    async def phases() -> tuple[float, float]:
        added = await tp.aadd_toxic("ctx", "bandwidth", {"rate": 100})
        removed = await tp.aremove_toxic("ctx", added.name)
        return added.applied_at, removed.applied_at

    added_at, removed_at = asyncio.run(phases())
    assert added_at <= removed_at and tp.proxies()["ctx"]["toxics"] == []
