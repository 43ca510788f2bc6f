"""Method inference for joined connections: strict wire checks, shape, exactly-one-fits, the sources
(protoset, modules, a real server's reflection) and the `shadowtest infer` / record-stop paths."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from agent_under_test.proto import agent_pb2
from capture.recording import Call, Flow, Message, Recording, RecordingWriter
from harness.cli import cli
from harness.infer import MAX_DEPTH, Source, check_message, infer_group, load_source, methods_of_services
from replay.testing import DECIDE, DECIDE_STREAM, EchoServer, decision_bytes, snapshot_bytes

AGENT = agent_pb2.DESCRIPTOR.services_by_name["TradingAgent"]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
# The agent's service beside grpc's health and reflection services: 6 methods.
FULL = Source("test", tuple(methods_of_services([AGENT, HEALTH, REFLECTION])))
SNAPSHOT = agent_pb2.MarketSnapshot.DESCRIPTOR


@dataclass(frozen=True)
class Msg:
    data: bytes
    compressed: bool = False


@dataclass
class FakeCall:
    requests: list[Msg]
    responses: list[Msg]


@dataclass(frozen=True)
class Group:
    kinds: dict[str, int]
    flow_id: int = 1
    ref: str = "hpack:5"
    protocol: str = "grpc"
    calls: int = field(default=0)


def _unary(n: int, req: bytes | None = None, resp: bytes | None = None) -> list[FakeCall]:
    return [FakeCall([Msg(snapshot_bytes(i) if req is None else req)], [Msg(decision_bytes(i) if resp is None else resp)])
            for i in range(n)]


def _field(number: int, wire: int) -> bytes:
    return bytes([number << 3 | wire])


def _a_pool() -> descriptor_pool.DescriptorPool:
    """agent.proto plus a.proto: service a.S with Decide and Other (both MarketSnapshot -> Decision),
    Widen (Wide -> Decision), and a recursive Node."""
    pool = descriptor_pool.DescriptorPool()
    agent = descriptor_pb2.FileDescriptorProto()
    agent_pb2.DESCRIPTOR.CopyToProto(agent)
    pool.Add(agent)
    f = descriptor_pb2.FileDescriptorProto(name="a.proto", package="a", syntax="proto3", dependency=[agent.name])
    t = descriptor_pb2.FieldDescriptorProto
    wide = f.message_type.add(name="Wide")
    wide.field.add(name="sequence_id", number=1, type=t.TYPE_UINT64, label=t.LABEL_OPTIONAL)
    wide.field.add(name="symbol", number=2, type=t.TYPE_STRING, label=t.LABEL_OPTIONAL)
    wide.field.add(name="extra", number=9, type=t.TYPE_UINT32, label=t.LABEL_OPTIONAL)
    wide.field.add(name="ids", number=10, type=t.TYPE_INT32, label=t.LABEL_REPEATED)
    node = f.message_type.add(name="Node")
    node.field.add(name="child", number=1, type=t.TYPE_MESSAGE, type_name=".a.Node", label=t.LABEL_OPTIONAL)
    svc = f.service.add(name="S")
    for name, inp in (("Decide", ".shadowtest.agent.v1.MarketSnapshot"), ("Other", ".shadowtest.agent.v1.MarketSnapshot"),
                      ("Widen", ".a.Wide")):
        svc.method.add(name=name, input_type=inp, output_type=".shadowtest.agent.v1.Decision")
    pool.Add(f)
    return pool


A_POOL = _a_pool()
A = Source("test", tuple(methods_of_services([A_POOL.FindServiceByName("a.S")])))


# -- the strict wire walk ----------------------------------------------------------------------------

def test_unknown_field_number_is_refused_where_parse_from_string_accepts_it() -> None:
    data = agent_pb2.MarketSnapshot(sequence_id=1, symbol="ACME").SerializeToString() + _field(9, 0) + b"\x07"
    agent_pb2.MarketSnapshot.FromString(data)   # the runtime keeps it as an unknown field: not enough
    assert check_message(data, SNAPSHOT) == "field 9 is not in shadowtest.agent.v1.MarketSnapshot"
    assert check_message(data, A_POOL.FindMessageTypeByName("a.Wide")) is None


def test_wire_types_packed_nested_truncated_groups_and_depth() -> None:
    wide = A_POOL.FindMessageTypeByName("a.Wide")
    assert check_message(snapshot_bytes(3), SNAPSHOT) is None
    assert check_message(b"", SNAPSHOT) is None                                   # empty: any type
    assert check_message(_field(10, 2) + b"\x03\x01\x02\x03", wide) is None        # packed repeated
    assert check_message(_field(10, 0) + b"\x01", wide) is None                    # unpacked repeated
    assert check_message(_field(9, 2) + b"\x01\x01", wide) == "a.Wide.extra sent as wire type 2, declared VARINT"
    assert check_message(_field(6, 5) + b"\0\0\0\0", SNAPSHOT) == \
        "shadowtest.agent.v1.MarketSnapshot.position sent as wire type 5, declared I64"
    assert check_message(_field(2, 2) + b"\x02\xff\xfe", SNAPSHOT) == \
        "shadowtest.agent.v1.MarketSnapshot.symbol is not valid UTF-8"
    assert check_message(_field(2, 2) + b"\x09ab", SNAPSHOT) == "truncated: 9 bytes wanted at byte 2 of 4"
    assert check_message(_field(1, 3), SNAPSHOT) == \
        "shadowtest.agent.v1.MarketSnapshot.sequence_id sent as wire type 3, declared VARINT"
    level = _field(7, 0) + b"\x01"                                                 # BookLevel has no field 7
    assert check_message(_field(3, 2) + bytes([len(level)]) + level, SNAPSHOT) == \
        "field 7 is not in shadowtest.agent.v1.BookLevel"
    assert check_message(_field(1, 2) + b"\x80", A_POOL.FindMessageTypeByName("a.Node")) == "bad varint at byte 1"


def test_nesting_beyond_the_bound_is_refused() -> None:
    node = A_POOL.FindMessageTypeByName("a.Node")
    nested = b""
    for _ in range(MAX_DEPTH):
        nested = _field(1, 2) + _varint(len(nested)) + nested
    assert check_message(nested, node) is None                    # the bound itself is fine
    deeper = _field(1, 2) + _varint(len(nested)) + nested
    assert check_message(deeper, node) == f"nested deeper than {MAX_DEPTH}"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


# -- one group against the agent's service, grpc health and reflection --------------------------------

def test_unary_group_is_decide() -> None:
    got = infer_group(Group({"unary": 5}), _unary(5), FULL)
    assert (got.flow_id, got.ref, got.method, got.candidates) == (1, "hpack:5", DECIDE, ())
    assert got.how == ("test: unary shape, 10 messages parsed, 1 of 6 methods fits exactly "
                       f"(streaming {DECIDE_STREAM} admits it too)")


def test_streaming_group_is_decide_stream() -> None:
    calls = [FakeCall([Msg(snapshot_bytes(i)) for i in range(3)], [Msg(decision_bytes(i)) for i in range(3)])
             for _ in range(2)]
    got = infer_group(Group({"bidi": 2}), calls, FULL)
    assert (got.method, got.how) == (DECIDE_STREAM, "test: bidi shape, 12 messages parsed, 1 of 6 methods fits")


def test_a_server_stream_shaped_group_fits_only_the_bidi_method() -> None:
    calls = [FakeCall([Msg(snapshot_bytes(i))], [Msg(decision_bytes(i)) for _ in range(3)]) for i in range(2)]
    got = infer_group(Group({"server_stream": 2}), calls, FULL)
    assert (got.method, got.how) == (DECIDE_STREAM, "test: server_stream shape, 8 messages parsed, "
                                                    "1 of 6 methods fits (as bidi)")


def test_two_methods_of_one_shape_and_types_stay_unknown_with_both() -> None:
    got = infer_group(Group({"unary": 3}), _unary(3), A)
    assert (got.method, got.candidates) == (None, ("/a.S/Decide", "/a.S/Other"))
    assert got.how == "test: 2 methods fit: /a.S/Decide, /a.S/Other (unary shape, 6 messages parsed)"


def test_an_unknown_field_number_rules_a_method_out() -> None:
    req = agent_pb2.MarketSnapshot(sequence_id=1, symbol="ACME").SerializeToString() + _field(9, 0) + b"\x07"
    got = infer_group(Group({"unary": 2}), _unary(2, req=req), A)
    assert (got.method, got.how) == ("/a.S/Widen", "test: unary shape, 4 messages parsed, 1 of 3 methods fits")


def test_a_wrong_wire_type_rules_a_method_out() -> None:
    req = agent_pb2.MarketSnapshot(sequence_id=1).SerializeToString() + _field(6, 5) + b"\0\0\0\0"
    got = infer_group(Group({"unary": 1}), _unary(1, req=req), FULL)
    assert got.method is None and got.candidates == ()
    assert got.how == (
        "test: no method of 6 fits (unary shape, 2 messages checked): "
        f"{DECIDE}: request shadowtest.agent.v1.MarketSnapshot.position sent as wire type 5, declared I64; "
        f"{DECIDE_STREAM}: request shadowtest.agent.v1.MarketSnapshot.position sent as wire type 5, declared I64; "
        "/grpc.health.v1.Health/Check: request grpc.health.v1.HealthCheckRequest.service sent as wire type 0, "
        "declared LEN; /grpc.health.v1.Health/List: request field 1 is not in grpc.health.v1.HealthListRequest")


def test_a_compressed_only_sample_stays_unknown_and_says_why() -> None:
    calls = [FakeCall([Msg(b"\x1f\x8b zipped", True)], [Msg(b"\x1f\x8b zipped too", True)]) for _ in range(2)]
    got = infer_group(Group({"unary": 2}), calls, FULL)
    assert got.method is None and len(got.candidates) == 6
    assert got.how == (f"test: 4 compressed messages cannot be checked; 6 methods admit the unary shape: {DECIDE}, "
                       f"{DECIDE_STREAM}, /grpc.health.v1.Health/Check, /grpc.health.v1.Health/List +2 more")


def test_empty_messages_count_for_nothing() -> None:
    got = infer_group(Group({"unary": 2}), _unary(2, req=b""), FULL)
    assert (got.method, got.how) == (DECIDE, "test: unary shape, 2 messages parsed, 1 of 6 methods fits exactly "
                                             f"(streaming {DECIDE_STREAM} admits it too)")
    nothing = infer_group(Group({"unary": 1}), _unary(1, req=b"", resp=b""), FULL)
    assert nothing.method is None and nothing.how.startswith("test: no message to check (2 empty); 6 methods admit")


def test_http2_groups_are_left_to_the_method_map() -> None:
    got = infer_group(Group({"unary": 1}, flow_id=4, ref="hpack:2", protocol="http2"), _unary(1), FULL)
    assert (got.method, got.how) == (None, "http2 calls: descriptors do not apply; name them with "
                                           "--method-map 4:hpack:2=PATH")


def test_modules_source_lists_their_services() -> None:
    src = load_source("agent_under_test.proto.agent_pb2,grpc_health.v1.health_pb2")
    assert src.label == "modules agent_under_test.proto.agent_pb2,grpc_health.v1.health_pb2"
    assert [m.path for m in src.methods] == [DECIDE, DECIDE_STREAM, "/grpc.health.v1.Health/Check",
                                             "/grpc.health.v1.Health/List", "/grpc.health.v1.Health/Watch"]


# -- recordings, the CLI and the record-stop hook ------------------------------------------------------

TS = 10_000_000_000


def _joined_recording(path: Path, server: tuple[str, int] = ("127.0.0.1", 50051)) -> None:
    """Flow 1: a unary group (hpack:5, 3 calls) and a bidi group (hpack:6); flow 2: a group whose
    messages are all compressed (hpack:5). Every call's method is unknown, as on a joined connection."""
    with RecordingWriter(path, meta={"host": "test"}) as w:
        f1 = w.add_flow(Flow(("127.0.0.1", 40001), server, joined_midstream=True, protocol="grpc"))
        f2 = w.add_flow(Flow(("127.0.0.1", 40002), server, joined_midstream=True, protocol="grpc"))
        for i in range(3):
            t = TS + i * 1_000_000
            w.add_call(Call("grpc", None, t, flow_id=f1, method_unknown=True, method_ref="hpack:5", status=0,
                            requests=[Message("c2s", 0, t, snapshot_bytes(i))],
                            responses=[Message("s2c", 0, t + 1000, decision_bytes(i))]))
        t = TS + 5_000_000
        w.add_call(Call("grpc", None, t, flow_id=f1, kind="bidi", method_unknown=True, method_ref="hpack:6",
                        status=0, requests=[Message("c2s", i, t + i * 1000, snapshot_bytes(i)) for i in range(3)],
                        responses=[Message("s2c", i, t + i * 1000 + 500, decision_bytes(i)) for i in range(3)]))
        t = TS + 7_000_000
        w.add_call(Call("grpc", None, t, flow_id=f2, method_unknown=True, method_ref="hpack:5", status=0,
                        requests=[Message("c2s", 0, t, b"zz", True)], responses=[Message("s2c", 0, t + 500, b"zz", True)]))


def _protoset(path: Path) -> Path:
    fds = descriptor_pb2.FileDescriptorSet()
    agent_pb2.DESCRIPTOR.CopyToProto(fds.file.add())
    path.write_bytes(fds.SerializeToString())
    return path


def _groups(path: Path) -> dict[tuple[int, str], tuple[str | None, str | None]]:
    with Recording(path) as rec:
        return {(g.flow_id, g.ref): (g.method, g.how) for g in rec.method_groups()}


PROTOSET_HOW = ("protoset agent.protoset: unary shape, 6 messages parsed, 1 of 2 methods fits exactly "
                f"(streaming {DECIDE_STREAM} admits it too)")


def test_cli_infers_from_a_protoset_and_writes_the_map(tmp_path: Path) -> None:
    rec, protoset = tmp_path / "r.rec", _protoset(tmp_path / "agent.protoset")
    _joined_recording(rec)
    res = CliRunner().invoke(cli, ["infer", str(rec), "--descriptors", str(protoset), "--json"])
    assert res.exit_code == 1, res.output          # flow 2's group stays unknown
    data = json.loads(res.stdout)
    rows = {(g["flow"], g["ref"]): (g["method"], g["how"], g["calls"], g["kinds"]) for g in data["groups"]}
    assert rows[(1, "hpack:5")] == (DECIDE, PROTOSET_HOW, 3, {"unary": 3})
    assert rows[(1, "hpack:6")] == (DECIDE_STREAM, "protoset agent.protoset: bidi shape, 6 messages parsed, "
                                                   "1 of 2 methods fits", 1, {"bidi": 1})
    assert rows[(2, "hpack:5")][:2] == (None, "protoset agent.protoset: 2 compressed messages cannot be checked; "
                                              f"2 methods admit the unary shape: {DECIDE}, {DECIDE_STREAM}")
    assert data["unknown_groups"] == 1
    assert _groups(rec) == {(1, "hpack:5"): (DECIDE, PROTOSET_HOW),
                            (1, "hpack:6"): (DECIDE_STREAM, rows[(1, "hpack:6")][1]), (2, "hpack:5"): (None, None)}
    # The remaining group by hand: every group known, exit 0.
    res = CliRunner().invoke(cli, ["infer", str(rec), "--method-map", f"2:hpack:5={DECIDE}"])
    assert res.exit_code == 0, res.output
    assert _groups(rec)[(2, "hpack:5")] == (DECIDE, "--method-map")
    assert "assigned 1 of 3 groups; 0 unknown" in res.output


def test_cli_dry_run_writes_nothing_and_usage_errors_exit_2(tmp_path: Path) -> None:
    rec, protoset = tmp_path / "r.rec", _protoset(tmp_path / "agent.protoset")
    _joined_recording(rec)
    res = CliRunner().invoke(cli, ["infer", str(rec), "--descriptors", str(protoset), "--dry-run"])
    assert res.exit_code == 1
    assert "would assign 2 of 3 groups; 1 unknown" in res.output and "--method-map FLOW:REF" in res.output
    assert all(m is None for m, _ in _groups(rec).values())
    for args in ([], ["--descriptors", str(tmp_path / "missing.protoset")], ["--method-map", f"9:hpack:5={DECIDE}"],
                 ["--descriptors", "reflection=192.0.2.1:50051"]):
        res = CliRunner().invoke(cli, ["infer", str(rec), *args])
        assert res.exit_code == 2, (args, res.output)


def test_cli_infers_from_a_real_servers_reflection(tmp_path: Path) -> None:
    rec = tmp_path / "r.rec"
    _joined_recording(rec)
    with EchoServer(reflection=True) as server:
        res = CliRunner().invoke(cli, ["infer", str(rec), "--descriptors", f"reflection={server.address}"])
    assert res.exit_code == 1, res.output
    # The echo server offers TradingAgent and the reflection service itself: 3 methods.
    label = f"reflection {server.address}"
    assert _groups(rec) == {
        (1, "hpack:5"): (DECIDE, f"{label}: unary shape, 6 messages parsed, 1 of 3 methods fits exactly "
                                 f"(streaming {DECIDE_STREAM} admits it too)"),
        (1, "hpack:6"): (DECIDE_STREAM, f"{label}: bidi shape, 6 messages parsed, 1 of 3 methods fits"),
        (2, "hpack:5"): (None, None)}


def test_record_stop_asks_the_recorded_servers_reflection(tmp_path: Path) -> None:
    from harness.commands.record import _name_methods

    rec = tmp_path / "r.rec"
    with EchoServer(reflection=True) as server:
        _joined_recording(rec, ("127.0.0.1", server.port))
        out = _name_methods(str(rec), None, reflection=True)["method_inference"]
    assert isinstance(out, dict)
    assert [(g["flow"], g["ref"], g["method"]) for g in out["inferred"]] == [(1, "hpack:5", DECIDE),
                                                                          (1, "hpack:6", DECIDE_STREAM)]
    assert out["inferred"][1]["how"] == f"reflection {server.address}: bidi shape, 6 messages parsed, 1 of 3 methods fits"
    assert [(g["flow"], g["ref"]) for g in out["unknown"]] == [(2, "hpack:5")] and out["notes"] == []
    assert _groups(rec)[(1, "hpack:5")][0] == DECIDE


def test_record_stop_without_reflection_says_so_and_uses_descriptors(tmp_path: Path) -> None:
    from harness.commands.record import _name_methods

    rec, protoset = tmp_path / "r.rec", _protoset(tmp_path / "agent.protoset")
    with EchoServer() as server:               # no reflection
        _joined_recording(rec, ("127.0.0.1", server.port))
        out = _name_methods(str(rec), str(protoset), reflection=True)["method_inference"]
    assert isinstance(out, dict)
    assert len(out["notes"]) == 1 and out["notes"][0].startswith(f"reflection not available at {server.address}: ")
    assert _groups(rec)[(1, "hpack:5")] == (DECIDE, PROTOSET_HOW)


def test_record_stop_does_not_ask_another_hosts_server(tmp_path: Path) -> None:
    from harness.commands.record import _name_methods

    rec = tmp_path / "r.rec"
    _joined_recording(rec, ("192.0.2.1", 50051))     # TEST-NET: neither loopback, ours, nor allowed
    out = _name_methods(str(rec), None, reflection=True)["method_inference"]
    assert isinstance(out, dict) and len(out["unknown"]) == 3 and not out["inferred"]
    assert out["notes"][0].startswith("reflection not available at 192.0.2.1:50051: cannot ask")


@pytest.mark.parametrize("spec", ["nope.protoset", "no_such_module_pb2"])
def test_record_refuses_bad_descriptors_before_recording(spec: str) -> None:
    res = CliRunner().invoke(cli, ["record", "--backend", "proxy", "--descriptors", spec, "-o", "/nonexistent/x.rec"])
    assert res.exit_code == 2 and "--descriptors" in res.output


def test_replay_names_groups_from_the_targets_reflection_for_that_replay_only(tmp_path: Path) -> None:
    rec = tmp_path / "r.rec"
    with EchoServer(reflection=True) as server:
        _joined_recording(rec, ("127.0.0.1", server.port))
        res = CliRunner().invoke(cli, ["replay", str(rec), "--target", server.address, "--json", str(tmp_path / "o.json")])
        received = sorted(m for _, m, _ in server.received)
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "o.json").read_text())
    assert (data["scheduled"], data["ok"], data["not_sent"]) == (5, 4, 1)
    assert data["not_sent_reasons"] == {"unknown_method": 1}            # compressed: nothing could be checked
    assert received == ["Decide"] * 3 + ["DecideStream"] * 3
    label = f"reflection {server.address}"
    assert (f"methods (this replay only): flow 1 hpack:6 (1 calls): {DECIDE_STREAM}: {label}: bidi shape, "
            "6 messages parsed, 1 of 3 methods fits") in res.stderr
    assert "methods (this replay only): flow 2 hpack:5 (1 calls): unknown: " in res.stderr
    assert all(m is None for m, _ in _groups(rec).values())              # the file is unchanged


def test_replay_without_reflection_sends_nothing_blind(tmp_path: Path) -> None:
    rec = tmp_path / "r.rec"
    with EchoServer() as server:
        _joined_recording(rec, ("127.0.0.1", server.port))
        res = CliRunner().invoke(cli, ["replay", str(rec), "--target", server.address, "--json", str(tmp_path / "o.json")])
        assert not server.received
    assert res.exit_code == 99, res.output          # nothing succeeded, and the run says why
    data = json.loads((tmp_path / "o.json").read_text())
    assert (data["scheduled"], data["not_sent"], data["not_sent_reasons"]) == (5, 5, {"unknown_method": 5})
    assert data["failures"] == ["no call succeeded: 0 ok of 5 scheduled; not sent: unknown_method 5"]
    assert "methods: 3 groups of calls of unknown method are not sent; reflection not available" in res.stderr


def test_a_joined_connection_decoded_for_real_gets_every_method_right(tmp_path: Path) -> None:
    """The decoder's own groups: Decide and DecideStream (one request type) used before the join, a
    health check, and a method first used after it; `infer` from the generated modules names each."""
    from capture.decode import FlowDecoder
    from capture.testing import HpackConnection

    check = "/grpc.health.v1.Health/Check"
    conn = HpackConnection()
    conn.preface()
    for path in (DECIDE, DECIDE_STREAM, check):      # the recorder never sees these: they fill the table
        conn.call(path)
    parts, truth = [], []
    for i in range(9):
        path = (DECIDE, DECIDE_STREAM, check)[i % 3]
        n = 3 if path == DECIDE_STREAM else 1
        req = health_pb2.HealthCheckRequest(service=f"s{i}").SerializeToString() if path == check else snapshot_bytes(i)
        resp = health_pb2.HealthCheckResponse(status=1).SerializeToString() if path == check else decision_bytes(i)
        parts += conn.call(path, [req] * n, [resp] * n)
        truth.append(path)
    parts += conn.call("/new.Svc/First", [b"x"])       # first used after the join: a literal :path
    dec = FlowDecoder(flow_id=1, joined=True)
    calls = [c for i, (d, data) in enumerate(parts) for c in dec.feed(d, TS + i * 1000, data)] + dec.finish()  # type: ignore[arg-type]
    rec = tmp_path / "r.rec"
    with RecordingWriter(rec, meta={"host": "test"}) as w:
        fid = w.add_flow(Flow(("127.0.0.1", 40001), ("127.0.0.1", 50051), joined_midstream=True, protocol="grpc"))
        for c in calls:
            c.flow_id = fid
            w.add_call(c)
    res = CliRunner().invoke(cli, ["infer", str(rec), "--descriptors",
                                   "agent_under_test.proto.agent_pb2,grpc_health.v1.health_pb2"])
    assert res.exit_code == 0, res.output
    with Recording(rec) as r:
        got = [c.method for c in r.calls()]
        groups = {g.method: g.how for g in r.method_groups()}
    assert got == truth + ["/new.Svc/First"]
    label = "modules agent_under_test.proto.agent_pb2,grpc_health.v1.health_pb2"
    assert groups == {
        DECIDE: f"{label}: unary shape, 6 messages parsed, 1 of 5 methods fits exactly (streaming {DECIDE_STREAM} "
                "admits it too)",
        DECIDE_STREAM: f"{label}: bidi shape, 18 messages parsed, 1 of 5 methods fits",
        check: f"{label}: unary shape, 6 messages parsed, 1 of 5 methods fits exactly (streaming "
               "/grpc.health.v1.Health/Watch admits it too)"}
