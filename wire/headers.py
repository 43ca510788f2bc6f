"""HPACK for the wire: a static-table encoder, a cached strict decoder and a tolerant one.

Encoding uses only HPACK's static table (indexed fields and literals *without indexing*), never the
dynamic table, so one encoded block is valid on every connection, can be built once and reused byte
for byte, and a capture that joins a connection mid-way can still decode it.

    CachedDecoder    one per connection and direction; hpack.Decoder underneath, memoised per block
                     while the dynamic table is unchanged; errors as H2Error
    TolerantDecoder  for observers that joined mid-stream: an entry it never saw costs one field,
                     not the block, and is named by a stable pre-join ordinal; can report literal
                     value spans for masking in place
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import hpack
from hpack.hpack import decode_integer, encode_integer
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

from wire.h2 import ErrorCode, H2Error

# ---- encoding ------------------------------------------------------------------------------------
_EXACT: dict[tuple[bytes, bytes], int] = {}
_NAME: dict[bytes, int] = {}
for _i, (_n, _v) in enumerate(HeaderTable.STATIC_TABLE, 1):
    _EXACT.setdefault((_n, _v), _i)
    _NAME.setdefault(_n, _i)


def _literal(s: bytes) -> bytes:
    return (bytes((len(s),)) if len(s) < 127 else bytes(encode_integer(len(s), 7))) + s  # no Huffman


def encode_field(name: str | bytes, value: str | bytes) -> bytes:
    """One header field: indexed when the static table holds it whole, else a literal without indexing
    (0000xxxx), so the peer's dynamic table is never touched."""
    n = name.encode() if isinstance(name, str) else name
    v = value.encode() if isinstance(value, str) else value
    idx = _EXACT.get((n, v))
    if idx is not None:
        head = encode_integer(idx, 7)
        head[0] |= 0x80
        return bytes(head)
    idx = _NAME.get(n)
    if idx is not None:
        return (bytes((idx,)) if idx < 15 else bytes(encode_integer(idx, 4))) + _literal(v)
    return b"\x00" + _literal(n) + _literal(v)


def encode_block(fields: Iterable[tuple[str | bytes, str | bytes]]) -> bytes:
    return b"".join(encode_field(k, v) for k, v in fields)


_FIELDS: dict[tuple[str, str], bytes] = {}


def encode_field_cached(name: str, value: str) -> bytes:
    """encode_field, memoised (bounded: recordings may carry a unique value per call)."""
    enc = _FIELDS.get((name, value))
    if enc is None:
        if len(_FIELDS) >= 8192:
            _FIELDS.clear()
        enc = _FIELDS[(name, value)] = encode_field(name, value)
    return enc


# ---- strict decoding -----------------------------------------------------------------------------
Fields = list[tuple[str, str]]
V = TypeVar("V")
_CONNECTION_SPECIFIC = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"})


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode("latin-1")     # never a traceback for a byte that is not UTF-8


def field_problem(fields: Fields) -> str | None:
    """Why a header list is malformed (RFC 9113 section 8.2), or None."""
    regular = False
    for name, value in fields:
        if not name:
            return "a header field with an empty name"
        if name != name.lower():
            return f"header name {name[:40]!r} is not lowercase"
        if name[0] == ":":
            if regular:
                return f"pseudo-header {name} after a regular field"
        else:
            regular = True
            if name in _CONNECTION_SPECIFIC or (name == "te" and value != "trailers"):
                return f"connection-specific header {name}"
    return None


class CachedDecoder:
    """One connection's HPACK decoder for one direction, memoised when that is exact.

    A block's meaning depends only on the block and the dynamic table. `adds` counts every change of
    that table, so a block whose decoding changed nothing is cached under the current count (what a
    peer sends once its headers sit in the table: the same few bytes per call); a block that changes
    the table is always decoded. With `validate`, a malformed header list is a stream error
    (H2Error PROTOCOL_ERROR on `sid`): the table stays in step, the connection lives on.
    `view()` also memoises what the caller derives from the fields (its parse of a request), so a
    repeated block costs a dict lookup and nothing per field."""

    def __init__(self, max_table_size: int = 4096, max_header_list_size: int = 1 << 16,
                 validate: bool = False) -> None:
        self.decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self.decoder.max_allowed_table_size = max_table_size
        self.validate = validate
        self.adds = 0
        # block -> [table state, fields, problem or None, the caller's view or None]
        self._cache: dict[bytes, list[Any]] = {}
        table, add = self.decoder.header_table, self.decoder.header_table.add

        def counted_add(name: bytes, value: bytes) -> None:
            self.adds += 1
            add(name, value)
        table.add = counted_add  # type: ignore[method-assign]

    def decode(self, block: bytes, sid: int = 0) -> Fields:
        """The block's fields. Raises H2Error: COMPRESSION_ERROR (connection) for a block that is not
        valid HPACK, ENHANCE_YOUR_CALM (connection) for one over the header list size, PROTOCOL_ERROR
        on `sid` for a malformed field list when validating."""
        entry = self._entry(block)
        if entry[2] is not None:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, entry[2], sid)
        return cast(Fields, entry[1])

    def view(self, block: bytes, sid: int, make: Callable[[Fields], V]) -> V:
        """`make(fields)`, computed once per cached block (one `make` per decoder). Raises as decode()."""
        entry = self._entry(block)
        if entry[2] is not None:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, entry[2], sid)
        if entry[3] is None:
            entry[3] = make(entry[1])
        return cast(V, entry[3])

    def _entry(self, block: bytes) -> list[Any]:
        state = (self.adds, self.decoder.header_table.maxsize)
        hit = self._cache.get(block)
        if hit is not None and hit[0] == state:
            return hit
        try:
            raw = self.decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError as exc:
            raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, f"header list too large: {exc}") from exc
        except (hpack.HPACKError, IndexError, ValueError) as exc:
            raise H2Error(ErrorCode.COMPRESSION_ERROR, f"cannot decode a header block: {exc}") from exc
        fields = [(_text(k), _text(v)) for k, v in raw]
        entry = [state, fields, field_problem(fields) if self.validate else None, None]
        if (self.adds, self.decoder.header_table.maxsize) == state:
            if len(self._cache) >= 256:
                self._cache.clear()
            self._cache[block] = entry
        return entry


# ---- tolerant decoding (observers) ---------------------------------------------------------------
class HpackBlockError(Exception):
    """The header block is malformed (not merely referring to unknown table entries)."""


@dataclass
class DecodedBlock:
    headers: list[tuple[str, str]] = field(default_factory=list)
    missing: int = 0          # header fields that referred to dynamic-table entries we never saw
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    # What a decoder derived from these headers: blocks repeat (and are cached above), so a
    # decoder may keep its interpretation here and skip redoing it on the next identical block.
    view: Any = None
    # The pre-join ordinal of each field (or field name) that referred to an entry inserted before
    # we joined, in block order (see TolerantDecoder): the same ordinal on one connection and
    # direction is the same, unknown, entry however many entries were inserted since.
    refs: list[int] = field(default_factory=list)
    invalid: int = 0          # references that cannot be a pre-join entry (index 0, or all were evicted)
    # With `path_spans`: (offset in the block, bytes) to write over a :path literal's string (same length)
    rewrites: list[tuple[int, bytes]] = field(default_factory=list)


_STATIC_LEN = HeaderTable.STATIC_TABLE_LENGTH   # 61: dynamic indices start at 62
_STATIC = HeaderTable.STATIC_TABLE


class _UnknownName(bytes):
    """The name of a table entry inserted after the join by a literal whose *name* referred to an entry
    we never saw: its value is known, its name is pre-join entry `ordinal` (None: not identifiable).
    Same bytes as the placeholder it always was, so the table's sizes are unchanged."""

    ordinal: int | None

    def __new__(cls, ordinal: int | None) -> _UnknownName:
        obj = super().__new__(cls, b"x-shadowtest-unknown")
        obj.ordinal = ordinal
        return obj


class TolerantDecoder:
    """One direction's HPACK decoder that survives a missing dynamic table (connections joined mid-way).

    Built on the `hpack` library's own pieces (HeaderTable, decode_integer, decode_huffman); only the
    per-representation loop is ours, so that one unresolvable index costs one header, not the block.
    Entries inserted *after* we joined sit at the front of the table, so their indices resolve; older
    ones do not. Each unresolvable header is counted in `missing` and skipped; the rest is kept.

    Identity of what could not be resolved: our table holds exactly the `n` entries inserted since
    the join that the peer's table still holds (newest first), and the pre-join entries sit behind
    them in the same order. A reference to dynamic index `d` (HPACK index - 61) with `d > n` is
    therefore pre-join entry `j = d - n`, counted from the newest pre-join entry (1); `j` names the
    same entry for as long as it lives, however many entries are inserted later. It goes to
    `DecodedBlock.refs`. Once our own table has evicted an entry (or was resized to zero), the
    peer's table evicted every pre-join entry before it: from then on such a reference is invalid
    (`DecodedBlock.invalid`), never a guess. A literal whose indexed name is unresolvable counts the
    same way (its name is pre-join entry `j`), and the entry it inserts remembers that ordinal."""

    def __init__(self) -> None:
        self.table = HeaderTable()
        self.prejoin_gone = False   # our table evicted an entry: the peer's has no pre-join entry left
        self._mask: Callable[[str], bool] | None = None
        self._path_spans: Callable[[bytes], list[tuple[int, int]]] | None = None
        # Blocks that only reference the table (no insertions) decode the same while the table
        # is unchanged: gRPC repeats such blocks (":status 200", "grpc-status 0") on every call.
        self._version = 0
        self._cache: dict[tuple[bytes, int], DecodedBlock] = {}

    def _entry(self, index: int) -> tuple[bytes, bytes] | int | None:
        """The entry at `index`; for one we never saw its pre-join ordinal, or None when invalid."""
        if 0 < index <= _STATIC_LEN:
            return _STATIC[index - 1]
        entries = self.table.dynamic_entries
        d = index - _STATIC_LEN
        if 0 < d <= len(entries):
            return entries[d - 1]
        if d <= 0 or self.prejoin_gone:
            return None
        return d - len(entries)

    def _add(self, name: bytes, value: bytes) -> None:
        before = len(self.table.dynamic_entries)
        self.table.add(name, value)
        if len(self.table.dynamic_entries) <= before:
            self.prejoin_gone = True    # something was evicted: every older (pre-join) entry went first
        self._version += 1

    @staticmethod
    def _unresolved(out: DecodedBlock, ordinal: int | None) -> None:
        out.missing += 1
        if ordinal is None:
            out.invalid += 1
        else:
            out.refs.append(ordinal)

    def _string(self, data: memoryview, pos: int) -> tuple[bytes, int]:
        if pos >= len(data):
            raise HpackBlockError("header block ends inside a string")
        huffman = bool(data[pos] & 0x80)
        length, used = decode_integer(data[pos:], 7)
        start = pos + used
        raw = bytes(data[start:start + length])
        if len(raw) != length:
            raise HpackBlockError("header block ends inside a string")
        return (decode_huffman(raw) if huffman else raw), start + length

    def decode(self, block: bytes, mask: Callable[[str], bool] | None = None,
               path_spans: Callable[[bytes], list[tuple[int, int]]] | None = None) -> DecodedBlock:
        """Decode one complete header block (HEADERS + CONTINUATION payloads joined).

        With `mask`, literal values whose header name it accepts are listed in `out.spans` as
        (length-prefix offset, value start, value end) so the caller can blank them in place.
        With `path_spans` (a :path value -> the spans of it to blank, e.g. its query's secrets), a
        literal :path gets `out.rewrites` that blank those parts and keep the rest (see _masked_path).
        Both callables must be the same on every call of one decoder (blocks are memoised)."""
        key = (block, self._version)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        out = DecodedBlock()
        self._mask = mask
        self._path_spans = path_spans
        data = memoryview(block)
        pos = 0
        try:
            while pos < len(data):
                pos = self._one(data, pos, out)
        except HpackBlockError:
            raise
        except Exception as exc:  # noqa: BLE001 - hpack's integer/huffman errors
            raise HpackBlockError(f"malformed header block: {exc}") from exc
        if key[1] == self._version:
            if len(self._cache) >= 4096:
                self._cache.clear()
            self._cache[key] = out
        return out

    def _one(self, data: memoryview, pos: int, out: DecodedBlock) -> int:
        b = data[pos]
        if b & 0x80:                                   # indexed header field
            index, used = decode_integer(data[pos:], 7)
            entry = self._entry(index)
            if not isinstance(entry, tuple):
                self._unresolved(out, entry)
            elif isinstance(entry[0], _UnknownName):   # inserted after the join, under a name we never saw
                self._unresolved(out, entry[0].ordinal)
            else:
                out.headers.append((entry[0].decode("latin-1"), entry[1].decode("latin-1")))
            return pos + used
        if (b & 0xE0) == 0x20:                         # dynamic table size update
            size, used = decode_integer(data[pos:], 5)
            before = len(self.table.dynamic_entries)
            self.table.maxsize = size
            if size <= 0 or len(self.table.dynamic_entries) < before:
                self.prejoin_gone = True
            self._version += 1
            return pos + used
        prefix, index_it = (6, True) if (b & 0xC0) == 0x40 else (4, False)
        name_index, used = decode_integer(data[pos:], prefix)
        pos += used
        name: bytes | None = None
        ordinal: int | None = None
        if name_index:
            entry = self._entry(name_index)
            if not isinstance(entry, tuple):
                ordinal = entry
            elif isinstance(entry[0], _UnknownName):
                ordinal = entry[0].ordinal
            else:
                name = entry[0]
        else:
            name, pos = self._string(data, pos)
        value_at = pos
        value, pos = self._string(data, pos)
        if self._mask and (name is None or self._mask(name.decode("latin-1"))):   # unknown name: masked
            _, used = decode_integer(data[value_at:], 7)
            out.spans.append((value_at, value_at + used, pos))
            value = b"*" * (pos - value_at - used)   # what a reader of the masked bytes will see
        elif self._path_spans is not None and name == b":path":
            value = self._masked_path(data, value_at, pos, value, out)
        if name is None:
            self._unresolved(out, ordinal)
            if index_it:
                # Keep indices of later entries right even though this name is unknown.
                self._add(_UnknownName(ordinal), value)
            return pos
        if index_it:
            self._add(name, value)
        out.headers.append((name.decode("latin-1"), value.decode("latin-1")))
        return pos

    def _masked_path(self, data: memoryview, value_at: int, end: int, value: bytes, out: DecodedBlock) -> bytes:
        """Blank parts of a literal :path in place (same byte length); returns what a reader of the masked
        bytes decodes, which is what enters the table. A plain literal keeps its length: the parts become
        '*'. A Huffman-coded one is coded again with each part a shorter run of '*' (8 bits each, where
        the secret's characters took 5-7), so the string's length stays; decoded it is never longer
        than before, so the table evicts no entry the peer still refers to. Where that cannot fit, the
        whole value is blanked as a masked header value is."""
        assert self._path_spans is not None
        spans = self._path_spans(value)
        if not spans:
            return value
        _, used = decode_integer(data[value_at:], 7)
        start = value_at + used
        if not data[value_at] & 0x80:
            new = _blank(value, [(s, e, e - s) for s, e in spans])
            out.rewrites.append((start, new))
            return new
        fitted = _refit_huffman(value, spans, end - start)
        if fitted is None:
            out.spans.append((value_at, start, end))
            return b"*" * (end - start)
        new, coded = fitted
        out.rewrites.append((start, coded))
        return new


_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
_STAR_BITS = REQUEST_CODES_LENGTH[0x2A]        # '*'


def _blank(value: bytes, runs: list[tuple[int, int, int]]) -> bytes:
    """`value` with each (start, end, n) replaced by n '*'."""
    out, at = bytearray(), 0
    for s, e, n in runs:
        out += value[at:s] + b"*" * n
        at = e
    return bytes(out + value[at:])


def _refit_huffman(value: bytes, spans: list[tuple[int, int]], length: int) -> tuple[bytes, bytes] | None:
    """(new value, its Huffman code of exactly `length` bytes) with each span a run of '*' no longer
    than the span, or None. Padding must stay under 8 bits (RFC 7541 5.2), so the runs are sized to
    fill the code to within 7 bits of its end."""
    bits = [sum(REQUEST_CODES_LENGTH[b] for b in value[s:e]) for s, e in spans]
    kept = sum(REQUEST_CODES_LENGTH[b] for b in value) - sum(bits)
    runs = [min(e - s, b // _STAR_BITS) for (s, e), b in zip(spans, bits, strict=True)]
    slack = 8 * length - kept - _STAR_BITS * sum(runs)
    for i, (s, e) in enumerate(spans):
        while slack >= 8 and runs[i] < e - s:
            runs[i] += 1
            slack -= _STAR_BITS
    if not 0 <= slack < 8:
        return None
    new = _blank(value, [(s, e, n) for (s, e), n in zip(spans, runs, strict=True)])
    coded = bytes(_HUFFMAN.encode(new))
    return (new, coded) if len(coded) == length else None
