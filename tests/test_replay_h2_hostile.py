"""The lean h2 sender against a hostile or broken server: every misbehaviour ends the call with a
precise outcome, and the client answers on the wire as grpc-go's client does (GOAWAY with the right
error code for connection errors, RST_STREAM for stream errors), never with a traceback.

The server here is a raw asyncio TCP server on 127.0.0.1 that speaks just enough HTTP/2 to accept
the sender's preface and read its request, then misbehaves and records every frame the client sends
until the client closes the connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import tracemalloc
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from replay.schedule import PlannedCall, PlannedMessage
from replay.senders import SendOutcome
from replay.senders.h2 import H2Sender
from replay.senders.h2conn import H2Connection
from wire.h2 import (
    GOAWAY_BODY,
    HEAD,
    PREFACE,
    SETTINGS_ACK,
    U32,
    ErrorCode,
    Flag,
    FrameType,
    Setting,
    data_frames,
    frame,
    ping,
    settings,
)
from wire.headers import encode_block
from wire.messages import frame_message
from wire.status import TRAILERS_OK

Frame = tuple[int, int, int, bytes]
RESPONSE_HEADERS = encode_block([(":status", "200"), ("content-type", "application/grpc")])
GZIP_HEADERS = encode_block([(":status", "200"), ("content-type", "application/grpc"), ("grpc-encoding", "gzip")])
CALL_TIMEOUT_S = 5.0  # every case ends far sooner: the deadline only bounds a broken client


class Peer:
    """The server side of one connection: reads the client's frames, writes whatever a case wants."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames: list[Frame] = []  # everything the client sent after its preface

    async def read_frame(self) -> Frame | None:
        """The client's next frame, or None at EOF (a reset connection counts as EOF)."""
        try:
            head = await self.reader.readexactly(9)
            hi, lo, ftype, flags, sid = HEAD.unpack(head)
            payload = await self.reader.readexactly(hi << 16 | lo)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        f = (ftype, flags, sid & 0x7FFFFFFF, payload)
        self.frames.append(f)
        return f

    def write(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    async def start(self, server_settings: bytes = settings({})) -> None:
        """Read the client's preface; send ours (a SETTINGS frame)."""
        assert await self.reader.readexactly(len(PREFACE)) == PREFACE
        self.write(server_settings)

    async def request(self) -> int:
        """Read until the client's request has ended (END_STREAM); its stream id."""
        for _ in range(100):
            f = await self.read_frame()
            assert f is not None, "the client closed before sending its request"
            if f[0] in (FrameType.HEADERS, FrameType.DATA) and f[1] & Flag.END_STREAM:
                return f[2]
        raise AssertionError("no request within 100 frames")

    async def until_eof(self) -> None:
        for _ in range(100_000):
            if await self.read_frame() is None:
                return

    def goaway(self) -> tuple[int, ErrorCode] | None:
        """(last stream id, error code) of the client's GOAWAY, None if it sent none."""
        got = [GOAWAY_BODY.unpack_from(p) for t, _, _, p in self.frames if t == FrameType.GOAWAY]
        assert len(got) <= 1
        return (got[0][0], ErrorCode(got[0][1])) if got else None

    def resets(self) -> list[tuple[int, ErrorCode]]:
        return [(sid, ErrorCode(U32.unpack(p)[0])) for t, _, sid, p in self.frames if t == FrameType.RST_STREAM]

    def count(self, ftype: FrameType, flags: int = 0) -> int:
        return sum(1 for t, fl, _, _ in self.frames if t == ftype and fl & flags == flags)


Case = Callable[[Peer], Awaitable[None]]


def _planned() -> PlannedCall:
    return PlannedCall(0, 0, "c0", "grpc", "/test.Hostile/Call", "unary", [PlannedMessage(0, b"request")])


async def _requests(planned: PlannedCall):  # noqa: ANN202 - an async generator of the call's messages
    for m in planned.messages:
        yield m


def _run(case: Case, **sender_options: Any) -> tuple[SendOutcome, Peer]:
    """One call through a fresh H2Sender against a server that plays `case`; the call's outcome and
    the server's record of what the client sent (complete: read until the client closed)."""
    async def go() -> tuple[SendOutcome, Peer]:
        loop = asyncio.get_running_loop()
        served: asyncio.Future[Peer] = loop.create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = Peer(reader, writer)
            try:
                await case(peer)
                await peer.until_eof()
            finally:
                writer.close()
                if not served.done():
                    served.set_result(peer)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        sender = H2Sender(f"127.0.0.1:{port}", **sender_options)
        try:
            planned = _planned()
            out = await asyncio.wait_for(sender.call(planned, _requests(planned), CALL_TIMEOUT_S), CALL_TIMEOUT_S + 5)
        finally:
            await sender.close()  # closes the connection when the call did not: the server sees EOF
        try:
            peer = await asyncio.wait_for(served, 5)
        finally:
            server.close()
            await server.wait_closed()
        return out, peer
    return asyncio.run(go())


def _result(out: SendOutcome) -> tuple[str, str | None, int | None, str]:
    return out.outcome, out.code, out.status, out.detail


def _unavailable(detail: str) -> tuple[str, str, int, str]:
    return "connection_error", "UNAVAILABLE", 14, detail


def _after_request(misbehave: Callable[[Peer, int], None]) -> Case:
    """A case: accept the connection and the request, then `misbehave(peer, stream id)`."""
    async def case(peer: Peer) -> None:
        await peer.start()
        sid = await peer.request()
        misbehave(peer, sid)
    return case


# ---- the harness itself ---------------------------------------------------------------------------
def test_a_well_behaved_raw_server_gets_ok_and_gzip_responses_are_decompressed() -> None:
    body = b"response " * 100
    gz = zlib.compressobj(6, zlib.DEFLATED, 31)
    packed = gz.compress(body) + gz.flush()

    def answer(peer: Peer, sid: int) -> None:
        peer.write(SETTINGS_ACK + frame(FrameType.HEADERS, Flag.END_HEADERS, sid, GZIP_HEADERS)
                   + frame(FrameType.DATA, 0, sid, frame_message(packed, compressed=True))
                   + frame(FrameType.HEADERS, Flag.END_HEADERS | Flag.END_STREAM, sid, TRAILERS_OK))

    out, peer = _run(_after_request(answer))
    assert (out.outcome, out.code, out.status, out.responses) == ("ok", "OK", 0, [body])
    assert peer.goaway() is None and peer.resets() == []


# ---- connection errors: GOAWAY with the code, the call fails UNAVAILABLE naming the cause ----------
def test_a_frame_over_max_frame_size_is_frame_size_error() -> None:
    def oversized(peer: Peer, sid: int) -> None:
        n = 1 << 20
        peer.write(HEAD.pack(n >> 16, n & 0xFFFF, FrameType.DATA, 0, sid) + b"x" * 100)  # the header is enough

    out, peer = _run(_after_request(oversized))
    assert _result(out) == _unavailable(
        "server protocol error: FRAME_SIZE_ERROR: 1048576-byte frame over MAX_FRAME_SIZE 16384")
    assert peer.goaway() == (0, ErrorCode.FRAME_SIZE_ERROR)


def test_settings_initial_window_size_of_2_to_the_31_is_flow_control_error() -> None:
    out, peer = _run(_after_request(lambda peer, _sid: peer.write(settings({Setting.INITIAL_WINDOW_SIZE: 1 << 31}))))
    assert _result(out) == _unavailable(
        "server protocol error: FLOW_CONTROL_ERROR: SETTINGS_INITIAL_WINDOW_SIZE 2147483648 over 2^31-1")
    assert peer.goaway() == (0, ErrorCode.FLOW_CONTROL_ERROR)


def test_settings_max_frame_size_100_in_the_servers_preface_fails_the_connection() -> None:
    async def case(peer: Peer) -> None:
        await peer.start(settings({Setting.MAX_FRAME_SIZE: 100}))

    out, peer = _run(case)
    assert _result(out) == _unavailable(
        "server protocol error: PROTOCOL_ERROR: SETTINGS_MAX_FRAME_SIZE 100 outside 2^14..2^24-1")
    assert peer.goaway() == (0, ErrorCode.PROTOCOL_ERROR)
    assert peer.count(FrameType.HEADERS) == 0  # the call never went out on that connection


def test_a_ping_of_7_bytes_is_frame_size_error() -> None:
    out, peer = _run(_after_request(lambda peer, _sid: peer.write(ping(b"1234567"))))
    assert _result(out) == _unavailable("server protocol error: FRAME_SIZE_ERROR: PING of 7 bytes")
    assert peer.goaway() == (0, ErrorCode.FRAME_SIZE_ERROR)
    assert peer.count(FrameType.PING) == 0  # not answered


def test_a_ping_flood_is_enhance_your_calm() -> None:
    out, peer = _run(_after_request(lambda peer, _sid: peer.write(ping(b"12345678") * 3000)))
    assert _result(out) == _unavailable("server protocol error: ENHANCE_YOUR_CALM: PING flood (over 1000 at 100/s)")
    assert peer.goaway() == (0, ErrorCode.ENHANCE_YOUR_CALM)
    acks = peer.count(FrameType.PING, Flag.ACK)
    assert 1000 <= acks < 1500, acks  # the burst, plus what 100/s refilled while the test ran (< 5 s)


def test_a_settings_flood_is_enhance_your_calm() -> None:
    out, peer = _run(_after_request(lambda peer, _sid: peer.write(settings({}) * 3000)))
    assert _result(out) == _unavailable(
        "server protocol error: ENHANCE_YOUR_CALM: SETTINGS flood (over 1000 at 100/s)")
    assert peer.goaway() == (0, ErrorCode.ENHANCE_YOUR_CALM)


def test_endless_continuation_is_enhance_your_calm_after_64_frames() -> None:
    def endless(peer: Peer, sid: int) -> None:
        peer.write(frame(FrameType.HEADERS, 0, sid, RESPONSE_HEADERS)
                   + frame(FrameType.CONTINUATION, 0, sid, b"\x00\x01a\x01b") * 1000)  # never END_HEADERS

    out, peer = _run(_after_request(endless))
    assert _result(out) == _unavailable(
        "server protocol error: ENHANCE_YOUR_CALM: header block over 1048576 bytes or 64 frames")
    assert peer.goaway() == (0, ErrorCode.ENHANCE_YOUR_CALM)


def test_a_frame_inside_a_header_block_is_protocol_error() -> None:
    def interleaved(peer: Peer, sid: int) -> None:
        peer.write(frame(FrameType.HEADERS, 0, sid, RESPONSE_HEADERS) + ping(b"12345678"))

    out, peer = _run(_after_request(interleaved))
    assert _result(out) == _unavailable(
        "server protocol error: PROTOCOL_ERROR: PING on stream 0 inside the header block of stream 1")
    assert peer.goaway() == (0, ErrorCode.PROTOCOL_ERROR)


def test_continuation_without_headers_is_protocol_error() -> None:
    out, peer = _run(_after_request(
        lambda peer, sid: peer.write(frame(FrameType.CONTINUATION, Flag.END_HEADERS, sid, RESPONSE_HEADERS))))
    assert _result(out) == _unavailable(
        "server protocol error: PROTOCOL_ERROR: CONTINUATION on stream 1 without HEADERS")
    assert peer.goaway() == (0, ErrorCode.PROTOCOL_ERROR)


@pytest.mark.parametrize("ftype", [FrameType.DATA, FrameType.HEADERS], ids=["DATA", "HEADERS"])
def test_data_or_headers_on_stream_0_is_protocol_error(ftype: FrameType) -> None:
    out, peer = _run(_after_request(
        lambda peer, _sid: peer.write(frame(ftype, Flag.END_HEADERS if ftype == FrameType.HEADERS else 0, 0,
                                            RESPONSE_HEADERS))))
    assert _result(out) == _unavailable(f"server protocol error: PROTOCOL_ERROR: {ftype.name} on stream 0")
    assert peer.goaway() == (0, ErrorCode.PROTOCOL_ERROR)


def test_invalid_hpack_is_compression_error() -> None:
    out, peer = _run(_after_request(
        lambda peer, sid: peer.write(frame(FrameType.HEADERS, Flag.END_HEADERS, sid, b"\x80"))))  # index 0
    assert _result(out) == _unavailable(
        "server protocol error: COMPRESSION_ERROR: cannot decode a header block: Invalid table index 0")
    assert peer.goaway() == (0, ErrorCode.COMPRESSION_ERROR)


def test_a_first_frame_other_than_settings_is_protocol_error() -> None:
    out, peer = _run(lambda peer: peer.start(ping(b"12345678")))
    assert _result(out) == _unavailable(
        "server protocol error: PROTOCOL_ERROR: the server's first frame is PING, not SETTINGS")
    assert peer.goaway() == (0, ErrorCode.PROTOCOL_ERROR)


def test_data_on_a_stream_we_never_opened_is_protocol_error() -> None:
    out, peer = _run(_after_request(lambda peer, _sid: peer.write(frame(FrameType.DATA, 0, 3, frame_message(b"x")))))
    assert _result(out) == _unavailable(
        "server protocol error: PROTOCOL_ERROR: DATA on stream 3, which we never opened")
    assert peer.goaway() == (0, ErrorCode.PROTOCOL_ERROR)


def test_an_http1_answer_is_named_as_such() -> None:
    async def case(peer: Peer) -> None:
        assert await peer.reader.readexactly(len(PREFACE)) == PREFACE
        peer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    out, peer = _run(case)
    assert _result(out) == _unavailable(
        "server protocol error: PROTOCOL_ERROR: the server answered in HTTP/1.x, not HTTP/2")
    assert peer.goaway() == (0, ErrorCode.PROTOCOL_ERROR)


def test_an_unexpected_exception_is_internal_error_and_one_log_line(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(H2Connection, "on_block", broken)
    with caplog.at_level(logging.ERROR, logger="replay.senders.h2conn"):
        out, peer = _run(_after_request(
            lambda peer, sid: peer.write(frame(FrameType.HEADERS, Flag.END_HEADERS, sid, RESPONSE_HEADERS))))
    assert _result(out) == _unavailable("h2 sender internal error: RuntimeError: boom")
    assert peer.goaway() == (0, ErrorCode.INTERNAL_ERROR)
    assert [r.getMessage() for r in caplog.records] == [
        "h2 sender: unexpected RuntimeError while handling the server's frames: boom"]
    assert all(r.exc_info is None for r in caplog.records)  # one line, no traceback


# ---- stream errors: RST_STREAM with the code, that call fails -------------------------------------
def test_data_beyond_the_stream_window_is_a_flow_control_stream_error() -> None:
    def overrun(peer: Peer, sid: int) -> None:
        # ACK first: from then on our 10000-byte stream window is in force
        peer.write(SETTINGS_ACK + frame(FrameType.HEADERS, Flag.END_HEADERS, sid, RESPONSE_HEADERS)
                   + frame(FrameType.DATA, 0, sid, frame_message(b"y" * 16_379)))  # a 16384-byte DATA frame

    out, peer = _run(_after_request(overrun), window=10_000)
    assert _result(out) == ("error", "INTERNAL", 13, "server protocol error: FLOW_CONTROL_ERROR on stream 1: "
                                                     "16384-byte DATA beyond the stream's receive window "
                                                     "(10000 bytes left)")
    assert peer.resets() == [(1, ErrorCode.FLOW_CONTROL_ERROR)]
    assert peer.goaway() is None  # a stream error: the connection lives on


def test_a_malformed_header_list_is_a_protocol_stream_error() -> None:
    bad = encode_block([(":status", "200"), ("X-Upper", "1")])
    out, peer = _run(_after_request(lambda peer, sid: peer.write(frame(FrameType.HEADERS, Flag.END_HEADERS, sid, bad))))
    assert _result(out) == ("error", "INTERNAL", 13, "server protocol error: PROTOCOL_ERROR on stream 1: "
                                                     "header name 'X-Upper' is not lowercase")
    assert peer.resets() == [(1, ErrorCode.PROTOCOL_ERROR)]
    assert peer.goaway() is None


def test_data_before_the_response_headers_is_a_protocol_stream_error() -> None:
    out, peer = _run(_after_request(lambda peer, sid: peer.write(frame(FrameType.DATA, 0, sid, frame_message(b"x")))))
    assert _result(out) == ("error", "INTERNAL", 13,
                            "server protocol error: PROTOCOL_ERROR on stream 1: DATA before the response HEADERS")
    assert peer.resets() == [(1, ErrorCode.PROTOCOL_ERROR)]
    assert peer.goaway() is None


# ---- message errors: the call ends with a gRPC status, RST_STREAM CANCEL ---------------------------
@functools.cache
def _gzip_bomb(inflated: int = 256 << 20) -> bytes:
    """gzip of `inflated` zero bytes (256 MiB -> about 260 KB)."""
    gz, zeros = zlib.compressobj(9, zlib.DEFLATED, 31), bytes(1 << 20)
    return b"".join(gz.compress(zeros) for _ in range(inflated >> 20)) + gz.flush()


def test_a_gzip_bomb_is_resource_exhausted_without_inflating_it() -> None:
    bomb = _gzip_bomb()

    def explode(peer: Peer, sid: int) -> None:
        peer.write(frame(FrameType.HEADERS, Flag.END_HEADERS, sid, GZIP_HEADERS)
                   + data_frames(sid, frame_message(bomb, compressed=True), 16_384)
                   + frame(FrameType.HEADERS, Flag.END_HEADERS | Flag.END_STREAM, sid, TRAILERS_OK))

    tracemalloc.start()
    try:
        started = time.monotonic()
        out, peer = _run(_after_request(explode), max_receive_message_length=4 << 20)
        elapsed = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert _result(out) == ("rejected", "RESOURCE_EXHAUSTED", 8,
                            "Received message larger than max (over 4194304 bytes after decompression)")
    assert peer.resets() == [(1, ErrorCode.CANCEL)]
    assert peer.goaway() is None
    assert peak < 32 << 20, peak  # the 4 MiB limit and the ~260 KB bomb, not the 256 MiB it inflates to
    assert elapsed < 4.0  # tolerance for a noisy host: inflating 256 MiB alone would take about 1 s


def test_a_compressed_response_without_grpc_encoding_is_internal() -> None:
    gz = zlib.compressobj(6, zlib.DEFLATED, 31)
    packed = gz.compress(b"response") + gz.flush()

    def unannounced(peer: Peer, sid: int) -> None:
        peer.write(frame(FrameType.HEADERS, Flag.END_HEADERS, sid, RESPONSE_HEADERS)
                   + frame(FrameType.DATA, 0, sid, frame_message(packed, compressed=True)))

    out, peer = _run(_after_request(unannounced))
    assert _result(out) == ("error", "INTERNAL", 13, "compressed flag set with identity or empty encoding")
    assert peer.resets() == [(1, ErrorCode.CANCEL)]
    assert peer.goaway() is None


def test_a_response_over_the_max_size_is_resource_exhausted() -> None:
    def big(peer: Peer, sid: int) -> None:
        peer.write(frame(FrameType.HEADERS, Flag.END_HEADERS, sid, RESPONSE_HEADERS)
                   + frame(FrameType.DATA, 0, sid, frame_message(b"z" * 2000))
                   + frame(FrameType.HEADERS, Flag.END_HEADERS | Flag.END_STREAM, sid, TRAILERS_OK))

    out, peer = _run(_after_request(big), max_receive_message_length=1000)
    assert _result(out) == ("rejected", "RESOURCE_EXHAUSTED", 8, "Received message larger than max (2000 vs. 1000)")
    assert peer.resets() == [(1, ErrorCode.CANCEL)]
    assert peer.goaway() is None


def test_a_calls_responses_together_are_bounded_by_the_max_size() -> None:
    def many(peer: Peer, sid: int) -> None:
        peer.write(frame(FrameType.HEADERS, Flag.END_HEADERS, sid, RESPONSE_HEADERS)
                   + frame(FrameType.DATA, 0, sid, frame_message(b"z" * 600)) * 3
                   + frame(FrameType.HEADERS, Flag.END_HEADERS | Flag.END_STREAM, sid, TRAILERS_OK))

    out, peer = _run(_after_request(many), max_receive_message_length=1000)
    assert _result(out) == ("rejected", "RESOURCE_EXHAUSTED", 8,
                            "responses to one call over the max receive message size (1000 bytes)")
    assert peer.resets() == [(1, ErrorCode.CANCEL)]
