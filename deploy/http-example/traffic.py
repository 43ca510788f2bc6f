"""Production-like traffic for the example service while it is recorded: three keep-alive clients
(Python's http.client) sending a mix of calls at about `--rate` calls/s for `--seconds`, loopback only.

    python3 deploy/http-example/traffic.py --address 127.0.0.1:18080 --seconds 6 --rate 60
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time

MAX_CALLS = 100_000


def client(address: str, index: int, count: int, gap_s: float, failures: list[str]) -> None:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    start = time.monotonic()
    for i in range(count):
        time.sleep(max(0.0, start + i * gap_s - time.monotonic()))
        n = index * count + i
        kind = n % 4
        try:
            if kind == 0:
                body = json.dumps({"sku": f"sku-{n % 50}", "qty": 1 + n % 3})
                conn.request("POST", f"/api/orders/{n}", body=body, headers={"Content-Type": "application/json"})
            elif kind == 1:
                conn.request("GET", f"/search?q=item{n % 20}")
            elif kind == 2:
                conn.request("GET", f"/static/app-{n % 5}.js")
            else:
                conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            if resp.status >= 400:
                failures.append(f"{resp.status} {n}")
        except (OSError, http.client.HTTPException) as exc:
            failures.append(f"{type(exc).__name__} {n}")
            conn.close()
    conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="127.0.0.1:18080")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rate", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=3)
    a = ap.parse_args()
    per_client = min(MAX_CALLS, int(a.seconds * a.rate / a.clients))
    gap = a.clients / a.rate
    failures: list[str] = []
    threads = [threading.Thread(target=client, args=(a.address, k, per_client, gap, failures))
               for k in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"sent {per_client * a.clients} calls on {a.clients} connections, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
