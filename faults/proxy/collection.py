"""The set of proxies behind the API: every operation Toxiproxy's ApiServer offers, as coroutines.

Each mutating call returns only after every live connection has switched (as Toxiproxy waits for
its links), and records `loop.time()` at that moment in `applied_at`: the harness uses it to know
when a fault really took effect.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from faults.proxy.model import (
    ERR_BAD_REQUEST_BODY,
    ERR_MISSING_FIELD,
    ERR_PROXY_ALREADY_EXISTS,
    ERR_PROXY_NOT_FOUND,
    ERR_TOXIC_ALREADY_EXISTS,
    ERR_TOXIC_NOT_FOUND,
    ApiError,
    spec_from_json,
    spec_updated,
)
from faults.proxy.proxy import Proxy

_GO_KINDS = {bool: "bool", int: "number", float: "number", str: "string", list: "array", dict: "object"}


def _typed(body: dict[str, Any], where: str = "") -> None:
    """Go's decoder into toxiproxy.Proxy: name/listen/upstream strings, enabled a JSON boolean (else 400)."""
    for key, want in (("name", str), ("listen", str), ("upstream", str), ("enabled", bool)):
        value = body.get(key)
        if value is None or isinstance(value, want):
            continue
        go_type = "bool" if want is bool else "string"
        raise ERR_BAD_REQUEST_BODY.joined(
            f"json: cannot unmarshal {_GO_KINDS.get(type(value), 'value')} into Go struct field "
            f"Proxy.{key} of type {go_type}{where}")


def _check_address(field: str, addr: str, where: str = "") -> None:
    """HOST:PORT with a port 0-65535 (a host is required upstream); else 400 before anything listens or dials."""
    host, sep, port = addr.rpartition(":")
    problem = ""
    if not sep:
        problem = "missing port in address"
    elif not port.isdigit() or int(port) > 65535:
        problem = "invalid port"
    elif field == "upstream" and not host.strip("[]"):
        problem = "missing host in address"
    elif host.count(":") and not (host.startswith("[") and host.endswith("]")):
        problem = "too many colons in address"
    if problem:
        raise ERR_BAD_REQUEST_BODY.joined(f"{field}{where}: address {addr}: {problem}")


class ProxyCollection:
    """Named proxies; one lock serialises changes, like Toxiproxy's collection mutex."""

    def __init__(self, seed: int = 0) -> None:
        self.proxies: dict[str, Proxy] = {}
        self.rng = random.Random(seed)
        self.lock = asyncio.Lock()
        self.applied_at = 0.0

    def _mark(self) -> None:
        self.applied_at = asyncio.get_running_loop().time()

    def get(self, name: str) -> Proxy:
        proxy = self.proxies.get(name)
        if proxy is None:
            raise ERR_PROXY_NOT_FOUND
        return proxy

    @staticmethod
    def _fields(body: Any, where: str = "") -> tuple[str, str, str, bool]:
        if not isinstance(body, dict):
            raise ERR_BAD_REQUEST_BODY.joined("json: cannot unmarshal into Go value of type toxiproxy.Proxy")
        _typed(body, where)
        name, upstream = body.get("name") or "", body.get("upstream") or ""
        if not name:
            raise ERR_MISSING_FIELD.joined("name" + where)
        if not upstream:
            raise ERR_MISSING_FIELD.joined("upstream" + where)
        listen = str(body.get("listen") or "127.0.0.1:0")
        _check_address("listen", listen, where)
        _check_address("upstream", upstream, where)
        enabled = body.get("enabled")
        return name, listen, upstream, True if enabled is None else enabled

    async def create(self, body: Any) -> Proxy:
        name, listen, upstream, enabled = self._fields(body)
        async with self.lock:
            if name in self.proxies:
                raise ERR_PROXY_ALREADY_EXISTS
            proxy = Proxy(name, listen, upstream, random.Random(self.rng.getrandbits(64)))
            if enabled:
                await proxy.start()
            self.proxies[name] = proxy
            self._mark()
            return proxy

    async def populate(self, body: Any) -> list[Proxy]:
        """Create or replace many proxies; validate all before changing anything."""
        if not isinstance(body, list):
            raise ERR_BAD_REQUEST_BODY.joined("json: cannot unmarshal object into Go value of type []struct")
        wanted = [self._fields(item, f" at proxy {i + 1}") for i, item in enumerate(body)]
        names = [w[0] for w in wanted]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ApiError(f'duplicate proxy name "{dup}"', 500)
        out = []
        async with self.lock:
            for name, listen, upstream, enabled in wanted:
                old = self.proxies.get(name)
                if old is not None and old.listen == listen and old.upstream == upstream:
                    out.append(old)
                    continue
                if old is not None:
                    await old.stop()
                proxy = Proxy(name, listen, upstream, random.Random(self.rng.getrandbits(64)))
                if enabled:
                    await proxy.start()
                self.proxies[name] = proxy
                out.append(proxy)
            self._mark()
        return out

    async def update(self, name: str, body: Any) -> Proxy:
        async with self.lock:
            proxy = self.get(name)
            if not isinstance(body, dict):
                raise ERR_BAD_REQUEST_BODY.joined("json: cannot unmarshal into Go value of type toxiproxy.Proxy")
            _typed(body)
            listen = str(body.get("listen") or proxy.listen)
            upstream = str(body.get("upstream") or proxy.upstream)
            _check_address("listen", listen)
            _check_address("upstream", upstream)
            enabled = proxy.enabled if body.get("enabled") is None else bool(body["enabled"])
            if listen != proxy.listen or upstream != proxy.upstream:
                await proxy.stop()
                proxy.listen, proxy.upstream = listen, upstream
            if enabled and not proxy.enabled:
                await proxy.start()
            elif not enabled and proxy.enabled:
                await proxy.stop()
            self._mark()
            return proxy

    async def delete(self, name: str) -> None:
        async with self.lock:
            proxy = self.get(name)
            await proxy.stop()
            del self.proxies[name]
            self._mark()

    async def reset(self) -> None:
        """Enable every proxy and remove every toxic."""
        async with self.lock:
            for proxy in self.proxies.values():
                await proxy.start()
                for spec in list(proxy.toxics):
                    await proxy.remove_toxic(spec.name)
            self._mark()

    async def add_toxic(self, proxy_name: str, body: Any) -> dict[str, Any]:
        async with self.lock:
            proxy = self.get(proxy_name)
            spec = spec_from_json(body)
            if proxy.find(spec.name) is not None:
                raise ERR_TOXIC_ALREADY_EXISTS
            await proxy.add_toxic(spec)
            self._mark()
            return spec.to_json()

    async def update_toxic(self, proxy_name: str, toxic: str, body: Any) -> dict[str, Any]:
        async with self.lock:
            proxy = self.get(proxy_name)
            old = proxy.find(toxic)
            if old is None:
                raise ERR_TOXIC_NOT_FOUND
            spec = spec_updated(old, body)
            await proxy.update_toxic(spec)
            self._mark()
            return spec.to_json()

    async def remove_toxic(self, proxy_name: str, toxic: str) -> None:
        async with self.lock:
            proxy = self.get(proxy_name)
            if proxy.find(toxic) is None:
                raise ERR_TOXIC_NOT_FOUND
            await proxy.remove_toxic(toxic)
            self._mark()

    def get_toxic(self, proxy_name: str, toxic: str) -> dict[str, Any]:
        spec = self.get(proxy_name).find(toxic)
        if spec is None:
            raise ERR_TOXIC_NOT_FOUND
        return spec.to_json()

    async def close(self) -> None:
        for proxy in list(self.proxies.values()):
            await proxy.stop()
