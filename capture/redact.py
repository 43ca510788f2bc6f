"""Redaction: remove credentials before they reach the recording, or afterwards with `redact`.

Rules are small objects registered by kind (`header`, `body-regex`, `json-field`):

    header:NAME[,NAME...]     mask metadata/header values (glob patterns: `*-token`)
    body-regex:PATTERN        replace regex matches in request/response bodies with '*' (same length)
    json-field:PATH           mask a field of JSON bodies (dotted path, e.g. `user.ssn`), with '*'

`DEFAULT_RULES` apply at record time unless `--no-default-redaction`: `default:credential-headers`
masks authorization, cookies and API-key/token style headers; `default:credential-fields` masks the
values of credential-named query parameters (HTTP/1 request target, HTTP/2 :path), form fields and
JSON keys at any depth (the names: capture/fields.py). Masking keeps lengths where bytes are masked in
place, so the raw chunks stay a valid byte stream (HTTP/1.1 header lines and bodies, HPACK literals,
DATA frames) for replay and export.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from capture.errors import CaptureError
from capture.fields import FORM, SNIFF, FieldPolicy, body_kind, mask_body, mask_target, may_hold_names
from capture.recording import Call, Message

MASK = "<redacted>"
DEFAULT_HEADER_PATTERNS = ("authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key",
                           "api-key", "apikey", "*-api-key", "*-token", "*-secret", "x-auth-*")


class Rule(Protocol):
    spec: str

    def apply(self, call: Call) -> bool:
        """Redact `call` in place; True when something changed."""


@dataclass
class HeaderRule:
    patterns: tuple[str, ...]
    spec: str = ""

    def matches(self, name: str) -> bool:
        # Called for every header of every call: remember each name's verdict.
        cache: dict[str, bool] = self.__dict__.setdefault("_cache", {})
        hit = cache.get(name)
        if hit is None:
            low = name.lower()
            hit = cache[name] = any(fnmatch.fnmatchcase(low, p) for p in self.patterns)
        return hit

    def line_pattern(self) -> re.Pattern[bytes] | None:
        """A regex of the `Name: value` lines whose name matches a pattern (group 1: the value), for
        scanning whole header blocks at C speed; None when a pattern is more than literals and `*`/`?`
        (a character class): then each line's name goes through `matches`."""
        if any("[" in p for p in self.patterns):
            return None
        alt = "|".join(_glob_regex(p) for p in self.patterns)
        return re.compile(rb"(?mi)^(?:" + alt.encode() + rb"):[ \t]*([^\r\n]*)")

    def line_hints(self) -> re.Pattern[bytes] | None:
        """A quick test for lower-cased text that may hold such a line: the longest literal piece of
        each pattern (a line whose name matches holds it); None when a pattern has no literal piece."""
        pieces = {max(re.split(r"[*?]", p), key=len).lower() for p in self.patterns}
        if not pieces or not all(pieces):
            return None
        needed = [p for p in pieces if not any(q != p and q in p for q in pieces)]   # "cookie" covers "set-cookie"
        return re.compile("|".join(re.escape(p) for p in sorted(needed)).encode())

    def apply(self, call: Call) -> bool:
        changed = False
        for attr in ("request_metadata", "response_metadata"):
            meta = getattr(call, attr)
            new = self._masked(meta)
            changed |= new != meta
            setattr(call, attr, new)
        return changed

    def _masked(self, meta: list[tuple[str, str]]) -> list[tuple[str, str]]:
        # The recorder applies this to every call, whose header sets repeat: remember each result.
        cache = self.__dict__.setdefault("_sets", {})
        try:
            key = tuple(meta)
            hit = cache.get(key)
        except TypeError:                 # pairs given as lists
            return [(k, MASK if self.matches(k) else v) for k, v in meta]
        if hit is None:
            if len(cache) >= 4096:
                cache.clear()
            hit = cache[key] = tuple((k, MASK if self.matches(k) else v) for k, v in meta)
        return list(hit)


_NAME_CHARS = r"[A-Za-z0-9!#$%&'*+.^_`|~-]"   # an HTTP header name's characters (RFC 9110 token)


def _glob_regex(pattern: str) -> str:
    """A header-name glob (`*`, `?` and literals, as HeaderRule.matches reads them) as a regex."""
    out = []
    for ch in pattern:
        out.append(_NAME_CHARS + "*" if ch == "*" else _NAME_CHARS if ch == "?" else re.escape(ch))
    return "".join(out)


@dataclass
class BodyRegexRule:
    pattern: re.Pattern[bytes]
    spec: str = ""

    def mask(self, data: bytes) -> bytes:
        return self.pattern.sub(lambda m: b"*" * len(m.group(0)), data)

    def apply(self, call: Call) -> bool:
        return _map_messages(call, self.mask)


@dataclass
class FieldRule:
    """Secret fields (capture/fields.py): in the query of a call's method/path and in its JSON and
    form bodies, masked with '*' of the same length, as the raw chunks are (so a call decoded from
    masked chunks is the call masked here). `default:credential-fields`: credential names anywhere."""

    policy: FieldPolicy
    spec: str = ""

    def apply(self, call: Call) -> bool:
        return mask_call_fields(call, self.policy)


def mask_call_fields(call: Call, policy: FieldPolicy) -> bool:
    """Mask `policy`'s fields in `call` in place; True when something changed. gRPC and raw TCP bodies
    are never read as text (protobuf, or bytes of unknown shape); compressed bodies cannot be."""
    changed = False
    if policy.names and call.method and "?" in call.method:
        method = mask_target(call.method, policy)
        changed, call.method = method != call.method, method
    if call.protocol not in ("http1", "http2"):
        return changed
    for attr, meta in (("requests", call.request_metadata), ("responses", call.response_metadata)):
        msgs: list[Message] = getattr(call, attr)
        if not msgs:
            continue
        if not policy.paths:
            for m in msgs:
                if may_hold_names(m.data, SNIFF):
                    break
            else:
                continue                  # no trace of a credential name in any of its bodies
        kind = _body_kind(meta)
        if kind is None or (kind == FORM and not policy.names):
            continue                      # most bodies (text, HTML, images): nothing to read
        out = []
        for m in msgs:
            data = m.data if m.compressed else mask_body(m.data, kind, policy)
            changed |= data != m.data
            out.append(m if data == m.data else Message(m.direction, m.seq, m.ts_ns, data, m.compressed))
        setattr(call, attr, out)
    return changed


def _map_messages(call: Call, fn: Callable[[bytes], bytes]) -> bool:
    changed = False
    for attr in ("requests", "responses"):
        out = []
        for m in getattr(call, attr):
            data = fn(m.data)
            changed |= data != m.data
            out.append(Message(m.direction, m.seq, m.ts_ns, data, m.compressed))
        setattr(call, attr, out)
    return changed


def _body_kind(meta: list[tuple[str, str]]) -> str | None:
    headers = dict(meta)                  # the decoders give header names in lower case; others may not
    if "content-type" not in headers and "content-encoding" not in headers:
        headers = {k.lower(): v for k, v in meta}
    return _kind_of(headers.get("content-type"), headers.get("content-encoding"))


_kind_of = functools.lru_cache(maxsize=256)(body_kind)   # the same few content types over and over


def parse_rule(spec: str) -> Rule:
    """Build a rule from `kind:argument` (see the module docstring).

    Raises CaptureError with the accepted forms when `spec` is malformed."""
    kind, _, arg = spec.partition(":")
    if not arg:
        raise CaptureError(f"redaction rule {spec!r} needs KIND:ARG with KIND header, body-regex or json-field")
    if kind == "header":
        return HeaderRule(tuple(p.strip().lower() for p in arg.split(",") if p.strip()), spec)
    if kind == "body-regex":
        try:
            return BodyRegexRule(re.compile(arg.encode()), spec)
        except re.error as exc:
            raise CaptureError(f"redaction rule {spec!r}: bad regex: {exc}") from exc
    if kind == "json-field":           # the value at that key path of JSON bodies (arrays are transparent)
        return FieldRule(FieldPolicy(paths=frozenset({tuple(arg.split("."))})), spec)
    raise CaptureError(f"unknown redaction rule kind {kind!r} in {spec!r}: use header, body-regex or json-field")


DEFAULT_RULES: tuple[Rule, ...] = (HeaderRule(DEFAULT_HEADER_PATTERNS, "default:credential-headers"),
                                   FieldRule(FieldPolicy(names=True), "default:credential-fields"))


def rules_from_specs(specs: list[object]) -> list[Rule]:
    """The rules a recording lists in `meta.redaction_rules` (defaults by their `default:` name);
    specs that do not parse are skipped (they were valid when applied)."""
    out: list[Rule] = []
    for spec in specs:
        text = str(spec)
        if text.startswith("default:"):
            out += [r for r in DEFAULT_RULES if r.spec == text and r not in out]
            continue
        try:
            out.append(parse_rule(text))
        except CaptureError:
            continue
    return out


@dataclass
class Redactor:
    """The rules in force for one recording; applies to calls and masks raw header bytes in chunks."""

    rules: list[Rule] = field(default_factory=lambda: list(DEFAULT_RULES))

    @property
    def specs(self) -> list[str]:
        return [r.spec for r in self.rules]

    def header_rule(self) -> HeaderRule | None:
        pats = tuple(p for r in self.rules if isinstance(r, HeaderRule) for p in r.patterns)
        return HeaderRule(pats) if pats else None

    def field_policy(self) -> FieldPolicy | None:
        """The secret fields of all field rules together (None: no field rule), for the raw chunks."""
        policies = [r.policy for r in self.rules if isinstance(r, FieldRule)]
        if not policies:
            return None
        return FieldPolicy(any(p.names for p in policies), frozenset().union(*(p.paths for p in policies)))

    def call(self, call: Call) -> bool:
        changed = False
        for rule in self.rules:
            changed |= rule.apply(call)
        return changed

    def body(self, data: bytes) -> bytes:
        for rule in self.rules:
            if isinstance(rule, BodyRegexRule):
                data = rule.mask(data)
        return data


_H1_HEADER = re.compile(rb"(?m)^([A-Za-z0-9!#$%&'*+.^_`|~-]+):[ \t]*([^\r\n]*)")


def mask_http1_headers(data: bytes, rule: HeaderRule) -> bytes:
    """Mask values of matching `Name: value` lines in raw HTTP/1.1 bytes, keeping every length."""
    def sub(m: re.Match[bytes]) -> bytes:
        if not rule.matches(m.group(1).decode("latin-1")):
            return m.group(0)
        return m.group(0)[:m.start(2) - m.start(0)] + b"*" * len(m.group(2))
    return _H1_HEADER.sub(sub, data)


# Credentials by pattern, for raw TCP flows (no header structure to go by): `Bearer X`/`Basic X`, and
# `api_key=X`, `"token": "X"`, `password: X`, `cookie=X`... The value (group 1) is blanked; its
# characters exclude '*', so masking twice changes nothing.
_VALUE = rb"[^\s\"',;&<>{}()\[\]*]"
_PATTERNS = re.compile(
    rb"(?i)(?:\b(?:bearer|basic)[ \t]{1,8}|(?:api[_-]?key|apikey|access[_-]?token|auth[_-]?token|"
    rb"refresh[_-]?token|token|secret|password|passwd|cookie|session[_-]?id)[\"']?[ \t]{0,4}[:=][ \t]{0,4}"
    rb"[\"']?)(" + _VALUE + rb"+)")
PATTERN_VALUE = re.compile(_VALUE + rb"*")


def mask_patterns(buf: bytearray) -> re.Pattern[bytes] | None:
    """Blank pattern credentials in `buf` in place; PATTERN_VALUE when a value runs to its end (the
    caller masks on into the next bytes), else None."""
    spans = [m.span(1) for m in _PATTERNS.finditer(buf)]
    for s, e in spans:
        buf[s:e] = b"*" * (e - s)
    return PATTERN_VALUE if spans and spans[-1][1] == len(buf) else None
