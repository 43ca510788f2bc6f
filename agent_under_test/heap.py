"""Where the agent's Python heap grows: tracemalloc started on demand and diffed against a baseline.

    POST /heap/start?frames=N   start tracing (if it is not on) and take the baseline snapshot
    GET  /heap/growth?top=K     the K allocation sites that grew most since the baseline, as JSON
    POST /heap/stop             stop tracing (what this module started only)

Tracing costs every Python allocation a little, so it is off until a harness asks for it (a run
that judges memory_flat does, at its start). What it names is the line that allocated the blocks
still alive, the way a Massif snapshot points at the cache that never frees; memory allocated by C
libraries (torch's tensors) is not traced: the RSS slope is the check, the sites are its evidence.
"""

from __future__ import annotations

import threading
import tracemalloc
from typing import Any

MAX_FRAMES = 8          # deeper tracebacks cost more per allocation than they tell here
MAX_TOP = 50            # sites in one answer
_IGNORED = (tracemalloc.__file__, "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>",
            "<unknown>")


def _snapshot() -> tracemalloc.Snapshot:
    return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, f) for f in _IGNORED]
                                                     + [tracemalloc.Filter(False, __file__)])


class HeapTracer:
    """One per process (tracemalloc is global). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._baseline: tracemalloc.Snapshot | None = None
        self._started_here = False

    def start(self, frames: int = 1) -> dict[str, Any]:
        """Start tracing with `frames` (1..MAX_FRAMES) frames per allocation unless it is on already,
        and take the baseline every later growth is measured against."""
        if not 1 <= frames <= MAX_FRAMES:
            raise ValueError(f"frames must be between 1 and {MAX_FRAMES}, got {frames}")
        with self._lock:
            if not tracemalloc.is_tracing():
                tracemalloc.start(frames)
                self._started_here = True
            self._baseline = _snapshot()
            current, _ = tracemalloc.get_traced_memory()
            return {"tracing": True, "frames": tracemalloc.get_traceback_limit(),
                    "traced_mb": round(current / 2**20, 3)}

    def growth(self, top: int = 10) -> dict[str, Any]:
        """The `top` (1..MAX_TOP) sites whose live blocks grew most since the baseline.

        Raises ValueError when no baseline was taken (or tracing was stopped since)."""
        if not 1 <= top <= MAX_TOP:
            raise ValueError(f"top must be between 1 and {MAX_TOP}, got {top}")
        with self._lock:
            if self._baseline is None or not tracemalloc.is_tracing():
                raise ValueError("heap tracing is off: POST /heap/start first")
            now = _snapshot()
            stats = now.compare_to(self._baseline, "lineno")
            current, peak = tracemalloc.get_traced_memory()
        grown = [s for s in stats if s.size_diff > 0][:top]
        return {"traced_mb": round(current / 2**20, 3), "peak_mb": round(peak / 2**20, 3),
                "grown_mb": round(sum(s.size_diff for s in stats) / 2**20, 3),
                "sites": [{"site": f"{s.traceback[0].filename}:{s.traceback[0].lineno}",
                           "grown_kb": round(s.size_diff / 1024, 1), "blocks": s.count_diff,
                           "live_kb": round(s.size / 1024, 1)} for s in grown]}

    def stop(self) -> dict[str, Any]:
        """Stop tracing if this tracer started it; forget the baseline."""
        with self._lock:
            self._baseline = None
            if self._started_here and tracemalloc.is_tracing():
                tracemalloc.stop()
            self._started_here = False
            return {"tracing": tracemalloc.is_tracing()}


TRACER = HeapTracer()
