"""The decoder interface: bytes of one flow in, finished calls out.

    chunks (c2s / s2c, each with its timestamp) --feed()--> StreamDecoder --> [Call, ...]
                                                  finish() --> calls still open at the end

Decoders are registered by name; `capture.decode.detect` picks one from a flow's first bytes.
"""

from __future__ import annotations

from typing import Protocol

from capture.recording import Call, Direction


class StreamDecoder(Protocol):
    protocol: str

    def feed(self, direction: Direction, ts_ns: int, data: bytes) -> list[Call]:
        """Take the next bytes of one direction; return the calls these bytes completed."""

    def finish(self, ts_ns: int | None = None) -> list[Call]:
        """The flow ended: return calls still open (incomplete, status None)."""


class RawDecoder:
    """Anything that is neither HTTP/2 nor HTTP/1.1: kept as raw chunks, no calls."""

    protocol = "tcp"

    def feed(self, direction: Direction, ts_ns: int, data: bytes) -> list[Call]:
        return []

    def finish(self, ts_ns: int | None = None) -> list[Call]:
        return []
