"""Network faults through the `toxiproxy-python` client, against a real Toxiproxy or the embedded one.

    NetworkFaults(url="http://ci-toxiproxy:8474")   a running toxiproxy-server
    NetworkFaults()                                 toxiproxy-server from PATH if present, else embedded

Either way the scenario is the same code: `proxy()` to route a target through it, `toxic()` as a
context manager that is recorded in the crash-safe state file before it is added.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from faults.errors import ProxyApiError, ProxyUnavailableError
from faults.process import OwnedProcess
from faults.proxy.server import EmbeddedToxiproxy
from faults.state import FaultRegistry, default_registry
from wire.process import free_port


def _wait_listening(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return True
        time.sleep(0.05)
    return False


class NetworkFaults:
    """A Toxiproxy server (real or embedded) driven by toxiproxy-python."""

    def __init__(self, url: str | None = None, binary: str | None = None, seed: int = 0,
                 registry: FaultRegistry | None = None, prefer_embedded: bool = False) -> None:
        self.url, self.binary, self.seed = url, binary, seed
        self.prefer_embedded = prefer_embedded
        self.registry = registry or default_registry()
        self.kind = ""
        self.embedded: EmbeddedToxiproxy | None = None
        self._owned: OwnedProcess | None = None

    def start(self) -> NetworkFaults:
        """Connect to `url`, or start toxiproxy-server, or the embedded proxy (in that order)."""
        binary = self.binary or (None if self.prefer_embedded else shutil.which("toxiproxy-server"))
        if self.url:
            self.kind = "real"
        elif binary:
            port = free_port()
            self._owned = OwnedProcess([binary, "-host", "127.0.0.1", "-port", str(port)],
                                       registry=self.registry).start()
            self.url, self.kind = f"http://127.0.0.1:{port}", "real-spawned"
        else:
            self.embedded = EmbeddedToxiproxy(seed=self.seed).start()
            self.url, self.kind = self.embedded.url, "embedded"
        u = urlparse(self.url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 8474
        if not _wait_listening(self.host, self.port, 10):
            self.stop()
            raise ProxyUnavailableError(f"no Toxiproxy API at {self.url} (start toxiproxy-server or drop --url)")
        return self

    def stop(self) -> None:
        if self.embedded is not None:
            self.embedded.stop()
            self.embedded = None
        if self._owned is not None:
            self._owned.stop()
            self._owned = None

    def __enter__(self) -> NetworkFaults:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def client(self) -> Any:
        """A toxiproxy-python `Toxiproxy` pointed at this server (its API consumer is global state)."""
        from toxiproxy import Toxiproxy

        tp = Toxiproxy()
        tp.update_api_consumer(self.host, self.port)
        return tp

    def proxy(self, name: str, upstream: str, listen: str = "127.0.0.1:0") -> Any:
        """Create (or replace) proxy `name` -> `upstream`; returns the toxiproxy-python Proxy."""
        tp = self.client
        old = tp.get_proxy(name)
        if old is not None:
            tp.destroy(old)
        return tp.create(upstream=upstream, name=name, listen=listen)

    @contextlib.contextmanager
    def toxic(self, proxy: str, type: str, attributes: dict[str, Any] | None = None, stream: str = "downstream",
              toxicity: float = 1.0, name: str | None = None) -> Iterator[str]:
        """Add a toxic for the duration; recorded before it is added, removed on any exit."""
        from toxiproxy.exceptions import InvalidToxic, NotFound

        toxic_name = name or f"{type}_{stream}"
        p = self.client.get_proxy(proxy)
        if p is None:
            raise ProxyApiError(f"proxy {proxy} not found on {self.url} (create it with proxy())", 404)

        def undo(_entry: dict[str, Any]) -> None:
            with contextlib.suppress(NotFound, ConnectionError):
                self.client.get_proxy(proxy).destroy_toxic(toxic_name)

        with self.registry.hold("toxic", undo, api=self.url, proxy=proxy, toxic=toxic_name):
            try:
                p.add_toxic(type=type, stream=stream, toxicity=toxicity, attributes=attributes or {},
                            name=toxic_name)
            except (InvalidToxic, NotFound) as exc:
                raise ProxyApiError(f"cannot add toxic {toxic_name}: {exc}", 400) from exc
            yield toxic_name

    def effects(self, proxy: str, timeout: float = 2.0) -> dict[str, Any] | None:
        """What each toxic of `proxy` was measured to do, by toxic name (shadowtest's proxy only:
        `GET /proxies/{proxy}/effects`); None when the server has no such endpoint (toxiproxy-server)
        or does not answer."""
        import json
        import urllib.error
        import urllib.request
        from urllib.parse import quote

        try:
            with urllib.request.urlopen(f"{self.url}/proxies/{quote(proxy, safe='')}/effects",
                                        timeout=timeout) as resp:
                body = json.loads(resp.read())
        except (OSError, ValueError, urllib.error.URLError):
            return None
        return body if isinstance(body, dict) else None

    def reset(self) -> None:
        self.client.reset()
