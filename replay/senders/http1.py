"""HTTP/1.1 sender: the recorded request line, headers and body on one keep-alive connection per
recorded connection, cleartext or TLS (HTTPS). Requests on a connection go one at a time (no pipelining,
as clients do). End-to-end headers (Content-Type, Accept-Encoding, User-Agent, ...) go out as recorded;
hop-by-hop ones are the sender's own: Host (the target, or --server-name), Content-Length (the body
sent), no Connection/Keep-Alive/TE/Transfer-Encoding/Upgrade/Proxy-* (senders.headers).

Outcome: 2xx/3xx ok, 429 rejected (the HTTP face of RESOURCE_EXHAUSTED), other statuses error
with code "HTTP_<status>", refused/reset connections connection_error, a failed TLS handshake
connection_error with code "TLS" and a one-line detail (e.g. "TLS: certificate verify failed for NAME").
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

from replay.schedule import PlannedCall, PlannedMessage
from replay.senders.base import CONNECTION_ERROR, ERROR, SendOutcome, http_outcome, replayable_metadata
from replay.senders.headers import HeaderPolicy
from replay.senders.tls import TlsConfig, describe
from replay.target import split_target

_MAX_BODY = 64 << 20


class _Conn:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None


class Http1Sender:
    """Replays HTTP/1.1 requests to `target` ("host:port").

    tls: a TlsConfig for HTTPS (None: cleartext). headers: the HeaderPolicy (default: the marker, no
    trace context)."""

    def __init__(self, target: str, *, tls: TlsConfig | None = None, headers: HeaderPolicy | None = None,
                 **_: object) -> None:
        self.target = target
        self.host, self.port = split_target(target)
        self.policy = headers
        self.tls = tls
        self.ssl: ssl.SSLContext | None = tls.context(alpn=("http/1.1",)) if tls else None
        self.server_name = tls.name_for(self.host) if tls else self.host
        self.authority = f"{tls.server_name}:{self.port}" if tls and tls.server_name else target
        self._conns: dict[str, _Conn] = {}

    async def call(self, planned: PlannedCall, requests: AsyncIterator[PlannedMessage], timeout_s: float) -> SendOutcome:
        body = b"".join([m.data async for m in requests])
        conn = self._conns.setdefault(planned.connection, _Conn())
        async with conn.lock:
            try:
                return await asyncio.wait_for(self._exchange(conn, planned, body), timeout_s)
            except ssl.SSLError as exc:  # an OSError too: the handshake (or the TLS session) failed
                await self._drop(conn)
                return SendOutcome(CONNECTION_ERROR, "TLS", detail=describe(exc, self.server_name))
            except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
                await self._drop(conn)
                return SendOutcome(CONNECTION_ERROR, "CONNECTION", detail=str(exc))
            except TimeoutError:
                await self._drop(conn)  # a half-read response poisons the connection
                return SendOutcome("timeout", "TIMEOUT")
            except ValueError as exc:
                await self._drop(conn)
                return SendOutcome(ERROR, "BAD_RESPONSE", detail=str(exc))

    def _request(self, planned: PlannedCall, body: bytes) -> bytes:
        line = planned.method or "GET /"
        headers = replayable_metadata(planned.metadata, self.policy, "http1")
        head = [f"{line} HTTP/1.1", f"Host: {self.authority}", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers]
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body

    async def _exchange(self, conn: _Conn, planned: PlannedCall, body: bytes) -> SendOutcome:
        if conn.writer is None or conn.writer.is_closing():
            if self.ssl is None:
                conn.reader, conn.writer = await asyncio.open_connection(self.host, self.port)
            else:
                conn.reader, conn.writer = await asyncio.open_connection(
                    self.host, self.port, ssl=self.ssl, server_hostname=self.server_name)
        assert conn.reader is not None
        conn.writer.write(self._request(planned, body))
        await conn.writer.drain()
        status, headers = await _read_head(conn.reader)
        # No body after a HEAD, a 204 or a 304 (RFC 9112 6.3), whatever their headers say.
        bodyless = (planned.method or "").startswith("HEAD ") or status in (204, 304)
        data = await _read_body(conn.reader, headers, head_only=bodyless)
        to_close = not bodyless and "content-length" not in headers and "chunked" not in headers.get(
            "transfer-encoding", "").lower()
        if to_close or headers.get("connection", "").lower() == "close":
            await self._drop(conn)
        return http_outcome(status, data)

    async def _drop(self, conn: _Conn) -> None:
        if conn.writer is not None:
            conn.writer.close()
        conn.reader = conn.writer = None

    async def close(self) -> None:
        for conn in self._conns.values():
            await self._drop(conn)
        self._conns = {}


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    while True:
        parts = (await reader.readuntil(b"\r\n")).decode("latin-1").split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise ValueError(f"not an HTTP status line: {' '.join(parts)[:60]!r}")
        headers: dict[str, str] = {}
        while (line := (await reader.readuntil(b"\r\n")).decode("latin-1").strip()):
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if not 100 <= int(parts[1]) < 200:  # skip interim responses
            return int(parts[1]), headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], head_only: bool) -> bytes:
    if head_only:
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = bytearray()
        while (size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)) > 0:
            out += await reader.readexactly(size)
            await reader.readexactly(2)
        while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
            pass
        return bytes(out)
    if "content-length" in headers:
        return await reader.readexactly(min(int(headers["content-length"]), _MAX_BODY))
    return await reader.read(_MAX_BODY)  # no length: the body runs to the close
