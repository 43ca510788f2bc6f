"""Toxiproxy 2.x's HTTP API over a small asyncio HTTP/1.1 server (keep-alive, Content-Length bodies).

Routes, status codes and error bodies follow Toxiproxy's api.go: errors are
``{"error": "<message>", "status": <code>}`` with 400, 404, 409 (500 for a listen failure);
creates answer 201 (toxics 200, as Toxiproxy does), deletes and /reset 204. Mutating answers also
carry `X-Shadowtest-Applied-At`: CLOCK_MONOTONIC seconds when every live connection had switched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

from faults.proxy.collection import ProxyCollection
from faults.proxy.model import ERR_BAD_REQUEST_BODY, ApiError

log = logging.getLogger(__name__)
VERSION = "2.12.0"
_MAX_BODY = 8 << 20

Reply = tuple[int, Any]
Handler = Callable[[ProxyCollection, dict[str, str], Any], Awaitable[Reply]]


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw.strip() else _raise_eof()
    except json.JSONDecodeError as exc:
        raise ERR_BAD_REQUEST_BODY.joined(f"invalid character: {exc.msg}") from exc


def _raise_eof() -> Any:
    raise ERR_BAD_REQUEST_BODY.joined("EOF")


async def _proxy_index(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    return 200, {name: p.to_json() for name, p in c.proxies.items()}


async def _proxy_create(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    return 201, (await c.create(_body(raw))).to_json()


async def _populate(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    try:
        proxies = await c.populate(_body(raw))
    except ApiError as exc:
        return exc.status, {"error": exc.message, "status": exc.status, "proxies": None}
    return 201, {"proxies": [p.to_json() for p in proxies]}


async def _proxy_show(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    return 200, c.get(v["proxy"]).to_json()


async def _proxy_update(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    c.get(v["proxy"])
    return 200, (await c.update(v["proxy"], _body(raw))).to_json()


async def _proxy_delete(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    await c.delete(v["proxy"])
    return 204, None


async def _reset(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    await c.reset()
    return 204, None


async def _toxic_index(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    return 200, c.get(v["proxy"]).toxic_array()


async def _toxic_create(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    c.get(v["proxy"])
    return 200, await c.add_toxic(v["proxy"], _body(raw))


async def _toxic_show(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    return 200, c.get_toxic(v["proxy"], v["toxic"])


async def _toxic_update(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    c.get(v["proxy"])
    return 200, await c.update_toxic(v["proxy"], v["toxic"], _body(raw))


async def _toxic_delete(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    await c.remove_toxic(v["proxy"], v["toxic"])
    return 204, None


async def _version(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    return 200, f'{{"version": "{VERSION}"}}\n'


_P = r"(?P<proxy>[^/]+)"
_T = r"(?P<toxic>[^/]+)"
ROUTES: list[tuple[re.Pattern[str], dict[str, Handler]]] = [
    (re.compile(r"^/reset$"), {"POST": _reset}),
    (re.compile(r"^/proxies$"), {"GET": _proxy_index, "POST": _proxy_create}),
    (re.compile(r"^/populate$"), {"POST": _populate}),
    (re.compile(rf"^/proxies/{_P}$"), {"GET": _proxy_show, "POST": _proxy_update, "PATCH": _proxy_update,
                                       "DELETE": _proxy_delete}),
    (re.compile(rf"^/proxies/{_P}/toxics$"), {"GET": _toxic_index, "POST": _toxic_create}),
    (re.compile(rf"^/proxies/{_P}/toxics/{_T}$"), {"GET": _toxic_show, "POST": _toxic_update,
                                                   "PATCH": _toxic_update, "DELETE": _toxic_delete}),
    (re.compile(r"^/version$"), {"GET": _version}),
]
_MUTATING = {"POST", "PATCH", "DELETE"}


async def dispatch(c: ProxyCollection, method: str, path: str, raw: bytes) -> tuple[int, bytes, str]:
    """Route one request; returns (status, body, content type)."""
    path = path.split("?", 1)[0]
    for pattern, methods in ROUTES:
        m = pattern.match(path)
        if m is None:
            continue
        handler = methods.get(method)
        if handler is None:
            return 405, b"", "text/plain; charset=utf-8"
        try:
            status, obj = await handler(c, {k: unquote(x) for k, x in m.groupdict().items()}, raw)
        except ApiError as exc:
            status, obj = exc.status, {"error": exc.message, "status": exc.status}
            return status, (json.dumps(obj) + "\n").encode(), "application/json"
        if obj is None:
            return status, b"", "application/json"
        if isinstance(obj, str):
            return status, obj.encode(), "application/json;charset=utf-8"
        return status, json.dumps(obj).encode(), "application/json"
    return 404, b"404 page not found\n", "text/plain; charset=utf-8"


_REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 500: "Internal Server Error"}


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes] | None:
    line = await reader.readline()
    if not line:
        return None
    method, target, version = line.decode("latin-1").split()
    headers: dict[str, str] = {"_version": version}
    while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
        k, _, val = h.decode("latin-1").partition(":")
        headers[k.strip().lower()] = val.strip()
    size = int(headers.get("content-length", "0") or 0)
    if size > _MAX_BODY:
        raise ValueError("body too large")
    body = await reader.readexactly(size) if size else b""
    return method.upper(), target, headers, body


async def serve_connection(c: ProxyCollection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer requests on one HTTP connection until the client closes it."""
    try:
        while (req := await _read_request(reader)) is not None:
            method, target, headers, body = req
            if headers.get("user-agent", "").startswith("Mozilla/"):
                status, payload, ctype = 403, b"User agent not allowed\n", "text/plain; charset=utf-8"
            else:
                status, payload, ctype = await dispatch(c, method, target, body)
            keep = headers["_version"] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
            head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}", f"Content-Type: {ctype}",
                    f"Content-Length: {len(payload)}", f"Connection: {'keep-alive' if keep else 'close'}"]
            if method in _MUTATING and status < 300:
                head.append(f"X-Shadowtest-Applied-At: {c.applied_at:.9f}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
            await writer.drain()
            if not keep:
                break
    except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
        log.debug("API connection ended: %s", exc)
    finally:
        writer.close()
