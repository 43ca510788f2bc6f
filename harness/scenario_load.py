"""Load and validate scenario YAML into `harness.scenario.Scenario`.

Every error names the file, the line and what is expected, e.g.
``scenarios/x.yaml:12: phases[1].duration: expected a duration like 15s, 500ms or 1m30s, got 'soon'``.
Every number is range-checked (the tables below; docs/harness.md lists them), e.g.
``scenarios/x.yaml:8: traffic.generator.rate -5 must be between 0.1 and 100000 calls/s``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent_under_test.arrivals import PATTERNS
from agent_under_test.config import CACHES, DEVICES, LIMITERS, ServeOptions
from agent_under_test.degrade import TIERS
from harness.checks import CHECKS, Param
from harness.checks.rule import declare_rule
from harness.errors import ScenarioError
from harness.faultspecs import (
    CALL_FAULTS,
    DEPENDENCY_FAULTS,
    FAULT_FAMILIES,
    GRPC_STATUS,
    MAX_TOXIC_MS,
    fault_bounds,
    fault_problem,
)
from harness.scenario import (
    DEPENDENCY_KINDS,
    UNTIL_END,
    AgentTarget,
    CheckSpec,
    DependencySpec,
    ExternalTarget,
    FaultSpec,
    GeneratorTraffic,
    MetricNames,
    Phase,
    PrometheusSpec,
    RecordingTraffic,
    Scenario,
)
from harness.yamlnodes import Bound, Node, compose
from replay.schedule import MAX_SPEED, MIN_SPEED
from wire.durations import MAX_DURATION_S, format_duration

# Options of the bundled agent the runner passes to AgentProcess, with their types.
AGENT_OPTIONS: dict[str, Param] = {
    "limiter": Param("choice:" + ",".join(LIMITERS.names())), "p99_threshold_ms": Param("number"),
    "alert_periods": Param("int"), "resolve_periods": Param("int"), "period_s": Param("number"),
    "tier": Param("choice:" + ",".join(TIERS)), "device": Param("choice:" + ",".join(DEVICES)),
    "hpack_table_size": Param("int"), "max_connection_age_s": Param("number"),
    "initial_rate": Param("number"), "min_rate": Param("number"), "max_rate": Param("number"),
    "batch_window_ms": Param("number"), "batch_window": Param("choice:adaptive,fixed"), "max_batch": Param("int"),
    "workers": Param("int"),
    "torch_threads": Param("int"), "seed": Param("int"), "weights": Param("str"), "grace_s": Param("number"),
    "max_message_bytes": Param("int"), "alerts": Param("bool"), "jit": Param("bool"),
    "min_samples": Param("int"), "rejected_ratio_threshold": Param("number"),
    "queue_light_depth": Param("int"),   # 0: only the P99 alert degrades (no queue-driven light tier)
    # The response cache (agent_under_test/cache.py). `cache: redis` comes with `dependencies: {redis: {}}`,
    # whose proxy's address the runner hands the agent as redis_url (so redis_url is not an option here).
    "cache": Param("choice:" + ",".join(CACHES)), "cache_threshold": Param("number"),
    "cache_local_ttl_s": Param("number"), "cache_redis_ttl_s": Param("number"),
    "redis_timeout_ms": Param("number"), "redis_tracking": Param("bool"), "circuit_failures": Param("int"),
    "circuit_open_s": Param("number"), "dependency_threshold_ms": Param("number"),
}
_TOP = {"name", "description", "seed", "target", "traffic", "phases", "expect", "proxy", "faults", "prometheus",
        "dependencies"}
RUN_PHASE = "(whole run)"   # the phase name fault windows of top-level faults carry

# ---- ranges: every number a scenario gives is checked against one of these -------------------------
MAX_RATE = 100_000           # calls/s the traffic may offer (the generator's rate times a phase's load)
MAX_PHASES = 100
MAX_MS = MAX_DURATION_S * 1000
SEED = Bound(0, 2**63 - 1, whole=True)
_PERIODS = Bound(1, 100, "periods", whole=True)
_LATENCY_MS = Bound(0, MAX_TOXIC_MS, "ms", above=True)
_LIMITER_RATE = Bound(0, 1_000_000, "calls/s", above=True)
_DURATION = Bound(0, MAX_DURATION_S, above=True, duration=True)     # more than 0s, at most 24h
_OFFSET = Bound(0, MAX_DURATION_S, duration=True)                   # 0s to 24h

AGENT_BOUNDS: dict[str, Bound] = {
    "p99_threshold_ms": _LATENCY_MS, "alert_periods": _PERIODS, "resolve_periods": _PERIODS,
    "period_s": Bound(0.01, 3600, "s"), "hpack_table_size": Bound(0, 2**32 - 1, "bytes", whole=True),
    "max_connection_age_s": Bound(0, MAX_DURATION_S, "s", above=True),
    "initial_rate": _LIMITER_RATE, "min_rate": _LIMITER_RATE, "max_rate": _LIMITER_RATE,
    "batch_window_ms": Bound(0, 1000, "ms"), "max_batch": Bound(1, 1024, whole=True),
    "workers": Bound(0, 64, whole=True), "torch_threads": Bound(0, 256, whole=True), "seed": SEED,
    "grace_s": Bound(0, 3600, "s"), "max_message_bytes": Bound(1, 1 << 30, "bytes", whole=True),
    "min_samples": Bound(1, 1_000_000, "calls", whole=True),
    "queue_light_depth": Bound(0, 1_000_000, "calls", whole=True),
    "rejected_ratio_threshold": Bound(0, 1, note="(a share of the offered calls)"),
    "cache_threshold": Bound(0, 1, above=True, note="(a cosine similarity)"),
    "cache_local_ttl_s": Bound(0, MAX_DURATION_S, "s", above=True),
    "cache_redis_ttl_s": Bound(0, MAX_DURATION_S, "s", above=True),
    "redis_timeout_ms": Bound(0, MAX_TOXIC_MS, "ms", above=True),
    "circuit_failures": Bound(1, 1_000_000, "failures", whole=True),
    "circuit_open_s": Bound(0, 3600, "s", above=True),
    "dependency_threshold_ms": _LATENCY_MS,
}
TRAFFIC_BOUNDS: dict[str, Bound] = {
    "rate": Bound(0.1, MAX_RATE, "calls/s"), "seed": SEED, "stream_share": Bound(0, 1),
    "speed": Bound(MIN_SPEED, MAX_SPEED, "x the recorded pace"), "loop": Bound(1, 1000, "times", whole=True),
    "scale": Bound(0.01, 100, "x the recorded connections"),
    "timeout_ms": Bound(1, 600_000, "ms"),
    "repeat_pct": Bound(0, 100, "% of the calls"), "repeat_pool": Bound(1, 100_000, "snapshots", whole=True),
}
_TIMEOUT = Param("number", help="each call's deadline in ms, sent as grpc-timeout (default: 4 periods, at "
                                "least 2 s)")
PHASE_BOUNDS: dict[str, Bound] = {
    "duration": _DURATION, "load": Bound(0.01, 100, "x the traffic's rate"), "after": _OFFSET, "for": _DURATION,
}
# Check parameters by name (a parameter a check adds later falls back to `default_bound`).
CHECK_BOUNDS: dict[str, Bound] = {
    "within_periods": Bound(0, 100, "periods", whole=True), "consecutive": _PERIODS,
    "threshold_ms": _LATENCY_MS, "p99_ms": _LATENCY_MS,
    "at_least_pct": Bound(0, 100, "%", above=True), "to_pct_of_baseline": Bound(0, 100, "%", above=True),
    "max_pct": Bound(0, 100, "%"), "tolerance_pct": Bound(0, 100, "%"),
    "min_increase_pct": Bound(0, 10_000, "%"), "min_increase_ms": Bound(0, MAX_MS, "ms"),
    "within_s": _DURATION, "settle_s": _OFFSET, "per_s": _DURATION,
    "fire_after": _PERIODS, "resolve_after": _PERIODS, "min_samples": AGENT_BOUNDS["min_samples"],
}


def default_bound(name: str, kind: str) -> Bound | None:
    """The range of a numeric parameter no table names: by its type and the unit its name ends in."""
    if kind == "duration":
        return _OFFSET
    if kind not in ("number", "int"):
        return None
    whole = kind == "int"
    if name.endswith("_pct"):
        return Bound(0, 100, "%", whole=whole)
    if name.endswith("_ms"):
        return Bound(0, MAX_MS, "ms", whole=whole)
    if name.endswith("_s"):
        return Bound(0, MAX_DURATION_S, "s", whole=whole)
    return Bound(0, whole=whole)


def _unknown(entries: dict[str, Node], allowed: set[str] | dict[str, Any], what: str) -> None:
    for key, node in entries.items():
        if key not in allowed:
            node.fail(f"{what}: unknown key {key!r}; expected one of: {', '.join(sorted(allowed))}")


def typed(node: Node, param: Param, what: str, phases: set[str] | None = None,
          bound: Bound | None = None) -> Any:
    """The node's value checked against `param.type` (see `checks.base.Param`); numbers against `bound`
    (by default `default_bound` of the parameter's name)."""
    kind = param.type
    if bound is None:
        bound = default_bound(what.rsplit(".", 1)[-1], kind)
    if kind == "number":
        return node.number(what, bound)
    if kind == "int":
        return node.integer(what, bound)
    if kind == "grpc_status":
        return _grpc_status(node, what, bound)
    if kind == "duration":
        return node.duration(what, bound)
    if kind == "loop":
        return _loop(node, what, bound)
    if kind == "rules":
        return _response_rules(node, what)
    if kind == "bool":
        return node.boolean(what)
    if kind == "strlist":
        return node.strings(what)
    if kind == "list":    # strings or whole numbers (a replay option's list: methods, flows)
        items = node.sequence(what) if isinstance(node.value(), list) else [node]
        return tuple(str(n.scalar(what)) for n in items)
    if kind == "phases":
        names = node.strings(what)
        for name in names:
            if phases is not None and name not in phases:
                node.fail(f"{what}: no phase named {name!r}; the phases are: {', '.join(sorted(phases))}")
        return names
    if kind.startswith("choice:"):
        choices = kind.split(":", 1)[1].split(",")
        raw = node.scalar(what)
        # YAML 1.1 reads a bare `off` as false: take it as the word the user wrote.
        value = {False: "off", True: "on"}.get(raw, raw) if isinstance(raw, bool) else node.string(what)
        if value not in choices:
            node.fail(f"{what}: expected one of {', '.join(choices)}, got {value!r}")
        return value
    value = node.string(what)
    if kind == "phase" and phases is not None and value not in phases:
        node.fail(f"{what}: no phase named {value!r}; the phases are: {', '.join(sorted(phases))}")
    return value


def _grpc_status(node: Node, what: str, bound: Bound | None) -> int:
    """A gRPC status code (1..16) or its name, any case: `14`, `UNAVAILABLE`, `unavailable`."""
    raw = node.scalar(what)
    if isinstance(raw, str):
        codes = {name: code for code, name in GRPC_STATUS.items()}
        code = codes.get(raw.strip().upper())
        if code is None:
            node.fail(f"{what}: {raw!r} is not a gRPC status; use a code 1..16 or a name such as UNAVAILABLE, "
                      "RESOURCE_EXHAUSTED, INTERNAL, DEADLINE_EXCEEDED")
        return code
    return node.integer(what, bound)


_RULE_KEYS = {"field", "min", "max", "in", "non_empty", "equals_request"}


def _response_rules(node: Node, what: str) -> tuple[Any, ...]:
    """responses_valid's rules: [{field: PATH, min/max/in/non_empty/equals_request}, ...]."""
    from harness.responses import MAX_RULES, ResponseRule

    items = node.sequence(what)
    if not items:
        node.fail(f"{what}: expected at least one rule ({{field: confidence, min: 0, max: 1}})")
    if len(items) > MAX_RULES:
        node.fail(f"{what}: {len(items)} rules; at most {MAX_RULES}")
    rules = []
    for i, item in enumerate(items):
        w = f"{what}[{i}]"
        entries = item.mapping(w)
        _unknown(entries, _RULE_KEYS, w)
        if "field" not in entries:
            item.fail(f"{w}: missing 'field' (a dotted path in the response: confidence, risk.limit)")
        path = entries["field"].string(f"{w}.field")
        if not path or len(path) > 200 or any(not part for part in path.split(".")):
            entries["field"].fail(f"{w}.field {path!r} must be a dotted path of field names")
        if len(entries) == 1:
            item.fail(f"{w}: a rule needs at least one of min, max, in, non_empty, equals_request")
        allowed = None
        if "in" in entries:
            values = entries["in"].sequence(f"{w}.in")
            if not values or len(values) > 1000:
                entries["in"].fail(f"{w}.in: expected 1 to 1000 allowed values")
            allowed = tuple(v.scalar(f"{w}.in") for v in values)
        rules.append(ResponseRule(
            path, min=entries["min"].number(f"{w}.min") if "min" in entries else None,
            max=entries["max"].number(f"{w}.max") if "max" in entries else None, allowed=allowed,
            non_empty=entries["non_empty"].boolean(f"{w}.non_empty") if "non_empty" in entries else False,
            equals_request=entries["equals_request"].string(f"{w}.equals_request")
            if "equals_request" in entries else None))
    return tuple(rules)


def _loop(node: Node, what: str, bound: Bound | None) -> int | str:
    """A recording's `loop`: a whole number of passes, or `until_end` (as many as the phases need)."""
    raw = node.scalar(what)
    if raw == UNTIL_END:
        return UNTIL_END
    if isinstance(raw, str):
        try:
            float(raw)
        except ValueError:
            node.fail(f"{what}: expected a whole number of passes or {UNTIL_END} (repeat the recording until "
                      f"the scenario ends), got {raw!r}")
    return node.integer(what, bound)


def typed_params(node: Node | None, spec: dict[str, Param], what: str,
                 phases: set[str] | None = None, bounds: dict[str, Bound] | None = None) -> dict[str, Any]:
    """A mapping of parameters validated against `spec` (unknown keys and missing required ones fail)
    and their numbers against `bounds` (by name)."""
    entries = node.mapping(what) if node is not None and node.value() is not None else {}
    _unknown(entries, spec, what)
    out: dict[str, Any] = {}
    for name, param in spec.items():
        if name in entries:
            out[name] = typed(entries[name], param, f"{what}.{name}", phases, (bounds or {}).get(name))
        elif param.required:
            where = node if node is not None else None
            message = f"{what}: missing {name!r} ({param.type}{': ' + param.help if param.help else ''})"
            if where is None:
                raise ScenarioError(message)
            where.fail(message)
    return out


def _target(node: Node, base: Path) -> AgentTarget | ExternalTarget:
    entries = node.mapping("target")
    if len(entries) != 1 or not set(entries) <= {"agent", "external"}:
        node.fail("target: expected exactly one of 'agent' (the bundled agent) or 'external' (your service)")
    if "agent" in entries:
        options = typed_params(entries["agent"], AGENT_OPTIONS, "target.agent", bounds=AGENT_BOUNDS)
        _limiter_range(entries["agent"], options)
        _cache_ttls(entries["agent"], options)
        return AgentTarget(options)
    ext_node = entries["external"]
    ext = ext_node.mapping("target.external")
    spec = {"address": Param("str", required=True), "metrics_url": Param("str"), "events_url": Param("str"),
            "p99_threshold_ms": Param("number"), "alert_periods": Param("int"), "period_s": Param("number"),
            "pid": Param("int"), "cgroup": Param("str")}
    metrics_node = ext.pop("metrics", None)
    allow_node = ext.pop("allow", None)
    tls_node = ext.pop("tls", None)
    headers_node = ext.pop("set_headers", None)
    _unknown(ext, spec | {"metrics": Param("str"), "allow": Param("str"), "tls": Param("str"),
                          "set_headers": Param("str")}, "target.external")
    if "address" not in ext:
        ext_node.fail("target.external: missing 'address' (host:port of your service)")
    values = {k: typed(v, spec[k], f"target.external.{k}", bound=AGENT_BOUNDS.get(k) or _WATCH_BOUNDS.get(k))
              for k, v in ext.items()}
    if "cgroup" in values and not Path(values["cgroup"], "memory.current").is_file():
        ext["cgroup"].fail(f"target.external.cgroup {values['cgroup']!r}: no memory.current there (a cgroup v2 "
                           "directory, e.g. /sys/fs/cgroup/system.slice/my.service)")
    _external_allowed(ext["address"], values["address"], allow_node)
    names = MetricNames()
    if metrics_node is not None:
        fields = {k: Param("str") for k in MetricNames.__dataclass_fields__}
        names = MetricNames(**typed_params(metrics_node, fields, "target.external.metrics"))
    tls = _external_tls(tls_node, values["address"], base) if tls_node is not None else None
    headers = _external_headers(headers_node) if headers_node is not None else ()
    return ExternalTarget(metrics=names, tls=tls, set_headers=headers, **values)


_TLS_KEYS = {"ca": Param("str", help="PEM file of the CAs to trust (default: the system CAs)"),
             "cert": Param("str", help="client certificate (PEM) for mTLS"),
             "key": Param("str", help="the client certificate's key"),
             "insecure": Param("bool", help="do not verify the certificate or name"),
             "server_name": Param("str", help="the name sent as SNI and verified (default: the address's host)")}


def _external_tls(node: Node, address: str, base: Path) -> Any:
    """`tls: true` or `tls: {ca, cert, key, insecure, server_name}` (files relative to the scenario),
    checked now: a missing or bad file is an error at its line. The name verified defaults to the
    address's host, also when the traffic goes through the local fault proxy."""
    from replay.senders.tls import TlsConfig, TlsConfigError
    from replay.target import split_target

    if isinstance(node.value(), bool):
        if not node.boolean("target.external.tls"):
            return None
        opts: dict[str, Any] = {}
    else:
        opts = typed_params(node, _TLS_KEYS, "target.external.tls")
        for key in ("ca", "cert", "key"):
            if key in opts:
                opts[key] = str((base / opts[key]) if not Path(opts[key]).is_absolute() else Path(opts[key]))
    opts.setdefault("server_name", split_target(address)[0])
    try:
        return TlsConfig.from_options(True, opts.get("ca"), opts.get("cert"), opts.get("key"),
                                      bool(opts.get("insecure", False)), opts["server_name"])
    except TlsConfigError as exc:
        node.fail(f"target.external.tls: {exc}")


def _external_headers(node: Node) -> tuple[tuple[str, str], ...]:
    """`set_headers: {authorization: Bearer shadow, ...}`: gRPC metadata added to every call."""
    from replay.senders.headers import HeaderError, HeaderPolicy

    entries = node.mapping("target.external.set_headers")
    pairs = tuple(f"{k}={v.string(f'target.external.set_headers.{k}')}" for k, v in entries.items())
    try:
        return HeaderPolicy.from_options(pairs).set_headers
    except HeaderError as exc:
        node.fail(f"target.external.set_headers: {exc}")


def _external_allowed(addr_node: Node, address: str, allow_node: Node | None) -> None:
    """`replay`'s safety check (replay/target.py) on an external target, before any traffic: loopback,
    SHADOWTEST_ALLOW_TARGETS or the allow-targets file, or `allow:` here (true: this host; or hosts/CIDRs)."""
    from replay.errors import TargetNotAllowedError
    from replay.target import check_target, split_target

    try:
        allow: tuple[str, ...] = ()
        if allow_node is not None and isinstance(allow_node.value(), bool):
            allow = (split_target(address)[0],) if allow_node.boolean("target.external.allow") else ()
        elif allow_node is not None:
            allow = allow_node.strings("target.external.allow")
        check_target(address, allow)
    except TargetNotAllowedError as exc:
        reason = str(exc).split("; pass --allow-target", 1)[0].replace("replay to", "send traffic to")
        hint = ("; if it really is a shadow environment, add 'allow: true' (or a list of hosts/CIDRs) "
                "under target.external") if "not allowed" in reason else ""
        addr_node.fail(f"target.external.address: {reason}{hint}")


def _cache_ttls(node: Node, options: dict[str, Any]) -> None:
    """cache_local_ttl_s <= cache_redis_ttl_s (soft before hard), counting the agent's defaults."""
    soft = options.get("cache_local_ttl_s", ServeOptions.cache_local_ttl_s)
    hard = options.get("cache_redis_ttl_s", ServeOptions.cache_redis_ttl_s)
    if soft <= hard:
        return
    entries = node.mapping("target.agent")
    key = "cache_redis_ttl_s" if "cache_redis_ttl_s" in entries else "cache_local_ttl_s"
    entries[key].fail(f"target.agent.{key} {entries[key].text}: cache_local_ttl_s {soft:g} (soft TTL) must be at "
                      f"most cache_redis_ttl_s {hard:g} (hard TTL)")


_DEPENDENCY_KEYS = {"address": Param("str", help="HOST:PORT the dependency listens on (nothing is started then)"),
                    "listen": Param("str", help="HOST:PORT where the harness's proxy for it listens (point "
                                                "your service at it)")}


def _dependencies(node: Node, target: AgentTarget | ExternalTarget, target_node: Node) -> tuple[DependencySpec, ...]:
    """`dependencies: {redis: {}}` (the runner starts a Redis behind a proxy and hands the agent the proxy's
    address) or, for an external target, `{redis: {address: HOST:PORT, listen: HOST:PORT}}`."""
    if node.value() is None:
        node.fail("dependencies: expected a mapping like {redis: {}}")
    entries = node.mapping("dependencies")
    if not entries:
        node.fail("dependencies: expected a mapping like {redis: {}}")
    out = []
    for name, item in entries.items():
        what = f"dependencies.{name}"
        if name not in DEPENDENCY_KINDS:
            item.fail(f"dependencies: unknown dependency {name!r}; expected one of: {', '.join(DEPENDENCY_KINDS)}")
        values = typed_params(item if item.value() is not None else None, _DEPENDENCY_KEYS, what)
        given = item.mapping(what) if item.value() is not None else {}
        for key, value in values.items():
            _host_port(given[key], f"{what}.{key}", value, zero_port=key == "listen")
        if isinstance(target, ExternalTarget):
            missing = [k for k in ("address", "listen") if k not in values]
            if missing:
                item.fail(f"{what}: an external target's dependency needs {' and '.join(repr(k) for k in missing)} "
                          "(address: where it listens; listen: where the harness's proxy for it listens, the "
                          "address your service must use); the harness starts no dependency for a service it "
                          "does not start")
            if values["listen"].rsplit(":", 1)[1] == "0":
                given["listen"].fail(f"{what}.listen {values['listen']}: an external service must be pointed at "
                                     "a fixed port; give one")
        out.append(DependencySpec(name, name, values.get("address"), values.get("listen"), line=item.line))
    if isinstance(target, AgentTarget):
        cache = target.options.get("cache")
        if cache is not None and cache != "redis":
            agent = target_node.mapping("target")["agent"].mapping("target.agent")
            agent["cache"].fail(f"target.agent.cache {cache}: the scenario declares a redis dependency, which the "
                                "agent uses only with cache: redis (leave cache out: the runner sets it)")
    return tuple(out)


def _host_port(node: Node, what: str, value: str, zero_port: bool) -> None:
    host, sep, port = value.rpartition(":")
    lo = 0 if zero_port else 1
    if not sep or not host or not port.isdigit() or not lo <= int(port) <= 65535 or " " in value:
        node.fail(f"{what}: expected HOST:PORT with a port {lo}..65535, like 127.0.0.1:6379, got {value!r}")


def _limiter_range(node: Node, options: dict[str, Any]) -> None:
    """min_rate <= max_rate, counting the agent's defaults for the one not given (else it would not start)."""
    lo = options.get("min_rate", ServeOptions.min_rate)
    hi = options.get("max_rate", ServeOptions.max_rate)
    if lo <= hi:
        return
    entries = node.mapping("target.agent")
    if "min_rate" in entries:
        given = "" if "max_rate" in options else " (the agent's default)"
        entries["min_rate"].fail(f"target.agent.min_rate {entries['min_rate'].text} must be at most "
                                 f"max_rate {hi:g}{given}")
    entries["max_rate"].fail(f"target.agent.max_rate {entries['max_rate'].text} must be at least "
                             f"min_rate {lo:g} (the agent's default)")


def _traffic(node: Node, base: Path) -> RecordingTraffic | GeneratorTraffic:
    entries = node.mapping("traffic")
    if ("recording" in entries) == ("generator" in entries):
        node.fail("traffic: expected exactly one of 'recording: FILE' or 'generator: {rate: N, ...}'")
    if "generator" in entries:
        _unknown(entries, {"generator"}, "traffic")
        spec = {"rate": Param("number", required=True, help="calls/s"),
                "pattern": Param("choice:" + ",".join(PATTERNS.names())), "seed": Param("int"),
                "stream_share": Param("number"), "timeout_ms": _TIMEOUT,
                "repeat_pct": Param("number", help="share of calls that send again a snapshot sent before "
                                                   "(what a response cache hits), 0..100 (default 0)"),
                "repeat_pool": Param("int", help="how many of the latest distinct snapshots a repeat is drawn "
                                                 "from (default 200)")}
        return GeneratorTraffic(**typed_params(entries["generator"], spec, "traffic.generator",
                                               bounds=TRAFFIC_BOUNDS))
    from replay.options import BY_NAME, SCENARIO, OptionError, offered, schedule_options

    spec = {"recording": Param("str", required=True),
            **{o.name: Param(_PARAM_KINDS[o.kind], help=o.help) for o in offered(SCENARIO)},
            "loop": Param("loop", help=f"passes, or {UNTIL_END}"),
            "timeout_ms": _TIMEOUT}   # the older spelling of `timeout`
    values = typed_params(node, spec, "traffic", bounds=TRAFFIC_BOUNDS)
    if "timeout" in values and "timeout_ms" in values:
        entries["timeout_ms"].fail("traffic: give one of timeout and timeout_ms (the older spelling)")
    if "timeout" in values:
        values["timeout_ms"] = values.pop("timeout") * 1000
        if not values["timeout_ms"] > 0:
            entries["timeout"].fail("traffic.timeout: must be above 0 (each call's deadline)")
    path = Path(values.pop("recording"))
    values["path"] = str(path if path.is_absolute() else base / path)
    try:
        # every replay option the file gave, but loop (it may be until_end: the runner counts the passes)
        sched = schedule_options({k: v for k, v in values.items() if k in BY_NAME and k != "loop"})
    except OptionError as exc:
        where = entries.get(exc.option.name) if exc.option else None
        (where or node).fail(exc.spelled(SCENARIO))
    values.update(window=sched.window, flows=tuple(sorted(sched.flows)))
    # Where a warning that the traffic ends early points: the `loop` entry, else the traffic itself.
    values["line"] = entries["loop"].line if "loop" in entries else node.line
    return RecordingTraffic(**values)


# How a scenario types each kind of replay option (replay/options.py).
_PARAM_KINDS = {"number": "number", "int": "int", "list": "list", "window": "str", "duration": "duration",
                "choice": "str", "flag": "bool", "text": "str", "file": "str"}


_WATCH_BOUNDS = {"pid": Bound(1, 1 << 22, whole=True, note="(a process id)")}


def _fault(node: Node, what: str, span_s: float, span: str, dependencies: tuple[str, ...] = ()) -> FaultSpec:
    """One fault; `span_s` is how long it can be held (its phase, or the run for a top-level fault);
    `dependencies`: the names `on:` may take."""
    entries = node.mapping(what)
    on_node = entries.pop("on", None)
    families = [f for f in FAULT_FAMILIES if f in entries]
    if len(families) != 1:
        node.fail(f"{what}: expected exactly one of {', '.join(FAULT_FAMILIES)} (e.g. network: latency)")
    family = families[0]
    kinds = FAULT_FAMILIES[family]
    kind = entries.pop(family).string(f"{what}.{family}")
    if kind not in kinds:
        node.fail(f"{what}: unknown {family} fault {kind!r}; expected one of: {', '.join(sorted(kinds))}")
    timing = {k: entries[k].duration(f"{what}.{k}", PHASE_BOUNDS[k]) for k in ("after", "for") if k in entries}
    if timing.get("after", 0.0) >= span_s:
        entries["after"].fail(f"{what}.after {entries['after'].text} must be less than {span}'s duration "
                              f"{format_duration(span_s)} (the fault would never start)")
    entries = {k: v for k, v in entries.items() if k not in ("after", "for")}
    _unknown(entries, kinds[kind], f"{what} ({family}: {kind})")
    bounds = fault_bounds()
    params = {k: typed(v, kinds[kind][k], f"{what}.{k}", bound=bounds.get(f"{kind}.{k}", bounds.get(k)))
              for k, v in entries.items()}
    for name, param in kinds[kind].items():
        if param.required and name not in params:
            node.fail(f"{what} ({family}: {kind}): missing {name!r} ({param.help or param.type})")
    if family == "cpu" and kind == "quota" and "pct" not in params and "pct_of_use" not in params:
        node.fail(f"{what} (cpu: quota): missing 'pct' (CPU share of one core, 1..100) or 'pct_of_use' "
                  "(share of the target's recent CPU use, 1..100)")
    if "size_variation" in params and params["size_variation"] >= params["average_size"]:
        entries["size_variation"].fail(f"{what}.size_variation {entries['size_variation'].text} must be less "
                                       f"than average_size {params['average_size']} (Toxiproxy's slicer)")
    problem = fault_problem(kind, params)
    if problem is not None:
        entries[problem[0]].fail(f"{what}.{problem[0]}{problem[1]}")
    on = _on(on_node, what, family, kind, dependencies) if on_node is not None else None
    return FaultSpec(family, kind, params, after_s=timing.get("after", 0.0), for_s=timing.get("for"),
                     line=node.line, on=on)


def _on(node: Node, what: str, family: str, kind: str, dependencies: tuple[str, ...]) -> str:
    """`on: redis`: the fault acts on that dependency's link (the proxy between the target and it)."""
    name = node.string(f"{what}.on")
    if name not in dependencies:
        declared = (f"the scenario declares: {', '.join(dependencies)}" if dependencies else
                    "the scenario declares none (add e.g. `dependencies: {redis: {}}`)")
        node.fail(f"{what}.on: no dependency named {name!r}; {declared}")
    if family != "network":
        node.fail(f"{what}.on: only network faults act on a dependency's link ({family}: {kind} acts on the "
                  "target's process)")
    if kind not in DEPENDENCY_FAULTS:
        node.fail(f"{what}.on: network: {kind} is a call-level fault that reads gRPC/HTTP calls; a dependency's "
                  f"link takes {', '.join(sorted(DEPENDENCY_FAULTS))}")
    return name


def _phases(node: Node, traffic: RecordingTraffic | GeneratorTraffic,
            dependencies: tuple[str, ...] = ()) -> tuple[Phase, ...]:
    items = node.sequence("phases")
    if not items:
        node.fail("phases: expected at least one phase ({name: baseline, duration: 15s})")
    if len(items) > MAX_PHASES:
        node.fail(f"phases has {len(items)} phases; a scenario may have at most {MAX_PHASES}")
    phases: list[Phase] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        what = f"phases[{i}]"
        entries = item.mapping(what)
        _unknown(entries, {"name", "duration", "faults", "load"}, what)
        for key in ("name", "duration"):
            if key not in entries:
                item.fail(f"{what}: missing {key!r}")
        name = entries["name"].string(f"{what}.name")
        if name in seen:
            entries["name"].fail(f"{what}.name: duplicate phase name {name!r}")
        seen.add(name)
        duration = entries["duration"].duration(f"{what}.duration", PHASE_BOUNDS["duration"])
        faults = tuple(_fault(f, f"{what}.faults[{j}]", duration, "the phase", dependencies)
                       for j, f in enumerate(entries["faults"].sequence(f"{what}.faults"))) \
            if "faults" in entries and entries["faults"].value() else ()
        load = entries["load"].number(f"{what}.load", PHASE_BOUNDS["load"]) if "load" in entries else 1.0
        if isinstance(traffic, GeneratorTraffic) and traffic.rate * load > MAX_RATE:
            entries["load"].fail(f"{what}.load {entries['load'].text} makes {traffic.rate * load:g} calls/s "
                                 f"(traffic.generator.rate {traffic.rate:g} x {load:g}); at most {MAX_RATE} "
                                 "calls/s")
        phases.append(Phase(name, duration, faults, load=load, line=item.line))
    total = sum(p.duration_s for p in phases)
    if total > MAX_DURATION_S:
        node.fail(f"phases last {format_duration(total)} in all; a run may last at most "
                  f"{format_duration(MAX_DURATION_S)}")
    return tuple(phases)


def _checks(node: Node, phases: set[str]) -> tuple[CheckSpec, ...]:
    if node.value() is None or not node.sequence("expect"):
        node.fail("expect: the list is empty; add at least one check (e.g. '- no_loss: {}'), or leave "
                  "'expect' out to run the scenario unjudged (the run then fails with 'no checks')")
    out = []
    for i, item in enumerate(node.sequence("expect")):
        what = f"expect[{i}]"
        entries = item.mapping(what)
        if len(entries) != 1:
            item.fail(f"{what}: expected one check per item, like '- alert_silent: {{phase: baseline}}'")
        (kind, params), = entries.items()
        if kind not in CHECKS:
            item.fail(f"{what}: unknown check {kind!r}; expected one of: {', '.join(sorted(CHECKS))}")
        values = typed_params(params if params.value() is not None else None, CHECKS[kind].params,
                              f"{what}.{kind}", phases, CHECK_BOUNDS)
        wrong = getattr(CHECKS[kind], "wrong_params", None)      # a check's own rules across its parameters
        if wrong is not None and (why := wrong(values)):
            item.fail(f"{what}.{kind}: {why}")
        out.append(CheckSpec(kind, values, line=item.line))
    return tuple(out)


def load_scenario_text(text: str, file: str = "<scenario>", base: Path | None = None) -> Scenario:
    """Build a Scenario from YAML text. Raises ScenarioError (file, line, what is expected)."""
    root = compose(text, file)
    entries = root.mapping("scenario")
    _unknown(entries, _TOP, "scenario")
    for key in ("name", "target", "traffic", "phases"):
        if key not in entries:
            root.fail(f"scenario: missing {key!r} (a scenario needs name, target, traffic and phases)")
    name = entries["name"].string("name")
    target = _target(entries["target"], base or Path("."))
    traffic = _traffic(entries["traffic"], base or Path("."))
    dependencies = _dependencies(entries["dependencies"], target, entries["target"]) \
        if "dependencies" in entries else ()
    names = tuple(d.name for d in dependencies)
    _cache_needs(entries["target"], target, names)
    phases = _phases(entries["phases"], traffic, names)
    expect = _checks(entries["expect"], {p.name for p in phases}) if "expect" in entries else ()
    expect = tuple(declare_rule(c, target) for c in expect)   # alert_rule: the rule the target declares
    run_s = sum(p.duration_s for p in phases)
    faults = tuple(_fault(f, f"faults[{j}]", run_s, "the run", names)
                   for j, f in enumerate(entries["faults"].sequence("faults"))) \
        if "faults" in entries and entries["faults"].value() else ()
    if getattr(target, "tls", None) is not None:
        calls = sorted({f.kind for p in phases for f in p.faults + faults if f.kind in CALL_FAULTS})
        if calls:
            entries["target"].fail(f"target.external.tls: {', '.join(calls)} cannot be applied to TLS traffic "
                                   "(the fault proxy cannot read it); use network faults, or a plaintext target")
    return Scenario(
        name=name, target=target, traffic=traffic, phases=phases, expect=expect,
        seed=entries["seed"].integer("seed", SEED) if "seed" in entries else 0,
        description=entries["description"].string("description") if "description" in entries else "",
        proxy=entries["proxy"].boolean("proxy") if "proxy" in entries else True, source=file,
        faults=faults,
        prometheus=_prometheus(entries["prometheus"], base) if "prometheus" in entries else None,
        dependencies=dependencies)


def _cache_needs(node: Node, target: AgentTarget | ExternalTarget, dependencies: tuple[str, ...]) -> None:
    """`cache: redis` on the agent needs the Redis the scenario declares (the runner hands it its address)."""
    if isinstance(target, AgentTarget) and target.options.get("cache") == "redis" and "redis" not in dependencies:
        agent = node.mapping("target")["agent"].mapping("target.agent")
        agent["cache"].fail("target.agent.cache redis: needs a Redis: add `dependencies: {redis: {}}` (the runner "
                            "starts one behind a fault proxy and hands the agent its address)")


def _prometheus(node: Node, base: Path | None) -> PrometheusSpec:
    from harness.prom import parse_prometheus  # the rule files are read where the scenario lives

    return parse_prometheus(node, base or Path("."))


def scenario_warnings(s: Scenario) -> tuple[list[str], float | None]:
    """What a valid scenario will get wrong when it runs, as one-line `FILE:LINE: ...` warnings, and
    until when (seconds into the run) its traffic lasts (None when that cannot be told).

    The traffic against the phases: a recording that ends before the scenario leaves the phases after
    it without calls (their checks are then skipped). The recording is read (without its messages) to
    work this out; one that cannot be read is a warning here, and an error when the scenario runs."""
    from capture.errors import CaptureError
    from harness.traffic import coverage
    from replay.errors import ReplayError

    traffic = s.traffic
    line = getattr(traffic, "line", None)
    where = f"{s.source or '<scenario>'}:{line}" if line else (s.source or "<scenario>")
    try:
        cov = coverage(s)
    except (CaptureError, ReplayError, OSError) as exc:
        return [f"{where}: traffic: cannot tell how long the recording lasts: {exc}"], None
    if not cov.short:
        return [], cov.ends_s
    if cov.loops_needed is None:
        return [f"{where}: traffic: {cov.how}: no phase gets any call, so every check will be skipped"], 0.0
    bounds = s.phase_bounds()
    empty = [name for name, (start, _) in bounds.items() if start >= cov.ends_s]
    none = f"; none at all in {', '.join(empty)}" if empty else ""
    loads = "" if all(p.load == 1.0 for p in s.phases) else " (their durations x load)"
    return [f"{where}: traffic runs out at {cov.ends_s:.1f}s of the scenario's {cov.run_s:g}s: {cov.how} lasts "
            f"{cov.lasts_s:.3g}s, the phases use {cov.needs_s:.3g}s of it{loads}; no calls after "
            f"{cov.ends_s:.1f}s in phase {cov.phase}{none} (checks bound to a phase without calls are skipped); "
            f"use 'loop: until_end' (or 'loop: {cov.loops_needed}')"], cov.ends_s


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file. Raises ScenarioError when it is missing or invalid."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ScenarioError(f"cannot read the scenario: {exc.strerror}", str(p)) from exc
    return load_scenario_text(text, str(p), p.parent)
