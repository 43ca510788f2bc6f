"""Senders: the only protocol-aware part of replay. One small Protocol, implementations by name.

    engine --call(planned, requests, timeout)--> Sender --> target
           <----------- SendOutcome -------------

`get_sender("grpc", target, ...)` builds one; `register(name, factory)` adds one (tests register a
fake transport). A sender keeps one connection per `PlannedCall.connection` unless told to share.
"""

from replay.senders.base import (
    HOP_BY_HOP,
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
