"""The Sender protocol, its outcome record, the registry, and metadata filtering."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from replay.errors import SenderError
from replay.schedule import PlannedCall, PlannedMessage
from replay.senders.headers import DEFAULT_POLICY, GRPC_OWN, REDACTION_MARKERS, HeaderPolicy
from wire.registry import Registry

# Outcome names every sender uses; the engine adds not_sent itself.
OK, REJECTED, ERROR, TIMEOUT, CONNECTION_ERROR = "ok", "rejected", "error", "timeout", "connection_error"

# Never taken from a recorded gRPC call: hop-by-hop headers and what gRPC sets itself (senders.headers).
HOP_BY_HOP = GRPC_OWN


@dataclass
class SendOutcome:
    """What one call did. `code` is the gRPC status name (or HTTP status / 'CONNECTION')."""

    outcome: str
    code: str | None = None
    status: int | None = None
    responses: list[bytes] = field(default_factory=list)
    detail: str = ""


def http_outcome(status: int, body: bytes) -> SendOutcome:
    """An HTTP response as every HTTP sender (http1, and h2 for plain HTTP/2) reports it: 2xx/3xx ok,
    429 rejected (the HTTP face of RESOURCE_EXHAUSTED), any other status error "HTTP_<status>"."""
    kind = OK if status < 400 else REJECTED if status == 429 else ERROR
    return SendOutcome(kind, "OK" if kind == OK else f"HTTP_{status}", status, [body])


class Sender(Protocol):
    """Send planned calls to one target; one connection per `planned.connection`."""

    async def call(self, planned: PlannedCall, requests: AsyncIterator[PlannedMessage], timeout_s: float) -> SendOutcome:
        """Send the call, pulling each request message from `requests` as the engine releases it.

        Never raises for the target's behaviour: a failure is an outcome."""

    async def close(self) -> None:
        """Close every connection (idempotent)."""


class Preparer(Protocol):
    """Optional ability: start opening `connection` ahead of its first call (must not block).
    May return an awaitable that completes when the connection is ready (or has failed): the
    engine waits, bounded, for those of the first lookahead before it starts the clock."""

    def prepare(self, connection: str) -> Awaitable[object] | None: ...


class Starter(Protocol):
    """Optional ability: send `planned` synchronously, now, and call `done(outcome)` exactly once
    when it ends (from the sender's own I/O callbacks). Returns a function that abandons the call
    (`done` then gets a cancelled outcome; the sender tells the target if it can), or None when this
    call needs `Sender.call` (the engine then falls back to it). Only asked for calls whose request
    messages are all due at their start."""

    def start(self, planned: PlannedCall, timeout_s: float,
              done: Callable[[SendOutcome], None]) -> Callable[[], None] | None: ...


SenderFactory = Callable[..., Sender]
SENDERS: Registry[str, SenderFactory] = Registry("sender", {
    "h2": "replay.senders.h2:H2Sender",           # imported on first use (grpcio is heavy)
    "grpc": "replay.senders.grpc:GrpcSender",
    "http1": "replay.senders.http1:Http1Sender",
    "tcp": "replay.senders.tcp:TcpSender",
}, error=SenderError)


def get_sender(name: str, target: str, **options: object) -> Sender:
    """Build the sender `name` for `target` ("host:port"). Raises SenderError for an unknown name."""
    return SENDERS.get(name)(target, **options)


def replayable_metadata(metadata: list[tuple[str, str]], policy: HeaderPolicy | None = None,
                        protocol: str = "grpc") -> list[tuple[str, str]]:
    """The headers a replayed call carries (keys lower-cased): the recorded ones minus pseudo, binary,
    redacted, hop-by-hop and trace-context entries, with the policy's additions (senders.headers)."""
    return (policy or DEFAULT_POLICY).apply(metadata, protocol)


__all__ = ["CONNECTION_ERROR", "ERROR", "HOP_BY_HOP", "OK", "REDACTION_MARKERS", "REJECTED", "TIMEOUT", "Preparer",
           "SENDERS", "SendOutcome", "Sender", "SenderFactory", "Starter", "get_sender", "http_outcome",
           "replayable_metadata"]
