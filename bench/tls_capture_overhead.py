"""TLS capture cost: the recorder's CPU per 1,000 calls/s on HTTPS, per TLS implementation, beside plain HTTP.

    nginx (Debian's, one worker) --+-- port A: HTTP/1.1                  <-- keep-alive clients at --rate
                                   +-- port B: HTTP/1.1 over TLS (libssl) <-- the same clients over ssl
    node (tls_peer.js https-server: OpenSSL inside node, memory BIOs)     <-- the same clients over ssl
    Go (https_roundtrip.go serve: crypto/tls, probes)                    <-- the same clients over ssl
    for each pair, each service: baseline, recorded (`shadowtest record --port P` in its own process,
    started and up before the load)

Prints, per service, the medians over --pairs of: the recorder's CPU per 1,000 calls/s (its process,
read after it is up, so the eBPF compile is not counted), the service's CPU per call with and without
the recorder (the uprobes and tracepoints run in its context: that is their cost on the recorded
service), calls recorded against calls made, and the TLS meta (plaintext flows, encrypted flows,
ciphertext not stored). Needs root, bcc, nginx, openssl; node and go for those rows (`--services`).
Run as `.venv/bin/python bench/tls_capture_overhead.py [--rate 300 --duration 6 --pairs 2 --connections 4
--services plain,openssl,node,go]`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from capture.recording import Recording  # noqa: E402
from wire.process import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONF = """
daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 60s;
    default_type application/json;
    server {{
        listen 127.0.0.1:{plain};
        listen 127.0.0.1:{tls} ssl;
        ssl_certificate {d}/cert.pem;
        ssl_certificate_key {d}/key.pem;
        location / {{ return 200 '{{"ok": true, "path": "$uri"}}'; }}
    }}
}}
"""



def start_nginx(d: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=30)
    plain, tls = free_port(), free_port()
    (d / "nginx.conf").write_text(CONF.format(d=d, plain=plain, tls=tls))
    proc = subprocess.Popen(["nginx", "-c", str(d / "nginx.conf"), "-p", str(d), "-e", str(d / "error.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", tls), timeout=0.2).close()
            return proc, plain, tls
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("nginx did not start")


def start_peer(argv: list[str], cwd: Path) -> tuple[subprocess.Popen[str], int]:
    """A service that prints its port first (a number, or {"port": N}, or "listening N"), then a line
    per call: those lines are drained by a thread, so a full pipe never stalls it."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=cwd)
    assert proc.stdout is not None
    first = proc.stdout.readline().strip()
    port = int(json.loads(first)["port"]) if first.startswith("{") else int(first.split()[-1])
    out = proc.stdout
    threading.Thread(target=lambda: [None for _ in iter(out.readline, "")], daemon=True).start()
    return proc, port


def build_go(d: Path) -> Path:
    src = REPO / "tests" / "interop" / "go" / "https_roundtrip.go"
    env = {**os.environ, "GOCACHE": str(d / "gocache"), "GOPATH": str(d / "gopath"), "GO111MODULE": "off",
           "GOFLAGS": "", "CGO_ENABLED": "0"}
    subprocess.run(["go", "build", "-o", str(d / "https_roundtrip"), str(src)], check=True, env=env, cwd=d,
                   capture_output=True, timeout=600)
    return d / "https_roundtrip"


def stop_nginx(nginx: subprocess.Popen[bytes]) -> None:
    """Graceful (SIGQUIT), then killed if it has not gone in 10 s."""
    nginx.send_signal(signal.SIGQUIT)
    try:
        nginx.wait(10)
    except subprocess.TimeoutExpired:
        nginx.kill()
        nginx.wait(5)


def worker(nginx: subprocess.Popen[bytes]) -> psutil.Process:
    kids = psutil.Process(nginx.pid).children()
    if len(kids) != 1:
        raise SystemExit(f"expected one nginx worker, found {len(kids)}")
    return kids[0]


def cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def load(port: int, cafile: Path | None, rate: float, duration: float, conns: int,
         new_connections: bool = False) -> tuple[int, int]:
    """Open loop: `conns` keep-alive connections (or, with `new_connections`, a connection per call),
    each sending GETs on its own schedule (rate/conns per second) for `duration` seconds. Returns (calls
    answered 200, errors)."""
    ok = [0] * conns
    errors = [0] * conns
    auth = {"Authorization": "Bearer bench-token-0123456789"}

    def run(i: int) -> None:
        ctx = ssl.create_default_context(cafile=str(cafile)) if cafile else None
        conn: http.client.HTTPConnection = (http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
                                            if ctx else http.client.HTTPConnection("127.0.0.1", port, timeout=5))
        period = conns / rate
        start = time.monotonic() + i * period / conns
        n = 0
        while True:
            at = start + n * period
            if at - start >= duration:
                break
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                conn.request("GET", f"/items/{i}/{n}", headers=auth)
                resp = conn.getresponse()
                resp.read()
                ok[i] += resp.status == 200
            except (OSError, http.client.HTTPException):
                errors[i] += 1
                conn.close()
            if new_connections:
                conn.close()
            n += 1
        conn.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration + 60)
    return sum(ok), sum(errors)


def start_recorder(port: int, out: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "record", "--port", str(port), "-o", str(out),
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists():
            try:
                with Recording(out) as r:
                    if "backend_settings" in r.meta:
                        time.sleep(1.0)    # the TLS program attaches just after
                        return proc
            except Exception:  # noqa: BLE001 - being created
                pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("recorder did not start (root and bcc needed: see `shadowtest doctor`)")


def stop_recorder(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=600)
    try:
        return dict(json.loads(out))
    except ValueError:
        return {}


def one(kind: str, port: int, cafile: Path | None, recorded: bool, args: argparse.Namespace, d: Path,
        service: psutil.Process) -> dict[str, Any]:
    rec = None
    out = d / f"{kind}-{time.monotonic_ns()}.rec"
    if recorded:
        rec = start_recorder(port, out)
        rproc = psutil.Process(rec.pid)
        r0 = cpu(rproc)
    w0, t0 = cpu(service), time.monotonic()
    calls, errors = load(port, cafile, args.rate, args.duration, args.connections)
    elapsed = time.monotonic() - t0
    w1 = cpu(service)
    if calls == 0:
        if rec is not None:
            stop_recorder(rec)
        raise SystemExit(f"{kind}: no call answered ({errors} errors): the service is gone")
    row: dict[str, Any] = {"kind": kind, "recorded": recorded, "calls": calls, "errors": errors,
                           "rate": calls / elapsed, "service_us_per_call": (w1 - w0) / max(1, calls) * 1e6}
    if rec is not None:
        time.sleep(0.5)       # the ring drains (10 polls)
        r1 = cpu(rproc)
        result = stop_recorder(rec)
        row["recorder_cpu_pct_per_1k"] = (r1 - r0) / elapsed * 100 / (row["rate"] / 1000)
        row["recorded_calls"] = result.get("calls")
        row["lost_events"] = result.get("lost_events")
        tls = result.get("tls") or {}
        row["tls"] = {k: tls.get(k) for k in ("capture", "plaintext_flows", "encrypted_flows",
                                               "ciphertext_bytes_not_stored", "lost_events")}
        for p in d.glob(out.name + "*"):
            p.unlink()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=300.0, help="calls/s offered (open loop)")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds of load per run")
    ap.add_argument("--pairs", type=int, default=2, help="rounds of (plain, plain recorded, TLS, TLS recorded)")
    ap.add_argument("--connections", type=int, default=4, help="keep-alive connections")
    ap.add_argument("--services", default="plain,openssl,node,go",
                    help="which: plain (nginx HTTP), openssl (nginx HTTPS), node, go")
    args = ap.parse_args()
    wanted = args.services.split(",")
    if os.geteuid() != 0 or not shutil.which("nginx"):
        raise SystemExit("needs root and nginx")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tls-bench-") as tmp:
        d = Path(tmp)
        nginx, plain, tls = start_nginx(d)
        peers: list[subprocess.Popen[str]] = []
        try:
            w = worker(nginx)
            services: list[tuple[str, int, Path | None, psutil.Process]] = []
            if "plain" in wanted:
                services.append(("plain", plain, None, w))
            if "openssl" in wanted:
                services.append(("openssl", tls, d / "cert.pem", w))
            if "node" in wanted and shutil.which("node"):
                proc, port = start_peer(["node", "tls_peer.js", "https-server", str(d / "cert.pem"), str(d / "key.pem")],
                                        REPO / "tests" / "interop" / "node")
                peers.append(proc)
                services.append(("node", port, d / "cert.pem", psutil.Process(proc.pid)))
            if "go" in wanted and shutil.which("go"):
                (d / "go").mkdir()
                proc, port = start_peer([str(build_go(d)), "serve", str(d / "go")], d)
                peers.append(proc)
                services.append(("go", port, d / "go" / "cert.pem", psutil.Process(proc.pid)))
            for _ in range(args.pairs):
                for kind, port, ca, service in services:
                    for recorded in (False, True):
                        row = one(kind, port, ca, recorded, args, d, service)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            for p in peers:
                assert p.stdin is not None
                p.stdin.close()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            stop_nginx(nginx)

    def med(kind: str, recorded: bool, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["kind"] == kind and r["recorded"] == recorded)

    print()
    print(f"rate offered {args.rate:.0f} calls/s, {args.connections} keep-alive connections, "
          f"{args.duration:.0f} s per run, {args.pairs} pairs (medians)")
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    for kind in kinds:
        rec_rows = [r for r in rows if r["kind"] == kind and r["recorded"]]
        print(f"{kind:8} recorder CPU {med(kind, True, 'recorder_cpu_pct_per_1k'):5.1f} % of a core per 1,000 calls/s"
              f"   service {med(kind, False, 'service_us_per_call'):6.1f} us/call unrecorded, "
              f"{med(kind, True, 'service_us_per_call'):6.1f} us/call recorded"
              f"   calls recorded/made {sum(r['recorded_calls'] or 0 for r in rec_rows)}/"
              f"{sum(r['calls'] for r in rec_rows)}   lost {sum(r['lost_events'] or 0 for r in rec_rows)}"
              f"   encrypted flows {sum((r['tls'] or {}).get('encrypted_flows') or 0 for r in rec_rows)}")
    if "plain" in kinds:
        base = max(1e-9, med("plain", True, "recorder_cpu_pct_per_1k"))
        for kind in kinds:
            if kind != "plain":
                print(f"{kind} recorder / plaintext recorder CPU per call: "
                      f"{med(kind, True, 'recorder_cpu_pct_per_1k') / base:.2f}")


if __name__ == "__main__":
    main()
