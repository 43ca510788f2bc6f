"""wire.h2 against hyperframe (and h2's SETTINGS rules) on random frame sequences.

Seeded random sequences of DATA and HEADERS (with and without PADDED and PRIORITY, malformed padding
included), HEADERS + CONTINUATION runs, SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, GOAWAY, PRIORITY
and unknown frame types are serialized, and the bytes go to `wire.h2.split` whole, in random pieces,
and, for a subset, in two pieces split at every byte offset and one byte at a time. Every frame that
comes out, (type, flags, stream id, payload after `strip` or the error), must equal what hyperframe
parses from the same bytes; header blocks assembled by `BlockAssembler` must equal the concatenation
of hyperframe's HEADERS and CONTINUATION data.

Where the rules differ on purpose the generator stays clear of it (commented at the spot): hyperframe
rejects a WINDOW_UPDATE whose reserved bit is set, RFC 9113 says to ignore that bit (and wire does);
stream frames on stream 0 are for the caller to refuse (wire.h2.strip never sees a stream id).
"""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest
from h2.exceptions import InvalidSettingsValueError
from h2.settings import Settings
from hyperframe.exceptions import HyperframeError, InvalidFrameError, InvalidPaddingError
from hyperframe.frame import ExtensionFrame, Frame

from wire.h2 import (
    MAX_STREAM_ID,
    BlockAssembler,
    ErrorCode,
    Flag,
    FrameType,
    H2Error,
    check_control,
    frame,
    parse_settings,
    split,
    strip,
    strip_or_none,
)

T = FrameType
Raw = tuple[int, int, int, bytes]   # (type, flags, stream id as sent incl. the R bit, payload)
_CONTROL = (T.PING, T.WINDOW_UPDATE, T.RST_STREAM, T.GOAWAY, T.PRIORITY)
_UNKNOWN = range(0x0B, 0x100)       # 0x0A is ALTSVC, which hyperframe parses


# ---- generating ----------------------------------------------------------------------------------
def _bytes(rnd: random.Random, n: int) -> bytes:
    return bytes(rnd.randrange(256) for _ in range(n))


def _sid(rnd: random.Random) -> int:
    sid = rnd.choice((1, 3, 5, 0x7FFFFFFF, rnd.randrange(1, 1 << 31)))
    return sid | 0x80000000 if rnd.random() < 0.1 else sid   # the R bit: ignored on receipt


def _body(rnd: random.Random, ftype: int, flags: int, fragment: bytes, malformed: bool) -> bytes:
    """The payload of a DATA/HEADERS frame carrying `fragment` with the padding/priority that `flags` ask."""
    if malformed:
        kind = rnd.randrange(3)
        if kind == 0 and flags & Flag.PADDED:
            return b""                                   # no room for the pad length
        if kind == 1 and ftype == T.HEADERS and flags & Flag.PRIORITY:
            pad_length = b"\x00" if flags & Flag.PADDED else b""
            return pad_length + _bytes(rnd, rnd.randrange(5))   # priority fields cut short
        if flags & Flag.PADDED:                          # padding as long as the rest, or longer
            rest = (_bytes(rnd, 5) if ftype == T.HEADERS and flags & Flag.PRIORITY else b"") + fragment
            # the smallest pad length hyperframe refuses (see wire.h2.strip): the exact boundary
            least = max(1, len(rest)) if ftype == T.HEADERS else len(rest) + 1
            return bytes((rnd.randrange(least, 256),)) + rest if least < 256 else b""
    pad = rnd.choice((0, 0, 1, 7, 255)) if flags & Flag.PADDED else 0
    head = bytes((pad,)) if flags & Flag.PADDED else b""
    if ftype == T.HEADERS and flags & Flag.PRIORITY:
        head += _bytes(rnd, 5)                           # dependency (E bit random) and weight
    return head + fragment + b"\x00" * pad


def _flags(rnd: random.Random, *defined: int) -> int:
    flags = 0
    for bit in defined:
        if rnd.random() < 0.5:
            flags |= bit
    if rnd.random() < 0.1:
        flags |= rnd.choice((0x2, 0x10, 0x40, 0x80))    # undefined bits are ignored
    return flags


def _settings_payload(rnd: random.Random) -> bytes:
    pairs = []
    for _ in range(rnd.randrange(5)):
        # 0x8 (ENABLE_CONNECT_PROTOCOL, RFC 8441) is left out: wire ignores it as unknown, h2 checks it
        key = rnd.choice((1, 2, 3, 4, 5, 6, 0, 0x10, 0xFFFF))
        value = rnd.choice((0, 1, 100, 16_384, 65_535, (1 << 24) - 1, (1 << 31) - 1))
        if rnd.random() < 0.1:
            value = rnd.choice((2, 1 << 24, 1 << 31, 0xFFFFFFFF, 16_383))   # out of range for some keys
        pairs.append(struct.pack(">HL", key, value))
    payload = b"".join(pairs)
    if rnd.random() < 0.05:
        payload += _bytes(rnd, rnd.randrange(1, 6))     # not a multiple of 6
    return payload


def _control(rnd: random.Random) -> Raw:
    ftype = rnd.choice((T.SETTINGS, T.SETTINGS, *_CONTROL))
    bad = rnd.random() < 0.15                             # a wrong length or a wrong stream
    if ftype == T.SETTINGS:
        if rnd.random() < 0.3:
            return T.SETTINGS, Flag.ACK, 0, _bytes(rnd, 6) if bad else b""
        return T.SETTINGS, _flags(rnd), _sid(rnd) if bad and rnd.random() < 0.5 else 0, _settings_payload(rnd)
    if ftype == T.PING:
        size = rnd.choice((0, 7, 9, 16)) if bad else 8
        return T.PING, _flags(rnd, Flag.ACK), _sid(rnd) if bad and rnd.random() < 0.3 else 0, _bytes(rnd, size)
    if ftype == T.WINDOW_UPDATE:
        sid = rnd.choice((0, _sid(rnd)))
        if bad and rnd.random() < 0.5:
            return T.WINDOW_UPDATE, 0, sid, _bytes(rnd, rnd.choice((0, 3, 5, 8)))
        # The reserved bit stays clear: hyperframe rejects it, RFC 9113 6.9 (and wire) ignore it.
        increment = 0 if bad else rnd.choice((1, 65_535, (1 << 31) - 1, rnd.randrange(1, 1 << 31)))
        return T.WINDOW_UPDATE, _flags(rnd), sid, struct.pack(">L", increment)
    if ftype == T.RST_STREAM:
        sid = 0 if bad and rnd.random() < 0.5 else _sid(rnd)
        size = rnd.choice((0, 3, 5, 8)) if bad and sid else 4
        return T.RST_STREAM, _flags(rnd), sid, _bytes(rnd, size)
    if ftype == T.GOAWAY:
        size = rnd.randrange(8) if bad else 8 + rnd.choice((0, 0, 3, 40))
        last = struct.pack(">L", rnd.randrange(1 << 31))
        return T.GOAWAY, _flags(rnd), _sid(rnd) if bad and rnd.random() < 0.3 else 0, (last + _bytes(rnd, 60))[:size]
    sid = 0 if bad and rnd.random() < 0.5 else _sid(rnd)            # PRIORITY
    size = rnd.choice((0, 4, 6)) if bad and sid else 5
    return T.PRIORITY, _flags(rnd), sid, _bytes(rnd, size)


def _sequence(rnd: random.Random, big: bool = False) -> list[Raw]:
    out: list[Raw] = []
    for _ in range(rnd.randrange(1, 9)):
        kind = rnd.random()
        if kind < 0.25:
            flags = _flags(rnd, Flag.END_STREAM, Flag.PADDED)
            size = rnd.choice((70_000, 1 << 16)) if big and rnd.random() < 0.3 else rnd.randrange(40)
            out.append((T.DATA, flags, _sid(rnd), _body(rnd, T.DATA, flags, _bytes(rnd, size),
                                                         rnd.random() < 0.15)))
        elif kind < 0.45:                                  # a one-frame header block
            flags = _flags(rnd, Flag.END_STREAM, Flag.PADDED, Flag.PRIORITY) | Flag.END_HEADERS
            out.append((T.HEADERS, flags, _sid(rnd), _body(rnd, T.HEADERS, flags, _bytes(rnd, rnd.randrange(30)),
                                                            rnd.random() < 0.15)))
        elif kind < 0.6:                                   # HEADERS + CONTINUATION, nothing in between
            sid = _sid(rnd)
            flags = _flags(rnd, Flag.END_STREAM, Flag.PADDED, Flag.PRIORITY) & ~Flag.END_HEADERS
            # a fragment of 1 byte at least: hyperframe (so wire) refuses a padded HEADERS with nothing
            # but padding after the pad length, which RFC 9113 6.2 allows
            fragment = _bytes(rnd, rnd.randrange(1, 30))
            out.append((T.HEADERS, flags, sid, _body(rnd, T.HEADERS, flags, fragment, False)))
            n = rnd.randrange(1, 5)
            for i in range(n):
                # CONTINUATION defines END_HEADERS only: PADDED or PRIORITY there are undefined bits
                extra = rnd.choice((0, 0, Flag.PADDED, Flag.PRIORITY, Flag.END_STREAM))
                end = Flag.END_HEADERS if i == n - 1 else 0
                out.append((T.CONTINUATION, extra | end, sid, _bytes(rnd, rnd.randrange(20))))
        elif kind < 0.9:
            out.append(_control(rnd))
        else:
            out.append((rnd.choice(_UNKNOWN), rnd.randrange(256), rnd.choice((0, _sid(rnd))),
                        _bytes(rnd, rnd.randrange(30))))
    return out


def _wire(seq: list[Raw]) -> bytes:
    return b"".join(frame(ftype, flags, sid, payload) for ftype, flags, sid, payload in seq)


# ---- what wire makes of the bytes ----------------------------------------------------------------
def _ours(frames: list[tuple[int, int, int, bytes]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for ftype, flags, sid, payload in frames:
        result: tuple[Any, ...]
        try:
            if ftype in (T.DATA, T.HEADERS):
                result = ("payload", strip(ftype, flags, payload))
                assert strip_or_none(ftype, flags, payload) == result[1]
            elif ftype == T.SETTINGS:
                result = ("settings", tuple(parse_settings(flags, sid, payload)))
            elif ftype in _CONTROL:
                check_control(ftype, flags, sid, payload)
                result = ("payload", bytes(payload))
            else:                                          # CONTINUATION and unknown types: as they came
                result = ("payload", bytes(payload))
        except H2Error as exc:
            if ftype in (T.DATA, T.HEADERS):
                assert strip_or_none(ftype, flags, payload) is None
            result = ("error", exc.code)
        out.append((ftype, flags, sid, result))
    return out


def _received(data: bytes, pieces: list[int]) -> list[tuple[int, int, int, bytes]]:
    """What a receiver gets feeding `data` to split() cut at the offsets in `pieces`."""
    frames: list[tuple[int, int, int, bytes]] = []
    buf, start = b"", 0
    for cut in [*pieces, len(data)]:
        buf += data[start:cut]
        start = cut
        got, pos, err = split(buf)
        assert err is None
        frames += got
        buf = buf[pos:]
    assert buf == b""
    return frames


# ---- what hyperframe makes of them ---------------------------------------------------------------
_HF_CODE = {InvalidFrameError: ErrorCode.FRAME_SIZE_ERROR, InvalidPaddingError: ErrorCode.PROTOCOL_ERROR}


def _settings_rules(pairs: list[tuple[int, int]]) -> ErrorCode | None:
    """h2's own check of received SETTINGS values (RFC 9113 6.5.2), first failure in order."""
    table = Settings(client=True)
    for key, value in pairs:
        try:
            table[key] = value
        except InvalidSettingsValueError as exc:
            return ErrorCode(exc.error_code)
    return None


def _oracle(seq: list[Raw]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for ftype, flags, sid, payload in seq:
        raw = frame(ftype, flags, sid, payload)
        result: tuple[Any, ...]
        try:
            parsed, length = Frame.parse_frame_header(memoryview(raw[:9]))
            assert length == len(payload) and parsed.stream_id == sid & MAX_STREAM_ID
            parsed.parse_body(memoryview(raw[9:]))
        except HyperframeError as exc:
            # DATA/HEADERS: padding errors have RFC codes; control frames: only "an error" is compared
            code = _HF_CODE.get(type(exc)) if ftype in (T.DATA, T.HEADERS) else None
            out.append((ftype, flags, sid & MAX_STREAM_ID, ("error", code)))
            continue
        hf: Any = parsed                                   # the frame classes' attributes, untyped
        if isinstance(parsed, ExtensionFrame):
            assert (parsed.type, parsed.flag_byte) == (ftype, flags)
            result = ("payload", parsed.body)
        else:
            assert parsed.flags == {name for name, bit in parsed.defined_flags if flags & bit}
            if ftype in (T.DATA, T.HEADERS, T.CONTINUATION):
                result = ("payload", hf.data)
            elif ftype == T.SETTINGS:
                pairs = [] if flags & Flag.ACK else list(struct.iter_unpack(">HL", payload))
                assert dict(pairs) == hf.settings
                code = _settings_rules(pairs)
                result = ("settings", tuple(pairs)) if code is None else ("error", code)
            else:
                result = ("payload", parsed.serialize_body())
        out.append((ftype, flags, sid & MAX_STREAM_ID, result))
    return out


def _agree(ours: list[tuple[Any, ...]], expected: list[tuple[Any, ...]]) -> None:
    # An oracle error without a code ("any error") takes our code, if ours is an error too.
    fixed = [e if not (e[3][0] == "error" and e[3][1] is None and o[3][0] == "error") else o
             for o, e in zip(ours, expected, strict=False)]
    assert ours == fixed


# ---- header blocks -------------------------------------------------------------------------------
def _our_blocks(frames: list[tuple[int, int, int, bytes]]) -> list[tuple[int, bytes]]:
    asm = BlockAssembler(1 << 20)
    blocks = []
    for ftype, flags, sid, payload in frames:
        if asm.sid:
            assert ftype == T.CONTINUATION      # the generator never puts a frame inside a block
        if ftype == T.HEADERS:
            fragment = strip_or_none(ftype, flags, payload)
            if fragment is None:
                continue
            block = asm.headers(sid, flags, fragment)
        elif ftype == T.CONTINUATION:
            block = asm.continuation(sid, flags, payload)
        else:
            continue
        if block is not None:
            blocks.append((sid, block))
    assert not asm.sid
    return blocks


def _hyperframe_blocks(seq: list[Raw]) -> list[tuple[int, bytes]]:
    blocks: list[tuple[int, bytes]] = []
    parts: list[bytes] = []
    for ftype, flags, sid, payload in seq:
        if ftype not in (T.HEADERS, T.CONTINUATION):
            continue
        raw = frame(ftype, flags, sid, payload)
        try:
            parsed, _ = Frame.parse_frame_header(memoryview(raw[:9]))
            parsed.parse_body(memoryview(raw[9:]))
        except HyperframeError:
            continue
        data: bytes = parsed.data  # type: ignore[attr-defined]
        parts = [data] if ftype == T.HEADERS else [*parts, data]
        if "END_HEADERS" in parsed.flags:
            blocks.append((sid & MAX_STREAM_ID, b"".join(parts)))
    return blocks


# ---- the tests -----------------------------------------------------------------------------------
def test_split_and_strip_agree_with_hyperframe_on_random_frame_sequences() -> None:
    rnd = random.Random(20240611)
    seen: dict[str, int] = {"error": 0, "payload": 0, "settings": 0, "multi-fragment blocks": 0}
    for i in range(3000):
        seq = _sequence(rnd)
        data = _wire(seq)
        expected = _oracle(seq)
        whole = split(data)
        assert whole[1:] == (len(data), None)
        ours = _ours(whole[0])
        _agree(ours, expected)
        # the same frames however the bytes arrive: random pieces for every sequence...
        cuts = sorted(rnd.sample(range(1, len(data)), min(len(data) - 1, rnd.randrange(1, 12))))
        assert _received(data, cuts) == whole[0]
        if i % 25 == 0:
            # ...and for a subset, two pieces cut at every byte offset, and one byte at a time
            for cut in range(len(data) + 1):
                assert _received(data, [cut]) == whole[0], cut
            assert _received(data, list(range(1, len(data)))) == whole[0]
        blocks = _our_blocks(whole[0])
        assert blocks == _hyperframe_blocks(seq)
        seen["multi-fragment blocks"] += sum(1 for f in seq if f[0] == T.CONTINUATION and f[1] & Flag.END_HEADERS)
        for entry in ours:
            seen[entry[3][0]] += 1
    # the generator reached every outcome, plenty of times
    assert min(seen.values()) > 300, seen


def test_frames_over_64_kib_split_and_strip_like_hyperframe() -> None:
    # 24-bit lengths: the high byte of the length matters here
    rnd = random.Random(7)
    for _ in range(40):
        seq = _sequence(rnd, big=True)
        data = _wire(seq)
        frames, pos, err = split(data)
        assert (pos, err) == (len(data), None)
        _agree(_ours(frames), _oracle(seq))
        cuts = sorted(rnd.sample(range(1, len(data)), min(len(data) - 1, 20)))
        assert _received(data, cuts) == frames


def test_strip_agrees_with_hyperframe_on_random_bodies() -> None:
    # Moved from tests/test_capture_decode.py (it tested capture's frame_body, now wire.h2.strip):
    # short bodies of small bytes hit every padding/priority boundary.
    rnd = random.Random(4)
    for _ in range(20000):
        ftype, flags = rnd.choice((0, 1)), rnd.randrange(256)
        body = bytes(rnd.randrange(256) if rnd.random() < 0.3 else rnd.randrange(8) for _ in range(rnd.randrange(12)))
        header = len(body).to_bytes(3, "big") + bytes((ftype, flags)) + (5).to_bytes(4, "big")
        try:
            parsed, _ = Frame.parse_frame_header(memoryview(header))
            parsed.parse_body(memoryview(body))
            expected: bytes | None = parsed.data  # type: ignore[attr-defined]
            code = None
        except HyperframeError as exc:
            expected, code = None, _HF_CODE[type(exc)]
        assert strip_or_none(ftype, flags, body) == expected, (ftype, flags, body)
        if code is not None:
            with pytest.raises(H2Error) as err:
                strip(ftype, flags, body)
            assert err.value.code == code and err.value.stream == 0
