"""Client CPU per 1,000 calls: shadowtest's open-loop replayer against Locust with a gRPC user.

Three clients in one run: shadowtest with the grpc sender (grpcio), shadowtest with the lean h2
sender (gRPC over its own HTTP/2 Protocol, no grpcio), and the Locust peer.

    same recording-equivalent load (R calls/s for D s, Decide with a real MarketSnapshot)
    --> the same echo target (own process, grpc.aio)
    shadowtest: ReplayRun of the recording, in its own process
    Locust:     the examples/grpc style -- a User with a generic gRPC client firing request events,
                constant_throughput users adding up to R calls/s, headless, in its own process

Each client measures its own CPU (process_time) over the load only (imports and start-up excluded).
Target (issue 5): shadowtest at most half of Locust's CPU per call. Default: 1,500 calls/s for 8 s.

    .venv/bin/python bench/replay_vs_locust.py [--rate R] [--duration S]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from replay.testing import write_unary_recording  # noqa: E402

OURS = textwrap.dedent("""
    import json, sys, time
    from replay.engine import ReplayRun
    from replay.options import ReplayOptions
    run = ReplayRun(sys.argv[1], sys.argv[2], ReplayOptions(sender=sys.argv[3]))
    cpu = time.process_time()
    rep = run.run()
    print(json.dumps({"cpu_s": time.process_time() - cpu, "calls": rep.ok, "rate": rep.achieved_rate,
                      "errors": rep.error_count + rep.timeouts + rep.not_sent}))
""")

PEER = textwrap.dedent('''
    import json, time
    from locust import User, constant_throughput, events, task
    import grpc, grpc.experimental.gevent as grpc_gevent
    from replay.testing import DECIDE, snapshot_bytes
    grpc_gevent.init_gevent()
    STATE = {}

    @events.test_start.add_listener
    def _start(environment, **kw):
        STATE["cpu"], STATE["t"] = time.process_time(), time.monotonic()

    @events.quitting.add_listener
    def _quit(environment, **kw):
        total = environment.stats.total
        print("RESULT " + json.dumps({"cpu_s": time.process_time() - STATE["cpu"], "calls": total.num_requests
              - total.num_failures, "rate": total.num_requests / (time.monotonic() - STATE["t"]),
              "errors": total.num_failures}), flush=True)

    class GrpcUser(User):
        wait_time = constant_throughput(RATE_PER_USER)
        seq = 0

        def on_start(self):
            self.channel = grpc.insecure_channel(self.host)
            self.call = self.channel.unary_unary(DECIDE)

        @task
        def decide(self):
            GrpcUser.seq += 1
            start, exc, size = time.perf_counter(), None, 0
            try:
                size = len(self.call(snapshot_bytes(GrpcUser.seq), timeout=10))
            except grpc.RpcError as e:
                exc = e
            self.environment.events.request.fire(request_type="grpc", name=DECIDE, response_length=size,
                response_time=(time.perf_counter() - start) * 1000, exception=exc, context={})
''')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, default=1500)
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--users", type=int, default=20, help="Locust users sharing the rate")
    args = ap.parse_args()
    echo = subprocess.Popen([sys.executable, "-m", "replay.testing", "--fast"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert echo.stdout is not None
    target = echo.stdout.readline().strip()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rec = Path(tmp) / "load.rec"
            n = int(args.rate * args.duration)
            write_unary_recording(rec, [i * 1_000_000_000 // args.rate for i in range(n)], flows=4)
            ours = {sender: json.loads(subprocess.run([sys.executable, "-c", OURS, str(rec), target, sender], cwd=ROOT,
                                                      check=True, capture_output=True, text=True
                                                      ).stdout.strip().splitlines()[-1]) for sender in ("grpc", "h2")}
            peer_file = Path(tmp) / "peer_locustfile.py"
            peer_file.write_text(PEER.replace("RATE_PER_USER", repr(args.rate / args.users)))
            out = subprocess.run([sys.executable, "-m", "locust", "-f", str(peer_file), "--headless", "-u",
                                  str(args.users), "-r", str(args.users * 10), "--run-time", f"{int(args.duration)}s",
                                  "--host", target, "--only-summary", "--loglevel", "WARNING"],
                                 cwd=ROOT, capture_output=True, text=True, timeout=args.duration + 120)
            lines = out.stdout.splitlines() + out.stderr.splitlines()
            line = next((x for x in lines if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit("the Locust peer printed no result:\n" + "\n".join(lines[-30:]))
            peer = json.loads(line[len("RESULT "):])
    finally:
        echo.terminate()
        echo.wait(10)
    print(f"target {target}: {args.rate} calls/s for {args.duration:g} s ({n} calls)")
    print(f"{'client':<16} {'calls ok':>9} {'failed':>7} {'rate/s':>8} {'CPU s':>7} {'CPU s / 1k calls':>17}")
    per = {}
    for who, r in (("shadowtest-grpc", ours["grpc"]), ("shadowtest-h2", ours["h2"]), ("locust-grpc", peer)):
        per[who] = r["cpu_s"] / max(r["calls"], 1) * 1000
        print(f"{who:<16} {r['calls']:>9} {r['errors']:>7} {r['rate']:>8.0f} {r['cpu_s']:>7.2f} {per[who]:>17.3f}")
    for who, goal in (("shadowtest-grpc", ""), ("shadowtest-h2", " (goal <= 0.33)")):
        print(f"ratio: {who} CPU per call / Locust CPU per call = {per[who] / per['locust-grpc']:.2f}{goal}")


if __name__ == "__main__":
    main()
