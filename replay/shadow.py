"""Shadow values for query parameters and body fields: `replay --set-query` and `--set-field`.

The recorder masks credential-named query parameters, form fields and JSON values with '*' of the
same length (capture/fields.py). Replayed as recorded, the target receives that run of '*'
(`?api_key=********`, `"password": "********"`): never the secret, and visibly a placeholder in the
target's logs when its auth refuses the call. These options give it a value of the replay's own, as
`--set-header` does for headers:

    --set-query NAME=VALUE   every query parameter NAME (as the application decodes it) of HTTP/1 and
                             plain HTTP/2 calls gets VALUE (percent-encoded)
    --set-field PATH=VALUE   in JSON bodies, the value at the dotted key path PATH (arrays are
                             transparent: `users.password` is every user's) becomes VALUE, a JSON
                             string (a number where the recorded value was a bare scalar and VALUE is
                             a number); in form bodies, every field named PATH gets VALUE

Only parameters and fields the recorded call has are set (a call without `api_key` gets none: a
shadow value replaces a recorded one, it does not change what the call carries). gRPC and raw TCP
calls are left alone. Applied once, where the plan is built (replay/schedule.py), so every sender
and every worker sends the same bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, quote_plus

from capture.fields import (
    FORM,
    JSON,
    SNIFF,
    FieldPolicy,
    JsonScanner,
    PairScanner,
    Span,
    body_kind,
    form_name,
    sniff,
    target_query_spans,
)

_MAX_VALUE = 8192
_MAX_RULES = 64
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_HTTP = ("http1", "http2")


class ShadowError(ValueError):
    """A --set-query or --set-field value that cannot be used (one line)."""


def _pair(text: str, option: str, example: str) -> tuple[str, str]:
    name, found, value = text.partition("=")
    if not found or not name.strip():
        raise ShadowError(f"{option} {text!r}: use NAME=VALUE, e.g. {example!r}")
    if len(value) > _MAX_VALUE or any(not c.isprintable() for c in value):
        raise ShadowError(f"{option} {name!r}: the value must be printable, at most {_MAX_VALUE} characters")
    return name.strip(), value


def parse_set_query(text: str) -> tuple[str, str]:
    """"NAME=VALUE" -> (name, value). Raises ShadowError."""
    name, value = _pair(text, "--set-query", "api_key=shadow-key")
    if any(c in name for c in "&=#?") or any(c.isspace() for c in name):
        raise ShadowError(f"--set-query {name!r}: a parameter name, without & = # ? or blanks")
    return name, value


def parse_set_field(text: str) -> tuple[str, str]:
    """"PATH=VALUE" -> (dotted path, value). Raises ShadowError."""
    path, value = _pair(text, "--set-field", "user.password=shadow-pass")
    if "" in path.split("."):
        raise ShadowError(f"--set-field {path!r}: a dotted key path such as user.password (no empty part)")
    return path, value


@dataclass(frozen=True)
class ShadowValues:
    """The --set-query and --set-field values of one replay (picklable, for --workers)."""

    queries: tuple[tuple[str, str], ...] = ()
    fields: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.queries or self.fields)

    @classmethod
    def from_options(cls, set_query: tuple[str, ...] = (), set_field: tuple[str, ...] = ()) -> ShadowValues:
        """From the CLI's strings; raises ShadowError (one line) for a bad one."""
        if len(set_query) > _MAX_RULES or len(set_field) > _MAX_RULES:
            raise ShadowError(f"at most {_MAX_RULES} --set-query and {_MAX_RULES} --set-field values")
        return cls(tuple(parse_set_query(q) for q in set_query), tuple(parse_set_field(f) for f in set_field))

    def method(self, protocol: str, method: str | None) -> str | None:
        """An HTTP call's "VERB target" with the shadow query values in."""
        if not self.queries or protocol not in _HTTP or not method or "?" not in method:
            return method
        raw = method.encode("utf-8", "surrogateescape")
        for name, value in self.queries:
            spans = target_query_spans(raw, _named(name))
            raw = _put(raw, spans, [quote(value, safe="").encode()] * len(spans))
        return raw.decode("utf-8", "surrogateescape")

    def body(self, protocol: str, metadata: list[tuple[str, str]], data: bytes) -> bytes:
        """An HTTP call's request body with the shadow field values in."""
        if not self.fields or protocol not in _HTTP or not data:
            return data
        headers = {k.lower(): v for k, v in metadata if k.lower() in ("content-type", "content-encoding")}
        kind = body_kind(headers.get("content-type"), headers.get("content-encoding"))
        kind = sniff(data) if kind == SNIFF else kind
        for path, value in self.fields:
            if kind == JSON:
                data = _json_field(data, path, value)
            elif kind == FORM:
                spans: list[Span] = []
                PairScanner(_named(path)).feed(data, 0, len(data), spans)
                data = _put(data, spans, [quote_plus(value).encode()] * len(spans))
        return data


def _named(name: str) -> Callable[[bytes], bool]:
    return lambda raw: form_name(raw) == name


def _json_field(data: bytes, path: str, value: str) -> bytes:
    scan = JsonScanner(FieldPolicy(paths=frozenset({tuple(path.split("."))})), subtree=False)
    spans: list[Span] = []
    scan.feed(data, 0, len(data), spans)
    assert scan.kinds is not None
    string = json.dumps(value)
    bare = value if _NUMBER.fullmatch(value) else string      # a number stays a number
    return _put(data, spans, [string[1:-1].encode() if s else bare.encode() for s in scan.kinds])


def _put(data: bytes, spans: list[Span], news: list[bytes]) -> bytes:
    """`data` with each span replaced by its new bytes (spans in order, not overlapping)."""
    if not spans:
        return data
    out, at = bytearray(), 0
    for (s, e), new in zip(spans, news, strict=True):
        out += data[at:s] + new
        at = e
    return bytes(out + data[at:])

