"""Call-level toxics as a connection's tap sees them: which calls a rule picks, and each call's fate.

Both taps (h2tap for HTTP/2 and gRPC, h1tap for HTTP/1.x) ask `fate_of` once per new call:

    rules (drawn per connection) --matches(call)--> share drawn per call --> Fate(delay_s, error)

A gRPC rule (`grpc_delay`, `grpc_error`) picks calls by gRPC method (`:path`); an HTTP rule
(`http_delay`, `http_error`) by HTTP method, path (a prefix, or a glob when it holds * ? or [)
and a header (`name`: present; `name: value`: equal, or a glob of the value).
"""

from __future__ import annotations

import fnmatch
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Call", "CallRule", "Fate", "fate_of", "rule_of", "GLOB_CHARS"]

GLOB_CHARS = frozenset("*?[")
CALL_TOXICS = {"grpc_delay": ("delay", "grpc"), "grpc_error": ("error", "grpc"),
               "http_delay": ("delay", "http"), "http_error": ("error", "http")}


@dataclass(frozen=True)
class Call:
    """What a rule may look at in a new call: HTTP method, request target, header fields (names lower case)."""

    method: str
    path: str
    headers: Sequence[tuple[str, str]] = ()


@dataclass(frozen=True)
class Fate:
    """What happens to one call: held `delay_s`, and/or answered by the proxy with `error`:
    ("grpc", status, message) or ("http", status, body)."""

    delay_s: float = 0.0
    error: tuple[str, int, str] | None = None


@dataclass
class CallRule:
    """One call toxic as this connection sees it (toxicity already drawn)."""

    kind: str  # "delay" | "error"
    attrs: dict[str, Any]
    proto: str = "grpc"  # "grpc" | "http"

    def matches(self, call: Call) -> bool:
        if self.proto == "grpc":
            want = str(self.attrs.get("method") or "")
            path = call.path
            return not want or path == want or path == "/" + want.lstrip("/") or path.endswith("/" + want)
        method = str(self.attrs.get("method") or "")
        if method and call.method.upper() != method.upper():
            return False
        path = str(self.attrs.get("path") or "")
        if path and not _path_matches(path, call.path):
            return False
        header = str(self.attrs.get("header") or "")
        return not header or _header_matches(header, call.headers)


def _path_matches(want: str, target: str) -> bool:
    if GLOB_CHARS.intersection(want):
        return fnmatch.fnmatchcase(target, want)
    return target.startswith(want)


def _header_matches(want: str, headers: Sequence[tuple[str, str]]) -> bool:
    name, sep, value = want.partition(":")
    name, value = name.strip().lower(), value.strip()
    for k, v in headers:
        if k == name:
            if not sep:
                return True
            v = v.strip()
            if v == value or (GLOB_CHARS.intersection(value) and fnmatch.fnmatchcase(v, value)):
                return True
    return False


def rule_of(toxic_type: str, attrs: dict[str, Any]) -> CallRule:
    kind, proto = CALL_TOXICS[toxic_type]
    return CallRule(kind, attrs, proto)


def fate_of(rules: Sequence[CallRule], call: Call, rng: random.Random, protos: frozenset[str]) -> Fate:
    """The fate of a new call under `rules` (only those of `protos` apply): delays add up, the first
    error drawn wins. One draw per matching rule, so shares hold per rule."""
    delay_ms = 0
    error: tuple[str, int, str] | None = None
    for rule in rules:
        if rule.proto not in protos or not rule.matches(call):
            continue
        if rng.random() >= float(rule.attrs.get("share", 1.0)):
            continue
        a = rule.attrs
        if rule.kind == "delay":
            jitter = int(a.get("jitter", 0))
            extra = rng.randrange(2 * jitter) - jitter if jitter > 0 else 0
            delay_ms += max(0, int(a.get("delay", 0)) + extra)
        elif error is None:
            if rule.proto == "grpc":
                error = ("grpc", int(a.get("status", 14)), str(a.get("message", "")))
            else:
                error = ("http", int(a.get("status", 503)), str(a.get("body", "")))
    return Fate(delay_ms / 1000.0, error)
