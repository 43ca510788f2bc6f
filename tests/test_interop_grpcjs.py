"""Interop with @grpc/grpc-js (pure JavaScript; shares no code with grpcio or with this project).

1. grpc-js client -> the lean server (agent_under_test/h2server.py): tests/interop/node/client.js runs
   its scripted checks once against a raw-bytes service hosted here, and each test below asserts one
   check's exact outcome: the four call kinds, metadata both ways (a -bin key too), a deadline that
   expires, a client cancel that reaches the handler, 4 MiB messages both ways, status codes, keepalive
   pings on an idle connection, and GOAWAY at the maximum connection age with calls succeeding across it.
2. `shadowtest replay` (its default h2 sender) -> a grpc-js server (tests/interop/node/server.js): a
   recording of all four call kinds is replayed with --compare and every response matches.

Node and `tests/interop/node/node_modules` come from `make test` (scripts/setup.sh runs `npm ci`).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent_under_test.h2server import LeanServer
from capture.recording import Call, Flow, Message, RecordingWriter
from tests.polling import wait_for
from wire.process import spawn

ROOT = Path(__file__).resolve().parents[1]
NODE_DIR = ROOT / "tests" / "interop" / "node"
NODE = shutil.which("node")
SERVICE = "interop.Bytes"
MIB4 = 4 << 20
OK, CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, NOT_FOUND = 0, 1, 2, 4, 5
RESOURCE_EXHAUSTED, UNIMPLEMENTED = 8, 12


def _node_problem() -> str | None:
    if NODE is None:
        return "node is not installed (Node.js 18+ and npm are needed)"
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js" / "package.json").exists():
        return f"{NODE_DIR / 'node_modules'} is missing"
    return None


pytestmark = pytest.mark.skipif(
    _node_problem() is not None,
    reason=f"grpc-js interop: {_node_problem()}; run `make test` (scripts/setup.sh installs them: npm ci)")


# ---- the lean server, hosted on its own event loop thread ----------------------------------------------
class Service:
    """Raw-bytes handlers (see the method list at the top of client.js); what they saw is kept."""

    def __init__(self) -> None:
        # (first bytes of the request, peer, metadata) of each Echo call
        self.echoes: list[tuple[bytes, str, tuple[tuple[str, Any], ...]]] = []
        self.meta_seen: list[tuple[tuple[str, Any], ...]] = []
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.counted: list[tuple[int, int]] = []

    async def echo(self, request: bytes, ctx: Any) -> bytes:
        self.echoes.append((request[:32], ctx.peer(), ctx.invocation_metadata()))
        return request

    async def meta(self, request: bytes, ctx: Any) -> bytes:
        md = ctx.invocation_metadata()
        self.meta_seen.append(md)
        team = next((v for k, v in md if k == "x-team"), "")
        blob = next((v for k, v in md if k == "blob-bin"), b"")
        await ctx.send_initial_metadata((("x-initial", "hi"), ("x-team-echo", team)))
        ctx.set_trailing_metadata((("x-multi-seen", ",".join(v for k, v in md if k == "x-multi")),
                                   ("blob-bin", blob), ("trailer-bin", b"\xff\x00\x7f")))
        return b"meta:" + request

    async def initial_bin(self, request: bytes, ctx: Any) -> bytes:
        await ctx.send_initial_metadata((("x-initial", "hi"), ("init-bin", b"\x01\x02\xff")))
        return b"initial-bin"

    async def sleep(self, request: bytes, ctx: Any) -> bytes:
        tag, _, seconds = request.decode().partition(":")
        self.started.append(tag)
        try:
            await asyncio.sleep(float(seconds))
        except asyncio.CancelledError:
            self.cancelled.append(tag)
            raise
        return b"slept"

    async def big(self, request: bytes, ctx: Any) -> bytes:
        return bytes(range(256)) * (int(request) // 256)

    async def fail(self, request: bytes, ctx: Any) -> bytes:
        raise ValueError("handler bug")

    async def count(self, requests: AsyncIterator[bytes], ctx: Any) -> bytes:
        total = n = 0
        async for r in requests:
            total, n = total + len(r), n + 1
        self.counted.append((n, total))
        ctx.set_trailing_metadata((("count", str(n)),))
        return f"{n} {total}".encode()

    async def spray(self, request: bytes, ctx: Any) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            yield i.to_bytes(4, "big") * 25_000  # 100 kB each

    async def chat(self, requests: AsyncIterator[bytes], ctx: Any) -> AsyncIterator[bytes]:
        async for m in requests:
            yield b"re:" + m

    def register(self, server: LeanServer) -> None:
        server.add_registered_method_handlers(SERVICE, {
            "Echo": grpc.unary_unary_rpc_method_handler(self.echo),
            "Meta": grpc.unary_unary_rpc_method_handler(self.meta),
            "InitialBin": grpc.unary_unary_rpc_method_handler(self.initial_bin),
            "Sleep": grpc.unary_unary_rpc_method_handler(self.sleep),
            "Big": grpc.unary_unary_rpc_method_handler(self.big),
            "Fail": grpc.unary_unary_rpc_method_handler(self.fail),
            "Count": grpc.stream_unary_rpc_method_handler(self.count),
            "Spray": grpc.unary_stream_rpc_method_handler(self.spray),
            "Chat": grpc.stream_stream_rpc_method_handler(self.chat),
        })


class Hosted:
    """A LeanServer with a Service on 127.0.0.1 port 0, in its own thread and event loop."""

    def __init__(self, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_error)
        self.loop_errors: list[str] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = Service()
        self.server = LeanServer(**options)
        self.service.register(self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.call(self.server.start())

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.loop_errors.append(str(context.get("exception") or context.get("message")))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _json_line(text: str) -> dict[str, Any]:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON line in node's output:\n{text[-2000:]}"
    return json.loads(lines[-1])


# ---- 1. grpc-js client -> lean server ----------------------------------------------------------------
class ClientRun:
    def __init__(self, results: dict[str, Any], main: Hosted, aging: Hosted, stderr: str) -> None:
        self.results, self.main, self.aging, self.stderr = results, main, aging, stderr

    def check(self, name: str) -> dict[str, Any]:
        result = self.results[name]
        assert set(result) != {"error"}, f"{name} threw in node: {result['error']}"  # a check that threw
        return result


@pytest.fixture(scope="module")
def grpcjs() -> Iterator[ClientRun]:
    """client.js run once (about 5 s) against a plain lean server and one that ages connections out."""
    main, aging = Hosted(), Hosted(max_connection_age_s=0.5, grace_s=2.0)
    try:
        assert NODE is not None
        proc = subprocess.run([NODE, "client.js", "--target", main.address, "--aging-target", aging.address,
                               "--watchdog-ms", "45000"],
                              cwd=NODE_DIR, capture_output=True, text=True, timeout=60)
        results = _json_line(proc.stdout)
        assert "fatal" not in results, f"client.js failed: {results['fatal']}\n{proc.stderr[-2000:]}"
        assert proc.returncode == 0, proc.stderr[-2000:]
        yield ClientRun(results, main, aging, proc.stderr)
    finally:
        main.close()
        aging.close()


def test_unary_calls_echo_the_bytes(grpcjs: ClientRun) -> None:
    r = grpcjs.check("unary")
    assert (r["hello"], r["hello_code"], r["hello_error"]) == ("hello grpc-js", OK, None)
    assert (r["empty_len"], r["empty_code"], r["empty_error"]) == (0, OK, None)  # empty is still one message


def test_text_metadata_both_ways(grpcjs: ClientRun) -> None:
    r = grpcjs.check("metadata")
    assert (r["response"], r["code"], r["error"]) == ("meta:meta", OK, None)
    assert r["headers"] == {"content-type": ["application/grpc"], "x-initial": ["hi"], "x-team-echo": ["sre"]}
    assert r["trailers"]["x-multi-seen"] == ["one,two"]  # a repeated key arrives as two entries, in order
    assert r["trailers"]["trailer-bin"] == ["hex:ff007f"]  # a handler's -bin trailer (base64 on the wire)
    (seen,) = grpcjs.main.service.meta_seen
    assert ("x-team", "sre") in seen and [v for k, v in seen if k == "x-multi"] == ["one", "two"]
    assert (r["after"], r["after_code"]) == ("after", OK)


def test_binary_request_metadata_reaches_the_handler_as_bytes(grpcjs: ClientRun) -> None:
    """A -bin request value is base64 on the wire; grpc.aio hands the handler the decoded bytes (so an
    echo of it comes back as the same bytes). Checked against grpc.aio with this same client."""
    r = grpcjs.check("metadata")
    (seen,) = grpcjs.main.service.meta_seen
    blob = [v for k, v in seen if k == "blob-bin"]
    assert blob == [b"\x00\x01\x02\xff\xfe"], (
        f"the handler got blob-bin={blob!r}: the base64 text from the wire, not the decoded bytes")
    assert r["trailers"]["blob-bin"] == ["hex:000102fffe"], "the echoed -bin value was not the bytes sent"


def test_binary_initial_metadata_from_the_handler(grpcjs: ClientRun) -> None:
    """ctx.send_initial_metadata with a -bin key and a bytes value (as grpc.aio takes it)."""
    r = grpcjs.check("metadata")
    assert (r["initial_bin_code"], r["initial_bin_error"]) == (OK, None), (
        "a bytes -bin value in send_initial_metadata failed the call; grpc-js saw "
        f"{r['initial_bin_error']} (its HTTP/2 layer resets a response whose first HEADERS lacks :status)")
    assert r["initial_bin_response"] == "initial-bin"
    assert r["initial_bin_headers"] == {"content-type": ["application/grpc"], "x-initial": ["hi"],
                                        "init-bin": ["hex:0102ff"]}


def test_client_streaming_beyond_the_stream_window(grpcjs: ClientRun) -> None:
    r = grpcjs.check("client_stream")
    n, total = r["sent_messages"], r["sent_bytes"]
    assert (n, total) == (42, 3 + 40 * 65536)
    assert (r["response"], r["code"], r["error"]) == (f"{n} {total}", OK, None)
    assert r["trailers"] == {"count": [str(n)]}
    assert grpcjs.main.service.counted == [(n, total)]


def test_server_streaming_delivers_every_message_in_order(grpcjs: ClientRun) -> None:
    r = grpcjs.check("server_stream")
    assert (r["code"], r.get("error")) == (OK, None)
    assert r["indices"] == list(range(12)) and r["lengths"] == [100_000] * 12 and r["intact"]


def test_bidi_answers_each_message_while_the_request_stream_is_open(grpcjs: ClientRun) -> None:
    r = grpcjs.check("bidi")
    assert (r["code"], r.get("error")) == (OK, None)
    assert r["replies"] == ["re:alpha", "re:beta", "re:gamma", "re:delta", "re:xxxxx...(100003)"]


def test_deadline_expires_and_the_handler_is_cancelled(grpcjs: ClientRun) -> None:
    r = grpcjs.check("deadline")
    assert r["code"] == DEADLINE_EXCEEDED and r["error"]["code"] == DEADLINE_EXCEEDED
    assert r["ms"] < 2000
    service = grpcjs.main.service
    assert "deadline" in service.started
    assert wait_for(lambda: "deadline" in service.cancelled, 3.0), "the handler kept running past the deadline"


def test_client_cancel_reaches_the_handler(grpcjs: ClientRun) -> None:
    r = grpcjs.check("cancel")
    assert r["code"] == CANCELLED and r["error"]["details"] == "Cancelled on client"
    service = grpcjs.main.service
    assert "cancel" in service.started
    assert wait_for(lambda: "cancel" in service.cancelled, 3.0), "RST_STREAM(CANCEL) did not cancel the handler"


def test_4mib_messages_both_ways_and_one_byte_over_the_limit(grpcjs: ClientRun) -> None:
    r = grpcjs.check("large")
    assert (r["echo_code"], r["echo_error"], r["echo_sent"], r["echo_len"], r["echo_equal"]) == (
        OK, None, MIB4, MIB4, True)
    assert (r["big_code"], r["big_error"], r["big_len"], r["big_equal"]) == (OK, None, MIB4, True)
    assert r["over_code"] == RESOURCE_EXHAUSTED  # the lean server's default 4 MiB receive limit
    assert r["over_details"] == f"Received message larger than max ({MIB4 + 1} vs. {MIB4})"
    assert (r["after"], r["after_code"]) == ("after", OK)


def test_status_codes_for_a_failing_handler_and_an_unknown_method(grpcjs: ClientRun) -> None:
    r = grpcjs.check("errors")
    assert r["fail_code"] == UNKNOWN and "handler bug" in r["fail_details"]
    assert r["nope_code"] == UNIMPLEMENTED and r["nope_details"] == f"Method not found: /{SERVICE}/Nope"
    assert r["after"] == "still serving"


def test_keepalive_pings_keep_an_idle_connection_healthy(grpcjs: ClientRun) -> None:
    r = grpcjs.check("keepalive")
    assert (r["first"], r["first_code"], r["second"], r["second_code"]) == ("ka-1", OK, "ka-2", OK)
    assert r["pings_sent"] >= 2 and r["ping_acks"] == r["pings_sent"], r  # 1 s pings over 3.5 s idle
    assert r["ping_failures"] == [] and r["goaways"] == []
    assert r["states_while_idle"] == [] and r["state_after_idle"] == "READY"
    peers = {peer for head, peer, md in grpcjs.main.service.echoes if head in (b"ka-1", b"ka-2")}
    assert len(peers) == 1, f"the keepalive calls used {len(peers)} connections"


def test_goaway_at_max_connection_age_and_calls_succeed_across_it(grpcjs: ClientRun) -> None:
    r = grpcjs.check("goaway")
    assert r["calls"] >= 10 and r["ok"] == r["calls"] and r["failed"] == [], r["failed"]
    # 2.5 s of calls against a 0.5 s maximum age: GOAWAY (NO_ERROR) several times, each followed by a new
    # connection (a new client port) that the next call uses
    assert len(r["goaways"]) >= 2 and all("GOAWAY with code 0" in g for g in r["goaways"]), r["goaways"]
    peers = {peer for _, peer, _ in grpcjs.aging.service.echoes}
    assert len(peers) >= 2
    assert grpcjs.aging.loop_errors == [] and grpcjs.main.loop_errors == []


# ---- 2. shadowtest replay (h2 sender) -> grpc-js server ----------------------------------------------
REPLAY = "/interop.Replay/"
MS = 1_000_000


class _Recorder:
    """Calls to server.js with the answers it gives, spread over two recorded connections 20 ms apart."""

    def __init__(self, w: RecordingWriter) -> None:
        self.w = w
        self.flows = [w.add_flow(Flow(("127.0.0.1", 42000 + i), ("127.0.0.1", 50051), protocol="grpc"))
                      for i in range(2)]
        self.counts = {"Unary": 0, "ClientStream": 0, "ServerStream": 0, "Bidi": 0, "Fail": 0}
        self.expected: list[tuple[str, str]] = []  # (method, tag) of every call

    def add(self, method: str, kind: str, tag: str, requests: list[bytes], responses: list[bytes],
            status: int = OK, compressed: bool = False) -> None:
        i = len(self.expected)
        ts = 10_000_000_000 + i * 20 * MS
        self.counts[method] += 1
        self.expected.append((method, tag))
        # user-agent is hop-by-hop and -bin values are not replayed: neither may reach the server
        metadata = [("x-replay-tag", tag), ("user-agent", "grpc-node-js/1.14.7"), ("trace-bin", "AAE=")]
        self.w.add_call(Call(
            protocol="grpc", method=REPLAY + method, request_ts_ns=ts, flow_id=self.flows[i % 2], kind=kind,
            request_metadata=metadata, status=status,
            requests=[Message("c2s", j, ts + j * 5 * MS, r, compressed) for j, r in enumerate(requests)],
            responses=[Message("s2c", j, ts + j * 5 * MS + 1000, r) for j, r in enumerate(responses)]))


def _write_replay_recording(path: Path) -> _Recorder:
    with RecordingWriter(path, meta={"host": "interop"}) as w:
        rec = _Recorder(w)
        for k in range(6):
            body = f"payload-{k}".encode() + bytes([0, 255, k])
            rec.add("Unary", "unary", f"u{k}", [body], [b"unary:u%d:" % k + body])
        big = bytes(range(256)) * 8192  # 2 MiB: far beyond grpc-js's 64 KiB initial windows, both ways
        rec.add("Unary", "unary", "big", [big], [b"unary:big:" + big])
        rec.add("Unary", "unary", "gz", [gzip.compress(b"zipped")], [b"unary:gz:zipped"], compressed=True)
        for k in range(3):
            parts = [b"c%d-%d" % (k, j) for j in range(3)]
            rec.add("ClientStream", "client_stream", f"c{k}", parts,
                    [b"client:c%d:3:" % k + b"|".join(parts)])
            req = b"s%d" % k
            rec.add("ServerStream", "server_stream", f"s{k}", [req],
                    [b"server:%d:s%d:" % (j, k) + req for j in range(3)])
            msgs = [b"b%d-%d" % (k, j) for j in range(4)]
            rec.add("Bidi", "bidi", f"b{k}", msgs, [b"bidi:%d:" % j + m for j, m in enumerate(msgs)])
        rec.add("Fail", "unary", "f", [b"widget"], [], status=NOT_FOUND)
    return rec


def _shadowtest() -> list[str]:
    script = Path(sys.executable).parent / "shadowtest"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from harness.cli import main; main()"]


def test_replay_into_a_grpcjs_server_matches_the_recording(tmp_path: Path) -> None:
    rec = _write_replay_recording(tmp_path / "r.rec")
    total = len(rec.expected)
    assert NODE is not None
    server = spawn([NODE, "server.js", "--max-seconds", "60"], cwd=str(NODE_DIR), stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        first = _json_line(server.stdout.readline())
        assert "port" in first, first
        cmd = [*_shadowtest(), "replay", str(tmp_path / "r.rec"), "--target", f"127.0.0.1:{first['port']}",
               "--compare", "--descriptors", "bytes", "--timeout", "5", "--json", "-"]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "NO_COLOR": "1"})
        out, _ = server.communicate(timeout=10)  # closes stdin: server.js prints what it saw and exits
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(5)
    assert res.returncode == 0, (
        f"shadowtest replay exited {res.returncode}:\n{res.stdout}\n{res.stderr[-3000:]}")
    report = json.loads(res.stdout)
    assert report["scheduled"] == report["sent"] == total, report["not_sent_reasons"]
    assert report["ok"] == total - 1 and report["errors"] == {"NOT_FOUND": 1}, report
    assert (report["rejected"], report["timeouts"], report["not_sent"]) == (0, 0, 0)
    assert report["invariant_ok"] and report["problems"] == []
    mism = report["mismatches"]
    assert mism["total"] == 0, mism  # every response (and the Fail status) equals the recorded one
    assert {m.rsplit("/", 1)[1]: e["compared"] for m, e in mism["by_method"].items()} == rec.counts

    seen = _json_line(out)["calls"]
    assert sorted((c["method"], c["tag"]) for c in seen) == sorted(rec.expected)
    assert all(c["user_agent"].startswith("shadowtest-h2/") for c in seen), {c["user_agent"] for c in seen}
    # the recorded metadata, the sender's user-agent and the replay marker (on by default), nothing else
    keys = ["user-agent", "x-replay-tag", "x-shadowtest-replay"]
    assert all(c["keys"] == keys for c in seen), {tuple(c["keys"]) for c in seen}
    assert all(0 < c["deadline_left_ms"] <= 5_100 for c in seen)  # grpc-timeout from --timeout 5
    by_tag = {c["tag"]: c for c in seen}
    assert by_tag["big"]["bytes"] == 2 << 20 and by_tag["gz"]["bytes"] == len(b"zipped")
    assert [by_tag[f"c{k}"]["messages"] for k in range(3)] == [3, 3, 3]
    assert [by_tag[f"b{k}"]["messages"] for k in range(3)] == [4, 4, 4]
