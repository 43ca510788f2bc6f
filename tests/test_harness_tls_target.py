"""A chaos scenario against a TLS service with shadow credentials: `target.external.tls` and
`set_headers`. The service is the real agent behind a real nginx that terminates TLS (HTTP/2, ALPN h2)
and passes the calls on with grpc_pass; the traffic goes through the local fault proxy, which carries
TLS bytes as they are."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.errors import ScenarioError
from harness.live import LiveView
from harness.runner import Runner, RunOptions
from harness.scenario import ExternalTarget
from harness.scenario_load import load_scenario_text
from tests.nginx import NGINX, PREAMBLE, TEMP_PATHS, running_nginx
from tests.test_replay_tls import Pki, needs_openssl, pki  # noqa: F401  (pki: the module's fixture)

_CONF = PREAMBLE + """
http {{
    log_format calls '$request_uri|$status|$server_protocol|$http_authorization|$http_x_shadowtest_replay';
    access_log {d}/access.log calls;""" + TEMP_PATHS + """    server {{
        listen 127.0.0.1:{port} ssl http2;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location / {{ grpc_pass grpc://{upstream}; }}
    }}
}}
"""


@contextlib.contextmanager
def _tls_front(tmp: Path, pki: Pki, upstream: str) -> Iterator[tuple[str, Path]]:  # noqa: F811
    """nginx on a free loopback port: TLS + HTTP/2 in front of `upstream` (h2c gRPC)."""
    d = tmp / "nginx"
    d.mkdir()
    conf = lambda port: _CONF.format(d=d, port=port, cert=pki.server_cert, key=pki.server_key,  # noqa: E731
                                     upstream=upstream)
    with running_nginx(d, conf) as port:
        yield f"127.0.0.1:{port}", d / "access.log"


SCENARIO = """\
name: tls-external
seed: 3
target:
  external:
    address: "{address}"
    metrics_url: "{metrics}"
    period_s: 0.5
    p99_threshold_ms: 1000
    tls: {{ca: "{ca}"}}
    set_headers: {{authorization: "Bearer shadow"}}
traffic: {{generator: {{rate: 30}}}}
phases:
  - {{name: only, duration: 3s}}
expect:
  - {{alert_silent: {{}}}}
  - {{no_loss: {{}}}}
"""


@pytest.mark.slow
@needs_openssl
@pytest.mark.skipif(NGINX is None, reason="needs nginx (apt-get install nginx; scripts/setup.sh does)")
def test_chaos_run_against_a_tls_service_with_shadow_credentials(tmp_path: Path, pki: Pki) -> None:  # noqa: F811
    from agent_under_test.launch import AgentProcess

    with AgentProcess(device="cpu", limiter="seed", period_s=0.5, initial_rate=300, max_rate=400) as agent, \
            _tls_front(tmp_path, pki, agent.grpc_address) as (address, log):
        scenario = load_scenario_text(SCENARIO.format(address=address, metrics=agent.metrics_url, ca=pki.ca))
        with (tmp_path / "live.txt").open("w") as stream:
            result = Runner(scenario, RunOptions(view=LiveView(scenario.name, stream=stream, rich=False))).run()
        time.sleep(0.2)
        lines = [line.split("|") for line in log.read_text().splitlines()]
    verdicts = {v.id: (v.passed, v.summary) for v in result.verdicts}
    assert all(ok for ok, _ in verdicts.values()), verdicts
    no_loss = next(v for v in result.verdicts if v.kind == "no_loss")
    sent = no_loss.evidence["client_sent"]
    assert sent > 45 and no_loss.evidence["agent_seen"] == sent          # through TLS, the proxy and nginx
    assert len(lines) == sent
    assert {(status, proto, auth, marker) for _, status, proto, auth, marker in lines} == \
        {("200", "HTTP/2.0", "Bearer shadow", "1")}


def _text(tls: str, faults: str = "") -> str:
    return f"""\
name: t
target:
  external:
    address: "127.0.0.1:9443"
    tls: {tls}
traffic: {{generator: {{rate: 10}}}}
phases:
  - {{name: only, duration: 2s{faults}}}
"""


def test_tls_target_problems_are_errors_at_their_line(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as missing:
        load_scenario_text(_text('{ca: "no-such-ca.pem"}'), "s.yaml", tmp_path)
    assert str(missing.value).startswith("s.yaml:5: target.external.tls:") and "no-such-ca.pem" in str(missing.value)
    with pytest.raises(ScenarioError) as unknown:
        load_scenario_text(_text("{cafile: x}"), "s.yaml", tmp_path)
    assert "s.yaml:5:" in str(unknown.value) and "cafile" in str(unknown.value)
    with pytest.raises(ScenarioError) as calls:
        load_scenario_text(_text("true", ", faults: [{network: grpc_error, share: 0.5}]"), "s.yaml", tmp_path)
    assert "s.yaml:3:" in str(calls.value) and "grpc_error cannot be applied to TLS traffic" in str(calls.value)
    plain = load_scenario_text(_text("true"), "s.yaml", tmp_path)
    assert isinstance(plain.target, ExternalTarget)
    assert plain.target.tls is not None and plain.target.tls.server_name == "127.0.0.1"  # the address's host
