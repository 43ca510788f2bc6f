"""What the lean h2 sender adds to `wire`: its request header blocks and its outcome mapping.

Frames, HPACK, gRPC status codes and the status maps live in `wire` (shared with the agent, capture
and the fault proxy). Only replay's own concepts are here:

- `request_block`: a gRPC request's header block, encoded with HPACK's static table only
  (`wire.headers.encode_field`), so one block is valid on every connection and is reused byte for
  byte: built once per (method, authority, timeout) plus the cached metadata fields; only the 9-byte
  frame header is packed per call.
- `http_request_block`: a plain HTTP/2 request's header block (:method, :scheme, :path, :authority,
  content-length of the body sent, then the recorded end-to-end headers), encoded the same way.
- `outcome` / `connection_failed`: a gRPC status as a `SendOutcome`, exactly as the grpc sender maps
  it (OK -> ok, RESOURCE_EXHAUSTED -> rejected, DEADLINE_EXCEEDED -> timeout, UNAVAILABLE ->
  connection_error, any other code -> error by name).
"""

from __future__ import annotations

from replay.senders.base import CONNECTION_ERROR, ERROR, OK, REJECTED, TIMEOUT, SendOutcome
from wire.headers import encode_field, encode_field_cached
from wire.status import Status, format_timeout, status_name

# gRPC status -> replay's outcome kind; every other code is an `error` named by its code.
_KIND: dict[int, str] = {Status.OK: OK, Status.RESOURCE_EXHAUSTED: REJECTED, Status.DEADLINE_EXCEEDED: TIMEOUT,
         Status.UNAVAILABLE: CONNECTION_ERROR}


_NAMES = {int(s): status_name(s) for s in Status}  # a dict lookup, not an Enum call, per outcome


def outcome(code: int, detail: str = "") -> SendOutcome:
    """The SendOutcome for gRPC status `code`, exactly as the grpc sender maps it (codes outside
    0..16 are UNKNOWN, as gRPC treats them)."""
    name = _NAMES.get(code, "UNKNOWN")
    if name == "UNKNOWN":
        code = Status.UNKNOWN
    return SendOutcome(_KIND.get(code, ERROR), name, int(code), detail=detail)


def connection_failed(detail: str) -> SendOutcome:
    """A call that could not reach the target or lost its connection (grpc says UNAVAILABLE)."""
    return SendOutcome(CONNECTION_ERROR, "UNAVAILABLE", int(Status.UNAVAILABLE), detail=detail)


_HEADS: dict[tuple[str, str, float, str], bytes] = {}


def request_block(method: str, authority: str, metadata: tuple[tuple[str, str], ...], timeout_s: float,
                  scheme: str = "http") -> bytes:
    """The encoded header block of a gRPC request (reusable on any connection); scheme https over TLS."""
    head = _HEADS.get((method, authority, timeout_s, scheme))
    if head is None:
        if len(_HEADS) >= 8192:  # bounded: recordings may carry many methods x timeouts
            _HEADS.clear()
        fields = [(":method", "POST"), (":scheme", scheme), (":path", method), (":authority", authority),
                  ("content-type", "application/grpc"), ("te", "trailers"), ("user-agent", "shadowtest-h2/1"),
                  ("grpc-timeout", format_timeout(timeout_s))]
        head = _HEADS[(method, authority, timeout_s, scheme)] = b"".join(encode_field(k, v) for k, v in fields)
    if not metadata:
        return head
    return head + b"".join([encode_field_cached(k, v) for k, v in metadata])


def http_request_block(verb: str, path: str, authority: str, metadata: tuple[tuple[str, str], ...],
                       body_len: int, scheme: str = "http") -> bytes:
    """The encoded header block of a plain HTTP/2 request; `metadata` already through the header policy
    (senders.headers: no pseudo, hop-by-hop or connection-specific fields, which HTTP/2 forbids)."""
    fields = [(":method", verb), (":scheme", scheme), (":path", path), (":authority", authority)]
    if body_len:  # as HTTP/2 clients send it: servers may insist on knowing the size up front
        fields.append(("content-length", str(body_len)))
    return b"".join(encode_field(k, v) for k, v in fields) + b"".join([encode_field_cached(k, v) for k, v in metadata])
