"""Decoding bytes into calls: HTTP/2 + gRPC (unary, streaming, trailers, mid-stream HPACK), HTTP/1.1."""

from __future__ import annotations

import pytest

from capture.decode import FlowDecoder
from capture.recording import Call
from capture.testing import GrpcCall, HpackConnection, h2_conversation

M = "/shadowtest.agent.v1.TradingAgent/Decide"
S = "/shadowtest.agent.v1.TradingAgent/DecideStream"


def _decode(parts: list[tuple[str, bytes]], joined: bool = False, start_ts: int = 1000) -> tuple[list[Call], FlowDecoder]:
    dec = FlowDecoder(flow_id=1, joined=joined)
    calls: list[Call] = []
    for i, (direction, data) in enumerate(parts):
        calls += dec.feed(direction, start_ts + i * 10, data)  # type: ignore[arg-type]
    calls += dec.finish()
    return calls, dec


def test_unary_and_streaming_grpc_calls_decode_with_order_timestamps_and_trailers() -> None:
    parts = h2_conversation([
        GrpcCall(M, [b"req-1"], [b"resp-1"], metadata=[("x-trace", "t1")]),
        GrpcCall(S, [b"s-a", b"s-b", b"s-c"], [b"r-a", b"r-b", b"r-c"]),
        GrpcCall(M, [b"bad"], [], status=3),
    ])
    calls, dec = _decode(parts)
    assert dec.protocol == "grpc"
    assert [c.method for c in calls] == [M, S, M]
    unary, stream, failed = calls
    assert unary.kind == "unary" and unary.status == 0 and unary.status_message == "ok"
    assert [m.data for m in unary.requests] == [b"req-1"] and [m.data for m in unary.responses] == [b"resp-1"]
    assert ("x-trace", "t1") in unary.request_metadata
    assert stream.kind == "bidi"
    assert [m.data for m in stream.requests] == [b"s-a", b"s-b", b"s-c"]
    assert [m.seq for m in stream.requests] == [0, 1, 2]
    # each message keeps the timestamp of the chunk that carried it, strictly increasing here
    ts = [m.ts_ns for m in stream.requests]
    assert ts == sorted(ts) and len(set(ts)) == 3
    assert [m.data for m in stream.responses] == [b"r-a", b"r-b", b"r-c"]
    assert stream.request_ts_ns < stream.requests[0].ts_ns <= stream.end_ts_ns
    assert failed.status == 3 and failed.status_message == "bad" and failed.responses == []


def test_bytes_split_at_every_position_decode_the_same() -> None:
    parts = h2_conversation([GrpcCall(M, [b"x" * 300], [b"y" * 50]), GrpcCall(S, [b"a", b"b"], [b"c"])])
    whole, _ = _decode(parts)
    # one byte per chunk: frame and message reassembly across chunk boundaries
    tiny = [(d, data[i:i + 1]) for d, data in parts for i in range(len(data))]
    split, _ = _decode(tiny)
    assert [(c.method, [m.data for m in c.requests], [m.data for m in c.responses]) for c in split] == \
           [(c.method, [m.data for m in c.requests], [m.data for m in c.responses]) for c in whole]


def _join_after(parts: list[tuple[str, bytes]], n_calls_first: int) -> list[tuple[str, bytes]]:
    """Drop everything before the (n+1)-th request HEADERS write: a capture joined mid-stream."""
    seen = 0
    for i, (d, data) in enumerate(parts):
        if d == "c2s" and len(data) > 9 and data[3] == 1:   # a HEADERS frame starts this write
            seen += 1
            if seen == n_calls_first + 1:
                return parts[i:]
    raise AssertionError("not enough calls")


def test_midstream_join_marks_and_counts_calls_whose_method_hpack_hid() -> None:
    calls_in = [GrpcCall(M, [b"%d" % i], [b"ok"]) for i in range(4)]
    parts = _join_after(h2_conversation(calls_in), 2)
    calls, dec = _decode(parts, joined=True)
    # the two later calls are not dropped: counted, their bytes kept, their method marked unknown
    assert len(calls) == 2
    assert all(c.method_unknown and c.method is None for c in calls)
    assert [c.requests[0].data for c in calls] == [b"2", b"3"]
    assert [[m.data for m in c.responses] for c in calls] == [[b"ok"], [b"ok"]]
    # the trailers were indexed before we joined: the status is unknown, the end of the call is not
    assert [c.status for c in calls] == [None, None] and all(c.end_ts_ns for c in calls)
    assert dec.inner.unknown_method_calls == 2  # type: ignore[union-attr]


def test_midstream_join_decodes_every_method_with_a_zero_hpack_table() -> None:
    calls_in = [GrpcCall(M, [b"%d" % i], [b"ok"]) for i in range(4)]
    parts = _join_after(h2_conversation(calls_in, header_table_size=0), 2)
    calls, _ = _decode(parts, joined=True)
    assert [(c.method, c.method_unknown) for c in calls] == [(M, False), (M, False)]


def test_midstream_join_starting_inside_a_frame_resynchronises() -> None:
    parts = _join_after(h2_conversation([GrpcCall(M, [b"%d" % i], [b"ok"]) for i in range(4)], 0, ), 2)
    # the first captured chunk starts in the middle of a frame: skipped, not misparsed
    parts = [(parts[0][0], parts[0][1][5:])] + parts[1:]
    calls, _ = _decode(parts, joined=True)
    # its DATA (a later write) is still recovered, under an unknown method; the next call is whole
    assert [(c.requests[0].data, c.method) for c in calls] == [(b"2", None), (b"3", M)]
    assert calls[0].method_unknown and not calls[1].method_unknown


def test_http1_keepalive_pipelining_and_chunked_bodies() -> None:
    c2s = (b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
           b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
           b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    s2c = (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nA!"
           b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nBODY\r\n0\r\n\r\n"
           b"HTTP/1.1 204 No Content\r\n\r\n")
    parts = [("c2s", c2s[:40]), ("c2s", c2s[40:]), ("s2c", s2c[:50]), ("s2c", s2c[50:])]
    calls, dec = _decode(parts)
    assert dec.protocol == "http1"
    assert [(c.method, c.status) for c in calls] == [("GET /a", 200), ("POST /b", 201), ("POST /c", 204)]
    assert [m.data for m in calls[1].requests] == [b"hello"]
    assert [m.data for m in calls[2].requests] == [b"abcde"]
    assert [m.data for m in calls[1].responses] == [b"BODY"]
    assert calls[0].kind == "request" and ("host", "x") in calls[0].request_metadata


def test_unanswered_http1_request_is_kept_without_status() -> None:
    calls, _ = _decode([("c2s", b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")])
    assert [(c.method, c.status) for c in calls] == [("GET /slow", None)]


def test_anything_else_is_raw_tcp_without_calls() -> None:
    calls, dec = _decode([("c2s", b"\x05\x01\x00\x03" + b"\x01" * 40), ("s2c", b"\x05\x00" + b"z" * 30)])
    assert calls == [] and dec.protocol == "tcp"


def test_header_block_over_continuation_frames_decodes_whole() -> None:
    # 40 KB of metadata: HEADERS + CONTINUATION frames (16 KiB each), assembled before HPACK decoding
    big = "v" * 40_000
    parts = h2_conversation([GrpcCall(M, [b"q"], [b"a"], metadata=[("x-big", big)]), GrpcCall(M, [b"2"], [b"b"])])
    assert any(d == "c2s" and b"\x09\x04\x00\x00\x00\x01" in data for d, data in parts)  # a final CONTINUATION
    for chunks in (parts, [(d, data[i:i + 1000]) for d, data in parts for i in range(0, len(data), 1000)]):
        calls, _ = _decode(chunks)
        assert [(c.method, [m.data for m in c.requests]) for c in calls] == [(M, [b"q"]), (M, [b"2"])]
        assert ("x-big", big) in calls[0].request_metadata


def test_header_block_over_the_cap_is_undecodable_not_buffered(monkeypatch: pytest.MonkeyPatch) -> None:
    import capture.decode.h2grpc as h2grpc

    monkeypatch.setattr(h2grpc, "MAX_HEADER_BLOCK", 20_000)
    parts = h2_conversation([GrpcCall(M, [b"q"], [b"a"], metadata=[("x-big", "v" * 40_000)])])
    calls, dec = _decode(parts)
    # the call is kept with its messages and status; its request headers are lost, and counted
    assert [(c.method, c.method_unknown, [m.data for m in c.responses], c.status) for c in calls] == \
           [(None, True, [b"a"], 0)]
    assert dec.inner.unknown_method_calls == 1  # type: ignore[union-attr]


def test_message_over_the_limit_is_skipped_and_counted_not_buffered(monkeypatch: pytest.MonkeyPatch) -> None:
    from capture.decode.h2grpc import H2Decoder

    monkeypatch.setattr(H2Decoder, "max_message", 1000)
    parts = h2_conversation([GrpcCall(S, [b"a", b"x" * 5000, b"b", b"y" * 1001, b"c"], [b"r" * 1000, b"s" * 1001]),
                             GrpcCall(M, [b"next"], [b"ok"])])
    whole, dec = _decode(parts)
    tiny, dec2 = _decode([(d, data[i:i + 7]) for d, data in parts for i in range(0, len(data), 7)])
    for calls, d in ((whole, dec), (tiny, dec2)):
        assert [([m.data for m in c.requests], [m.data for m in c.responses]) for c in calls] == \
               [([b"a", b"b", b"c"], [b"r" * 1000]), ([b"next"], [b"ok"])]
        assert d.inner.truncated_messages == 3  # type: ignore[union-attr]
        assert [c.status for c in calls] == [0, 0]


def test_skipped_messages_reach_the_recording_and_inspect_says_so(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from capture.decode.h2grpc import H2Decoder
    from capture.record import build_redactor
    from capture.recording import Flow, Recording, RecordingWriter
    from capture.sink import FlowSink
    from capture.summary import summarize

    monkeypatch.setattr(H2Decoder, "max_message", 1000)
    parts = h2_conversation([GrpcCall(M, [b"x" * 5000], [b"ok"]), GrpcCall(M, [b"small"], [b"y" * 2000])])
    path = tmp_path / "big.rec"
    with RecordingWriter(path) as w:
        sink = FlowSink(w, build_redactor(True, []))
        sink.open_flow("k", Flow(src=("127.0.0.1", 40000), dst=("127.0.0.1", 50051)))
        for i, (d, data) in enumerate(parts):
            sink.data("k", d, 1000 + i, data)  # type: ignore[arg-type]
        sink.close_flow("k", 99999)
        stats = sink.close()
    assert stats.truncated_messages == 2
    with Recording(path) as rec:
        assert rec.meta["truncated_messages"] == 2
        problems = summarize(rec)["problems"]
    assert [p for p in problems if "over the decoder's" in p] == [
        "2 gRPC message(s) over the decoder's 16 MiB cap were not stored as messages "
        "(their calls lack them; the bytes are in the chunks)"]


# -- joined connections: identity of the HPACK entries inserted before the join ----------------------

def _after_join(conn: HpackConnection, before: list[str]) -> None:
    """Calls on `conn` whose bytes a recorder that joins afterwards never sees."""
    conn.preface()
    for path in before:
        conn.call(path)


def test_tolerant_decoder_names_prejoin_entries_by_a_stable_ordinal() -> None:
    import hpack

    from wire.headers import TolerantDecoder

    enc = hpack.Encoder()
    enc.encode([(":path", "/a"), ("x-k", "1")])      # before the join: table [x-k 1, :path /a]
    enc.encode([(":path", "/b")])                    # [:path /b, x-k 1, :path /a]
    dec = TolerantDecoder()
    first = dec.decode(enc.encode([(":path", "/a"), (":path", "/b"), ("x-k", "1")]))
    assert (first.headers, first.refs, first.missing, first.invalid) == ([], [3, 1, 2], 3, 0)
    # later insertions push every index up; the ordinals stay
    assert dec.decode(enc.encode([("x-new", "v")])).headers == [("x-new", "v")]
    again = dec.decode(enc.encode([(":path", "/a"), ("x-new", "v"), (":path", "/b")]))
    assert (again.headers, again.refs) == ([("x-new", "v")], [3, 1])
    # a literal whose name is a pre-join entry: the name's ordinal; its new entry remembers it
    lit = dec.decode(enc.encode([("x-k", "2")]))
    assert (lit.headers, lit.refs) == ([], [2])
    assert dec.decode(enc.encode([("x-k", "2")])).refs == [2]
    # a table resized to zero drops every pre-join entry: what is past our table is now invalid
    dec.decode(b"\x20")
    bad = dec.decode(bytes([0x80 | 62]))
    assert (bad.refs, bad.invalid, bad.missing) == ([], 1, 1)


def test_joined_connection_gives_calls_of_one_method_one_ref_and_methods_different_ones() -> None:
    conn = HpackConnection()
    _after_join(conn, [M, S, M])          # both methods' :path are in the client's table before the join
    parts: list[tuple[str, bytes]] = []
    for i in range(12):
        parts += conn.call(M if i % 3 else S, [b"%d" % i])
        if i % 4 == 0:
            parts += conn.call(f"/new.Svc/First{i}")    # first used after the join: pushes indices up
    calls, dec = _decode(parts, joined=True)
    old = [c for c in calls if c.method is None]
    new = [c for c in calls if c.method is not None]
    assert len(old) == 12 and all(c.method_unknown for c in old)
    # the same entries, whatever was inserted in between: one ref per method, two methods two refs
    refs = {c.requests[0].data: c.method_ref for c in old}
    by_method = {"M": {refs[b"%d" % i] for i in range(12) if i % 3}, "S": {refs[b"%d" % i] for i in range(0, 12, 3)}}
    assert by_method == {"M": {"hpack:5,4,3,2"}, "S": {"hpack:1,4,3,2"}}
    # a method first used after the join has a literal :path: decoded, named, gRPC
    assert [(c.method, c.method_unknown, c.protocol) for c in new] == \
           [(f"/new.Svc/First{i}", False, "grpc") for i in (0, 4, 8)]
    assert dec.inner.unknown_method_calls == 12  # type: ignore[union-attr]


def test_a_connection_not_joined_has_no_refs() -> None:
    conn = HpackConnection()
    parts = conn.preface() + conn.call(M) + conn.call(M) + conn.call(S)
    calls, _ = _decode(parts)
    assert [(c.method, c.method_ref, c.method_unknown) for c in calls] == [(M, None, False), (M, None, False),
                                                                          (S, None, False)]


def test_evicted_prejoin_entries_are_relearnt_or_never_guessed() -> None:
    big = "v" * 1500
    # The client's table is ours in size (4096): once big entries evict its pre-join entries, the
    # client sends :path as a literal again and the method decodes.
    conn = HpackConnection()
    _after_join(conn, [M])
    parts = conn.call(M, [b"0"])
    for i in range(3):
        parts += conn.call("/other.Svc/X", [b"x"], metadata=[("x-big", f"{i}{big}")])
    parts += conn.call(M, [b"1"])
    calls, _ = _decode(parts, joined=True)
    assert [(c.method, c.method_ref) for c in calls if c.requests[0].data in (b"0", b"1")] == \
           [(None, "hpack:4,3,2,1"), (M, None)]
    # A peer whose table is larger than ours (its size was agreed before the join): our table evicts
    # while the peer's pre-join entries live on. References past our table are then invalid: the call
    # has no ref rather than a wrong one.
    conn = HpackConnection(header_table_size=65536)
    _after_join(conn, [M])
    parts = conn.call(M, [b"0"])
    for i in range(3):
        parts += conn.call("/other.Svc/X", [b"x"], metadata=[("x-big", f"{i}{big}")])
    parts += conn.call(M, [b"1"])
    calls, _ = _decode(parts, joined=True)
    got = {c.requests[0].data: (c.method, c.method_ref, c.method_unknown) for c in calls}
    assert got[b"0"] == (None, "hpack:4,3,2,1", True) and got[b"1"] == (None, None, True)


def test_plain_http2_joined_calls_group_by_path_and_authority() -> None:
    conn = HpackConnection()
    conn.preface()
    for path, host in (("/api/a", "x.example"), ("/api/b", "x.example"), ("/api/a", "y.example")):
        conn.call(path, [], [], grpc=False, authority=host)
    parts: list[tuple[str, bytes]] = []
    for path, host in [("/api/a", "x.example"), ("/api/b", "x.example"), ("/api/a", "y.example")] * 3:
        parts += conn.call(path, [], [], grpc=False, authority=host)
    parts += conn.call("/api/a", [], [], grpc=False, authority="x.example", content_type="text/plain")
    calls, dec = _decode(parts, joined=True)
    assert dec.protocol == "http2" and all(c.method is None for c in calls)
    refs = [c.method_ref for c in calls]
    assert refs[:3] == refs[3:6] == refs[6:9] and len(set(refs[:3])) == 3 and None not in refs
    # a content-type that is not gRPC, seen after the join: the call is plain HTTP/2, same :path group
    assert calls[-1].protocol == "http2" and calls[-1].method_ref is not None


def test_a_gap_starts_the_client_table_afresh_with_its_own_refs() -> None:
    conn = HpackConnection()
    _after_join(conn, [M])
    before = conn.call("/new.Svc/N", [b"0"]) + conn.call(M, [b"1"])
    after = conn.call("/new.Svc/N", [b"2"]) + conn.call(M, [b"3"])
    dec = FlowDecoder(flow_id=1, joined=True)
    calls: list[Call] = []
    for i, (d, data) in enumerate(before):
        calls += dec.feed(d, 1000 + i, data)  # type: ignore[arg-type]
    dec.gap("c2s")       # bytes lost here may have inserted entries: nothing learnt before counts
    for i, (d, data) in enumerate(after):
        calls += dec.feed(d, 2000 + i, data)  # type: ignore[arg-type]
    got = [(c.requests[0].data, c.method, c.method_ref) for c in calls]
    assert got[:2] == [(b"0", "/new.Svc/N", "hpack:3,2,1"), (b"1", None, "hpack:4,3,2,1")]
    # after the gap /new.Svc/N (learnt before it) is unknown too, and no ref is shared across the gap
    assert [(d, m) for d, m, _ in got[2:]] == [(b"2", None), (b"3", None)]
    assert all(r is not None and r.startswith("hpack@1:") for _, _, r in got[2:])
    assert got[2][2] != got[3][2]


@pytest.mark.parametrize("decode", ["live", "at-stop"])
def test_method_refs_reach_the_recording_and_its_groups(tmp_path, decode: str) -> None:
    from capture.record import build_redactor
    from capture.recording import Flow, Recording, RecordingWriter
    from capture.sink import FlowSink

    conn = HpackConnection()
    _after_join(conn, [M, S])
    parts: list[tuple[str, bytes]] = []
    for i in range(5):
        parts += conn.call(M if i % 2 else S, [b"%d" % i], metadata=[("authorization", "Bearer s3cret")])
    path = tmp_path / f"{decode}.rec"
    with RecordingWriter(path) as w:
        sink = FlowSink(w, build_redactor(True, []), decode=decode)
        fid = sink.open_flow("k", Flow(src=("127.0.0.1", 40000), dst=("127.0.0.1", 50051), joined_midstream=True))
        for i, (d, data) in enumerate(parts):
            sink.data("k", d, 1000 + i, data)  # type: ignore[arg-type]
        sink.close_flow("k", 99999)
        sink.close()
    with Recording(path) as rec:
        assert [(g.flow_id, g.calls, g.kinds, g.method) for g in rec.method_groups()] == \
               [(fid, 3, {"unary": 3}, None), (fid, 2, {"unary": 2}, None)]
        refs = [g.ref for g in rec.method_groups()]
        assert [[m.data for c in rec.group_calls(fid, r) for m in c.requests] for r in refs] == \
               [[b"0", b"2", b"4"], [b"1", b"3"]]


# --- HTTP/1 gaps: step over a gap of known size inside a body, never mis-pair -------------------------

_BODY_MISSING = "body not captured: {side}, {n} bytes missing in a gap"


def _gapped(parts: list[tuple[str, object]]) -> list[Call]:
    """Feed ("c2s"|"s2c", bytes) and ("gap-c2s"|"gap-s2c", nbytes or None) in order."""
    dec = FlowDecoder(flow_id=1)
    calls: list[Call] = []
    for i, (what, data) in enumerate(parts):
        if what.startswith("gap-"):
            dec.gap(what[4:], data)  # type: ignore[arg-type]
        else:
            calls += dec.feed(what, 1000 + i * 10, data)  # type: ignore[arg-type, arg-type]
    return calls + dec.finish()


_GETS = b"".join(b"GET /k%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(3))
_RESPS = b"".join(b"HTTP/1.1 %d X\r\nContent-Length: 2\r\n\r\nk%d" % (200 + i, i) for i in range(3))


@pytest.mark.parametrize("chunked", [False, True])
def test_http1_known_size_gap_in_a_request_body_keeps_every_pairing(chunked: bool) -> None:
    if chunked:
        head = b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n10\r\n0123"
        tail = b"CDEF\r\n2\r\nzz\r\n0\r\n\r\n" + _GETS      # the gap: 8 of the 16-byte chunk's bytes
    else:
        head = b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n01234"
        tail = b"FGHIJ" + _GETS                              # the gap: 10 of the 20 body bytes
    gap = 8 if chunked else 10
    resp = b"HTTP/1.1 413 Too Large\r\nContent-Length: 0\r\n\r\n" + _RESPS
    calls = _gapped([("c2s", head), ("gap-c2s", gap), ("c2s", tail), ("s2c", resp)])
    assert [(c.method, c.status) for c in calls] == [("POST /up", 413), ("GET /k0", 200), ("GET /k1", 201),
                                                     ("GET /k2", 202)]
    assert calls[0].requests == [] and calls[0].status_message == _BODY_MISSING.format(side="request", n=gap)
    assert [m.data for c in calls[1:] for m in c.responses] == [b"k0", b"k1", b"k2"]
    assert [c.status_message for c in calls[1:]] == ["X", "X", "X"]


@pytest.mark.parametrize("chunked", [False, True])
def test_http1_known_size_gap_in_a_response_body_keeps_every_pairing(chunked: bool) -> None:
    req = b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" + _GETS
    if chunked:
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n20\r\nabcd"
        tail = b"\r\n0\r\n\r\n" + _RESPS                    # the gap: the rest of the 32-byte chunk (28)
        gap = 28
    else:
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabcd"
        tail = b"z" * 6 + _RESPS
        gap = 90
    calls = _gapped([("c2s", req), ("s2c", head), ("gap-s2c", gap), ("s2c", tail)])
    assert [(c.method, c.status) for c in calls] == [("GET /big", 200), ("GET /k0", 200), ("GET /k1", 201),
                                                     ("GET /k2", 202)]
    assert calls[0].responses == [] and calls[0].status_message == _BODY_MISSING.format(side="response", n=gap)
    assert [m.data for c in calls[1:] for m in c.responses] == [b"k0", b"k1", b"k2"]


def test_http1_two_gaps_in_one_body_add_up_and_a_gap_longer_than_the_body_does_not_step() -> None:
    head = b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n01"
    calls = _gapped([("c2s", head), ("gap-c2s", 5), ("c2s", b"789"), ("gap-c2s", 4), ("c2s", b"EFGHIJ" + _GETS),
                     ("s2c", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n" + _RESPS)])
    assert [(c.method, c.status) for c in calls][:2] == [("POST /up", 200), ("GET /k0", 200)]
    assert calls[0].status_message == _BODY_MISSING.format(side="request", n=9)

    too_long = _gapped([("c2s", b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n01"), ("gap-c2s", 50),
                        ("c2s", _GETS), ("s2c", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n" + _RESPS)])
    # the gap held more than the body: what follows cannot be trusted; the cut request still pairs
    # (its answer comes first), nothing after it is paired
    assert [(c.method, c.status) for c in too_long] == [("POST /up", 200)]
    assert too_long[0].status_message == _BODY_MISSING.format(side="request", n="an unknown number of")


def test_http1_gap_in_a_response_header_marks_the_rest_outcome_unknown_never_mispaired() -> None:
    from capture.recording import OUTCOME_UNKNOWN
    req = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n"
    calls = _gapped([("c2s", req), ("s2c", b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nAHTTP/1.1 4"),
                     ("gap-s2c", 30), ("s2c", b"\r\n\r\n" + _RESPS), ("c2s", _GETS)])
    assert [(c.method, c.status, c.status_message) for c in calls] == [
        ("GET /a", 200, "OK"), ("GET /b", None, OUTCOME_UNKNOWN), ("GET /k0", None, OUTCOME_UNKNOWN),
        ("GET /k1", None, OUTCOME_UNKNOWN), ("GET /k2", None, OUTCOME_UNKNOWN)]
    assert all(c.responses == [] for c in calls[1:])


def test_http1_gap_of_unknown_size_or_in_a_request_header_pairs_nothing_after_it() -> None:
    for gap in (None, 12):
        calls = _gapped([("c2s", b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HT"), ("gap-c2s", gap),
                         ("c2s", b"\r\n\r\n" + _GETS), ("s2c", _RESPS)])
        # /a still pairs with the first response (it precedes everything lost); no later response is
        # attached to anything
        assert [(c.method, c.status) for c in calls] == [("GET /a", 200)]


def test_http1_gap_at_a_chunk_boundary_cannot_step() -> None:
    head = b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
    calls = _gapped([("c2s", head), ("gap-c2s", 5), ("c2s", b"0\r\n\r\n" + _GETS), ("s2c", _RESPS)])
    assert [(c.method, c.status) for c in calls] == [("POST /up", 200)]
    assert calls[0].status_message and calls[0].status_message.startswith("body not captured: request")


@pytest.mark.parametrize("decode", ["live", "at-stop"])
@pytest.mark.parametrize("how", ["gap", "discarded"])
def test_http1_sink_gaps_pass_their_length_and_inspect_counts_the_damage(tmp_path, decode: str,
                                                                        how: str) -> None:
    from capture.record import build_redactor
    from capture.recording import Flow, Recording, RecordingWriter
    from capture.sink import FlowSink
    from capture.summary import summarize
    from replay.schedule import ScheduleOptions, build_plan

    out = tmp_path / f"gap-{decode}-{how}.rec"
    with RecordingWriter(out) as w:
        sink = FlowSink(w, build_redactor(True, []), decode=decode)
        sink.open_flow("k", Flow(src=("127.0.0.1", 40000), dst=("127.0.0.1", 80)))
        sink.data("k", "c2s", 10, b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n01234")
        getattr(sink, how)("k", "c2s", 15)
        sink.data("k", "c2s", 20, b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        sink.data("k", "s2c", 30, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
                                  b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi")
        sink.close_flow("k", 40)
        sink.close()
    with Recording(out) as r:
        calls = list(r.calls())
        summary = summarize(r)
    assert [(c.method, c.status) for c in calls] == [("POST /up", 404), ("GET /hello", 200)]
    assert calls[0].status_message == _BODY_MISSING.format(side="request", n=15) and calls[0].requests == []
    assert any(p.startswith("1 HTTP call(s) have a body that was not captured") for p in summary["problems"])
    plan = list(build_plan(lambda: iter(calls), ScheduleOptions()))
    assert [p.request_body_missing for p in plan] == [True, False]


def test_http1_request_whose_body_was_not_captured_is_not_replayed(tmp_path) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from capture.recording import Flow, RecordingWriter
    from replay.engine import ReplayRun

    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with RecordingWriter(tmp_path / "g.rec") as w:
            fid = w.add_flow(Flow(("127.0.0.1", 40000), ("127.0.0.1", 8080), protocol="http1"))
            w.add_call(Call(protocol="http1", method="POST /up", request_ts_ns=10**10, flow_id=fid,
                            kind="request", request_metadata=[("Content-Length", "20")], status=200,
                            status_message=_BODY_MISSING.format(side="request", n=15)))
            w.add_call(Call(protocol="http1", method="GET /health", request_ts_ns=10**10 + 5_000_000,
                            flow_id=fid, kind="request", status=200))
        rep = ReplayRun(tmp_path / "g.rec", f"127.0.0.1:{server.server_address[1]}").run()
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["/health"]                       # never sent with an invented (or empty) body
    assert rep.ok == 1 and rep.not_sent_reasons == {"request_body_not_captured": 1} and rep.invariant_ok


def _summary(parts: list[tuple[str, bytes]]) -> tuple[str | None, list[tuple[str | None, int | None, bytes]]]:
    calls, dec = _decode(parts)
    return dec.protocol, [(c.method, c.status, b"".join(m.data for m in c.requests)) for c in calls]


def _splits(parts: list[tuple[str, bytes]], which: int) -> list[list[tuple[str, bytes]]]:
    """`parts` with part `which` split in two at every offset of its first 80 bytes, and one byte at a time."""
    d, data = parts[which]
    out = [parts[:which] + [(d, data[:k]), (d, data[k:])] + parts[which + 1:] for k in range(1, min(80, len(data)))]
    out.append(parts[:which] + [(d, data[i:i + 1]) for i in range(len(data))] + parts[which + 1:])
    return out


HTTP1 = [("c2s", b"GET /hello HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer abc\r\n\r\n"),
         ("s2c", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"),
         ("c2s", b"POST /submit HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc"),
         ("s2c", b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")]


@pytest.mark.parametrize("name", ["http1", "http1-server-split", "grpc", "grpc-server-first", "tcp"])
def test_detection_does_not_depend_on_how_the_first_bytes_were_split(name: str) -> None:
    """`GET /hello ` in one read and the rest in the next, the preface split anywhere, one byte at a time:
    the same protocol and the same calls as when the first bytes came in one read."""
    if name.startswith("http1"):
        parts, which, want = HTTP1, (1 if name.endswith("split") else 0), "http1"
    elif name.startswith("grpc"):
        parts = h2_conversation([GrpcCall("/s.S/M", [b"req"], [b"resp"]), GrpcCall("/s.S/N", [b"r2"], [b"p2"])])
        if name.endswith("first"):        # the server's SETTINGS arrive before the client's preface
            first_s2c = next(i for i, (d, _) in enumerate(parts) if d == "s2c")
            parts = [parts[first_s2c]] + parts[:first_s2c] + parts[first_s2c + 1:]
        which, want = 0, "grpc"
    else:
        parts, which, want = [("c2s", b"HELO relay.example\r\nAUTH x\r\n"), ("s2c", b"250 ok\r\n")], 0, "tcp"
    whole = _summary(parts)
    assert whole[0] == want and (want == "tcp" or len(whole[1]) == 2), whole
    for variant in _splits(parts, which):
        assert _summary(variant) == whole, [len(b) for _, b in variant[:4]]


def test_a_request_line_still_incomplete_after_8_kib_is_raw_tcp() -> None:
    calls, dec = _decode([("c2s", b"GET /" + b"a" * 9000)])
    assert calls == [] and dec.protocol == "tcp"
    dec = FlowDecoder(1)
    assert dec.feed("c2s", 1, b"GET /hello ") == [] and dec.protocol is None    # waits: a prefix of a request


def test_inspect_blames_a_gap_not_a_join_for_methods_a_gap_hid(tmp_path) -> None:
    """A connection seen from its first byte, with bytes lost in the middle: calls whose :path was an
    HPACK entry from before the gap are unresolved because of the gap, and the problem says so."""
    from capture.record import build_redactor
    from capture.recording import Flow, Recording, RecordingWriter
    from capture.sink import FlowSink
    from capture.summary import summarize

    conn = HpackConnection()
    before = conn.preface() + conn.call(M, [b"0"]) + conn.call(M, [b"1"])
    lost = conn.call(S, [b"2"])          # its entries reach the peers' tables, never the recording
    after = conn.call(M, [b"3"]) + conn.call(S, [b"4"])
    path = tmp_path / "gap.rec"
    writer = RecordingWriter(path)
    sink = FlowSink(writer, build_redactor(True, []))
    sink.open_flow("k", Flow(src=("127.0.0.1", 40000), dst=("127.0.0.1", 50051), opened_ns=1))
    for i, (d, data) in enumerate(before):
        sink.data("k", d, 100 + i, data)  # type: ignore[arg-type]
    sink.gap("k", "c2s", sum(len(b) for d, b in lost if d == "c2s"))
    sink.gap("k", "s2c", sum(len(b) for d, b in lost if d == "s2c"))
    for i, (d, data) in enumerate(after):
        sink.data("k", d, 200 + i, data)  # type: ignore[arg-type]
    sink.close_flow("k", 300)
    sink.close()
    writer.close()
    with Recording(path) as rec:
        summary = summarize(rec)
    assert summary["joined_flows"] == 0 and summary["unresolved_method_calls"] == 2
    problem = next(p for p in summary["problems"] if "unknown method" in p)
    assert "before a gap in the recorded bytes" in problem and "joined" not in problem


def test_http1_answers_to_requests_never_seen_are_dropped_not_paired_with_the_next() -> None:
    # A connection joined mid-stream: its first server bytes answer a request read before the capture
    # (here two answers, one with an interim 100 first). Paired with the next request, every answer on
    # the connection would shift by one; they are counted and dropped instead.
    from capture.decode.http1 import Http1Decoder

    dec = Http1Decoder(flow_id=1, joined=True)
    calls: list[Call] = []
    calls += dec.feed("s2c", 1, b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nold")
    calls += dec.feed("s2c", 2, b"HTTP/1.1 404 Not Found\r\nContent-Length: 4\r\n\r\nold2")
    for n in range(3):
        calls += dec.feed("c2s", 10 + n, b"GET /x/%d HTTP/1.1\r\nHost: t\r\n\r\n" % n)
        # a response that starts while its request is still being read is that request's (early answer)
        calls += dec.feed("s2c", 20 + n, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nnew-%d" % n)
    calls += dec.feed("c2s", 30, b"POST /y HTTP/1.1\r\nContent-Length: 4\r\n\r\nab")
    calls += dec.feed("s2c", 31, b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n")
    calls += dec.feed("c2s", 32, b"cd")
    calls += dec.finish()
    assert [(c.method, c.status, b"".join(m.data for m in c.responses)) for c in calls] == [
        ("GET /x/0", 200, b"new-0"), ("GET /x/1", 200, b"new-1"), ("GET /x/2", 200, b"new-2"),
        ("POST /y", 413, b"")]
    assert dec.unasked == 2
