"""Senders: the only protocol-aware part of replay. One small Protocol, implementations by name.

    engine --call(planned, requests, timeout)--> Sender --> target
           <----------- SendOutcome -------------

Registered: `grpc` (grpcio), `h2` (the lean HTTP/2 sender for gRPC and plain HTTP/2, no grpcio:
replay/senders/h2.py),
`http1`, `tcp`. `get_sender("grpc", target, ...)` builds one; `register(name, factory)` adds one (tests register a
fake transport). A sender keeps one connection per `PlannedCall.connection` unless told to share.
"""

from typing import Any

from replay.senders.base import (
    HOP_BY_HOP,
    Preparer,
    Sender,
    SenderFactory,
    SendOutcome,
    available,
    get_sender,
    register,
    replayable_metadata,
)

__all__ = ["HOP_BY_HOP", "Preparer", "SendOutcome", "Sender", "SenderFactory", "available", "get_sender", "register",
           "replayable_metadata"]


def _h2_sender(target: str, **options: Any) -> Sender:
    from replay.senders.h2 import H2Sender  # imported on first use, like the built-in entries
    return H2Sender(target, **options)


register("h2", _h2_sender)
