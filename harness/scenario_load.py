"""Load and validate scenario YAML into `harness.scenario.Scenario`.

Every error names the file, the line and what is expected, e.g.
``scenarios/x.yaml:12: phases[1].duration: expected a duration like 15s, 500ms or 1m30s, got 'soon'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.checks import CHECKS, Param
from harness.errors import ScenarioError
from harness.faultspecs import FAULT_FAMILIES
from harness.scenario import (
    AgentTarget,
    CheckSpec,
    ExternalTarget,
    FaultSpec,
    GeneratorTraffic,
    MetricNames,
    Phase,
    RecordingTraffic,
    Scenario,
)
from harness.yamlnodes import Node, compose

# Options of the bundled agent the runner passes to AgentProcess, with their types.
AGENT_OPTIONS: dict[str, Param] = {
    "limiter": Param("choice:seed,gradient,off"), "p99_threshold_ms": Param("number"),
    "alert_periods": Param("int"), "resolve_periods": Param("int"), "period_s": Param("number"),
    "tier": Param("choice:full,light"), "device": Param("choice:auto,cpu,cuda"),
    "hpack_table_size": Param("int"), "max_connection_age_s": Param("number"),
    "initial_rate": Param("number"), "min_rate": Param("number"), "max_rate": Param("number"),
    "batch_window_ms": Param("number"), "max_batch": Param("int"), "workers": Param("int"),
    "torch_threads": Param("int"), "seed": Param("int"), "weights": Param("str"), "grace_s": Param("number"),
    "max_message_bytes": Param("int"), "alerts": Param("bool"), "jit": Param("bool"),
    "min_samples": Param("int"), "rejected_ratio_threshold": Param("number"),
}
_TOP = {"name", "description", "seed", "target", "traffic", "phases", "expect", "proxy", "faults"}
RUN_PHASE = "(whole run)"   # the phase name fault windows of top-level faults carry


def _unknown(entries: dict[str, Node], allowed: set[str] | dict[str, Any], what: str) -> None:
    for key, node in entries.items():
        if key not in allowed:
            node.fail(f"{what}: unknown key {key!r}; expected one of: {', '.join(sorted(allowed))}")


def typed(node: Node, param: Param, what: str, phases: set[str] | None = None) -> Any:
    """The node's value checked against `param.type` (see `checks.base.Param`)."""
    kind = param.type
    if kind == "number":
        return node.number(what)
    if kind == "int":
        return node.integer(what)
    if kind == "duration":
        return node.duration(what)
    if kind == "bool":
        return node.boolean(what)
    if kind == "strlist":
        return node.strings(what)
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


def typed_params(node: Node | None, spec: dict[str, Param], what: str,
                 phases: set[str] | None = None) -> dict[str, Any]:
    """A mapping of parameters validated against `spec` (unknown keys and missing required ones fail)."""
    entries = node.mapping(what) if node is not None and node.value() is not None else {}
    _unknown(entries, spec, what)
    out: dict[str, Any] = {}
    for name, param in spec.items():
        if name in entries:
            out[name] = typed(entries[name], param, f"{what}.{name}", phases)
        elif param.required:
            where = node if node is not None else None
            message = f"{what}: missing {name!r} ({param.type}{': ' + param.help if param.help else ''})"
            if where is None:
                raise ScenarioError(message)
            where.fail(message)
    return out


def _target(node: Node) -> AgentTarget | ExternalTarget:
    entries = node.mapping("target")
    if len(entries) != 1 or not set(entries) <= {"agent", "external"}:
        node.fail("target: expected exactly one of 'agent' (the bundled agent) or 'external' (your service)")
    if "agent" in entries:
        return AgentTarget(typed_params(entries["agent"], AGENT_OPTIONS, "target.agent"))
    ext_node = entries["external"]
    ext = ext_node.mapping("target.external")
    spec = {"address": Param("str", required=True), "metrics_url": Param("str"), "events_url": Param("str"),
            "p99_threshold_ms": Param("number"), "alert_periods": Param("int"), "period_s": Param("number")}
    metrics_node = ext.pop("metrics", None)
    _unknown(ext, spec | {"metrics": Param("str")}, "target.external")
    if "address" not in ext:
        ext_node.fail("target.external: missing 'address' (host:port of your gRPC service)")
    values = {k: typed(v, spec[k], f"target.external.{k}") for k, v in ext.items()}
    names = MetricNames()
    if metrics_node is not None:
        fields = {k: Param("str") for k in MetricNames.__dataclass_fields__}
        names = MetricNames(**typed_params(metrics_node, fields, "target.external.metrics"))
    return ExternalTarget(metrics=names, **values)


def _traffic(node: Node, base: Path) -> RecordingTraffic | GeneratorTraffic:
    entries = node.mapping("traffic")
    if ("recording" in entries) == ("generator" in entries):
        node.fail("traffic: expected exactly one of 'recording: FILE' or 'generator: {rate: N, ...}'")
    if "generator" in entries:
        _unknown(entries, {"generator"}, "traffic")
        spec = {"rate": Param("number", required=True, help="calls/s"),
                "pattern": Param("choice:poisson,bursty,constant"), "seed": Param("int"),
                "stream_share": Param("number")}
        return GeneratorTraffic(**typed_params(entries["generator"], spec, "traffic.generator"))
    spec = {"recording": Param("str", required=True), "speed": Param("number"), "loop": Param("int"),
            "methods": Param("strlist"), "window": Param("str")}
    values = typed_params(node, spec, "traffic")
    path = Path(values.pop("recording"))
    values["path"] = str(path if path.is_absolute() else base / path)
    if "window" in values:
        values["window"] = _window(entries["window"])
    if values.get("speed", 1.0) <= 0:
        entries["speed"].fail("traffic.speed: expected a number > 0 (0.1 to 100)")
    return RecordingTraffic(**values)


def _window(node: Node) -> tuple[float, float]:
    text = node.string("traffic.window")
    parts = text.split(":")
    if len(parts) != 2:
        node.fail(f"traffic.window: expected START:END like 0s:30s, got {text!r}")
    from harness.durations import parse_duration
    try:
        return parse_duration(parts[0]), parse_duration(parts[1])
    except ValueError as exc:
        node.fail(f"traffic.window: {exc}")


def _fault(node: Node, what: str) -> FaultSpec:
    entries = node.mapping(what)
    families = [f for f in FAULT_FAMILIES if f in entries]
    if len(families) != 1:
        node.fail(f"{what}: expected exactly one of {', '.join(FAULT_FAMILIES)} (e.g. network: latency)")
    family = families[0]
    kinds = FAULT_FAMILIES[family]
    kind = entries.pop(family).string(f"{what}.{family}")
    if kind not in kinds:
        node.fail(f"{what}: unknown {family} fault {kind!r}; expected one of: {', '.join(sorted(kinds))}")
    timing = {k: entries.pop(k).duration(f"{what}.{k}") for k in ("after", "for") if k in entries}
    _unknown(entries, kinds[kind], f"{what} ({family}: {kind})")
    params = {k: typed(v, kinds[kind][k], f"{what}.{k}") for k, v in entries.items()}
    for name, param in kinds[kind].items():
        if param.required and name not in params:
            node.fail(f"{what} ({family}: {kind}): missing {name!r} ({param.help or param.type})")
    return FaultSpec(family, kind, params, after_s=timing.get("after", 0.0), for_s=timing.get("for"),
                     line=node.line)


def _phases(node: Node) -> tuple[Phase, ...]:
    items = node.sequence("phases")
    if not items:
        node.fail("phases: expected at least one phase ({name: baseline, duration: 15s})")
    phases, seen = [], set()
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
        duration = entries["duration"].duration(f"{what}.duration")
        if duration <= 0:
            entries["duration"].fail(f"{what}.duration: expected a duration > 0")
        faults = tuple(_fault(f, f"{what}.faults[{j}]")
                       for j, f in enumerate(entries["faults"].sequence(f"{what}.faults"))) \
            if "faults" in entries and entries["faults"].value() else ()
        load = entries["load"].number(f"{what}.load", minimum=0.01, maximum=100) if "load" in entries else 1.0
        phases.append(Phase(name, duration, faults, load=load, line=item.line))
    return tuple(phases)


def _checks(node: Node, phases: set[str]) -> tuple[CheckSpec, ...]:
    out = []
    for i, item in enumerate(node.sequence("expect")):
        what = f"expect[{i}]"
        entries = item.mapping(what)
        if len(entries) != 1:
            item.fail(f"{what}: expected one check per item, like '- alert_silent: {{phase: baseline}}'")
        (kind, params), = entries.items()
        if kind not in CHECKS:
            item.fail(f"{what}: unknown check {kind!r}; expected one of: {', '.join(sorted(CHECKS))}")
        values = typed_params(params, CHECKS[kind].params, f"{what}.{kind}", phases) \
            if params.value() is not None else typed_params(None, CHECKS[kind].params, f"{what}.{kind}")
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
    target = _target(entries["target"])
    traffic = _traffic(entries["traffic"], base or Path("."))
    phases = _phases(entries["phases"])
    expect = _checks(entries["expect"], {p.name for p in phases}) if "expect" in entries else ()
    return Scenario(
        name=name, target=target, traffic=traffic, phases=phases, expect=expect,
        seed=entries["seed"].integer("seed") if "seed" in entries else 0,
        description=entries["description"].string("description") if "description" in entries else "",
        proxy=entries["proxy"].boolean("proxy") if "proxy" in entries else True, source=file,
        faults=tuple(_fault(f, f"faults[{j}]") for j, f in enumerate(entries["faults"].sequence("faults")))
        if "faults" in entries and entries["faults"].value() else ())


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file. Raises ScenarioError when it is missing or invalid."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ScenarioError(f"cannot read the scenario: {exc.strerror}", str(p)) from exc
    return load_scenario_text(text, str(p), p.parent)
