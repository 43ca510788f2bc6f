"""Credential fields: query parameters, form fields and JSON keys whose values are secrets.

The names live here, once (CREDENTIAL_NAMES and the rules beside it), with the scanners that find
their values, in whole bodies (calls) and in byte streams cut anywhere (raw chunks, see
capture/decode/h1mask.py and capture/decode/h2mask.py):

    PairScanner   name=value&name=value: query strings, application/x-www-form-urlencoded bodies
    JsonScanner   JSON text (objects, arrays, strings, numbers; NDJSON too), one piece at a time
    FieldPolicy   what is secret: credential names at any depth (the default rule), json-field paths

Both scanners carry their state from one piece to the next (a name, a key, an escape or a value
split anywhere, byte by byte included), and neither holds bytes back: a name is not a secret, so
by the time a value starts its name is known. They return the spans of secret values; callers mask
them in place with '*' of the same length (MASK_BYTE), so a body keeps its length, an HTTP/1
Content-Length or chunk size and an HTTP/2 DATA frame stay right. A JSON string keeps its quotes
(`"password":"******"` is still JSON); a number under a credential name becomes '*'s too (same
length, so a JSON parser rejects that body: replay's --set-field gives it a value); true, false and
null stay as they are.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

MASK_BYTE = 0x2A                     # '*', as every in-place mask (header values, body-regex)

# ---- the names -----------------------------------------------------------------------------------
# Compared after normalising: lower case, '-', '_', '.' and spaces removed, so api_key, api-key, apiKey,
# API_KEY and "api key" are one name. A bare "key" is not one of them: it names sort keys, map keys,
# cache and partition keys far more often than secrets (api_key, access_key, private_key... are).
CREDENTIAL_NAMES = frozenset({
    "password", "passwd", "pwd", "pass", "passphrase", "passcode",
    "secret", "token", "auth", "authorization", "credential", "credentials", "cookie",
    "apikey", "accesskey", "secretkey", "privatekey", "signingkey", "encryptionkey", "masterkey",
    "session", "sessionid", "sessid", "sid", "phpsessid", "jsessionid",
    "signature", "sig",
})
# Anywhere in a name: new_password, password_confirmation, db_passwd, client_secret, webhookSecret.
CREDENTIAL_PARTS = ("password", "passwd", "secret")
# At the end of a name: access_token, refresh_token, id_token, auth_token, csrf_token,
# x-amz-security-token, x_api_key, aws_access_key, ssh_private_key, user_session_id, X-Amz-Signature.
CREDENTIAL_ENDS = ("token", "apikey", "accesskey", "privatekey", "secretkey", "sessionid", "signature")
# ...but not pagination cursors, which end in "token" and must replay as recorded.
NOT_CREDENTIAL_ENDS = ("pagetoken", "nexttoken", "continuationtoken", "synctoken", "resumetoken")
_NORMALISE = str.maketrans("", "", "-_. ")
NAME_CAP = 256                       # longer names are not credential names (and are not kept)


@functools.lru_cache(maxsize=4096)
def is_credential_name(name: str) -> bool:
    """True when a query/form/JSON field called `name` holds a credential (see the lists above).
    Bracketed form names (`user[password]`) count by their last part."""
    n = name.lower().translate(_NORMALISE)
    if "[" in n:
        n = n.replace("]", "").rsplit("[", 1)[-1]
    return (n in CREDENTIAL_NAMES or any(p in n for p in CREDENTIAL_PARTS)
            or (n.endswith(CREDENTIAL_ENDS) and not n.endswith(NOT_CREDENTIAL_ENDS)))


def form_name(raw: bytes) -> str:
    """A query/form name as the application reads it: '+' is a space, %XX its byte."""
    return unquote_to_bytes(raw.replace(b"+", b" ")).decode("utf-8", "replace")


@dataclass(frozen=True)
class FieldPolicy:
    """Which values are secret. names: credential names (query, form, JSON keys at any depth), the
    default rule. paths: JSON key paths from json-field rules ("user.ssn" -> ("user", "ssn")); arrays
    are transparent (`users.password` covers every user of a list). Under a secret key the whole
    value is secret: an object's or array's strings and numbers too (its keys stay)."""

    names: bool = False
    paths: frozenset[tuple[str, ...]] = frozenset()

    def __bool__(self) -> bool:
        return self.names or bool(self.paths)

    def param(self, raw_name: bytes) -> bool:
        return self.names and is_credential_name(form_name(raw_name))

    def key(self, path: tuple[str, ...], name: str) -> bool:
        return (self.names and is_credential_name(name)) or (bool(self.paths) and path in self.paths)


Span = tuple[int, int]


# ---- name=value&... -----------------------------------------------------------------------------
_NAME_RUN = re.compile(rb"[^=&]*")


class PairScanner:
    """Values of `name=value` pairs separated by '&', whose (decoded) name `secret` accepts. Fed the
    pairs' bytes only (the caller cuts a query string at its end, a form body at its framing)."""

    def __init__(self, secret: Callable[[bytes], bool]) -> None:
        self.secret = secret
        self.name: bytearray | None = bytearray()    # None: longer than NAME_CAP
        self.in_value = False
        self.masked = False

    def feed(self, data: bytes | bytearray, pos: int, end: int, spans: list[Span]) -> None:
        while pos < end:
            if self.in_value:
                amp = data.find(b"&", pos, end)
                stop = end if amp < 0 else amp
                if self.masked:               # an empty value too (replay's --set-field fills it)
                    spans.append((pos, stop))
                if amp < 0:
                    return
                pos, self.in_value, self.name = amp + 1, False, bytearray()
                continue
            m = _NAME_RUN.match(data, pos, end)
            assert m is not None
            e = m.end()
            if self.name is not None:
                self.name += data[pos:e]
                if len(self.name) > NAME_CAP:
                    self.name = None
            if e == end:
                return
            if data[e] == 0x3D:                                      # '='
                self.in_value = True
                self.masked = self.name is not None and self.secret(bytes(self.name))
            else:                                                    # '&': a name without a value
                self.name = bytearray()
            pos = e + 1


def query_spans(target: bytes | bytearray, secret: Callable[[bytes], bool], start: int = 0,
                end: int | None = None) -> list[Span]:
    """Secret values in the query string of a whole request target (`/p?api_key=x&y=1`)."""
    end = len(target) if end is None else end
    q = target.find(b"?", start, end)
    if q < 0:
        return []
    hash_at = target.find(b"#", q, end)
    spans: list[Span] = []
    PairScanner(secret).feed(target, q + 1, end if hash_at < 0 else hash_at, spans)
    return spans


# ---- JSON ----------------------------------------------------------------------------------------
_STRUCT = re.compile(rb'["{}\[\],:]')
_STRUCT_OR_SCALAR = re.compile(rb'["{}\[\],:]|[^\s"{}\[\],:]+')
_STRING_RUN = re.compile(rb'[^"\\]*')
_SCALAR_RUN = re.compile(rb'[^\s"{}\[\],:]*')
_NOT_SPACE = re.compile(rb"[^ \t\r\n]")
_QUOTE, _BACKSLASH, _LBRACE, _RBRACE, _LBRACKET, _RBRACKET, _COMMA, _COLON = b'"\\{}[],:'
_LITERAL_START = frozenset(b"tfn")     # true, false, null: no secret, and masking them would break the JSON
DEPTH_CAP = 512          # deeper JSON stops being scanned (and no one nests credentials that deep)


@dataclass(frozen=True)
class _Frame:
    is_object: bool
    path: tuple[str, ...]      # keys from the top (arrays add none)
    secret: bool               # everything inside is secret


class JsonScanner:
    """Secret values of JSON text fed in pieces: strings (their content, between the quotes) and
    numbers (bare scalars other than true/false/null) under a secret key or inside a secret object/array.

    Tolerant: it never raises; a body whose first byte (after blanks) is not '{' or '[' is not
    scanned (not JSON, or nothing that has keys), and each later top-level value must start so too.
    With `subtree` False only values at an exact secret key count (replay's --set-field looks a
    path up that way) on a whole body: each string is then one span (its content, empty or escaped
    alike) and `kinds` tells strings (True) from scalars (False)."""

    def __init__(self, policy: FieldPolicy, subtree: bool = True) -> None:
        self.policy = policy
        self.subtree = subtree
        self.stack: list[_Frame] = []
        self.expect_key = False
        self.value_secret = False          # the value after the current key
        self.key_path: tuple[str, ...] = ()
        self.in_string = False
        self.string_from = 0               # where the string's content starts (whole bodies only)
        self.string_key = False
        self.string_secret = False
        self.escape = False
        self.key: bytearray | None = None
        self.in_scalar = False             # inside a bare scalar (secret position) that reached the end of a piece
        self.scalar_masked = False         # ...and not true/false/null (masked)
        self.started = False               # inside a top-level value
        self.dead = False
        self.kinds: list[bool] | None = None if subtree else []     # for --set-field (whole bodies only)

    def feed(self, data: bytes | bytearray, pos: int, end: int, spans: list[Span]) -> None:
        while pos < end and not self.dead:
            if self.in_string:
                pos = self._string(data, pos, end, spans)
            elif self.in_scalar:
                m = _SCALAR_RUN.match(data, pos, end)
                assert m is not None
                if self.scalar_masked:
                    self._span(spans, pos, m.end(), False)
                pos = m.end()
                self.in_scalar = pos == end
            elif not self.started:
                m = _NOT_SPACE.search(data, pos, end)
                if m is None:
                    return
                pos = m.start()
                if data[pos] not in (_LBRACE, _LBRACKET):
                    self.dead = True                 # not an object or array: nothing to look up
                    return
                self.started = True
            else:
                pos = self._token(data, pos, end, spans)

    def _span(self, spans: list[Span], s: int, e: int, string: bool) -> None:
        if e > s:
            spans.append((s, e))
            if self.kinds is not None:
                self.kinds.append(string)

    def _secret_here(self) -> bool:
        """Is a value at the current position secret?"""
        if not self.stack:
            return False
        top = self.stack[-1]
        return top.secret if not top.is_object else self.value_secret

    def _token(self, data: bytes | bytearray, pos: int, end: int, spans: list[Span]) -> int:
        secret = self._secret_here()
        m = (_STRUCT_OR_SCALAR if secret else _STRUCT).search(data, pos, end)
        if m is None:
            return end
        c = data[m.start()]
        if c == _QUOTE:
            self.in_string = True
            self.string_key = self.expect_key and bool(self.stack) and self.stack[-1].is_object
            self.string_secret = not self.string_key and secret
            self.string_from = m.end()
            self.key = bytearray() if self.string_key else None
        elif c in (_LBRACE, _LBRACKET):
            self._push(c == _LBRACE, secret)
        elif c in (_RBRACE, _RBRACKET):
            if self.stack:
                self.stack.pop()
            self.expect_key = False
            self.started = bool(self.stack)          # a top-level value ended (NDJSON: another may follow)
        elif c == _COMMA:
            self.expect_key = bool(self.stack) and self.stack[-1].is_object
        elif c == _COLON:
            self.expect_key = False
        else:                                        # a bare scalar (only searched for when secret)
            self.scalar_masked = c not in _LITERAL_START   # a number (or a '*' run the recorder left)
            if self.scalar_masked:
                self._span(spans, m.start(), m.end(), False)
            self.in_scalar = m.end() == end
        return m.end()

    def _push(self, is_object: bool, secret: bool) -> None:
        if len(self.stack) >= DEPTH_CAP:
            self.dead = True
            return
        top = self.stack[-1] if self.stack else None
        path = self.key_path if top is not None and top.is_object else (top.path if top else ())
        self.stack.append(_Frame(is_object, path, secret and self.subtree))
        self.expect_key = is_object
        self.value_secret = False

    def _string(self, data: bytes | bytearray, pos: int, end: int, spans: list[Span]) -> int:
        masking = self.string_secret and self.kinds is None      # a lookup takes the string whole at its end
        if self.escape:                              # the byte after a backslash
            self.escape = False
            if masking:
                self._span(spans, pos, pos + 1, True)
            self._key_add(data, pos, pos + 1)
            return pos + 1
        m = _STRING_RUN.match(data, pos, end)
        assert m is not None
        e = m.end()
        if masking:
            self._span(spans, pos, e, True)
        self._key_add(data, pos, e)
        if e == end:
            return e
        if data[e] == _BACKSLASH:
            self.escape = True
            if masking:
                self._span(spans, e, e + 1, True)
            self._key_add(data, e, e + 1)
            return e + 1
        self.in_string = False                       # the closing quote
        if self.string_key:
            self._key_done()
        elif self.string_secret and self.kinds is not None:
            spans.append((self.string_from, e))
            self.kinds.append(True)
        return e + 1

    def _key_add(self, data: bytes | bytearray, s: int, e: int) -> None:
        if self.key is not None and e > s:
            self.key += data[s:e]
            if len(self.key) > NAME_CAP:
                self.key = None                      # too long for a name: never secret by name

    def _key_done(self) -> None:
        raw, self.key = self.key, None
        top = self.stack[-1]
        name = _key_text(bytes(raw)) if raw is not None else None
        # a name too long to keep is in no json-field path ("\0" is in none either)
        self.key_path = top.path + (name if name is not None else "\0",) if self.policy.paths else ()
        self.value_secret = (top.secret or (name is not None and self.policy.key(self.key_path, name)))
        self.expect_key = False


def _key_text(raw: bytes) -> str:
    if b"\\" not in raw:
        return raw.decode("utf-8", "replace")
    try:
        return str(json.loads(b'"' + raw + b'"'))
    except ValueError:
        return raw.decode("utf-8", "replace")


# ---- bodies --------------------------------------------------------------------------------------
JSON, FORM, SNIFF = "json", "form", "sniff"     # SNIFF: the headers do not say; the first byte decides


def body_kind(content_type: str | None, content_encoding: str | None = None) -> str | None:
    """JSON, FORM, SNIFF (no content type, or one HPACK hid from a joined capture) or None (not
    scanned) for a body with these headers. A compressed body cannot be masked in place (its bytes
    are not the text), so it is not scanned."""
    if content_encoding and content_encoding.strip().lower() not in ("", "identity"):
        return None
    if not content_type:
        return SNIFF
    media = content_type.split(";", 1)[0].strip().lower()
    if media.startswith("application/grpc"):       # length-prefixed messages, JSON codec or not
        return None
    if media == "application/x-www-form-urlencoded":
        return FORM
    if "json" in media.rpartition("/")[2]:          # application/json, +json, x-ndjson, text/json
        return JSON
    return None


def sniff_byte(first: int) -> str | None:
    """What a body of unknown type is, by its first byte after blanks: JSON when '{' or '[', nothing
    when binary (a control byte or one over 0x7F: gRPC's message prefix is 0 or 1), else FORM text
    (the pair scanner masks only what follows a credential name and '=')."""
    if first in (_LBRACE, _LBRACKET):
        return JSON
    return FORM if 0x20 <= first < 0x7F else None


def sniff(data: bytes | bytearray) -> str | None:
    m = _NOT_SPACE.search(data)
    return None if m is None else sniff_byte(data[m.start()])


class SniffScanner:
    """A body of unknown type: becomes a JsonScanner or a PairScanner at its first byte (sniff_byte)."""

    def __init__(self, policy: FieldPolicy) -> None:
        self.policy = policy
        self.inner: PairScanner | JsonScanner | None = None
        self.decided = False

    def feed(self, data: bytes | bytearray, pos: int, end: int, spans: list[Span]) -> None:
        if not self.decided:
            m = _NOT_SPACE.search(data, pos, end)
            if m is None:
                return
            self.decided, kind = True, sniff_byte(data[m.start()])
            if kind is not None:
                self.inner = JsonScanner(self.policy) if kind == JSON else PairScanner(self.policy.param)
        if self.inner is not None:
            self.inner.feed(data, pos, end, spans)


BodyScanner = PairScanner | JsonScanner | SniffScanner


def scanner(kind: str, policy: FieldPolicy) -> BodyScanner:
    if kind == JSON:
        return JsonScanner(policy)
    return PairScanner(policy.param) if kind == FORM else SniffScanner(policy)


def mask_spans(data: bytes | bytearray, spans: list[Span]) -> bytes:
    if not spans:
        return bytes(data)
    out = bytearray(data)
    for s, e in spans:
        out[s:e] = b"*" * (e - s)
    return bytes(out)


def mask_body(data: bytes, kind: str | None, policy: FieldPolicy) -> bytes:
    """A whole body with its secret values masked (same length)."""
    if kind == SNIFF:
        kind = sniff(data)
    if kind is None or not policy or (kind == FORM and not policy.names):
        return data
    spans: list[Span] = []
    scanner(kind, policy).feed(data, 0, len(data), spans)
    return mask_spans(data, spans)


def target_query_spans(raw: bytes, secret: Callable[[bytes], bool]) -> list[Span]:
    """query_spans of a call's method: a request target, or "VERB target" as HTTP calls have it."""
    q = raw.find(b"?")
    if q < 0:
        return []
    end = raw.find(b" ", q)
    return query_spans(raw, secret, raw.rfind(b" ", 0, q) + 1, len(raw) if end < 0 else end)


def mask_target(text: str, policy: FieldPolicy) -> str:
    """A call's method ("VERB target" or a target) with its query's secret values masked."""
    if "?" not in text or not policy.names:
        return text
    raw = text.encode("utf-8", "surrogateescape")
    spans = target_query_spans(raw, policy.param)
    return mask_spans(raw, spans).decode("utf-8", "surrogateescape") if spans else text
