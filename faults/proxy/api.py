"""Toxiproxy 2.x's HTTP API over a small asyncio HTTP/1.1 server (keep-alive, Content-Length or
chunked request bodies, `Expect: 100-continue` answered as Go's net/http does).

Routes, status codes and error bodies follow Toxiproxy's api.go: an error is Go's `http.Error` of the
compact JSON ``{"error":"<message>","status":<code>}`` -- so Content-Type `text/plain; charset=utf-8`,
`X-Content-Type-Options: nosniff` and a trailing newline -- with 400, 404, 409 (500 for a listen
failure); creates answer 201 (toxics 200, as Toxiproxy does), deletes and /reset 204. Mutating answers
also carry `X-Shadowtest-Applied-At`: CLOCK_MONOTONIC seconds when every live connection had switched.

Two routes are shadowtest's own, never part of Toxiproxy's answers: `GET /proxies/{name}/effects`,
what each toxic of that proxy was measured to do (`{toxic_name: {...}}`, removed toxics included), and
`GET /proxies/{name}/flows`, how its connections move bytes (`{"connections": [{"upstream": {"mode":
"fast"|"chunk", "fast_bytes", "spliced_bytes", "chunk_bytes", "to_fast", "to_chunk"}, "downstream":
{...}}, ...], "closed": {the counts of closed connections, summed}}`).
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
_MAX_LINE = 8 << 10
ERROR_TYPE = "text/plain; charset=utf-8"  # Go's http.Error overrides the application/json set before it


def go_json(obj: Any) -> str:
    """json.Marshal's text: compact, UTF-8, with <, > and & escaped as Go does."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                    ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def error_body(message: str, status: int) -> bytes:
    """Toxiproxy's apiError: http.Error(json.Marshal(ApiError)) -- the JSON and a newline."""
    return (go_json({"error": message, "status": status}) + "\n").encode()


class HttpError(Exception):
    """A request the HTTP layer refuses before routing (Go's net/http answers these itself)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

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


async def _effects(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    return 200, c.get(v["proxy"]).effects.to_json()


async def _flows(c: ProxyCollection, v: dict[str, str], raw: Any) -> Reply:
    return 200, c.get(v["proxy"]).flow_stats()


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
    (re.compile(rf"^/proxies/{_P}/effects$"), {"GET": _effects}),
    (re.compile(rf"^/proxies/{_P}/flows$"), {"GET": _flows}),
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
            return exc.status, error_body(exc.message, exc.status), ERROR_TYPE
        if obj is None:
            return status, b"", "application/json"
        if isinstance(obj, str):
            return status, obj.encode(), "application/json;charset=utf-8"
        return status, json.dumps(obj).encode(), "application/json"
    return 404, b"404 page not found\n", "text/plain; charset=utf-8"


_REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 413: "Request Entity Too Large",
            417: "Expectation Failed", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            501: "Not Implemented"}


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                        ) -> tuple[str, str, dict[str, str], bytes] | None:
    line = await reader.readline()
    if not line:
        return None
    parts = line.decode("latin-1").split()
    if len(parts) != 3:
        raise HttpError(400, "malformed HTTP request")
    method, target, version = parts
    headers: dict[str, str] = {"_version": version}
    while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
        if len(h) > _MAX_LINE:
            raise HttpError(431, "request header too large")
        k, _, val = h.decode("latin-1").partition(":")
        headers[k.strip().lower()] = val.strip()
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    if headers.get("transfer-encoding") and not chunked:
        raise HttpError(501, "unsupported transfer encoding")
    try:
        size = 0 if chunked else int(headers.get("content-length", "0") or 0)
    except ValueError as exc:
        raise HttpError(400, "bad Content-Length") from exc
    if size > _MAX_BODY or size < 0:
        raise HttpError(413, "request body too large")
    expect = headers.get("expect", "").lower()
    if expect and expect != "100-continue":
        raise HttpError(417, "unsupported Expect")
    if expect and version == "HTTP/1.1" and (size or chunked):
        # What Go's net/http does: the client is told to send the body once a handler reads it.
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if chunked:
        body = await _read_chunked(reader)
    else:
        body = await reader.readexactly(size) if size else b""
    return method.upper(), target, headers, body


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A Transfer-Encoding: chunked body, at most _MAX_BODY bytes; trailers are read and ignored."""
    out = bytearray()
    while True:
        line = await reader.readline()
        if not line.endswith(b"\n") or len(line) > _MAX_LINE:
            raise HttpError(400, "malformed chunked encoding")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError as exc:
            raise HttpError(400, "malformed chunked encoding") from exc
        if size < 0 or len(out) + size > _MAX_BODY:
            raise HttpError(413, "request body too large")
        if size == 0:
            while (t := await reader.readline()) not in (b"\r\n", b"\n"):
                if not t or len(t) > _MAX_LINE:
                    raise HttpError(400, "malformed chunked encoding")
            return bytes(out)
        out += await reader.readexactly(size)
        if await reader.readline() not in (b"\r\n", b"\n"):
            raise HttpError(400, "malformed chunked encoding")


def _head(status: int, ctype: str, length: int, keep: bool) -> list[str]:
    return [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}", f"Content-Type: {ctype}",
            f"Content-Length: {length}", f"Connection: {'keep-alive' if keep else 'close'}"]


async def serve_connection(c: ProxyCollection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer requests on one HTTP connection until the client closes it."""
    try:
        while True:
            try:
                req = await _read_request(reader, writer)
            except HttpError as exc:
                # Answered and closed, as net/http does for a request it cannot parse or accept.
                payload = f"{exc.status} {_REASONS.get(exc.status, 'Bad Request')}: {exc.message}".encode()
                head = _head(exc.status, ERROR_TYPE, len(payload), False)
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
                await writer.drain()
                break
            if req is None:
                break
            method, target, headers, body = req
            if headers.get("user-agent", "").startswith("Mozilla/"):
                status, payload, ctype = 403, b"User agent not allowed\n", ERROR_TYPE
            else:
                status, payload, ctype = await dispatch(c, method, target, body)
            keep = headers["_version"] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
            head = _head(status, ctype, len(payload), keep)
            if ctype == ERROR_TYPE and status >= 400:
                head.append("X-Content-Type-Options: nosniff")
            if method in _MUTATING and status < 300:
                head.append(f"X-Shadowtest-Applied-At: {c.applied_at:.9f}")
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
            await writer.drain()
            if not keep:
                break
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        log.debug("API connection ended: %s", exc)
    finally:
        writer.close()
