"""HPACK decoding that survives a missing dynamic table (connections joined mid-stream).

Built on the `hpack` library's own pieces (HeaderTable, decode_integer, decode_huffman); only the
per-representation loop is ours, so that one unresolvable index costs one header, not the block.

A connection joined after it opened has a dynamic table we never saw. Entries inserted *after* we
joined sit at the front of the table, so their indices resolve; older ones do not. Each
unresolvable header is reported as a name in `missing` and skipped, everything else is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpack.hpack import decode_huffman, decode_integer
from hpack.table import HeaderTable


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


class TolerantDecoder:
    """One direction's HPACK decoder. `decode(block)` never raises for unknown indices."""

    def __init__(self) -> None:
        self.table = HeaderTable()
        self._mask: Callable[[str], bool] | None = None
        # Blocks that only reference the table (no insertions) decode the same while the table
        # is unchanged: gRPC repeats such blocks (":status 200", "grpc-status 0") on every call.
        self._version = 0
        self._cache: dict[tuple[bytes, int], DecodedBlock] = {}

    def _lookup(self, index: int) -> tuple[bytes, bytes] | None:
        try:
            name, value = self.table.get_by_index(index)
        except Exception:  # noqa: BLE001 - hpack raises InvalidTableIndex(Error)
            return None
        return name, value

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

    def decode(self, block: bytes, mask: Callable[[str], bool] | None = None) -> DecodedBlock:
        """Decode one complete header block (HEADERS + CONTINUATION payloads joined).

        With `mask`, literal values whose header name it accepts are listed in `out.spans` as
        (length-prefix offset, value start, value end) so the caller can blank them in place."""
        key = (block, self._version)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        out = DecodedBlock()
        self._mask = mask
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
            entry = self._lookup(index)
            if entry is None:
                out.missing += 1
            else:
                out.headers.append((entry[0].decode("latin-1"), entry[1].decode("latin-1")))
            return pos + used
        if (b & 0xE0) == 0x20:                         # dynamic table size update
            size, used = decode_integer(data[pos:], 5)
            self.table.maxsize = size
            self._version += 1
            return pos + used
        prefix, index_it = (6, True) if (b & 0xC0) == 0x40 else (4, False)
        name_index, used = decode_integer(data[pos:], prefix)
        pos += used
        name: bytes | None
        if name_index:
            entry = self._lookup(name_index)
            name = entry[0] if entry else None
        else:
            name, pos = self._string(data, pos)
        value_at = pos
        value, pos = self._string(data, pos)
        if name is not None and self._mask and self._mask(name.decode("latin-1")):
            _, used = decode_integer(data[value_at:], 7)
            out.spans.append((value_at, value_at + used, pos))
            value = b"*" * (pos - value_at - used)   # what a reader of the masked bytes will see
        if name is None:
            out.missing += 1
            if index_it:
                # Keep indices of later entries right even though this name is unknown.
                self.table.add(b"x-shadowtest-unknown", value)
                self._version += 1
            return pos
        if index_it:
            self.table.add(name, value)
            self._version += 1
        out.headers.append((name.decode("latin-1"), value.decode("latin-1")))
        return pos
