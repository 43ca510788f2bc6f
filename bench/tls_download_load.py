"""TLS capture under a download load: what is lost, and what recording costs the downloads.

    nginx (Debian's, one worker, HTTPS) serving 1 MiB and 8 MiB files
        <-- --clients at once: curl (three URLs on one keep-alive connection) and Python http.client over
            ssl (two files and a POST per connection), --rounds each
    runs alternate: unrecorded, recorded (the eBPF recorder with TLS capture, in this process), ...

Prints, per run, the wall time of the load and the megabytes downloaded per second, and for the recorded
runs the lost events, the calls recorded against the lines nginx logged, and how many of those calls are
marked (damaged, body not captured, outcome unknown): the peer is the same load unrecorded, and the ratio
is the recorded runs' median throughput over the unrecorded runs'. Needs root, bcc, nginx, curl, openssl.
Run as `.venv/bin/python bench/tls_download_load.py [--clients 4 --rounds 4 --pairs 2]`.
"""

from __future__ import annotations

import argparse
import http.client
import random
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from capture.backends import RecordOptions  # noqa: E402
from capture.record import Recorder  # noqa: E402
from capture.recording import Recording, call_damage  # noqa: E402
from tests.nginx import PREAMBLE, TEMP_PATHS, make_cert, running_nginx  # noqa: E402

FILES = {"1m.bin": 1 << 20, "8m.bin": 8 << 20}
CONF = PREAMBLE + """
http {{
    access_log {d}/access.log;
    default_type application/octet-stream;
""" + TEMP_PATHS + """
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {d}/cert.pem;
        ssl_certificate_key {d}/key.pem;
        root {d}/www;
        location = /post {{ return 200 "posted ok\\n"; }}
    }}
}}
"""


def curl(port: int, cert: Path, rounds: int) -> None:
    base = f"https://127.0.0.1:{port}"
    urls = [f"{base}/1m.bin", f"{base}/8m.bin", f"{base}/missing"]
    for _ in range(rounds):
        subprocess.run(["curl", "-sS", "--cacert", str(cert), "-H", "Authorization: Bearer bench-token",
                        *[a for _ in urls for a in ("-o", "/dev/null")], *urls], check=True, timeout=120)


def python(port: int, cert: Path, rounds: int) -> None:
    ctx = ssl.create_default_context(cafile=str(cert))
    for _ in range(rounds):
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=60)
        for method, path in (("GET", "/1m.bin"), ("GET", "/8m.bin"), ("POST", "/post")):
            conn.request(method, path, body=b"x=1" if method == "POST" else None,
                         headers={"Authorization": "Bearer bench-token"})
            conn.getresponse().read()
        conn.close()


def load(port: int, cert: Path, clients: int, rounds: int) -> float:
    """The wall time of `clients` clients at once, half curl, half Python."""
    threads = [threading.Thread(target=curl if i % 2 == 0 else python, args=(port, cert, rounds))
               for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def one_run(d: Path, port: int, cert: Path, args: argparse.Namespace, recorded: bool, n: int) -> dict[str, object]:
    log = d / "access.log"
    logged_before = len(log.read_text().splitlines()) if log.exists() else 0
    out = d / f"run{n}.rec"
    rec = Recorder(RecordOptions(output=str(out), port=port)).start() if recorded else None
    try:
        wall = load(port, cert, args.clients, args.rounds)
        time.sleep(0.5)
    finally:
        result = rec.stop() if rec is not None else {}
    mb = args.rounds * args.clients * sum(FILES.values()) / 1e6
    row: dict[str, object] = {"recorded": recorded, "wall_s": round(wall, 2), "mb_per_s": round(mb / wall, 1)}
    if rec is not None:
        with Recording(out) as r:
            calls = list(r.calls())
        marked = sum(call_damage(c.status, c.status_message, c.protocol) is not None for c in calls)
        row |= {"lost_events": result["lost_events"], "calls": len(calls), "marked": marked,
                "logged": len(log.read_text().splitlines()) - logged_before}
        out.unlink()
    print(row, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--pairs", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        cert = make_cert(d)
        (d / "www").mkdir()
        rng = random.Random(1)
        for name, size in FILES.items():
            (d / "www" / name).write_bytes(rng.randbytes(size))
        with running_nginx(d, lambda port: CONF.format(d=d, port=port)) as port:
            rows = [one_run(d, port, cert, args, recorded, i)
                    for i, recorded in enumerate([False, True] * args.pairs + [False])]
    plain = statistics.median(float(r["mb_per_s"]) for r in rows if not r["recorded"])   # type: ignore[arg-type]
    rec = statistics.median(float(r["mb_per_s"]) for r in rows if r["recorded"])          # type: ignore[arg-type]
    lost = [r["lost_events"] for r in rows if r["recorded"]]
    print(f"\n{args.clients} clients x {args.rounds} rounds x {sum(FILES.values()) / 1e6:.1f} MB, {args.pairs} pairs")
    print(f"downloads unrecorded {plain:.0f} MB/s, recorded {rec:.0f} MB/s: recorded / unrecorded {rec / plain:.2f}")
    print(f"lost events per recorded run: {lost}; calls recorded / logged, marked: "
          + ", ".join(f"{r['calls']}/{r['logged']} ({r['marked']})" for r in rows if r["recorded"]))


if __name__ == "__main__":
    main()
