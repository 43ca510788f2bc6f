"""The faults a scenario may ask for, by family and kind, with their parameters (validated on load).

The runner's fault adapters (`harness.faultrun`) implement exactly these. `fault_bounds()` gives each
numeric parameter's range: Toxiproxy's for the toxics (whole numbers, as its int64 attributes take
them), the CPU fault's own for contention and quota.
"""

from __future__ import annotations

import os
import re
from typing import Any

from harness.checks.base import Param
from harness.yamlnodes import Bound
from wire.durations import MAX_DURATION_S

_STREAM = Param("choice:upstream,downstream", help="direction the toxic acts on (default downstream)")
_TOXICITY = Param("number", help="share of connections affected, 0..1 (default 1)")
_SHARE = Param("number", help="share of the calls affected, 0..1 (default 1)")
_SHARE_PCT = Param("number", help="the same share in percent, 0..100 (give share or share_pct)")
_METHOD = Param("str", help="only calls of this method: /pkg.Service/Method, pkg.Service/Method or Method")
_HTTP_METHOD = Param("str", help="only requests of this HTTP method (GET, POST, ...)")
_PATH = Param("str", help="only requests whose target starts with this path, or matches it as a glob (* ? [])")
_HEADER = Param("str", help="only requests carrying this header: `name`, or `name: value` (the value may be a glob)")
_HTTP_FILTERS = {"share": _SHARE, "share_pct": _SHARE_PCT, "method": _HTTP_METHOD, "path": _PATH, "header": _HEADER}

FAULT_FAMILIES: dict[str, dict[str, dict[str, Param]]] = {
    "network": {
        "latency": {"latency_ms": Param("int", required=True, help="added delay in ms"),
                    "jitter_ms": Param("int"), "stream": _STREAM, "toxicity": _TOXICITY},
        "bandwidth": {"rate_kbps": Param("int", required=True, help="KB/s"), "stream": _STREAM,
                      "toxicity": _TOXICITY},
        "slow_close": {"delay_ms": Param("int", required=True), "stream": _STREAM},
        "timeout": {"timeout_ms": Param("int", required=True), "stream": _STREAM, "toxicity": _TOXICITY},
        "reset_peer": {"timeout_ms": Param("int"), "stream": _STREAM, "toxicity": _TOXICITY},
        "slicer": {"average_size": Param("int", required=True), "size_variation": Param("int"),
                   "delay_us": Param("int"), "stream": _STREAM},
        "limit_data": {"bytes": Param("int", required=True), "stream": _STREAM},
        # The link unreachable: the proxy stops listening and closes every connection (Toxiproxy's
        # `enabled: false`); new connections are refused until the fault is removed (re-enabled).
        "down": {},
        # Call-level (HTTP/2, gRPC): one draw per call, so a single shared connection is hit in part.
        "grpc_delay": {"delay_ms": Param("int", required=True, help="how long the chosen calls' requests are held"),
                       "jitter_ms": Param("int"), "share": _SHARE, "share_pct": _SHARE_PCT, "method": _METHOD},
        "grpc_error": {"status": Param("grpc_status", help="gRPC status: a code 1..16 or its name "
                                                         "(default 14, UNAVAILABLE)"),
                       "message": Param("str", help="grpc-message the client gets"),
                       "share": _SHARE, "share_pct": _SHARE_PCT, "method": _METHOD},
        # Call-level (HTTP/1.x and HTTP/2): per request, as Envoy's fault filter
        "http_delay": {"delay_ms": Param("int", required=True, help="how long the chosen requests are held "
                                                                     "before they go to the target"),
                       "jitter_ms": Param("int"), **_HTTP_FILTERS},
        "http_error": {"status": Param("int", help="the HTTP status the proxy answers with (default 503)"),
                       "body": Param("str", help="the body of that answer (default empty)"), **_HTTP_FILTERS},
    },
    "cpu": {
        "contention": {"workers": Param("int", help="competing busy workers (default: one per CPU)"),
                       "load_pct": Param("int", help="each worker's load, 1..100 (default 100)"),
                       "pin": Param("bool", help="pin the workers to the target's CPUs (default true)")},
        "quota": {"pct": Param("number", help="CPU share of one core for the target, 1..100 (or pct_of_use)"),
                  "pct_of_use": Param("number", help="instead of pct: this share of the CPU the target used in "
                                                     "the 2 s before the fault, 1..100 (the same squeeze on a "
                                                     "fast machine and a slow one)"),
                  "period_ms": Param("int", help="the CFS period the share is enforced over (default 100 ms); "
                                                 "a throttled target waits up to period x (1 - pct), so a "
                                                 "shorter period spreads the same share into shorter stalls")},
    },
    "process": {
        "pause": {"duration": Param("duration", required=True, help="how long the target stays stopped")},
    },
}

MAX_TOXIC_MS = 60_000            # a toxic's delay or timeout: a minute is already an outage
WORKERS_PER_CPU = 4              # contention beyond a few burners per core measures the scheduler, not the target

_MS = Bound(0, MAX_TOXIC_MS, "ms", whole=True)
_BOUNDS: dict[str, Bound] = {
    "latency_ms": _MS, "jitter_ms": _MS, "delay_ms": _MS, "timeout_ms": _MS,
    "rate_kbps": Bound(0, 10_000_000, "KB/s", above=True, whole=True),
    "toxicity": Bound(0, 1, note="(the share of connections affected)"),
    "average_size": Bound(1, 1 << 20, "bytes", whole=True),
    "size_variation": Bound(0, 1 << 20, "bytes", whole=True),   # and less than average_size (the loader)
    "delay_us": Bound(0, MAX_TOXIC_MS * 1000, "us", whole=True),
    "bytes": Bound(0, 1 << 40, "bytes", whole=True),
    "load_pct": Bound(1, 100, "%", whole=True),
    "pct": Bound(1, 100, "% of one core"),
    "pct_of_use": Bound(1, 100, "% of the target's recent CPU use"),
    "period_ms": Bound(1, 1000, "ms", whole=True, note="(the kernel takes 1 ms to 1 s)"),
    "duration": Bound(0, MAX_DURATION_S, above=True, duration=True),
    "share": Bound(0, 1, note="(the share of calls affected)"),
    "share_pct": Bound(0, 100, "%", note="of the calls"),
    "status": Bound(1, 16, whole=True, note="(a gRPC status code: 4 DEADLINE_EXCEEDED, 8 RESOURCE_EXHAUSTED, "
                                            "13 INTERNAL, 14 UNAVAILABLE, ...)"),
    "http_error.status": Bound(200, 599, whole=True, note="(an HTTP status: 429, 500, 503, ...)"),
}
# The faults that act per call (only shadowtest's own proxy has them; they must read the traffic)
CALL_FAULTS = frozenset({"grpc_delay", "grpc_error", "http_delay", "http_error"})
# What `on: DEPENDENCY` may take: the connection-level network faults (a dependency speaks its own
# protocol, Redis's RESP, which the call-level toxics cannot read).
DEPENDENCY_FAULTS = frozenset(k for k in FAULT_FAMILIES["network"] if k not in CALL_FAULTS)
MAX_BODY = 4096                  # an http_error body: an error page, not a payload
_HTTP_METHOD_RE = re.compile(r"[A-Z][A-Z-]{0,19}")
_HEADER_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}(\s*:\s*[ -~]{0,200})?")

GRPC_STATUS = {1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
               6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
               10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
               15: "DATA_LOSS", 16: "UNAUTHENTICATED"}
MAX_MESSAGE = 200                # grpc-message: one line a person reads
_METHOD_RE = re.compile(r"/?[A-Za-z_][A-Za-z0-9_.]{0,199}(/[A-Za-z_][A-Za-z0-9_]{0,99})?")


def cpu_count() -> int:
    """CPUs this process may run on (what an unpinned contention fault spreads over)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:        # not Linux
        return os.cpu_count() or 1


def fault_bounds() -> dict[str, Bound]:
    """Each numeric fault parameter's range by name; `workers` depends on this machine's CPUs."""
    n = cpu_count()
    workers = Bound(1, WORKERS_PER_CPU * n, whole=True,
                    note=f"({WORKERS_PER_CPU} per CPU; this machine has {n})")
    return _BOUNDS | {"workers": workers}


def fault_problem(kind: str, params: dict[str, Any]) -> tuple[str, str] | None:
    """A rule between a fault's parameters that their ranges cannot say: (parameter, what is wrong,
    to follow 'WHERE.PARAMETER'), or None when they are fine."""
    if "share" in params and "share_pct" in params:
        return "share_pct", ": give share (0..1) or share_pct (0..100), not both"
    if kind == "quota" and "pct" in params and "pct_of_use" in params:
        return "pct_of_use", ": give pct (of one core) or pct_of_use (of the target's recent use), not both"
    if kind == "quota" and "period_ms" in params and "pct" in params and params["pct"] * params["period_ms"] / 100 < 1:
        return "period_ms", (f" {params['period_ms']} at {params['pct']:g} % gives less than 1 ms of CPU per period, "
                             "the kernel's smallest quota; use a longer period")
    if kind.startswith("http_"):
        return _http_problem(params)
    method = params.get("method")
    if method is not None and not _METHOD_RE.fullmatch(method):
        return "method", (f" {method!r} must be a gRPC method: /pkg.Service/Method, pkg.Service/Method or "
                          "Method (letters, digits, _ and .)")
    message = params.get("message")
    if message is not None and (len(message) > MAX_MESSAGE or not message.isascii() or not message.isprintable()):
        return "message", f" must be printable ASCII of at most {MAX_MESSAGE} characters"
    return None


def _http_problem(params: dict[str, Any]) -> tuple[str, str] | None:
    method = params.get("method")
    if method is not None and not _HTTP_METHOD_RE.fullmatch(method):
        return "method", f" {method!r} must be an HTTP method in capitals: GET, POST, PUT, DELETE, ..."
    path = params.get("path")
    if path is not None and not (path[:1] in ("/", "*") and len(path) <= 200 and path.isascii()
                                 and path.isprintable() and " " not in path):
        return "path", (f" {path!r} must be a request path (starting with /) or a glob (/search*), printable "
                        "ASCII without spaces, at most 200 characters")
    header = params.get("header")
    if header is not None and not _HEADER_RE.fullmatch(header):
        return "header", (f" {header!r} must be a header name (x-canary) or `name: value` (x-canary: 1, the "
                          "value may be a glob)")
    body = params.get("body")
    if body is not None and len(body) > MAX_BODY:
        return "body", f" is {len(body)} characters; at most {MAX_BODY}"
    return None
