"""gRPC over HTTP/2: status codes, grpc-timeout, grpc-message, `-bin` metadata and trailer blocks.

The rules are gRPC's PROTOCOL-HTTP2.md and http-grpc-status-mapping.md, as grpc-go applies them.
"""

from __future__ import annotations

import base64
import binascii
from enum import IntEnum
from urllib.parse import quote, unquote

from wire.h2 import ErrorCode, WireError
from wire.headers import encode_block


class Status(IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


def status_name(code: int) -> str:
    """The canonical name of a gRPC code; codes outside 0..16 are UNKNOWN, as gRPC treats them."""
    try:
        return Status(code).name
    except ValueError:
        return "UNKNOWN"


class GrpcError(WireError):
    """A call must end with `status` and `message` (a limit, a malformed message, a bad encoding)."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


# RST_STREAM error code -> gRPC status (PROTOCOL-HTTP2.md); anything else is INTERNAL.
RST_TO_STATUS = {ErrorCode.NO_ERROR: Status.INTERNAL, ErrorCode.REFUSED_STREAM: Status.UNAVAILABLE,
                 ErrorCode.CANCEL: Status.CANCELLED, ErrorCode.ENHANCE_YOUR_CALM: Status.RESOURCE_EXHAUSTED,
                 ErrorCode.INADEQUATE_SECURITY: Status.PERMISSION_DENIED}
# HTTP status of a response without grpc-status -> gRPC status (http-grpc-status-mapping.md).
HTTP_TO_STATUS = {400: Status.INTERNAL, 401: Status.UNAUTHENTICATED, 403: Status.PERMISSION_DENIED,
                  404: Status.UNIMPLEMENTED, 429: Status.UNAVAILABLE, 502: Status.UNAVAILABLE,
                  503: Status.UNAVAILABLE, 504: Status.UNAVAILABLE}


# ---- grpc-timeout --------------------------------------------------------------------------------
_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def parse_timeout(value: str) -> float | None:
    """grpc-timeout ('250m', '5S', ...) in seconds; None when it is malformed (then it is ignored)."""
    unit = _UNITS.get(value[-1:]) if value else None
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


def format_timeout(seconds: float) -> str:
    """gRPC's TimeoutValue for `seconds`: at most 8 digits and a unit, rounded up (never 0)."""
    for unit, scale in (("m", 1e3), ("S", 1.0), ("M", 1 / 60), ("H", 1 / 3600)):
        value = max(1, int(seconds * scale + 0.999))
        if value < 100_000_000:
            return f"{value}{unit}"
    return "99999999H"


# ---- grpc-message and binary metadata ------------------------------------------------------------
_UNRESERVED = (" !\"#$&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`"
               "abcdefghijklmnopqrstuvwxyz{|}~")


def percent_encode(text: str) -> str:
    """gRPC's percent-encoding for grpc-message: printable ASCII but '%' stays, the rest is %XX of UTF-8."""
    return quote(text, safe=_UNRESERVED)


def percent_decode(text: str) -> str:
    return unquote(text, errors="replace")


def encode_bin(value: str | bytes) -> str:
    """A binary (-bin) metadata value as gRPC sends it: base64 without padding."""
    raw = value if isinstance(value, bytes) else value.encode()
    return base64.b64encode(raw).decode().rstrip("=")


def decode_bin(value: str) -> bytes:
    """A received -bin value (padded or not, standard or URL alphabet). Raises ValueError if not base64."""
    text = value.strip().replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except binascii.Error as exc:
        raise ValueError(f"malformed base64 in binary metadata: {exc}") from exc


Metadata = tuple[tuple[str, str | bytes], ...]


def metadata_out(metadata: Metadata) -> list[tuple[str, str]]:
    """Metadata as header fields: `-bin` values base64-encoded, the rest as given."""
    return [(k, encode_bin(v) if k.endswith("-bin") else v if isinstance(v, str) else v.decode("latin-1"))
            for k, v in metadata]


def metadata_in(fields: list[tuple[str, str]]) -> list[tuple[str, str | bytes]]:
    """Received metadata with `-bin` values decoded to bytes (ValueError on bad base64)."""
    return [(k, decode_bin(v)) if k.endswith("-bin") else (k, v) for k, v in fields]


# ---- trailers ------------------------------------------------------------------------------------
RESPONSE_HEADERS = encode_block([(":status", "200"), ("content-type", "application/grpc")])
TRAILERS_OK = encode_block([("grpc-status", "0")])
_BLOCKS: dict[tuple[int, str, Metadata, bool], bytes] = {}


def status_block(code: int, message: str = "", metadata: Metadata = (), trailers_only: bool = False) -> bytes:
    """The header block that ends a call (with :status and content-type first when nothing was sent).

    Static-table encoding only, so it is valid on any connection (a proxy can inject it without
    touching the client's dynamic table). Memoised (bounded): a refusal under overload is the same
    few blocks thousands of times a second."""
    key = (code, message, metadata, trailers_only)
    hit = _BLOCKS.get(key)
    if hit is None:
        if len(_BLOCKS) >= 1024:
            _BLOCKS.clear()
        fields = [(":status", "200"), ("content-type", "application/grpc")] if trailers_only else []
        fields.append(("grpc-status", str(int(code))))
        if message:
            fields.append(("grpc-message", percent_encode(message)))
        hit = _BLOCKS[key] = encode_block(fields + metadata_out(metadata))
    return hit


def status_from_headers(headers: list[tuple[str, str]], http_status: int | None) -> tuple[int, str] | None:
    """(grpc code, message) from a trailer block, or None when it has no grpc-status.

    A non-200 HTTP status without grpc-status maps through HTTP_TO_STATUS (UNKNOWN otherwise)."""
    code, message = None, ""
    for k, v in headers:
        if k == "grpc-status":
            code = int(v) if v.isdigit() else int(Status.UNKNOWN)
        elif k == "grpc-message":
            message = percent_decode(v)
    if code is None:
        if http_status is not None and http_status != 200:
            return int(HTTP_TO_STATUS.get(http_status, Status.UNKNOWN)), f"HTTP status {http_status} without grpc-status"
        return None
    return code, message
