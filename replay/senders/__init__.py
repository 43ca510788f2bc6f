"""Senders: the only protocol-aware part of replay. One small Protocol, implementations by name.

    engine --call(planned, requests, timeout)--> Sender --> target
           <----------- SendOutcome -------------

Registered: `grpc` (grpcio), `h2` (the lean HTTP/2 sender for gRPC and plain HTTP/2, no grpcio:
replay/senders/h2.py),
`http1`, `tcp`. `get_sender("grpc", target, ...)` builds one; `SENDERS.add(name, factory)` adds one (tests add a
fake transport). A sender keeps one connection per `PlannedCall.connection` unless told to share.
"""

from replay.senders.base import (
    HOP_BY_HOP,
    SENDERS,
    Preparer,
    Sender,
    SenderFactory,
    SendOutcome,
    get_sender,
    replayable_metadata,
)

__all__ = ["HOP_BY_HOP", "SENDERS", "Preparer", "SendOutcome", "Sender", "SenderFactory", "get_sender",
           "replayable_metadata"]
