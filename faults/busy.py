"""Built-in CPU burner used when stress-ng is absent: `python -m faults.busy --load 80 --cpu 0`.

Duty cycle in 10 ms slices (spin `load`% of each slice, sleep the rest), pinned to one CPU.
"""

from __future__ import annotations

import argparse
import os
import time


def burn(load_pct: float, seconds: float, slice_s: float = 0.01) -> None:
    """Spin for `load_pct`% of every `slice_s` until `seconds` have passed (forever when <= 0)."""
    end = time.monotonic() + seconds if seconds > 0 else float("inf")
    busy = slice_s * max(0.0, min(100.0, load_pct)) / 100.0
    while True:
        t0 = time.monotonic()
        if t0 >= end:
            return
        while time.monotonic() - t0 < busy:
            pass
        rest = slice_s - (time.monotonic() - t0)
        if rest > 0:
            time.sleep(rest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--load", type=float, default=100.0)
    ap.add_argument("--cpu", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=0.0)
    args = ap.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    burn(args.load, args.seconds)


if __name__ == "__main__":
    main()
