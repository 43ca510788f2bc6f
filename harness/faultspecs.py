"""The faults a scenario may ask for, by family and kind, with their parameters (validated on load).

The runner's fault adapters (`harness.faultrun`) implement exactly these.
"""

from __future__ import annotations

from harness.checks.base import Param

_STREAM = Param("choice:upstream,downstream", help="direction the toxic acts on (default downstream)")
_TOXICITY = Param("number", help="share of connections affected, 0..1 (default 1)")

FAULT_FAMILIES: dict[str, dict[str, dict[str, Param]]] = {
    "network": {
        "latency": {"latency_ms": Param("number", required=True, help="added delay in ms"),
                    "jitter_ms": Param("number"), "stream": _STREAM, "toxicity": _TOXICITY},
        "bandwidth": {"rate_kbps": Param("number", required=True, help="KB/s"), "stream": _STREAM,
                      "toxicity": _TOXICITY},
        "slow_close": {"delay_ms": Param("number", required=True), "stream": _STREAM},
        "timeout": {"timeout_ms": Param("number", required=True), "stream": _STREAM, "toxicity": _TOXICITY},
        "reset_peer": {"timeout_ms": Param("number"), "stream": _STREAM, "toxicity": _TOXICITY},
        "slicer": {"average_size": Param("int", required=True), "size_variation": Param("int"),
                   "delay_us": Param("int"), "stream": _STREAM},
        "limit_data": {"bytes": Param("int", required=True), "stream": _STREAM},
    },
    "cpu": {
        "contention": {"workers": Param("int", help="competing busy workers (default: one per CPU)"),
                       "load_pct": Param("number", help="each worker's load, 1..100 (default 100)"),
                       "pin": Param("bool", help="pin the workers to the target's CPUs (default true)")},
        "quota": {"pct": Param("number", required=True, help="CPU share of one core for the target, e.g. 20")},
    },
    "process": {
        "pause": {"duration": Param("duration", required=True, help="how long the target stays stopped")},
    },
}
