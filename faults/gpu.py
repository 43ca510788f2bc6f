"""GPU fault: a competing CUDA workload on the target's device (`python -m faults.gpu --device 0`).

The burner runs in its own process (recorded like any fault process), multiplying square matrices
for `duty_pct`% of each 20 ms slice. Hosts without CUDA raise GpuUnavailableError with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from faults.errors import GpuUnavailableError
from faults.process import _comm, kill_recorded
from faults.state import FaultRegistry, default_registry, proc_start_time
from wire.process import spawn


@functools.cache
def gpu_problem() -> str | None:
    """Why a GPU fault cannot run here, or None when a CUDA device is usable."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'shadowtest[agent]')"
    if not torch.cuda.is_available():
        return "no CUDA device on this host"
    return None


@dataclass
class GpuLoad:
    device: int
    duty_pct: int
    pid: int
    started_at: float


@contextlib.contextmanager
def gpu_contention(device: int = 0, duty_pct: int = 100, size: int = 4096, max_seconds: float = 3600,
                   registry: FaultRegistry | None = None, ready_timeout: float = 60) -> Iterator[GpuLoad]:
    """Burn GPU `device` at `duty_pct`% until exit. Raises GpuUnavailableError without CUDA."""
    if (why := gpu_problem()) is not None:
        raise GpuUnavailableError(f"GPU contention unavailable: {why}")
    reg = registry or default_registry()
    argv = [sys.executable, "-m", "faults.gpu", "--device", str(device), "--duty", str(duty_pct),
            "--size", str(size), "--seconds", str(max_seconds)]
    with reg.hold("process", lambda e: kill_recorded(e.get("procs", []), signal.SIGKILL),
                  purpose="gpu_contention", procs=[]) as entry_id:
        p = spawn(argv, stdout=subprocess.PIPE, text=True)
        reg.update(entry_id, procs=[{"pid": p.pid, "start": proc_start_time(p.pid), "group": True,
                                     "comm": _comm(p.pid)}])
        assert p.stdout is not None
        # "ready": CUDA context up and first kernel done. A wedged driver must not hang the run.
        ready, _, _ = select.select([p.stdout], [], [], ready_timeout)
        if not ready or p.stdout.readline().strip() != "ready":
            raise GpuUnavailableError(f"GPU burner on device {device} failed to start within "
                                      f"{ready_timeout:g} s")
        yield GpuLoad(device, duty_pct, p.pid, time.monotonic())


def burn(device: int, duty_pct: int, size: int, seconds: float, slice_s: float = 0.02) -> None:
    """Matrix multiplications on `device` for duty_pct% of each slice, for `seconds`."""
    import torch

    dev = torch.device(f"cuda:{device}")
    a = torch.randn(size, size, device=dev)
    b = torch.randn(size, size, device=dev)
    torch.cuda.synchronize(dev)
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        while time.monotonic() - t0 < slice_s * duty_pct / 100:
            a = a @ b
            a = a / a.norm()
            torch.cuda.synchronize(dev)
        rest = slice_s - (time.monotonic() - t0)
        if rest > 0:
            time.sleep(rest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--duty", type=int, default=100)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=3600)
    args = ap.parse_args()
    burn(args.device, args.duty, args.size, args.seconds)


if __name__ == "__main__":
    main()
