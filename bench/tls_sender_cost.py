"""Client CPU per call of the TLS senders beside the plaintext ones, in the same run.

    recording (R calls/s for D s, 4 connections)
      --> h2 sender (lean gRPC)   --> grpc.aio echo, cleartext port  | the same server's TLS port (ALPN h2)
      --> http1 sender            --> nginx `return 200`, plain port | the same nginx's TLS port
    each replay in its own process; CPU = its process_time over the run only (imports excluded)

The pairs alternate (plain, TLS, plain, TLS, ...) `--runs` times; the table gives each run's CPU ms
per call and the medians, and the ratio TLS / plaintext of the medians. The certificates (a CA and a
server certificate for 127.0.0.1) are made with the openssl CLI in a temporary directory. Needs
nginx for the HTTP/1 pair (skipped with a line when it is missing).

    .venv/bin/python bench/tls_sender_cost.py [--rate R] [--duration S] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capture.recording import Call, Flow, Message, RecordingWriter  # noqa: E402
from replay.testing import write_unary_recording  # noqa: E402
from wire.process import free_port  # noqa: E402

CLIENT = textwrap.dedent("""
    import json, sys, time
    from replay.engine import ReplayRun
    from replay.options import ReplayOptions
    from replay.senders.tls import TlsConfig
    path, target, sender, ca = sys.argv[1:5]
    run = ReplayRun(path, target, ReplayOptions(sender=sender, tls=TlsConfig(ca=ca) if ca != "-" else None))
    cpu = time.process_time()
    rep = run.run()
    print(json.dumps({"cpu_s": time.process_time() - cpu, "ok": rep.ok, "scheduled": rep.scheduled,
                      "rate": rep.achieved_rate, "reasons": rep.error_reasons}))
""")

GRPC_SERVER = textwrap.dedent("""
    import asyncio, sys
    import grpc, grpc.aio
    async def main(cert, key):
        server = grpc.aio.server()
        async def echo(request, context):
            return request
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "shadowtest.agent.v1.TradingAgent", {"Decide": grpc.unary_unary_rpc_method_handler(echo)}),))
        plain = server.add_insecure_port("127.0.0.1:0")
        creds = grpc.ssl_server_credentials([(open(key, "rb").read(), open(cert, "rb").read())])
        tls = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        print(plain, tls, flush=True)
        await server.wait_for_termination()
    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")

NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    keepalive_requests 1000000;
    server {{
        listen 127.0.0.1:{plain};
        listen 127.0.0.1:{tls} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location / {{ return 200 "ok\\n"; }}
    }}
}}
"""


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=30)


def make_pki(d: Path) -> tuple[Path, Path, Path]:
    """(CA, server certificate for 127.0.0.1, its key)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(d, "req", "-x509", *ec, "-days", "2", "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=bench CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    _openssl(d, "req", *ec, "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=localhost")
    (d / "srv.ext").write_text("basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
                               "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(d, "x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-out", "srv.pem", "-extfile", "srv.ext")
    return d / "ca.pem", d / "srv.pem", d / "srv.key"


def http_recording(path: Path, rate: int, duration: float, flows: int = 4) -> None:
    with RecordingWriter(path) as w:
        fids = [w.add_flow(Flow(("127.0.0.1", 40000 + i), ("127.0.0.1", 8080), protocol="http1"))
                for i in range(flows)]
        for i in range(int(rate * duration)):
            ts = 10_000_000_000 + i * 1_000_000_000 // rate
            w.add_call(Call(protocol="http1", method=f"POST /orders/{i}", request_ts_ns=ts, flow_id=fids[i % flows],
                            kind="request", request_metadata=[("Content-Type", "application/json")], status=200,
                            requests=[Message("c2s", 0, ts, b'{"order": %d}' % i)]))



def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"server on port {port} did not start")


def replay(rec: Path, target: str, sender: str, ca: Path | None) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", CLIENT, str(rec), target, sender, str(ca) if ca else "-"], cwd=ROOT,
                         check=True, capture_output=True, text=True, timeout=600)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if result["ok"] != result["scheduled"]:
        raise SystemExit(f"{sender} to {target}: {result['ok']} ok of {result['scheduled']}: {result['reasons']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if not 1 <= args.rate <= 20000 or not 0 < args.duration <= 120 or not 1 <= args.runs <= 20:
        raise SystemExit("--rate 1..20000, --duration up to 120 s, --runs 1..20")
    procs: list[subprocess.Popen[bytes]] = []
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ca, cert, key = make_pki(d)
        try:
            grpc_srv = subprocess.Popen([sys.executable, "-c", GRPC_SERVER, str(cert), str(key)], cwd=ROOT,
                                        stdout=subprocess.PIPE)
            procs.append(grpc_srv)
            assert grpc_srv.stdout is not None
            plain, tls = grpc_srv.stdout.readline().split()
            pairs = [("h2", d / "g.rec", f"127.0.0.1:{int(plain)}", f"127.0.0.1:{int(tls)}")]
            n = write_unary_recording(d / "g.rec", [i * 1_000_000_000 // args.rate
                                                    for i in range(int(args.rate * args.duration))], flows=4)
            nginx = shutil.which("nginx") or "/usr/sbin/nginx"
            if Path(nginx).exists():
                ports = free_port(), free_port()
                (d / "nginx.conf").write_text(NGINX_CONF.format(d=d, plain=ports[0], tls=ports[1], cert=cert, key=key))
                web = subprocess.Popen([nginx, "-p", str(d), "-c", str(d / "nginx.conf")], stderr=subprocess.DEVNULL)
                procs.append(web)
                _wait_port(ports[0], web)
                _wait_port(ports[1], web)
                http_recording(d / "h.rec", args.rate, args.duration)
                pairs.append(("http1", d / "h.rec", f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"))
            else:
                print("nginx not found: the http1 pair is skipped (apt-get install nginx)")
            for run in range(args.runs):
                for sender, rec, plain_addr, tls_addr in pairs:
                    for label, addr, use_ca in ((f"{sender} plain", plain_addr, None), (f"{sender} TLS", tls_addr, ca)):
                        r = replay(rec, addr, sender, use_ca)
                        ms = float(r["cpu_s"]) / float(r["ok"]) * 1000
                        rows.setdefault(label, []).append(ms)
                        print(f"run {run + 1} {label:<12} {r['ok']} ok at {float(r['rate']):.0f}/s "
                              f"CPU {float(r['cpu_s']):.2f} s = {ms:.3f} ms/call", flush=True)
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM if p is procs[0] else signal.SIGQUIT)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
    print(f"\n{args.rate} calls/s for {args.duration:g} s ({n} calls a run, 4 connections), {args.runs} runs")
    print(f"{'client':<12} {'CPU ms/call (runs)':<30} {'median':>8}")
    med = {label: statistics.median(v) for label, v in rows.items()}
    for label, v in rows.items():
        print(f"{label:<12} {', '.join(f'{x:.3f}' for x in v):<30} {med[label]:>8.3f}")
    for sender, *_ in pairs:
        print(f"ratio: {sender} TLS / plain CPU per call = {med[f'{sender} TLS'] / med[f'{sender} plain']:.2f}")


if __name__ == "__main__":
    main()
