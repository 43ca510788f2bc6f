"""gRPC sender: generic calls with the recorded method and raw request bytes, all four call kinds.

No descriptors are needed: serializers are identity, so the recorded bytes go out unchanged and the
response bytes come back for comparison. Each recorded connection gets its own channel with a local
subchannel pool (grpc would otherwise share one TCP connection between identical channels). With
`tls` the channels are secure (grpcio's TLS, ALPN h2; the CA, client certificate and name to verify
from the TlsConfig); a failed handshake is UNAVAILABLE with a one-line "TLS: ..." detail.
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Awaitable

import grpc
import grpc.aio

from replay.schedule import PlannedCall, PlannedMessage
from replay.senders.base import (
    CONNECTION_ERROR,
    ERROR,
    OK,
    REJECTED,
    TIMEOUT,
    SendOutcome,
    replayable_metadata,
)
from replay.senders.headers import HeaderPolicy
from replay.senders.tls import TlsConfig


def _raw(data: bytes, compressed: bool) -> bytes:
    # A compressed recorded message is sent decompressed; grpc compresses again if configured.
    if compressed:
        try:
            return gzip.decompress(data)
        except OSError:
            return data
    return data


def outcome_for_code(code: grpc.StatusCode, detail: str = "") -> SendOutcome:
    """Map a gRPC status to an outcome: ok, rejected, timeout, connection_error or error."""
    name = code.name
    kind = {grpc.StatusCode.OK: OK, grpc.StatusCode.RESOURCE_EXHAUSTED: REJECTED,
            grpc.StatusCode.DEADLINE_EXCEEDED: TIMEOUT,
            grpc.StatusCode.UNAVAILABLE: CONNECTION_ERROR}.get(code, ERROR)
    return SendOutcome(kind, name, code.value[0], detail=detail)


class GrpcSender:
    """Replays gRPC calls to `target`.

    Args:
        target: "host:port".
        share_connection: one channel for all recorded connections (default: one each).
        tls: a TlsConfig for secure channels (None: insecure channels). headers: the HeaderPolicy.
    """

    def __init__(self, target: str, *, share_connection: bool = False, tls: TlsConfig | None = None,
                 headers: HeaderPolicy | None = None, **_: object) -> None:
        self.target = target
        self.share = share_connection
        self.policy = headers
        self.tls = tls
        self._creds = tls.grpc_credentials() if tls else None
        self._name = tls.name_for(target.rsplit(":", 1)[0].strip("[]")) if tls else ""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._unary: dict[tuple[int, str], grpc.aio.UnaryUnaryMultiCallable] = {}
        self._md: dict[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...] | None] = {}

    def _channel(self, connection: str) -> grpc.aio.Channel:
        key = "shared" if self.share else connection
        ch = self._channels.get(key)
        if ch is None:
            opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0),
                    ("grpc.max_receive_message_length", 64 << 20)]
            if self.tls is None:
                ch = grpc.aio.insecure_channel(self.target, options=opts)
            else:
                ch = grpc.aio.secure_channel(self.target, self._creds, options=opts + self.tls.grpc_options())
            self._channels[key] = ch
        return ch

    def _metadata(self, recorded: list[tuple[str, str]]) -> tuple[tuple[str, str], ...] | None:
        key = tuple(recorded)
        md = self._md.get(key, ())
        if md == ():
            if len(self._md) >= 4096:  # bounded: recordings may carry unique metadata per call
                self._md.clear()
            md = self._md[key] = tuple(replayable_metadata(recorded, self.policy)) or None
        return md

    def _detail(self, detail: str) -> str:
        """grpcio's TLS failures in the words the other senders use (the original kept after it)."""
        if self.tls is None:
            return detail
        text = " ".join(detail.split())
        if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text.lower():
            return f"TLS: certificate verify failed for {self._name} (grpcio: {text})"
        if "handshake" in text.lower() or "SSL_ERROR" in text:
            return f"TLS: handshake failure with {self._name} (grpcio: {text})"
        if text.startswith("failed to connect to all addresses") and "Socket closed" in text:
            hint = "" if self.tls.cert else "; does it require a client certificate (--cert, --key)?"
            return f"TLS: {self._name} closed the connection during the handshake{hint} (grpcio: {text})"
        return detail

    def prepare(self, connection: str) -> Awaitable[None]:
        """Create the channel and start connecting now (non-blocking), ahead of the first call;
        the awaitable completes when the channel is READY (it never fails: bound its wait)."""
        ch = self._channel(connection)
        ch.get_state(try_to_connect=True)
        ready: Awaitable[None] = ch.channel_ready()
        return ready

    async def call(self, planned: PlannedCall, requests: AsyncIterator[PlannedMessage], timeout_s: float) -> SendOutcome:
        ch = self._channel(planned.connection)
        method = planned.method or ""
        md = self._metadata(planned.metadata)
        timeout = timeout_s + planned.last_offset_ns / 1e9
        try:
            responses = await self._invoke(ch, planned.kind, method, requests, md, timeout)
        except grpc.aio.AioRpcError as exc:
            return outcome_for_code(exc.code(), self._detail(exc.details() or ""))
        except StopAsyncIteration:
            return SendOutcome(ERROR, "NO_REQUEST", detail="the recorded call has no request message")
        return SendOutcome(OK, "OK", 0, responses)

    async def _invoke(self, ch: grpc.aio.Channel, kind: str, method: str,
                      requests: AsyncIterator[PlannedMessage], md: tuple[tuple[str, str], ...] | None,
                      timeout: float) -> list[bytes]:
        if kind in ("client_stream", "bidi"):
            if kind == "client_stream":
                return [await ch.stream_unary(method)(_wire(requests), timeout=timeout, metadata=md)]
            return [r async for r in ch.stream_stream(method)(_wire(requests), timeout=timeout, metadata=md)]
        msg = await anext(requests)
        first = _raw(msg.data, msg.compressed)
        if kind == "server_stream":
            return [r async for r in ch.unary_stream(method)(first, timeout=timeout, metadata=md)]
        unary = self._unary.get((id(ch), method))
        if unary is None:  # building a multicallable per call costs as much as a tenth of the call
            unary = self._unary[(id(ch), method)] = ch.unary_unary(method)
        return [await unary(first, timeout=timeout, metadata=md)]

    async def close(self) -> None:
        channels, self._channels, self._unary = list(self._channels.values()), {}, {}
        for ch in channels:
            await ch.close(grace=None)


async def _wire(requests: AsyncIterator[PlannedMessage]) -> AsyncIterator[bytes]:
    async for m in requests:
        yield _raw(m.data, m.compressed)
