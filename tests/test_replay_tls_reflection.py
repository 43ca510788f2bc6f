"""Reflection (for --compare and for naming calls of unknown method) over TLS, with the replay's metadata.

A TLS target used to be asked for reflection over a cleartext channel, which it cannot answer; now the
reflection channel uses the replay's TLS settings and carries its --set-header credentials and marker.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from replay.compare import CompareError, CompareSpec, descriptors_from_reflection
from replay.senders.tls import TlsConfig
from tests.test_replay_tls import Pki, needs_openssl, pki  # noqa: F401  (pki: the module's fixture)

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class _Seen(grpc.ServerInterceptor):
    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.metadata.append({k: v for k, v in details.invocation_metadata if isinstance(v, str)})
        return continuation(details)


@pytest.fixture
def tls_reflection_server(pki: Pki) -> Iterator[tuple[str, _Seen]]:  # noqa: F811
    seen = _Seen()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=(seen,))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    reflection.enable_server_reflection((HEALTH, reflection.SERVICE_NAME), server)
    creds = grpc.ssl_server_credentials([(pki.server_key.read_bytes(), pki.server_cert.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        server.stop(None).wait(5)


@needs_openssl
def test_reflection_over_tls_uses_the_ca_and_carries_the_replay_metadata(
        tls_reflection_server: tuple[str, _Seen], pki: Pki) -> None:  # noqa: F811
    address, seen = tls_reflection_server
    meta = (("authorization", "Bearer shadow"), ("x-shadowtest-replay", "1"))
    desc = descriptors_from_reflection(address, 5.0, tls=TlsConfig(ca=str(pki.ca)), metadata=meta)
    assert HEALTH in desc.services
    assert seen.metadata and all(md.get("authorization") == "Bearer shadow"
                                 and md.get("x-shadowtest-replay") == "1" for md in seen.metadata)
    # the spec the replay builds (and each worker rebuilds) carries the same settings
    comparer = CompareSpec("reflection", (), TlsConfig(ca=str(pki.ca)), meta).build(address)
    assert comparer is not None


@needs_openssl
def test_reflection_of_a_tls_target_fails_in_one_line_without_tls_or_with_insecure(
        tls_reflection_server: tuple[str, _Seen], pki: Pki) -> None:  # noqa: F811
    address, _ = tls_reflection_server
    with pytest.raises(CompareError) as plain:
        descriptors_from_reflection(address, 1.0)
    assert "\n" not in str(plain.value) and "--descriptors" in str(plain.value)
    with pytest.raises(CompareError) as insecure:
        descriptors_from_reflection(address, 1.0, tls=TlsConfig(insecure=True))
    assert "--ca" in str(insecure.value) and "\n" not in str(insecure.value)
    with pytest.raises(CompareError) as wrong_ca:
        descriptors_from_reflection(address, 2.0, tls=TlsConfig(ca=str(pki.other_ca)))
    assert "over TLS" in str(wrong_ca.value) and "\n" not in str(wrong_ca.value)
