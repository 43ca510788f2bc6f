"""What sampling, rotation and the flight recorder cost the recorder: CPU per 1,000 calls/s beside a plain run.

    nginx (one worker, HTTP/1.1) <-- keep-alive clients at --rate (open loop), the same load every run
    runs, alternating, --pairs times: plain `record`, `--sample 50`, `--rotate-mb 2`, `--ring 20s`

Prints, per mode, the medians of: the recorder's CPU per 1,000 calls/s offered (its process, read after
it is up), calls recorded against calls made, and the ratio to the plain run. Sampling should cost less
(the dropped half is not copied out of the kernel), rotation and the ring about the same (a file closed
and opened now and then). Needs root, bcc and nginx. Run as
`.venv/bin/python bench/recorder_bounded.py [--rate 600 --duration 8 --pairs 2 --connections 16]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
from tls_capture_overhead import cpu, load, start_nginx, stop_nginx  # noqa: E402

from tests.polling import recording_meta  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODES = "plain,sample 50,rotate-mb 2,ring 20s"


def mode_args(mode: str) -> list[str]:
    """"plain" -> [], "rotate-mb 2" -> ["--rotate-mb", "2"], "sample 50" -> ["--sample", "50"]."""
    return [] if mode == "plain" else [f"--{mode.split()[0]}", *mode.split()[1:]]


def run(mode: str, port: int, args: argparse.Namespace, d: Path) -> dict[str, Any]:
    out = d / f"{mode.replace(' ', '_')}-{time.monotonic_ns()}"    # a directory for rotate and ring
    first = {"rotate-mb": out / "000001.rec", "rotate-s": out / "000001.rec",
             "ring": out / ".ring" / "000001.rec"}.get(mode.split()[0], out)
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "record", "--port", str(port), "--json", "-o",
                             str(out), *mode_args(mode)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while "backend_settings" not in recording_meta(first):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{mode}: the recorder did not start")
        time.sleep(0.1)
    time.sleep(1.0)
    rp = psutil.Process(proc.pid)
    c0, t0 = cpu(rp), time.monotonic()
    calls, errors = load(port, None, args.rate, args.duration, args.connections, new_connections=args.new_connections)
    elapsed = time.monotonic() - t0
    time.sleep(0.5)
    c1 = cpu(rp)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=300)
    result = json.loads(stdout)
    if out.is_dir():
        shutil.rmtree(out, ignore_errors=True)
    for p in d.glob(out.name + "*"):
        p.unlink()
    return {"mode": mode, "calls": calls, "errors": errors, "recorded": result.get("calls"),
            "cpu_pct_per_1k": (c1 - c0) / elapsed * 100 / (calls / elapsed / 1000)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=600.0)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--new-connections", action="store_true",
                    help="a connection per call (sampling then drops whole connections as they come)")
    ap.add_argument("--modes", default=DEFAULT_MODES,
                    help=f"comma-separated, plain first (default {DEFAULT_MODES!r}; e.g. 'plain,rotate-mb 8')")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or modes[0] != "plain":
        raise SystemExit("--modes starts with plain (the ratios are to it)")
    if os.geteuid() != 0 or not shutil.which("nginx"):
        raise SystemExit("needs root and nginx")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bounded-bench-") as tmp:
        d = Path(tmp)
        nginx, plain, _tls = start_nginx(d)
        try:
            for _ in range(args.pairs):
                for mode in modes:
                    row = run(mode, plain, args, d)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            stop_nginx(nginx)
    base = statistics.median(r["cpu_pct_per_1k"] for r in rows if r["mode"] == "plain")
    print(f"\nrate {args.rate:.0f} calls/s, {args.connections} connections"
          f"{' (one per call)' if args.new_connections else ' (keep-alive)'}, {args.duration:.0f} s, {args.pairs} pairs")
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        med = statistics.median(r["cpu_pct_per_1k"] for r in mine)
        print(f"{mode:12} recorder CPU {med:5.1f} % of a core per 1,000 calls/s ({med / base:.2f}x plain)   "
              f"recorded {sum(r['recorded'] or 0 for r in mine)} of {sum(r['calls'] for r in mine)} calls")


if __name__ == "__main__":
    main()
