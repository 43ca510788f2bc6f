"""Proxy overhead: the embedded Toxiproxy-compatible proxy (no toxics) against a direct connection.

Three processes: an asyncio echo/sink server, the proxy (`faults.proxy.main`), and this client.
  1. latency: 64-byte requests paced at 1,000/s on one connection, round trip p50/p99, direct
     and through the proxy; the difference is the proxy's added latency per request.
  2. bulk: N MiB pushed through one connection into a sink, MB/s direct and through the proxy.
Targets (issue 6): at most 150 us added p50, at least 300 MB/s bulk.

    .venv/bin/python bench/proxy_overhead.py [--requests 3000] [--mib 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


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
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return asyncio.run(_serve())
    from faults.proxy import spawn_proxy_server

    echo = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout is not None
        echo_port = int(echo.stdout.readline())
        with spawn_proxy_server() as server:
            req = urllib.request.Request(server.url + "/proxies", method="POST", data=json.dumps(
                {"name": "bench", "upstream": f"127.0.0.1:{echo_port}"}).encode())
            with urllib.request.urlopen(req) as r:
                proxy_port = int(json.loads(r.read())["listen"].rsplit(":", 1)[1])
            _latency(echo_port, 200, args.rate), _latency(proxy_port, 200, args.rate)  # warm up
            direct = _latency(echo_port, args.requests, args.rate)
            proxied = _latency(proxy_port, args.requests, args.rate)
            bulk_direct = _bulk(echo_port, args.mib)
            bulk_proxied = _bulk(proxy_port, args.mib)
    finally:
        echo.kill()
        echo.wait()
    d50, d99, p50, p99 = _pct(direct, .5), _pct(direct, .99), _pct(proxied, .5), _pct(proxied, .99)
    print(f"latency at {args.rate:.0f} req/s, {args.requests} requests of 64 B, one connection:")
    print(f"  direct  p50 {d50:7.1f} us  p99 {d99:7.1f} us  mean {statistics.mean(direct) * 1e6:7.1f} us")
    print(f"  proxied p50 {p50:7.1f} us  p99 {p99:7.1f} us  mean {statistics.mean(proxied) * 1e6:7.1f} us")
    print(f"  added   p50 {p50 - d50:7.1f} us  p99 {p99 - d99:7.1f} us   (target: added p50 <= 150 us)")
    print(f"bulk, {args.mib} MiB on one connection:")
    print(f"  direct  {bulk_direct:8.1f} MB/s")
    print(f"  proxied {bulk_proxied:8.1f} MB/s   ratio {bulk_proxied / bulk_direct:.3f}   (target: >= 300 MB/s)")


if __name__ == "__main__":
    main()
