"""The HTTP/2 and gRPC wire, written once for every package that speaks it.

    wire.h2        frame types, flags, settings and error codes as enums; frame building; frame
                   splitting into tuples; padding/priority stripping; SETTINGS and control-frame
                   validation; header-block assembly with a size cap
    wire.headers   HPACK: the static-table encoder (blocks valid on any connection, reusable byte for
                   byte), a cached strict decoder, a tolerant decoder for connections joined mid-way,
                   request field validation
    wire.messages  gRPC message framing (5-byte prefix), a bounded message reader, bounded decompression
    wire.status    gRPC status codes, grpc-timeout, grpc-message percent-encoding, `-bin` metadata,
                   trailer blocks and the HTTP/2 -> gRPC status maps
    wire.limits    token-bucket budgets for floods (PING, SETTINGS, resets, empty frames)

Users: the agent's lean server (strict, hostile peers), the replay sender (strict, the peer is a
target we do not control), capture's decoders and masker (tolerant: they observe, never answer) and
the fault proxy's gRPC tap. It depends on the standard library and `hpack` only, so the agent can use
it and still import nothing of capture, replay, faults or the harness.

Exceptions, all rooted at `WireError`:

    WireError
    +-- H2Error          an HTTP/2 error with its ErrorCode; `stream` 0 is a connection error
    |                    (answer GOAWAY), a stream id is a stream error (answer RST_STREAM)
    +-- GrpcError        a gRPC-level failure with the Status to end the call with
"""

from wire.h2 import ErrorCode, FrameType, H2Error, WireError
from wire.status import GrpcError, Status

__all__ = ["ErrorCode", "FrameType", "GrpcError", "H2Error", "Status", "WireError"]
