"""What the fault proxy's HTTP/1 tap costs: wrk against nginx, direct, through the proxy with the tap
off (bytes passed as they are, as before HTTP call toxics existed) and with it on (every request and
response framed, upstream legs timed, an idle http_error rule consulted per request).

    .venv/bin/python bench/http_tap_cost.py [--seconds 5] [--connections 4] [--rounds 3]

Each round runs the three in turn (interleaved, so a noisy host hits all alike); prints requests/s and
wrk's latency P50/P99 per setup, the median over rounds, and the ratios tap-on / tap-off. Loopback only;
nginx and wrk from Debian (apt-get install nginx wrk).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wire.process import free_port  # noqa: E402

CONF = """
daemon off; master_process off; worker_processes 1; pid {d}/nginx.pid; error_log {d}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off; client_body_temp_path {d}/body; keepalive_requests 1000000;
    server {{ listen 127.0.0.1:{port}; location / {{ return 200 "ok $request_uri\\n"; }} }}
}}
"""



def _wrk(address: str, seconds: float, connections: int) -> tuple[float, float, float]:
    """(requests/s, p50 ms, p99 ms) of one wrk run."""
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency",
                          f"http://{address}/api/x?q=1"], capture_output=True, text=True, timeout=seconds + 30)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out.stdout).group(1))   # type: ignore[union-attr]

    def ms(q: str) -> float:
        m = re.search(rf"\s{q}%\s+([\d.]+)(us|ms|s)", out.stdout)
        assert m, out.stdout
        return float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]

    return rps, ms("50"), ms("99")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if not (shutil.which("nginx") and shutil.which("wrk")):
        print("needs nginx and wrk (apt-get install nginx wrk)")
        return 2
    if not (0.5 <= a.seconds <= 60 and 1 <= a.connections <= 64 and 1 <= a.rounds <= 20):
        ap.error("--seconds 0.5..60, --connections 1..64, --rounds 1..20")
    from faults.proxy import EmbeddedToxiproxy
    from faults.proxy import proxy as proxy_mod

    d = Path(tempfile.mkdtemp(prefix="tapcost-"))
    port = free_port()
    (d / "nginx.conf").write_text(CONF.format(d=d, port=port))
    nginx = subprocess.Popen(["nginx", "-p", str(d), "-c", str(d / "nginx.conf")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    real = proxy_mod.looks_like_http1
    results: dict[str, list[tuple[float, float, float]]] = {"direct": [], "proxy, tap off": [], "proxy, tap on": []}
    try:
        time.sleep(0.5)
        os.environ["SHADOWTEST_LEG_LOG"] = str(d / "legs.log")
        with EmbeddedToxiproxy(seed=1) as tp:
            listen = tp.create_proxy("web", f"127.0.0.1:{port}")["listen"]
            tp.add_toxic("web", "http_error", {"path": "/never"}, stream="upstream")
            for r in range(a.rounds):
                results["direct"].append(_wrk(f"127.0.0.1:{port}", a.seconds, a.connections))
                proxy_mod.looks_like_http1 = lambda data: False
                results["proxy, tap off"].append(_wrk(listen, a.seconds, a.connections))
                proxy_mod.looks_like_http1 = real
                results["proxy, tap on"].append(_wrk(listen, a.seconds, a.connections))
                print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1][0]:.0f}/s" for k, v in results.items()), flush=True)
    finally:
        proxy_mod.looks_like_http1 = real
        nginx.send_signal(signal.SIGQUIT)
        nginx.wait(10)
    legs = sum(1 for _ in open(d / "legs.log")) if (d / "legs.log").exists() else 0
    print(f"\nwrk -t1 -c{a.connections} -d{a.seconds:g}s, {a.rounds} rounds, medians; {os.cpu_count()} CPUs")
    print(f"{'setup':<16} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    med = {}
    for k, v in results.items():
        med[k] = tuple(statistics.median(x[i] for x in v) for i in range(3))
        print(f"{k:<16} {med[k][0]:>8.0f} {med[k][1]:>8.3f} {med[k][2]:>8.3f}")
    on, off = med["proxy, tap on"], med["proxy, tap off"]
    print(f"tap on / tap off: throughput {on[0] / off[0]:.2f}x, p50 {on[1] / off[1]:.2f}x, p99 {on[2] / off[2]:.2f}x; "
          f"{legs} upstream legs timed")
    shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
