"""Raw TCP sender: a recorded flow's client bytes, each chunk at its own time, on a fresh connection.

The response side is read concurrently (so the server never blocks on a full socket buffer) until
the server closes or `idle_s` passes after the last chunk; the bytes come back for comparison. With
`tls` the connection is TLS-wrapped (the recorded bytes are the plaintext the client sent inside its
own TLS session); a failed handshake is a connection_error with code "TLS" and a one-line detail.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator

from replay.schedule import PlannedCall, PlannedMessage
from replay.senders.base import CONNECTION_ERROR, OK, SendOutcome
from replay.senders.tls import TlsConfig, describe
from replay.target import split_target


class TcpSender:
    """Replays raw TCP flows to `target` ("host:port"); one connection per planned flow."""

    def __init__(self, target: str, *, idle_s: float = 0.1, tls: TlsConfig | None = None, **_: object) -> None:
        self.host, self.port = split_target(target)
        self.idle_s = idle_s
        self.ssl: ssl.SSLContext | None = tls.context() if tls else None
        self.server_name = tls.name_for(self.host) if tls else self.host

    async def call(self, planned: PlannedCall, requests: AsyncIterator[PlannedMessage], timeout_s: float) -> SendOutcome:
        try:
            if self.ssl is None:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            else:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    self.host, self.port, ssl=self.ssl, server_hostname=self.server_name), timeout_s)
        except ssl.SSLError as exc:
            return SendOutcome(CONNECTION_ERROR, "TLS", detail=describe(exc, self.server_name))
        except TimeoutError:
            return SendOutcome("timeout", "TIMEOUT", detail=f"TLS: no handshake with {self.server_name} "
                                                               f"within {timeout_s:g} s")
        except OSError as exc:
            return SendOutcome(CONNECTION_ERROR, "CONNECTION_REFUSED", detail=str(exc))
        received = bytearray()
        reading = asyncio.create_task(self._read(reader, received))
        try:
            async for msg in requests:
                writer.write(msg.data)
                await writer.drain()
            await asyncio.wait({reading}, timeout=self.idle_s)
        except OSError as exc:
            return SendOutcome(CONNECTION_ERROR, "CONNECTION_RESET", detail=str(exc))
        finally:
            reading.cancel()
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await reading
        return SendOutcome(OK, "OK", responses=[bytes(received)])

    async def _read(self, reader: asyncio.StreamReader, into: bytearray) -> None:
        while chunk := await reader.read(65536):
            into += chunk

    async def close(self) -> None:
        pass
