"""The wire module's own rules with exact values: frames, HPACK, gRPC status and messages, budgets.

The random-sequence comparison with hyperframe is tests/test_wire_oracle.py; this file pins each rule
(error code, connection or stream error, the bytes produced) one case at a time.
"""

from __future__ import annotations

import gzip
import random
import struct
import time
import zlib

import hpack
import pytest

from wire.clock import FakeClock
from wire.h2 import (
    DEFAULT_MAX_FRAME,
    MAX_FRAME_LIMIT,
    MAX_WINDOW,
    SETTINGS_ACK,
    BlockAssembler,
    ErrorCode,
    Flag,
    FrameType,
    H2Error,
    Setting,
    check_control,
    data_frames,
    error_name,
    frame,
    frame_lengths_plausible,
    goaway,
    grow_window,
    headers,
    parse_settings,
    ping,
    rst_stream,
    settings,
    split,
    strip,
    strip_or_none,
    window_update,
)
from wire.headers import CachedDecoder, encode_block, encode_field, encode_field_cached
from wire.limits import Budget
from wire.messages import MessageReader, decompress, frame_message, prefix
from wire.status import (
    RESPONSE_HEADERS,
    TRAILERS_OK,
    GrpcError,
    Status,
    decode_bin,
    encode_bin,
    format_timeout,
    metadata_in,
    metadata_out,
    parse_timeout,
    percent_decode,
    percent_encode,
    status_block,
    status_from_headers,
    status_name,
)

T = FrameType


def _h2error(fn, *args) -> H2Error:  # type: ignore[no-untyped-def]
    with pytest.raises(H2Error) as err:
        fn(*args)
    return err.value


# ---- building frames -----------------------------------------------------------------------------
def test_frame_builders_produce_exact_bytes() -> None:
    assert frame(T.DATA, Flag.END_STREAM, 1, b"hi") == b"\x00\x00\x02\x00\x01\x00\x00\x00\x01hi"
    assert frame(T.DATA, 0, 3, bytes(70_000))[:9] == b"\x01\x11\x70\x00\x00\x00\x00\x00\x03"   # 24-bit length
    assert SETTINGS_ACK == b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
    assert settings({Setting.MAX_FRAME_SIZE: 16_384}) == b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x05\x00\x00\x40\x00"
    assert window_update(5, 1000) == b"\x00\x00\x04\x08\x00\x00\x00\x00\x05\x00\x00\x03\xe8"
    assert rst_stream(7, ErrorCode.CANCEL) == b"\x00\x00\x04\x03\x00\x00\x00\x00\x07\x00\x00\x00\x08"
    assert goaway(9, ErrorCode.ENHANCE_YOUR_CALM, b"x") == \
        b"\x00\x00\x09\x07\x00\x00\x00\x00\x00\x00\x00\x00\x09\x00\x00\x00\x0bx"
    assert ping(b"12345678", ack=True) == b"\x00\x00\x08\x06\x01\x00\x00\x00\x0012345678"
    assert error_name(8) == "CANCEL" and error_name(0x42) == "error 0x42"


def test_headers_and_data_split_at_the_peers_frame_size() -> None:
    block = bytes(range(256)) * 3                            # 768 bytes
    frames, pos, err = split(headers(1, block, 300, end_stream=True))
    assert err is None
    assert [(t, f, s, len(p)) for t, f, s, p in frames] == [
        (T.HEADERS, Flag.END_STREAM, 1, 300), (T.CONTINUATION, 0, 1, 300), (T.CONTINUATION, Flag.END_HEADERS, 1, 168)]
    assert b"".join(p for *_, p in frames) == block
    assert split(headers(3, b"abc", 300))[0] == [(T.HEADERS, Flag.END_HEADERS, 3, b"abc")]
    frames = split(data_frames(5, memoryview(bytes(650)), 300, end_stream=True))[0]
    assert [(f, len(p)) for _, f, _, p in frames] == [(0, 300), (0, 300), (Flag.END_STREAM, 50)]
    assert split(data_frames(5, b"", 300))[0] == [(T.DATA, 0, 5, b"")]


# ---- splitting -----------------------------------------------------------------------------------
def test_split_returns_whole_frames_and_the_position_after_them() -> None:
    data = frame(T.DATA, 1, 1, b"abc") + frame(T.PING, 0, 0, bytes(8)) + frame(T.HEADERS, 4, 0x80000003, b"h")
    frames, pos, err = split(data + b"\x00\x00\x05\x00")   # and 4 bytes of the next frame's header
    assert frames == [(T.DATA, 1, 1, b"abc"), (T.PING, 0, 0, bytes(8)), (T.HEADERS, 4, 3, b"h")]  # R bit dropped
    assert (pos, err) == (len(data), None)
    assert split(data, pos=12) == ([(T.PING, 0, 0, bytes(8)), (T.HEADERS, 4, 3, b"h")], len(data), None)
    assert split(data[:-1]) == (frames[:2], 12 + 17, None)     # the last frame is not whole yet
    assert split(b"") == ([], 0, None)


def test_split_refuses_an_oversized_frame_as_soon_as_its_header_is_in() -> None:
    before = frame(T.DATA, 0, 1, b"ok") + frame(T.PING, 0, 0, bytes(8))
    big_header = frame(T.DATA, 0, 1, bytes(DEFAULT_MAX_FRAME + 1))[:9]
    # 8 bytes of the big frame's header: nothing to say yet
    assert split(before + big_header[:8], max_size=DEFAULT_MAX_FRAME) == \
        ([(T.DATA, 0, 1, b"ok"), (T.PING, 0, 0, bytes(8))], len(before), None)
    # the 9th byte: FRAME_SIZE_ERROR (connection), the frames before it still returned, none of its body needed
    frames, pos, err = split(before + big_header, max_size=DEFAULT_MAX_FRAME)
    assert frames == [(T.DATA, 0, 1, b"ok"), (T.PING, 0, 0, bytes(8))] and pos == len(before)
    assert err is not None and (err.code, err.stream) == (ErrorCode.FRAME_SIZE_ERROR, 0)
    exact = frame(T.DATA, 0, 1, bytes(DEFAULT_MAX_FRAME))
    assert split(exact, max_size=DEFAULT_MAX_FRAME)[1:] == (len(exact), None)
    # the default limit is the largest length 24 bits can hold: never an error
    assert split(b"\xff\xff\xff\x00\x00\x00\x00\x00\x01")[2] is None and MAX_FRAME_LIMIT == 0xFFFFFF


def test_frame_lengths_plausible() -> None:
    good = frame(T.SETTINGS, 0, 0, b"") + frame(T.DATA, 0, 1, b"x") + frame(T.WINDOW_UPDATE, 0, 0, b"\0\0\0\1")
    assert frame_lengths_plausible(good)
    assert frame_lengths_plausible(good + b"\x00\x00")          # a partial header at the end is fine
    assert not frame_lengths_plausible(b"\x00\x00")              # no frame at all
    assert not frame_lengths_plausible(frame(0x0A, 0, 0, b""))  # not a type of RFC 9113
    assert not frame_lengths_plausible(frame(T.PING, 0, 1, bytes(8)))      # connection frame on a stream
    assert not frame_lengths_plausible(frame(T.DATA, 0, 0, b"x"))          # stream frame on stream 0
    assert not frame_lengths_plausible(frame(T.DATA, 0, 0x80000001, b"x"))  # R bit set
    assert not frame_lengths_plausible(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")


# ---- stripping -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("ftype", "flags", "body", "want"), [
    (T.DATA, 0, b"\x02abc", b"\x02abc"),                                  # nothing to strip
    (T.DATA, Flag.PADDED, b"\x02abc\0\0", b"abc"),
    (T.DATA, Flag.PADDED, b"\x00abc", b"abc"),
    (T.DATA, Flag.PADDED, b"\x02\0\0", b""),                              # all padding: allowed
    (T.DATA, Flag.PRIORITY, b"abcdefg", b"abcdefg"),                      # PRIORITY means nothing on DATA
    (T.HEADERS, Flag.PRIORITY, b"\x80\0\0\x01\x10blk", b"blk"),
    (T.HEADERS, Flag.PADDED | Flag.PRIORITY, b"\x01\0\0\0\x01\x10blk\0", b"blk"),
    (T.HEADERS, Flag.PADDED, b"\x01b\0", b"b"),
    (T.CONTINUATION, Flag.PADDED | Flag.PRIORITY, b"\x05raw", b"\x05raw"),  # only DATA/HEADERS carry them
])
def test_strip(ftype: int, flags: int, body: bytes, want: bytes) -> None:
    assert strip(ftype, flags, body) == want
    assert strip_or_none(ftype, flags, body) == want


@pytest.mark.parametrize(("ftype", "flags", "body", "code"), [
    (T.DATA, Flag.PADDED, b"", ErrorCode.FRAME_SIZE_ERROR),              # no room for the pad length
    (T.HEADERS, Flag.PADDED, b"", ErrorCode.FRAME_SIZE_ERROR),
    (T.HEADERS, Flag.PRIORITY, b"\0\0\0\x01", ErrorCode.FRAME_SIZE_ERROR),  # 4 of 5 priority bytes
    (T.HEADERS, Flag.PADDED | Flag.PRIORITY, b"\0\0\0\0\x01", ErrorCode.FRAME_SIZE_ERROR),
    (T.DATA, Flag.PADDED, b"\x03ab", ErrorCode.PROTOCOL_ERROR),          # padding as long as the payload
    (T.DATA, Flag.PADDED, b"\xffab", ErrorCode.PROTOCOL_ERROR),
    (T.HEADERS, Flag.PADDED, b"\x02ab", ErrorCode.PROTOCOL_ERROR),       # as long as what follows
    (T.HEADERS, Flag.PADDED, b"\x01\0", ErrorCode.PROTOCOL_ERROR),       # (hyperframe's bound)
])
def test_strip_errors(ftype: int, flags: int, body: bytes, code: ErrorCode) -> None:
    err = _h2error(strip, ftype, flags, body)
    assert (err.code, err.stream) == (code, 0)
    assert strip_or_none(ftype, flags, body) is None


# ---- SETTINGS and control frames -----------------------------------------------------------------
def _pairs(*pairs: tuple[int, int]) -> bytes:
    return b"".join(struct.pack(">HL", k, v) for k, v in pairs)


def test_parse_settings_accepts_valid_values_in_order() -> None:
    pairs = [(Setting.HEADER_TABLE_SIZE, 0), (Setting.ENABLE_PUSH, 0), (Setting.ENABLE_PUSH, 1),
             (Setting.MAX_CONCURRENT_STREAMS, 0xFFFFFFFF), (Setting.INITIAL_WINDOW_SIZE, MAX_WINDOW),
             (Setting.MAX_FRAME_SIZE, 16_384), (Setting.MAX_FRAME_SIZE, (1 << 24) - 1),
             (Setting.MAX_HEADER_LIST_SIZE, 0), (0x8, 7), (0xABCD, 0xFFFFFFFF)]   # unknown ids are kept, unchecked
    assert parse_settings(0, 0, _pairs(*pairs)) == pairs
    assert parse_settings(0, 0, b"") == []
    assert parse_settings(Flag.ACK, 0, b"") == []


@pytest.mark.parametrize(("flags", "sid", "payload", "code"), [
    (0, 1, b"", ErrorCode.PROTOCOL_ERROR),                                    # on a stream
    (Flag.ACK, 3, b"", ErrorCode.PROTOCOL_ERROR),
    (Flag.ACK, 0, _pairs((1, 0)), ErrorCode.FRAME_SIZE_ERROR),                # ACK with a payload
    (0, 0, b"\0\x01\0\0\0", ErrorCode.FRAME_SIZE_ERROR),                      # 5 bytes
    (0, 0, _pairs((1, 0)) + b"\0", ErrorCode.FRAME_SIZE_ERROR),               # 7 bytes
    (0, 0, _pairs((Setting.ENABLE_PUSH, 2)), ErrorCode.PROTOCOL_ERROR),
    (0, 0, _pairs((Setting.INITIAL_WINDOW_SIZE, MAX_WINDOW + 1)), ErrorCode.FLOW_CONTROL_ERROR),
    (0, 0, _pairs((Setting.MAX_FRAME_SIZE, 16_383)), ErrorCode.PROTOCOL_ERROR),
    (0, 0, _pairs((Setting.MAX_FRAME_SIZE, 1 << 24)), ErrorCode.PROTOCOL_ERROR),
    (0, 0, _pairs((1, 0), (Setting.MAX_FRAME_SIZE, 0)), ErrorCode.PROTOCOL_ERROR),   # a bad pair after good ones
])
def test_parse_settings_errors_are_connection_errors(flags: int, sid: int, payload: bytes, code: ErrorCode) -> None:
    err = _h2error(parse_settings, flags, sid, payload)
    assert (err.code, err.stream) == (code, 0)


@pytest.mark.parametrize(("ftype", "sid", "payload", "code", "stream"), [
    (T.PING, 1, bytes(8), ErrorCode.PROTOCOL_ERROR, 0),
    (T.PING, 0, bytes(7), ErrorCode.FRAME_SIZE_ERROR, 0),
    (T.PING, 0, bytes(9), ErrorCode.FRAME_SIZE_ERROR, 0),
    (T.WINDOW_UPDATE, 0, bytes(3), ErrorCode.FRAME_SIZE_ERROR, 0),
    (T.WINDOW_UPDATE, 5, bytes(5), ErrorCode.FRAME_SIZE_ERROR, 0),             # a connection error even on a stream
    (T.WINDOW_UPDATE, 0, bytes(4), ErrorCode.PROTOCOL_ERROR, 0),               # increment 0: connection...
    (T.WINDOW_UPDATE, 5, bytes(4), ErrorCode.PROTOCOL_ERROR, 5),               # ...or stream error
    (T.WINDOW_UPDATE, 5, b"\x80\0\0\0", ErrorCode.PROTOCOL_ERROR, 5),          # the R bit is not an increment
    (T.RST_STREAM, 0, bytes(4), ErrorCode.PROTOCOL_ERROR, 0),
    (T.RST_STREAM, 1, bytes(3), ErrorCode.FRAME_SIZE_ERROR, 0),
    (T.RST_STREAM, 1, bytes(5), ErrorCode.FRAME_SIZE_ERROR, 0),
    (T.PRIORITY, 0, bytes(5), ErrorCode.PROTOCOL_ERROR, 0),
    (T.PRIORITY, 1, bytes(4), ErrorCode.FRAME_SIZE_ERROR, 0),
    (T.PRIORITY, 1, bytes(6), ErrorCode.FRAME_SIZE_ERROR, 0),
    (T.GOAWAY, 1, bytes(8), ErrorCode.PROTOCOL_ERROR, 0),
    (T.GOAWAY, 0, bytes(7), ErrorCode.FRAME_SIZE_ERROR, 0),
])
def test_check_control_errors(ftype: int, sid: int, payload: bytes, code: ErrorCode, stream: int) -> None:
    err = _h2error(check_control, ftype, 0, sid, payload)
    assert (err.code, err.stream) == (code, stream)


@pytest.mark.parametrize(("ftype", "flags", "sid", "payload"), [
    (T.PING, 0, 0, bytes(8)), (T.PING, Flag.ACK, 0, b"12345678"),
    (T.WINDOW_UPDATE, 0, 0, b"\0\0\0\x01"), (T.WINDOW_UPDATE, 0, 3, b"\x7f\xff\xff\xff"),
    (T.WINDOW_UPDATE, 0, 3, b"\x80\0\0\x01"),                                 # R bit ignored
    (T.RST_STREAM, 0, 1, bytes(4)), (T.PRIORITY, 0, 1, bytes(5)),
    (T.GOAWAY, 0, 0, bytes(8)), (T.GOAWAY, 0, 0, bytes(8) + b"debug data"),
    (T.DATA, 0, 0, b""), (T.SETTINGS, 0, 5, b"x"), (0x0B, 0xFF, 0, b"anything"),  # not checked here
])
def test_check_control_accepts(ftype: int, flags: int, sid: int, payload: bytes) -> None:
    check_control(ftype, flags, sid, payload)


def test_grow_window() -> None:
    assert grow_window(65_535, 1000, 1) == 66_535
    assert grow_window(-100, 50, 1) == -50                   # a window may be negative after SETTINGS
    assert grow_window(MAX_WINDOW - 10, 10, 3) == MAX_WINDOW
    err = _h2error(grow_window, MAX_WINDOW - 10, 11, 3)
    assert (err.code, err.stream) == (ErrorCode.FLOW_CONTROL_ERROR, 3)
    err = _h2error(grow_window, MAX_WINDOW, 1, 0)
    assert (err.code, err.stream) == (ErrorCode.FLOW_CONTROL_ERROR, 0)


# ---- header blocks -------------------------------------------------------------------------------
def test_block_assembler_joins_headers_and_continuation() -> None:
    asm = BlockAssembler(100)
    assert asm.headers(1, Flag.END_HEADERS | Flag.END_STREAM, b"one") == b"one" and asm.sid == 0
    assert asm.headers(3, Flag.END_STREAM, b"ab") is None
    assert (asm.sid, asm.flags) == (3, Flag.END_STREAM)
    assert asm.continuation(3, 0, b"") is None
    assert asm.continuation(3, 0, b"cd") is None
    assert asm.continuation(3, Flag.END_HEADERS, b"ef") == b"abcdef"
    assert asm.sid == 0 and asm.flags == Flag.END_STREAM     # the HEADERS flags stay readable
    assert asm.headers(5, 0, b"x") is None
    asm.reset()
    assert asm.sid == 0 and asm.headers(7, Flag.END_HEADERS, b"y") == b"y"


def test_block_assembler_caps_size_while_growing() -> None:
    asm = BlockAssembler(10)
    assert asm.headers(1, Flag.END_HEADERS, bytes(10)) == bytes(10)     # exactly the cap
    err = _h2error(asm.headers, 1, Flag.END_HEADERS, bytes(11))
    assert (err.code, err.stream) == (ErrorCode.ENHANCE_YOUR_CALM, 0)
    asm = BlockAssembler(10)
    asm.headers(1, 0, bytes(6))
    assert asm.continuation(1, 0, bytes(4)) is None                      # 10: still fine
    err = _h2error(asm.continuation, 1, Flag.END_HEADERS, b"x")          # 11: refused before END_HEADERS
    assert (err.code, err.stream) == (ErrorCode.ENHANCE_YOUR_CALM, 0)
    assert sum(map(len, asm.parts)) == 10                                # the refused fragment is not kept


def test_block_assembler_caps_the_number_of_fragments() -> None:
    asm = BlockAssembler(1 << 20)
    assert BlockAssembler.MAX_FRAGMENTS == 64
    asm.headers(1, 0, b"h")
    for _ in range(62):
        assert asm.continuation(1, 0, b"c") is None
    assert asm.continuation(1, Flag.END_HEADERS, b"e") == b"h" + b"c" * 62 + b"e"   # 64 fragments
    asm.headers(1, 0, b"")
    for _ in range(63):
        asm.continuation(1, 0, b"")
    err = _h2error(asm.continuation, 1, Flag.END_HEADERS, b"")          # the 65th, even empty
    assert err.code == ErrorCode.ENHANCE_YOUR_CALM


def test_block_assembler_refuses_frames_out_of_place() -> None:
    asm = BlockAssembler(100)
    err = _h2error(asm.continuation, 1, Flag.END_HEADERS, b"x")          # no block open
    assert (err.code, err.stream) == (ErrorCode.PROTOCOL_ERROR, 0)
    asm.headers(1, 0, b"a")
    err = _h2error(asm.continuation, 3, Flag.END_HEADERS, b"x")          # another stream's CONTINUATION
    assert (err.code, err.stream) == (ErrorCode.PROTOCOL_ERROR, 0)
    for sid in (1, 3):                                                   # HEADERS inside an open block
        err = _h2error(asm.headers, sid, Flag.END_HEADERS, b"x")
        assert (err.code, err.stream) == (ErrorCode.PROTOCOL_ERROR, 0)
    assert asm.continuation(1, Flag.END_HEADERS, b"b") == b"ab"          # the open block is unharmed


# ---- HPACK encoding ------------------------------------------------------------------------------
def _decode_fresh(block: bytes) -> tuple[list[tuple[str, str]], hpack.Decoder]:
    dec = hpack.Decoder()
    return [(str(k), str(v)) for k, v in dec.decode(block)], dec


@pytest.mark.parametrize(("name", "value", "want"), [
    (":method", "POST", b"\x83"),                                         # whole field in the static table
    (":status", "200", b"\x88"),
    (":path", "/x", b"\x04\x02/x"),                                       # static name (index 4), literal value
    ("content-type", "application/grpc", b"\x0f\x10\x10application/grpc"),  # index 31: 4-bit prefix overflows
    ("grpc-status", "0", b"\x00\x0bgrpc-status\x010"),                    # literal name and value
    (b"x-raw", b"\xff\x00", b"\x00\x05x-raw\x02\xff\x00"),                 # bytes in, bytes kept
])
def test_encode_field_exact_bytes(name: str | bytes, value: str | bytes, want: bytes) -> None:
    assert encode_field(name, value) == want


def test_encoded_blocks_decode_to_the_input_and_leave_the_dynamic_table_empty() -> None:
    fields = [(":status", "200"), ("content-type", "application/grpc"), (":path", "/pkg.Svc/Method"),
              ("grpc-status", "13"), ("grpc-message", "caf%C3%A9"), ("x-long", "v" * 126), ("x-longer", "w" * 127),
              ("x-huge", "z" * 20_000), ("x-utf8", "naïve ☃"), ("te", "trailers"), ("", "")]
    block = encode_block(fields)
    decoded, dec = _decode_fresh(block)
    assert decoded == fields
    assert len(dec.header_table.dynamic_entries) == 0
    rnd = random.Random(1)
    for _ in range(200):
        fields = [("".join(rnd.choice("abcxyz-") for _ in range(rnd.randrange(1, 20))),
                   "".join(chr(rnd.randrange(32, 0x2FF)) for _ in range(rnd.randrange(300)))) for _ in range(5)]
        decoded, dec = _decode_fresh(encode_block(fields))
        assert decoded == fields and len(dec.header_table.dynamic_entries) == 0


def test_encode_field_cached_returns_the_same_bytes() -> None:
    first = encode_field_cached("x-cached", "1")
    assert first == encode_field("x-cached", "1") and encode_field_cached("x-cached", "1") is first


# ---- HPACK decoding ------------------------------------------------------------------------------
def test_cached_decoder_reuses_a_result_only_while_the_table_is_unchanged() -> None:
    enc = hpack.Encoder()
    dec = CachedDecoder()
    static = encode_block([(":status", "200"), ("grpc-status", "0")])
    first = dec.decode(static)
    assert first == [(":status", "200"), ("grpc-status", "0")]
    assert dec.decode(static) is first                           # a hit: the same list
    adding = enc.encode([("x-a", "1")])                          # literal with incremental indexing
    assert dec.decode(adding) == [("x-a", "1")] and dec.adds == 1
    again = dec.decode(static)
    assert again == first and again is not first                # the table changed: decoded afresh
    assert dec.decode(static) is again
    # a block that adds to the table is decoded every time (each decoding adds again)
    assert dec.decode(adding) == [("x-a", "1")] and dec.adds == 2
    assert len(dec.decoder.header_table.dynamic_entries) == 2
    # a block that refers to the table is cached while the table stays as it is
    indexed = enc.encode([("x-a", "1")])
    assert indexed == b"\xbe"
    hit = dec.decode(indexed)
    assert hit == [("x-a", "1")] and dec.decode(indexed) is hit


@pytest.mark.parametrize(("fields", "why"), [
    ([("X-Upper", "1")], "not lowercase"),
    ([("x-a", "1"), (":path", "/")], "pseudo-header :path after a regular field"),
    ([("connection", "close")], "connection-specific"),
    ([("te", "gzip")], "connection-specific"),
    ([("", "x")], "empty name"),
])
def test_cached_decoder_validation_errors_carry_the_stream_id(fields: list[tuple[str, str]], why: str) -> None:
    dec = CachedDecoder(validate=True)
    block = encode_block(fields)
    for sid in (7, 9):                                           # the second time from the cache
        err = _h2error(dec.decode, block, sid)
        assert (err.code, err.stream) == (ErrorCode.PROTOCOL_ERROR, sid) and why in err.why
    assert CachedDecoder().decode(block) == fields               # without validate: no complaint
    assert CachedDecoder(validate=True).decode(encode_block([(":path", "/"), ("te", "trailers")])) == \
        [(":path", "/"), ("te", "trailers")]


@pytest.mark.parametrize("garbage", [
    b"\x80",                                    # index 0
    b"\xbf",                                    # index 63: no such entry
    b"\x00\x05ab",                              # a literal cut short
    b"\xff" * 11 + b"\x7f",                     # an integer too long
])
def test_cached_decoder_garbage_is_a_compression_error(garbage: bytes) -> None:
    err = _h2error(CachedDecoder().decode, garbage, 5)
    assert (err.code, err.stream) == (ErrorCode.COMPRESSION_ERROR, 0)   # a connection error whatever the stream


def test_cached_decoder_header_list_over_the_limit_is_enhance_your_calm() -> None:
    dec = CachedDecoder(max_header_list_size=100)
    assert dec.decode(encode_block([("x", "v" * 50)])) == [("x", "v" * 50)]
    err = _h2error(dec.decode, encode_block([("x", "v" * 200)]), 1)
    assert (err.code, err.stream) == (ErrorCode.ENHANCE_YOUR_CALM, 0)


def test_cached_decoder_non_utf8_bytes_do_not_raise() -> None:
    dec = CachedDecoder(validate=True)
    assert dec.decode(b"\x00\x01x\x02\xff\xfe") == [("x", "\xff\xfe")]          # latin-1, not a traceback
    assert dec.decode(encode_block([("x-u", "é")])) == [("x-u", "é")]           # UTF-8 stays UTF-8


# ---- gRPC status helpers -------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "seconds"), [
    ("250m", 0.25), ("5S", 5.0), ("1H", 3600.0), ("2M", 120.0), ("100u", 1e-4), ("7n", 7e-9),
    ("99999999S", 99_999_999.0), ("0m", 0.0),
])
def test_parse_timeout(text: str, seconds: float) -> None:
    assert parse_timeout(text) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize("text", ["", "m", "10", "-5S", "1.5S", "5s", "123456789S", " 5S", "5 S", "S5"])
def test_parse_timeout_malformed_is_none(text: str) -> None:
    assert parse_timeout(text) is None


def test_format_timeout_exact_and_round_trips() -> None:
    assert [format_timeout(s) for s in (0, 1e-9, 0.25, 5, 99_999.999, 1e8, 1e12)] == \
        ["1m", "1m", "250m", "5000m", "99999999m", "1666667M", "99999999H"]
    rnd = random.Random(3)
    for seconds in [rnd.uniform(0, 10) for _ in range(500)] + [rnd.uniform(0, 1e9) for _ in range(500)]:
        text = format_timeout(seconds)
        back = parse_timeout(text)
        assert back is not None and len(text) <= 9
        unit = {"m": 1e-3, "S": 1.0, "M": 60.0, "H": 3600.0}[text[-1]]
        # rounded up by one unit at most; a fraction under 1/1000 of the unit (float noise, as in
        # 0.25 * 1000 = 250.00000000000003) is rounded down
        assert seconds - unit / 1000 <= back <= seconds + unit
        assert format_timeout(back) == text                                # and stable


def test_percent_encoding_of_grpc_message() -> None:
    assert percent_encode("resource exhausted by chaos") == "resource exhausted by chaos"
    assert percent_encode("100% ünïcode\n") == "100%25 %C3%BCn%C3%AFcode%0A"
    assert percent_encode("~!\"#$&'()*+,-./:;<=>?@[\\]^_`{|}") == "~!\"#$&'()*+,-./:;<=>?@[\\]^_`{|}"
    assert percent_decode("%zz") == "%zz" and percent_decode("%FF") == "\ufffd"
    rnd = random.Random(5)
    for _ in range(300):
        text = "".join(chr(rnd.choice((rnd.randrange(0, 128), rnd.randrange(128, 0x10FFFF)))) for _ in range(20))
        text = text.encode("utf-8", "replace").decode("utf-8", "replace")  # no lone surrogates
        encoded = percent_encode(text)
        assert all(0x20 <= ord(c) <= 0x7E for c in encoded)
        assert percent_decode(encoded) == text


def test_binary_metadata() -> None:
    assert encode_bin(b"\x00\x01\x02") == "AAEC"
    assert encode_bin(b"a") == "YQ" and encode_bin("ab") == "YWI"           # no padding
    assert decode_bin("YQ") == b"a" and decode_bin("YQ==") == b"a" and decode_bin("YQ=") == b"a"
    assert decode_bin("-_8") == b"\xfb\xff" and decode_bin("+/8") == b"\xfb\xff"   # URL or standard alphabet
    for bad in ("Y", "Y!Q", "YW Jj", "YQ==="):
        with pytest.raises(ValueError):
            decode_bin(bad)
    rnd = random.Random(9)
    for n in range(40):
        raw = bytes(rnd.randrange(256) for _ in range(n))
        assert decode_bin(encode_bin(raw)) == raw
    fields = metadata_out((("x-id-bin", b"\xff\x00"), ("x-plain", "v"), ("x-bytes", b"b")))
    assert fields == [("x-id-bin", "/wA"), ("x-plain", "v"), ("x-bytes", "b")]
    assert metadata_in(fields) == [("x-id-bin", b"\xff\x00"), ("x-plain", "v"), ("x-bytes", "b")]


def test_status_from_headers() -> None:
    assert status_from_headers([("grpc-status", "0")], None) == (0, "")
    assert status_from_headers([("grpc-status", "8"), ("grpc-message", "a%20b%25")], 200) == (8, "a b%")
    assert status_from_headers([("grpc-status", "x")], 200) == (Status.UNKNOWN, "")
    assert status_from_headers([("grpc-status", "14")], 503) == (14, "")            # grpc-status wins
    assert status_from_headers([("content-type", "application/grpc")], 200) is None
    assert status_from_headers([], None) is None
    for http, code in ((400, Status.INTERNAL), (401, Status.UNAUTHENTICATED), (403, Status.PERMISSION_DENIED),
                       (404, Status.UNIMPLEMENTED), (429, Status.UNAVAILABLE), (502, Status.UNAVAILABLE),
                       (503, Status.UNAVAILABLE), (504, Status.UNAVAILABLE), (418, Status.UNKNOWN),
                       (500, Status.UNKNOWN)):
        assert status_from_headers([], http) == (code, f"HTTP status {http} without grpc-status")
    assert [status_name(c) for c in (0, 8, 16, 17, -1)] == \
        ["OK", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "UNKNOWN", "UNKNOWN"]


def test_status_block_is_static_table_only_and_memoised() -> None:
    block = status_block(8, "resource exhausted by chaos", trailers_only=True)
    decoded, dec = _decode_fresh(block)
    assert decoded == [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "8"),
                       ("grpc-message", "resource exhausted by chaos")]
    assert len(dec.header_table.dynamic_entries) == 0           # the client's table is never touched
    assert block[:1] == b"\x88" and status_block(8, "resource exhausted by chaos", trailers_only=True) is block
    decoded, dec = _decode_fresh(status_block(Status.UNAVAILABLE, "50% über", (("x-d-bin", b"\x01"),)))
    assert decoded == [("grpc-status", "14"), ("grpc-message", "50%25 %C3%BCber"), ("x-d-bin", "AQ")]
    assert status_from_headers(decoded, 200) == (14, "50% über")
    assert _decode_fresh(status_block(0))[0] == [("grpc-status", "0")]
    assert _decode_fresh(TRAILERS_OK)[0] == [("grpc-status", "0")]
    assert _decode_fresh(RESPONSE_HEADERS)[0] == [(":status", "200"), ("content-type", "application/grpc")]


# ---- gRPC messages -------------------------------------------------------------------------------
def test_message_prefix() -> None:
    assert prefix(b"abc") == b"\x00\x00\x00\x00\x03" and prefix(b"", compressed=True) == b"\x01\x00\x00\x00\x00"
    assert frame_message(b"hi", compressed=True) == b"\x01\x00\x00\x00\x02hi"


def test_message_reader_fast_path_buffers_nothing() -> None:
    reader = MessageReader(100)
    payload = frame_message(b"hello")
    assert reader.feed(payload) == [(0, b"hello")]
    assert reader.buf is None and reader.pending == 0
    assert reader.feed(frame_message(b"", compressed=True)) == [(1, b"")]
    assert reader.feed(b"") == [] and reader.buf is None


def test_message_reader_same_messages_however_the_bytes_are_cut() -> None:
    messages = [(0, b"a"), (1, b""), (0, bytes(range(200))), (0, b"x" * 100), (1, b"zz")]
    data = b"".join(frame_message(m, compressed=bool(f)) for f, m in messages)
    for cut in range(len(data) + 1):                            # two pieces, cut at every byte
        reader = MessageReader(200)
        assert reader.feed(data[:cut]) + reader.feed(data[cut:]) == messages, cut
        assert reader.pending == 0 and reader.buf is None
    reader = MessageReader(200)
    out = []
    for i in range(len(data)):                                  # one byte at a time
        out += reader.feed(data[i:i + 1])
    assert out == messages and reader.pending == 0
    reader = MessageReader(200)
    assert reader.feed(data[:3]) == [] and reader.pending == 3


def test_message_reader_refuses_an_over_limit_prefix_before_buffering() -> None:
    reader = MessageReader(100)
    assert reader.feed(prefix(bytes(100))) == [] and reader.pending == 5   # exactly the limit: waited for
    reader = MessageReader(100)
    with pytest.raises(GrpcError) as err:
        reader.feed(b"\x00\x00\x00\x00\x65")                    # 101 declared, not one byte of it sent
    assert err.value.status == Status.RESOURCE_EXHAUSTED and "101 vs. 100" in err.value.message
    assert reader.pending == 0
    reader = MessageReader(100)
    assert reader.feed(b"\x00\x00\x00") == []                   # the prefix cut in two
    with pytest.raises(GrpcError):
        reader.feed(b"\x10\x00")
    reader = MessageReader(1 << 20)
    with pytest.raises(GrpcError):
        reader.feed(frame_message(b"ok") + b"\x00\xff\xff\xff\xff")   # 4 GiB declared after a good message
    with pytest.raises(GrpcError):
        MessageReader(10).feed(frame_message(bytes(11)))        # whole in one frame: the fast path checks too
    assert MessageReader(10).feed(frame_message(bytes(10))) == [(0, bytes(10))]


def test_decompress_round_trips_gzip_and_deflate() -> None:
    data = b"gRPC message " * 1000
    assert decompress(gzip.compress(data), "gzip", len(data)) == data
    assert decompress(zlib.compress(data), "deflate", len(data)) == data
    assert decompress(gzip.compress(b""), "gzip", 0) == b""
    with pytest.raises(GrpcError) as err:
        decompress(gzip.compress(data), "gzip", len(data) - 1)   # one byte over the limit
    assert err.value.status == Status.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(("data", "encoding", "status"), [
    (gzip.compress(b"x"), "", Status.INTERNAL),                    # flag set, no encoding
    (gzip.compress(b"x"), "identity", Status.INTERNAL),
    (gzip.compress(b"x"), "br", Status.UNIMPLEMENTED),
    (gzip.compress(b"x"), "snappy", Status.UNIMPLEMENTED),
    (gzip.compress(b"x" * 1000)[:-12], "gzip", Status.INTERNAL),   # truncated
    (zlib.compress(b"x" * 1000)[:6], "deflate", Status.INTERNAL),
    (b"not compressed at all", "gzip", Status.INTERNAL),
    (gzip.compress(b"x"), "deflate", Status.INTERNAL),             # gzip bytes called deflate
])
def test_decompress_errors(data: bytes, encoding: str, status: Status) -> None:
    with pytest.raises(GrpcError) as err:
        decompress(data, encoding, 1 << 20)
    assert err.value.status == status


def _gzip_of_zeros(mib: int) -> bytes:
    """A valid gzip of `mib` MiB of zeros, built 1 MiB at a time: after a full flush each further MiB
    compresses to the same bytes, so the bomb costs a few ms to make and never exists inflated."""
    zeros = bytes(1 << 20)
    comp = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    first = comp.compress(zeros) + comp.flush(zlib.Z_FULL_FLUSH)
    more = comp.compress(zeros) + comp.flush(zlib.Z_FULL_FLUSH)
    assert comp.compress(zeros) + comp.flush(zlib.Z_FULL_FLUSH) == more
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    # an empty final block, then the gzip trailer: CRC-32 and length mod 2^32
    return first + more * (mib - 1) + b"\x03\x00" + struct.pack("<LL", crc, (mib << 20) & 0xFFFFFFFF)


def test_gzip_bomb_of_1_gib_is_refused_quickly() -> None:
    assert gzip.decompress(_gzip_of_zeros(3)) == bytes(3 << 20)    # the construction is a valid gzip
    bomb = _gzip_of_zeros(1024)
    assert len(bomb) < 2 << 20
    t0 = time.monotonic()
    with pytest.raises(GrpcError) as err:
        decompress(bomb, "gzip", 4 << 20)
    assert err.value.status == Status.RESOURCE_EXHAUSTED
    assert time.monotonic() - t0 < 1.0          # it stops at the limit: ~4 MiB inflated, not 1 GiB


# ---- budgets -------------------------------------------------------------------------------------
class _CountingClock(FakeClock):
    """Virtual time that notes every read of now()."""

    def __init__(self) -> None:
        super().__init__(start_ns=0)
        self.reads: list[float] = []

    def now(self) -> float:
        self.reads.append(super().now())
        return self.reads[-1]


def test_budget_burst_then_refill_in_virtual_time() -> None:
    clock = _CountingClock()
    reads = clock.reads
    budget = Budget(burst=3, per_s=2, clock=clock)
    seq = []
    for t, n in ((0.0, 4), (0.25, 1), (0.5, 2), (1.0, 1), (10.0, 5), (10.125, 1), (10.5, 1)):
        clock.advance_ns(round(t * 1e9) - clock.now_ns())
        seq.append([budget.spend() for _ in range(n)])
    assert seq == [
        [True, True, True, False],      # the burst, then empty
        [False],                        # 0.5 token after 0.25 s
        [True, False],                  # 1 token at 0.5 s
        [True],                         # 1 more at 1.0 s
        [True, True, True, False, False],   # long idle: back to the burst, not more
        [False],                        # 0.25 token
        [True],                         # 0.25 + 0.75
    ]
    assert reads[0] == 0.0 and reads.count(10.0) == 3   # the clock is read only when running low
    big = Budget(burst=10, per_s=1, clock=FakeClock(start_ns=0))
    assert big.spend(4) and big.spend(6) and not big.spend(0.5)


def test_budget_refund_gives_tokens_back_up_to_the_burst() -> None:
    budget = Budget(burst=2, per_s=0, clock=FakeClock(start_ns=0))
    assert [budget.spend() for _ in range(3)] == [True, True, False]
    budget.refund()
    assert [budget.spend() for _ in range(2)] == [True, False]
    budget.refund(10)
    assert [budget.spend() for _ in range(3)] == [True, True, False]   # never more than the burst


def test_budget_that_sat_full_gives_its_burst_once_not_twice() -> None:
    clock = FakeClock(start_ns=0)
    budget = Budget(burst=4, per_s=1, clock=clock)
    clock.advance(100.0)                                   # full all along: no credit piles up meanwhile
    assert [budget.spend() for _ in range(6)] == [True] * 4 + [False, False]
    assert budget.available() == 0
    clock.advance(1.5)
    assert budget.available() == 1.5 and budget.spend() and not budget.spend()
