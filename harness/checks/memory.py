"""memory_flat: the target's memory does not grow through the judged window.

The harness samples the target's memory every half period from outside it: the RSS of its process
(the bundled agent, or an external service's `pid:`), or its cgroup's memory.current (`cgroup:`).
A leak is a slope: the least-squares line through the samples of the window, after a warm-up
(caches, JIT, pools filling), in MB per minute. A slope alone over a short window is noisy (an
allocator returning a few MB moves it), so the check fails only when the slope is over its bound
AND the memory really grew by more than `min_growth_mb` from the window's first samples to its last.

For the bundled agent the runner also traces its Python heap (tracemalloc, started and read through
the agent's /heap endpoints) once the memory is seen growing a third of the way into the window:
the allocation sites whose live blocks grew most are the evidence, and a failing verdict names the
first ones. A flat agent is never traced (tracing costs it ~50 % more CPU a call).
"""

from __future__ import annotations

from harness.checks.base import CHECKS, Param, Verdict, nothing_to_judge, phase_window, verdict
from harness.scenario import CheckSpec
from harness.timeline import Timeline


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t seconds, MB) in MB per minute (0 for fewer than two distinct times)."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var <= 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in points) / var * 60.0


def _edge(values: list[float]) -> float:
    """The median of a few samples at one end of the window (one sample's noise is not growth)."""
    s = sorted(values)
    return s[len(s) // 2]


def _sites(heap: dict | None, shown: int = 2) -> str:
    """Where the Python heap grew, for the verdict line: "; Python heap +37.5 MB, most at
    broken_agent.py:210 (+37.5 MB, 600 blocks)"; "" without tracing."""
    if not heap:
        return ""
    sites = [s for s in heap.get("sites", []) if s.get("grown_kb", 0) > 0][:shown]
    if not sites:
        return f"; the Python heap grew {heap.get('grown_mb', 0):+.1f} MB, no site grew (memory outside Python?)"
    where = ", ".join(f"{s['site'].rsplit('/', 1)[-1]} (+{s['grown_kb'] / 1024:.1f} MB, {s['blocks']} blocks)"
                      for s in sites)
    return f"; Python heap {heap.get('grown_mb', 0):+.1f} MB, most at {where}"


class MemoryFlat:
    name = "memory_flat"
    params = {"phase": Param("phase", help="default: the whole run"),
              "warmup_s": Param("duration", help="left out at the start of the window (default 2s)"),
              "max_mb_per_min": Param("number", help="largest slope allowed (default 20 MB/min)"),
              "min_growth_mb": Param("number", help="growth below this never fails, whatever the slope "
                                                    "(default 8 MB)"),
              "allocations": Param("bool", help="once the bundled agent's memory is seen growing, trace its "
                                                "Python heap to name the sites that grew (default true)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        start, end = phase_window(tl, spec)
        warm = spec.params.get("warmup_s", 2.0)
        bound = spec.params.get("max_mb_per_min", 20.0)
        floor = spec.params.get("min_growth_mb", 8.0)
        samples = tl.outside.get("memory") or []
        of = tl.outside.get("memory_of") or "the target"
        if not samples:
            return nothing_to_judge(spec, "no memory samples: the target's process is not known to the harness "
                                    "(an external service needs `pid:` or `cgroup:` under target.external)")
        points = [(t, mb) for t, mb in samples if start + warm <= t <= end]
        if len(points) < 4:
            return nothing_to_judge(spec, f"only {len(points)} memory samples of {of} in {start + warm:.1f}-"
                                    f"{end:.1f}s (after the {warm:g}s warm-up): too few for a slope")
        slope = slope_per_min(points)
        k = max(1, len(points) // 10)
        first, last = _edge([v for _, v in points[:k]]), _edge([v for _, v in points[-k:]])
        growth = last - first
        top = max(v for _, v in points)
        evidence = {"of": of, "window_s": [round(points[0][0], 3), round(points[-1][0], 3)], "samples": len(points),
                    "first_mb": round(first, 1), "last_mb": round(last, 1), "max_mb": round(top, 1),
                    "growth_mb": round(growth, 1), "slope_mb_per_min": round(slope, 2),
                    "max_mb_per_min": bound, "min_growth_mb": floor}
        said = (f"{of}: {first:.0f} -> {last:.0f} MB (max {top:.0f}) over {points[-1][0] - points[0][0]:.0f}s, "
                f"{slope:+.1f} MB/min")
        heap = tl.outside.get("heap")
        if heap:
            evidence |= {"python_heap_grown_mb": heap.get("grown_mb"), "heap_sites": heap.get("sites", [])[:5]}
        if slope > bound and growth > floor:
            return verdict(spec, False, f"memory grows: {said}; at most {bound:g} MB/min (growth over "
                           f"{floor:g} MB): a leak" + _sites(heap), **evidence)
        return verdict(spec, True, f"memory flat: {said} (at most {bound:g} MB/min, or under {floor:g} MB "
                       "of growth)", **evidence)


for _check in (MemoryFlat(),):
    CHECKS.add(_check.name, _check)
