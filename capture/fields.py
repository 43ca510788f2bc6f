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
# Every credential name holds one of these words as written (case aside): the JSON scanner skims past
# text without one at C speed (searched in lower-cased text: an IGNORECASE search is ten times
# slower). A backslash is one too: an escaped key is read in full.
_HINT_WORDS = ("pass", "pwd", "secret", "token", "auth", "credential", "cookie", "key", "session", "sid", "sig")
_HINT = re.compile("|".join(_HINT_WORDS).encode() + rb"|\\")
# ... and in a form (or a body that may be one), '%': a percent-encoded name is read in full too
_FORM_HINT = re.compile(_HINT.pattern + rb"|%")


@functools.lru_cache(maxsize=4096)
def is_credential_name(name: str) -> bool:
    """True when a query/form/JSON field called `name` holds a credential (see the lists above).
    Bracketed form names (`user[password]`) count by their last part."""
    low = name.lower()
    if not any(w in low for w in _HINT_WORDS):
        return False                 # what the skim relies on (and "to_ken" is no credential spelling)
    n = low.translate(_NORMALISE)
    if "[" in n:
        n = n.replace("]", "").rsplit("[", 1)[-1]
    return (n in CREDENTIAL_NAMES or any(p in n for p in CREDENTIAL_PARTS)
            or (n.endswith(CREDENTIAL_ENDS) and not n.endswith(NOT_CREDENTIAL_ENDS)))


def form_name(raw: bytes) -> str:
    """A query/form name as the application reads it: '+' is a space, %XX its byte."""
    return unquote_to_bytes(raw.replace(b"+", b" ")).decode("utf-8", "replace")


@functools.lru_cache(maxsize=4096)
def _credential_param(raw_name: bytes) -> bool:
    return is_credential_name(form_name(raw_name))


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
        return self.names and _credential_param(raw_name)

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
_REST_OF_STRING = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"')     # to the closing quote, escapes and all
_KEY_COLON = re.compile(rb"[ \t\r\n]*:")
_BEFORE_VALUE = re.compile(rb"[ \t\r\n]*:?[ \t\r\n]*")
# After a key whose value no one masks: its colon, a string or bare value, and a comma, in one step
_PLAIN_VALUE = re.compile(rb'[ \t\r\n]*:[ \t\r\n]*(?:"[^"\\]*(?:\\.[^"\\]*)*"|[^\s"{}\[\],:]+)[ \t\r\n]*(,?)')
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
        self.string_key: bool | None = False
        self.string_secret = False
        self.escape = False
        self.key: bytearray | None = None
        self.in_scalar = False             # inside a bare scalar (secret position) that reached the end of a piece
        self.scalar_masked = False         # ...and not true/false/null (masked)
        self.started = False               # inside a top-level value
        self.dead = False
        self.kinds: list[bool] | None = None if subtree else []     # for --set-field (whole bodies only)
        # Credential names only (the default rule): no structure is kept outside secret values; the
        # scanner skims from one credential-looking key to the next (_skim). Paths need the structure.
        self.skim = subtree and not policy.paths
        self.pending_key: bytes | None = None    # skim: a string ended the last piece; a key if ':' follows
        self.low: bytes | bytearray = b""        # skim: the piece being fed, lower-cased, from low_at on
        self.low_at = 0

    def feed(self, data: bytes | bytearray, pos: int, end: int, spans: list[Span]) -> None:
        if self.skim:
            self.low, self.low_at = data[pos:end].lower(), pos     # where _skim looks for hints
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
            elif self.skim and not self.stack:
                pos = self._skim(data, pos, end, spans)
            else:
                pos = self._token(data, pos, end, spans)

    # ---- skimming (credential names only) -----------------------------------------------------
    def _skim(self, data: bytes | bytearray, pos: int, end: int, spans: list[Span]) -> int:
        """Outside secret values: jump to the next hint of a credential name (_HINT), and look only
        at the string holding it (whether one is open there: the parity of the quotes before it)."""
        if self.pending_key is not None:
            m = _NOT_SPACE.search(data, pos, end)
            if m is None:
                return end
            raw, self.pending_key = self.pending_key, None
            if data[m.start()] == _COLON:
                self._key_done(raw)
            return m.start()
        if self.value_secret:
            return self._secret_value(data, pos, end, spans)
        hint = _HINT.search(self.low, pos - self.low_at, end - self.low_at)
        limit = end if hint is None else hint.start() + self.low_at
        # No backslash before `limit` (it is a hint): quotes there open and close strings in turn.
        if not data.count(b'"', pos, limit) % 2:
            return end if hint is None else limit + 1      # no string open at `limit`
        quote = data.rfind(b'"', pos, limit)
        whole = _REST_OF_STRING.match(data, quote + 1, end)
        if whole is None:                     # a string that goes on in the next piece: a key, maybe
            self._open_string(quote + 1, None, False)
            return quote + 1
        return self._string_closed(data, bytes(data[quote + 1:whole.end() - 1]), whole.end(), end)

    def _string_closed(self, data: bytes | bytearray, raw: bytes | None, after: int, end: int) -> int:
        """Skim: a string just closed (its bytes `raw`, None when too long); a key when ':' follows."""
        colon = _KEY_COLON.match(data, after, end)
        if colon is not None:
            self._key_done(raw if raw is not None and len(raw) <= NAME_CAP else None)
            return colon.end()
        if _NOT_SPACE.search(data, after, end) is None and raw is not None and len(raw) <= NAME_CAP:
            self.pending_key = raw            # blanks to the end of the piece: the ':' may come next
        return after

    def _secret_value(self, data: bytes | bytearray, pos: int, end: int, spans: list[Span]) -> int:
        """Skim: the value of a credential key, masked whole (an object or array by the token path)."""
        blanks = _BEFORE_VALUE.match(data, pos, end)
        assert blanks is not None                 # it matches nothing at worst
        pos = blanks.end()
        if pos == end:
            return end
        self.value_secret = False
        c = data[pos]
        if c == _QUOTE:
            whole = _REST_OF_STRING.match(data, pos + 1, end)
            if whole is None:
                self._open_string(pos + 1, False, True)
                return pos + 1
            self._span(spans, pos + 1, whole.end() - 1, True)
            return whole.end()
        if c in (_LBRACE, _LBRACKET):
            self._push(c == _LBRACE, True)
            return pos + 1
        m = _SCALAR_RUN.match(data, pos, end)
        assert m is not None
        if m.end() == pos:
            return pos + 1                    # a stray ',' or bracket: not a value
        self.scalar_masked = c not in _LITERAL_START
        if self.scalar_masked:
            self._span(spans, pos, m.end(), False)
        self.in_scalar = m.end() == end
        return m.end()

    def _open_string(self, start: int, key: bool | None, secret: bool) -> None:
        """A string that goes on in the next piece. key: True, False, or None (skim: not known yet)."""
        self.in_string = True
        self.string_key = key
        self.string_secret = secret
        self.string_from = start
        self.key = bytearray() if key is not False else None

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
            start = m.end()
            is_key = self.expect_key and bool(self.stack) and self.stack[-1].is_object
            whole = _REST_OF_STRING.match(data, start, end)
            if whole is not None:                    # the usual case: the whole string is here
                close = whole.end() - 1
                if is_key:
                    self._key_done(bytes(data[start:close]) if close - start <= NAME_CAP else None)
                    if not self.value_secret:        # most keys: skip their value too when it is simple
                        plain = _PLAIN_VALUE.match(data, whole.end(), end)
                        if plain is not None:
                            self.expect_key = bool(plain.group(1))
                            return plain.end()
                elif secret and (close > start or self.kinds is not None):
                    spans.append((start, close))
                    if self.kinds is not None:
                        self.kinds.append(True)
                return whole.end()
            self._open_string(start, is_key, not is_key and secret)   # it goes on in the next piece
        elif c in (_LBRACE, _LBRACKET):
            self._push(c == _LBRACE, secret)
        elif c in (_RBRACE, _RBRACKET):
            if self.stack:
                self.stack.pop()
            self.expect_key = False
            # a top-level value ended (NDJSON: another may follow); skimming, a secret value did
            self.started = bool(self.stack) or self.skim
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
        if self.string_key is None:                  # skim: a key if ':' follows
            raw, self.key = self.key, None
            return self._string_closed(data, bytes(raw) if raw is not None else None, e + 1, end)
        if self.string_key:
            raw, self.key = self.key, None
            self._key_done(bytes(raw) if raw is not None else None)
        elif self.string_secret and self.kinds is not None:
            spans.append((self.string_from, e))
            self.kinds.append(True)
        return e + 1

    def _key_add(self, data: bytes | bytearray, s: int, e: int) -> None:
        if self.key is not None and e > s:
            self.key += data[s:e]
            if len(self.key) > NAME_CAP:
                self.key = None                      # too long for a name: never secret by name

    def _key_done(self, raw: bytes | None) -> None:
        """A key ended (`raw`: its bytes as written, None when too long for a name)."""
        top = self.stack[-1] if self.stack else _Frame(True, (), False)      # skimming: no frames kept
        name = _key_text(raw) if raw is not None else None
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


# Media types whose bodies are bytes, not text: no `Name: value` line can be in them, so the header
# line masker need not read them (a large download is most of what a recorder sees).
_OPAQUE_MEDIA = ("application/octet-stream", "application/zip", "application/gzip", "application/x-gzip",
                 "application/x-tar", "application/pdf", "application/wasm", "application/x-protobuf",
                 "application/protobuf", "application/grpc", "image/", "audio/", "video/", "font/")


def opaque_body(content_type: str | None, content_encoding: str | None = None) -> bool:
    """Whether a body with these headers is bytes with no text lines in it: compressed, or of a
    binary media type (a body of unknown type is not: it may be text)."""
    if content_encoding and content_encoding.strip().lower() not in ("", "identity"):
        return True
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return bool(media) and media.startswith(_OPAQUE_MEDIA)


def may_hold_names(body: bytes, kind: str) -> bool:
    """Whether a whole body of this kind could hold a credential name (False: nothing in it to mask by
    name, no scanner needed): the skim's test, on the body at once."""
    return (_HINT if kind == JSON else _FORM_HINT).search(body.lower()) is not None


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
    if not policy.paths and not may_hold_names(data, kind):
        return data                       # no trace of a credential name: most bodies, at C speed
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
