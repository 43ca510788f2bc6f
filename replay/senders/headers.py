"""Which recorded headers (HTTP/1) and metadata (gRPC) a replayed call carries.

    recorded headers -- pseudo, -bin, redacted, hop-by-hop -------------------------> dropped
                     -- trace context (traceparent, tracestate, b3, x-b3-*, uber-trace-id) -> dropped
                        (unless keep_trace_context: a replayed call must not join production traces)
                     -- --drop-header GLOB -------------------------------------------> dropped
                     -- the rest (Content-Type, Accept-Encoding, User-Agent, ...) -------> replayed as recorded
                     + --set-header NAME=VALUE (replaces any recorded one: shadow credentials)
                     + x-shadowtest-replay: 1 (unless --no-marker)

Hop-by-hop (RFC 9110 7.6.1) is about the connection, so the sender sets it for its own: Connection and
the headers it names, Keep-Alive, Proxy-*, TE, Trailer, Transfer-Encoding, Upgrade, Host (the target)
and Content-Length (the body sent). On gRPC calls the sender also owns content-type, user-agent, te
(trailers), grpc-timeout and the grpc-* encodings and status fields, so recorded ones are not replayed.
A redacted credential stays dropped: only --set-header can give the replay one of its own.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass, field

MARKER = ("x-shadowtest-replay", "1")
REDACTION_MARKERS = ("[REDACTED", "<REDACTED", "REDACTED")
HTTP_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host",
    "content-length",
})
# What a gRPC sender sets itself (or HTTP/2 forbids): never taken from the recording.
GRPC_OWN = HTTP_HOP_BY_HOP | frozenset({
    "content-type", "user-agent", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding", "accept-encoding",
    "grpc-status", "grpc-message",
})
TRACE_CONTEXT = ("traceparent", "tracestate", "b3", "x-b3-*", "uber-trace-id")
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}$")
_GRPC_KEY = re.compile(r"^[0-9a-z_.-]{1,256}$")
_MAX_VALUE = 8192
_MAX_RULES = 64
_MAX_NAMES = 4096  # distinct recorded header names whose decision is kept


class HeaderError(ValueError):
    """A --set-header or --drop-header value that cannot be used (one line)."""


@functools.lru_cache(maxsize=64)
def _matcher(globs: tuple[str, ...]) -> re.Pattern[str] | None:
    """One compiled pattern for a set of name globs (None for none)."""
    return re.compile("|".join(fnmatch.translate(g) for g in globs)) if globs else None


def _hop_by_hop(key: str) -> bool:
    return key in HTTP_HOP_BY_HOP or key.startswith("proxy-")


def parse_set_header(text: str) -> tuple[str, str]:
    """"NAME=VALUE" (or "NAME: VALUE") -> (lower-case name, value). Raises HeaderError."""
    sep = "=" if "=" in text and (":" not in text or text.index("=") < text.index(":")) else ":"
    name, found, value = text.partition(sep)
    name, value = name.strip().lower(), value.strip()
    if not found or not name:
        raise HeaderError(f"{text!r}: use NAME=VALUE, e.g. 'authorization=Bearer shadow'")
    if not _TOKEN.match(name):
        raise HeaderError(f"{name!r}: not a header name (letters, digits and -_.!#$%&'*+^`|~ only)")
    if _hop_by_hop(name) or name.startswith(":"):
        raise HeaderError(f"{name!r} is hop-by-hop: the sender sets it for its own connection")
    if name.endswith("-bin"):
        raise HeaderError(f"{name!r}: binary (-bin) metadata cannot be set from the command line")
    if len(value) > _MAX_VALUE or any(not 0x20 <= ord(c) < 0x7F for c in value):  # what gRPC metadata allows
        raise HeaderError(f"{name!r}: the value must be printable ASCII of at most {_MAX_VALUE} characters")
    return name, value


def parse_drop_header(glob: str) -> str:
    """A header-name glob ("x-debug-*"), lower-cased. Raises HeaderError for an empty or odd one."""
    g = glob.strip().lower()
    if not g or len(g) > 256 or any(c.isspace() or c in ":=" for c in g):
        raise HeaderError(f"{glob!r}: give a header name or a glob such as 'x-debug-*'")
    return g


@dataclass(frozen=True)
class HeaderPolicy:
    """The header rules of one replay (picklable, for --workers). See the module docstring."""

    set_headers: tuple[tuple[str, str], ...] = ()
    drop: tuple[str, ...] = ()
    marker: bool = True
    keep_trace_context: bool = False
    # Per protocol: {recorded name: (lower-cased name, dropped by its name alone)} and the headers the
    # policy adds. Deciding each name once instead of per call took apply from ~11 to ~3 us per call.
    _rules: dict[str, tuple[dict[str, tuple[str, bool]], list[tuple[str, str]]]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @classmethod
    def from_options(cls, set_headers: tuple[str, ...] = (), drop: tuple[str, ...] = (), *, marker: bool = True,
                     keep_trace_context: bool = False) -> HeaderPolicy:
        """From the CLI's strings; raises HeaderError (one line) for a bad one."""
        if len(set_headers) > _MAX_RULES or len(drop) > _MAX_RULES:
            raise HeaderError(f"at most {_MAX_RULES} --set-header and {_MAX_RULES} --drop-header values")
        return cls(tuple(parse_set_header(s) for s in set_headers), tuple(parse_drop_header(d) for d in drop),
                   marker, keep_trace_context)

    def apply(self, metadata: list[tuple[str, str]], protocol: str = "grpc") -> list[tuple[str, str]]:
        """The headers to send for a call recorded with `metadata` (names lower-cased)."""
        rules = self._rules.get(protocol) or self._new_rules(protocol)
        by_name, tail = rules
        keep = []
        named = None  # headers the recorded Connection header names are hop-by-hop too
        for key, value in metadata:
            rule = by_name.get(key)
            if rule is None:
                if len(by_name) >= _MAX_NAMES:  # bounded: names are few, unless a recording is hostile
                    by_name.clear()
                rule = by_name[key] = self._rule(key, protocol)
            k, dropped = rule
            if k == "connection":
                named = (named or set()) | {t.strip().lower() for t in value.split(",")}
            if not dropped and not value.upper().startswith(REDACTION_MARKERS):
                keep.append((k, value))
        if named:
            keep = [(k, v) for k, v in keep if k not in named]
        return keep + tail if tail else keep

    def _rule(self, key: str, protocol: str) -> tuple[str, bool]:
        """(lower-cased name, whether the name alone drops it) for a recorded header name."""
        k = key.lower()
        own = GRPC_OWN if protocol == "grpc" else HTTP_HOP_BY_HOP
        replaced = {n for n, _ in self.set_headers} | ({MARKER[0]} if self.marker else set())
        dropped = _matcher(self.drop + (() if self.keep_trace_context else TRACE_CONTEXT))
        return k, bool(k.startswith(":") or k in own or _hop_by_hop(k) or k.endswith("-bin") or k in replaced
                       or (dropped is not None and dropped.match(k)))

    def _new_rules(self, protocol: str) -> tuple[dict[str, tuple[str, bool]], list[tuple[str, str]]]:
        """This policy's per-name decisions for `protocol` (filled as names are met) and what it adds."""
        own = GRPC_OWN if protocol == "grpc" else HTTP_HOP_BY_HOP
        if protocol == "grpc":  # what gRPC owns, or a name gRPC metadata cannot carry: HTTP/1 calls only
            tail = [(k, v) for k, v in self.set_headers if k not in own and _GRPC_KEY.match(k)]
        else:
            tail = list(self.set_headers)
        if self.marker:
            tail.append(MARKER)
        rules: tuple[dict[str, tuple[str, bool]], list[tuple[str, str]]] = ({}, tail)
        self._rules[protocol] = rules
        return rules


DEFAULT_POLICY = HeaderPolicy()
