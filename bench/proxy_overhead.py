"""Proxy overhead: the embedded Toxiproxy-compatible proxy (no toxics) against a direct connection.

Three processes: an asyncio echo/sink server, the proxy (`faults.proxy.main`), and this client.
  1. latency: 64-byte requests paced at 1,000/s on one connection, round trip p50/p99, direct
     and through the proxy; the difference is the proxy's added latency per request.
  2. bulk: N MiB pushed through one connection into a sink, MB/s direct and through the proxy.
Targets (issue 6): at most 150 us added p50, at least 300 MB/s bulk; issue 28: at most 20 us added p50,
bulk at least 0.8 of direct. Toxiproxy itself (Go) is measured the same way as a peer when
`toxiproxy-server` is on PATH (else the run says it has no peer). The proxy's own count of how it moved
the bytes (fast path, of which spliced, or chunk path; `GET /proxies/bench/flows`) is printed last.

On a shared host the load changes within seconds, so the targets are measured in `--rounds` interleaved
rounds (direct, proxied, [toxiproxy], [floor], then again): latency percentiles pool every round's
samples, bulk reports the median MB/s and the median of the rounds' proxied/direct ratios. `--floor`
adds a bare forwarder (a plain Python epoll loop, recv_into/send, no asyncio) as the cost of the extra
process hop alone: what any user-space proxy on this host pays before its own work.

    .venv/bin/python bench/proxy_overhead.py [--requests 3000] [--mib 256] [--rounds 3] [--floor]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wire.process import free_port  # noqa: E402
from wire.stats import percentiles  # noqa: E402


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = transport
        self.sink = False
        self.count = 0

    def data_received(self, data: bytes) -> None:
        if not self.sink and self.count == 0 and data.startswith(b"SINK"):
            self.sink = True
        if self.sink:
            self.count += len(data)
        else:
            self.t.write(data)  # type: ignore[attr-defined]

    def eof_received(self) -> bool:
        if self.sink:
            self.t.write(str(self.count).encode())  # type: ignore[attr-defined]
        self.t.close()
        return False


async def _serve() -> None:
    server = await asyncio.get_running_loop().create_server(_Echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


def _forward(upstream_port: int) -> None:
    """The floor: a bare epoll forwarder (one thread, no asyncio, no chunks), blocking when a send is short."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)
    print(ls.getsockname()[1], flush=True)
    ep = select.epoll()
    ep.register(ls.fileno(), select.EPOLLIN)
    socks: dict[int, socket.socket] = {}
    peer: dict[int, socket.socket] = {}
    buf = bytearray(1 << 18)
    view = memoryview(buf)
    while True:
        for fd, _ in ep.poll():
            if fd == ls.fileno():
                c, _ = ls.accept()
                u = socket.create_connection(("127.0.0.1", upstream_port))
                for a, b in ((c, u), (u, c)):
                    a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    a.setblocking(False)
                    socks[a.fileno()], peer[a.fileno()] = a, b
                    ep.register(a.fileno(), select.EPOLLIN)
                continue
            try:
                n = socks[fd].recv_into(buf)
            except BlockingIOError:
                continue
            except OSError:
                n = 0
            out = peer[fd]
            if not n:
                ep.unregister(fd)
                try:
                    out.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                continue
            try:
                sent = out.send(view[:n])
            except BlockingIOError:
                sent = 0
            if sent < n:
                out.setblocking(True)
                out.sendall(view[sent:n])
                out.setblocking(False)


def _latency(port: int, n: int, rate: float) -> list[float]:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg, out = b"x" * 64, []
    start = time.perf_counter()
    for i in range(n):
        due = start + i / rate
        while (now := time.perf_counter()) < due:
            if due - now > 0.0005:
                time.sleep(due - now - 0.0003)
        t0 = time.perf_counter()
        s.sendall(msg)
        got = 0
        while got < 64:
            got += len(s.recv(64 - got))
        out.append(time.perf_counter() - t0)
    s.close()
    return out


def _bulk(port: int, mib: int) -> float:
    s = socket.create_connection(("127.0.0.1", port))
    block = b"SINK" + bytes(1024 * 1024 - 4)
    t0 = time.perf_counter()
    for _ in range(mib):
        s.sendall(block)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while data := s.recv(100):
        reply += data
    took = time.perf_counter() - t0
    assert int(reply) == mib * 1024 * 1024, reply
    s.close()
    return mib * 1024 * 1024 / took / 1e6


def _pct(xs: list[float], q: float) -> float:
    return percentiles(xs, (q,))[q] * 1e6


def _create(url: str, upstream_port: int) -> int:
    req = urllib.request.Request(url + "/proxies", method="POST", data=json.dumps(
        {"name": "bench", "listen": "127.0.0.1:0", "upstream": f"127.0.0.1:{upstream_port}"}).encode())
    with urllib.request.urlopen(req) as r:
        return int(json.loads(r.read())["listen"].rsplit(":", 1)[1])



def _toxiproxy(echo_port: int) -> tuple[subprocess.Popen[bytes], int] | None:
    """toxiproxy-server on a free port with a proxy to the echo server; None when it is not installed."""
    exe = shutil.which("toxiproxy-server")
    if exe is None:
        return None
    api = free_port()
    proc = subprocess.Popen([exe, "-host", "127.0.0.1", "-port", str(api)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{api}/version", timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    # Toxiproxy answers with the listen address it was given: ask for a free port, not port 0
    req = urllib.request.Request(f"http://127.0.0.1:{api}/proxies", method="POST", data=json.dumps(
        {"name": "bench", "listen": f"127.0.0.1:{free_port()}", "upstream": f"127.0.0.1:{echo_port}"}).encode())
    with urllib.request.urlopen(req) as r:
        return proc, int(json.loads(r.read())["listen"].rsplit(":", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000, help="latency requests per target, over all rounds")
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--mib", type=int, default=256, help="bulk MiB per target and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (1: the old back-to-back run)")
    ap.add_argument("--floor", action="store_true", help="also measure a bare Python epoll forwarder")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--forward", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return asyncio.run(_serve())
    if args.forward:
        return _forward(args.forward)
    from faults.proxy import spawn_proxy_server

    echo = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    peer: tuple[subprocess.Popen[bytes], int] | None = None
    floor: subprocess.Popen[str] | None = None
    lat: dict[str, list[float]] = {}
    bulk: dict[str, list[float]] = {}
    rounds = max(1, args.rounds)
    try:
        assert echo.stdout is not None
        echo_port = int(echo.stdout.readline())
        peer = _toxiproxy(echo_port)
        with spawn_proxy_server() as server:
            ports = {"direct": echo_port, "proxied": _create(server.url, echo_port)}
            if peer is not None:
                ports["toxiproxy"] = peer[1]
            if args.floor:
                floor = subprocess.Popen([sys.executable, __file__, "--forward", str(echo_port)],
                                         stdout=subprocess.PIPE, text=True)
                assert floor.stdout is not None
                ports["floor"] = int(floor.stdout.readline())
            for port in ports.values():
                _latency(port, 200, args.rate)  # warm up
            per_round = max(1, args.requests // rounds)
            for _ in range(rounds):
                for who, port in ports.items():
                    lat.setdefault(who, []).extend(_latency(port, per_round, args.rate))
            for _ in range(rounds):
                for who, port in ports.items():
                    bulk.setdefault(who, []).append(_bulk(port, args.mib))
            with urllib.request.urlopen(server.url + "/proxies/bench/flows") as r:
                flows = json.loads(r.read())
    finally:
        for proc in (echo, floor, peer[0] if peer is not None else None):
            if proc is not None:
                proc.kill()
                proc.wait()
    d50, d99 = _pct(lat["direct"], .5), _pct(lat["direct"], .99)
    print(f"latency at {args.rate:.0f} req/s, {len(lat['direct'])} requests of 64 B per target in {rounds} "
          "interleaved rounds, one connection each:")
    for who, xs in lat.items():
        print(f"  {who:9s} p50 {_pct(xs, .5):7.1f} us  p99 {_pct(xs, .99):7.1f} us  mean {statistics.mean(xs) * 1e6:7.1f} us")
    for who, xs in lat.items():
        if who != "direct":
            target = "   (target: added p50 <= 20 us)" if who == "proxied" else ""
            print(f"  added by {who:9s} p50 {_pct(xs, .5) - d50:7.1f} us  p99 {_pct(xs, .99) - d99:7.1f} us{target}")
    if peer is None:
        print("  (toxiproxy-server is not on PATH: no Toxiproxy peer in this run)")
    print(f"bulk, {args.mib} MiB on one connection per target and round, {rounds} rounds (MB/s per round):")
    for who, runs in bulk.items():
        ratio = ""
        if who != "direct":
            ratios = [b / d for b, d in zip(runs, bulk["direct"], strict=True)]
            ratio = f"   ratio {statistics.median(ratios):.3f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})"
        target = "   (target: ratio >= 0.8)" if who == "proxied" else ""
        print(f"  {who:9s} {statistics.median(runs):8.1f} MB/s  [{', '.join(f'{b:.0f}' for b in runs)}]{ratio}{target}")
    closed, live = flows["closed"], flows["connections"]
    for conn in live:
        for direction in conn.values():
            for key in closed:
                closed[key] += direction[key]
    print(f"proxy's own count: fast path {closed['fast_bytes']:,} B (spliced {closed['spliced_bytes']:,} B), "
          f"chunk path {closed['chunk_bytes']:,} B")


if __name__ == "__main__":
    main()
