"""The Sender protocol, its outcome record, the registry, and metadata filtering."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from replay.errors import SenderError
from replay.schedule import PlannedCall, PlannedMessage

# Outcome names every sender uses; the engine adds not_sent itself.
OK, REJECTED, ERROR, TIMEOUT, CONNECTION_ERROR = "ok", "rejected", "error", "timeout", "connection_error"

# Never replayed: connection-level (hop-by-hop) headers, pseudo headers, and what gRPC sets itself.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "host",
    "content-length", "content-type", "user-agent", "grpc-timeout", "grpc-encoding",
    "grpc-accept-encoding", "accept-encoding", "grpc-status", "grpc-message", "trailer",
})
REDACTION_MARKERS = ("[REDACTED", "<REDACTED", "REDACTED")


@dataclass
class SendOutcome:
    """What one call did. `code` is the gRPC status name (or HTTP status / 'CONNECTION')."""

    outcome: str
    code: str | None = None
    status: int | None = None
    responses: list[bytes] = field(default_factory=list)
    detail: str = ""


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
_REGISTRY: dict[str, str | SenderFactory] = {
    "grpc": "replay.senders.grpc:GrpcSender",
    "http1": "replay.senders.http1:Http1Sender",
    "tcp": "replay.senders.tcp:TcpSender",
}


def register(name: str, factory: SenderFactory) -> None:
    """Register a sender factory `factory(target, **options)` under `name`."""
    _REGISTRY[name] = factory


def available() -> list[str]:
    return sorted(_REGISTRY)


def get_sender(name: str, target: str, **options: object) -> Sender:
    """Build the sender `name` for `target` ("host:port"). Raises SenderError for an unknown name."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise SenderError(f"no sender named {name!r}; available: {', '.join(available())}")
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
    return entry(target, **options)


def replayable_metadata(metadata: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Recorded metadata minus hop-by-hop, pseudo, binary and redacted entries (keys lower-cased)."""
    keep = []
    for key, value in metadata:
        k = key.lower()
        if k.startswith(":") or k in HOP_BY_HOP or k.endswith("-bin"):
            continue
        if value.upper().startswith(REDACTION_MARKERS):
            continue
        keep.append((k, value))
    return keep
