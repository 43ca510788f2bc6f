"""The same network-fault scenario through toxiproxy-python against every backend available:
the embedded proxy, a proxy server at a URL, and a real toxiproxy-server when one is on PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from faults.network import NetworkFaults
from faults.proxy import spawn_proxy_server
from faults.state import FaultRegistry
from faults.testing import EchoServer, connect, read_exactly
from wire.process import spawn

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["embedded", "url", "toxiproxy-server"])
def network(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NetworkFaults]:
    reg = FaultRegistry(tmp_path / "state")
    if request.param == "toxiproxy-server":
        if not shutil.which("toxiproxy-server"):
            pytest.skip("toxiproxy-server is not on PATH (not installable here; CI may have it)")
        with NetworkFaults(registry=reg) as nf:
            yield nf
    elif request.param == "url":
        with spawn_proxy_server() as server, NetworkFaults(url=server.url, registry=reg) as nf:
            yield nf
    else:
        with NetworkFaults(registry=reg, prefer_embedded=True) as nf:
            yield nf


def scenario_rtts(nf: NetworkFaults, upstream: str) -> tuple[float, float, float]:
    """Baseline, under a 100 ms latency toxic, and after it: one connection throughout."""
    proxy = nf.proxy("agent", upstream)

    def rtt(s: object) -> float:
        t0 = time.monotonic()
        s.sendall(b"ping")  # type: ignore[attr-defined]
        assert read_exactly(s, 4) == b"ping"  # type: ignore[arg-type]
        return time.monotonic() - t0

    with connect(proxy.listen) as s:
        before = rtt(s)
        with nf.toxic("agent", "latency", {"latency": 100}) as name:
            assert name == "latency_downstream"
            assert nf.registry.path.exists()  # recorded while in effect
            during = rtt(s)
        after = rtt(s)
    return before, during, after


def test_same_scenario_on_each_backend(network: NetworkFaults) -> None:
    with EchoServer() as echo:
        before, during, after = scenario_rtts(network, echo.addr)
    assert before < 0.08 and during >= 0.095 and after < 0.08  # 100 ms toxic (5 ms early tolerance)
    assert not network.registry.path.exists()
    assert network.client.get_proxy("agent").toxics() == {}


def test_unreachable_url_says_what_to_do(tmp_path: Path) -> None:
    from faults.errors import ProxyUnavailableError

    with pytest.raises(ProxyUnavailableError, match="start toxiproxy-server"):
        NetworkFaults(url="http://127.0.0.1:1", registry=FaultRegistry(tmp_path)).start()


def test_cli_proxy_serve_answers_the_api(tmp_path: Path) -> None:
    config = tmp_path / "proxies.json"
    config.write_text(json.dumps([{"name": "pre", "upstream": "127.0.0.1:9", "listen": "127.0.0.1:0"}]))
    proc = spawn([sys.executable, "-m", "harness.cli", "proxy", "serve", "--port", "0", "--json",
                  "--config", str(config)], stdout=subprocess.PIPE, stderr=None, text=True, cwd=str(ROOT),
                 env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["listening"]
        import urllib.request

        with urllib.request.urlopen(url + "/proxies", timeout=5) as r:
            assert list(json.loads(r.read())) == ["pre"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
