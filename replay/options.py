"""Every replay option, declared once, and the one ReplayOptions that travels from there to the engine.

Three surfaces take replay options, and each is made from OPTIONS below, so a new option is one line
here and reads the same everywhere:

    surface                        spelling            made by
    `shadowtest replay`            --max-in-flight     click_options()      (harness/commands/replay.py)
    `shadowtest locust`            --shadow-max-in-flight   add_argparse()  (replay/locust_user.py)
    a scenario's `traffic:`        max_in_flight       the scenario loader  (harness/scenario_load.py)

Each surface collects the values by option name (`Option.name`) and calls `build(values)`, which
parses and checks them all in one place (window, methods, method map, TLS, headers, shadow values,
speed/loop/scale ranges) and returns a ReplayOptions; a bad value raises OptionError naming the
option, which each surface spells its own way (`spell`). A Locust master sends the same values, as
JSON, to its workers, whose child processes build the same ReplayOptions from them.

Conventions: a repeatable option is spelled in the singular (`--method A --method B`; `methods:` in
a scenario); methods may also be given comma-separated; a window is START:END with seconds or
durations on either side (`10:70`, `1m:2m30s`); a timeout is seconds or a duration (`2`, `500ms`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from replay.errors import PlanError, SenderError
from replay.schedule import MAX_SPEED, MIN_SPEED, SHARD_BY, ScheduleOptions
from replay.senders import SENDERS
from replay.senders.headers import HeaderPolicy
from replay.senders.tls import TlsConfig
from replay.shadow import ShadowValues
from wire.durations import parse_seconds

if TYPE_CHECKING:   # replay.compare pulls in protobuf: imported only when a run compares
    from argparse import Namespace, _ArgumentGroup

    from replay.compare import Comparer, CompareSpec

SENDER_CHOICES = ("auto", *SENDERS.names())   # auto: by each call's protocol
EVENT_LOOPS = ("auto", "asyncio", "uvloop")
CLI, LOCUST, SCENARIO = "cli", "locust", "scenario"
_EVERYWHERE = frozenset({CLI, LOCUST, SCENARIO})
_COMMANDS = frozenset({CLI, LOCUST})
LOCUST_PREFIX = "shadow-"


@dataclass
class ReplayOptions:
    """How to replay (the schedule options say what and when).

    sender: a registered sender name for every call, or "auto" (by each call's protocol).
    timeout_s: per call, after its last request message. max_in_flight: per connection (a call that
        finds that many outstanding on its connection is not sent, counted as in_flight_cap).
    lookahead_s: how far ahead of now the plan is read (bounds memory).
    spin_us: the real clock spins this long before each send (accuracy vs client CPU; 0: never;
        -1: the clock's default, none with a timerfd at 1 ns slack, 300 us without).
    start_at_ns: t0 on the clock (workers pass a shared one); None: now.
    compare: a `replay.compare.Comparer` (or a CompareSpec, built at start) to check responses
        against recorded ones, or None.
    event_loop: "auto", "asyncio" or "uvloop" (for `run()`). auto: uvloop when it is installed and
        the run uses only the lean senders (h2, http1, tcp) without compare; grpcio's asyncio layer
        (the grpc sender, reflection) stays on the standard loop it is tested with.
    tls: speak TLS to the target (replay.senders.tls.TlsConfig: CA, client certificate, --insecure,
        server name), every sender alike; None: cleartext.
    headers: which recorded headers/metadata go out and what is added (replay.senders.headers.HeaderPolicy);
        None: the default policy (recorded end-to-end headers, no trace context, the replay marker).
    salvage: read a damaged recording's intact part (capture.integrity) and count the calls it lost
        as not sent, "damaged_recording" (the CLI refuses a damaged file without --salvage).
    """

    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    sender: str = "auto"
    sender_options: dict[str, object] = field(default_factory=dict)
    timeout_s: float = 10.0
    max_in_flight: int = 256
    lookahead_s: float = 0.2
    start_at_ns: int | None = None
    stop_grace_s: float = 1.0
    spin_us: int = -1
    allow_targets: tuple[str, ...] = ()
    compare: Comparer | CompareSpec | None = None
    event_loop: str = "auto"
    tls: TlsConfig | None = None
    headers: HeaderPolicy | None = None
    salvage: bool = False


@dataclass(frozen=True)
class Option:
    """One replay option.

    name: the key its value goes by (a scenario's `traffic:` key, the CLI's parameter name).
    kind: number, int, choice, flag, list (repeatable), window (START:END), duration (seconds), text, file.
    flag: its command-line spelling without dashes when that is not `name` with dashes (a repeatable
        option is singular: methods -> method). group: replay, tls or headers (other commands share
        the last two). surfaces: where it is offered (cli, locust, scenario).
    """

    name: str
    kind: str
    default: object
    help: str
    flag: str = ""
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    item: type = str
    group: str = "replay"
    surfaces: frozenset[str] = _COMMANDS
    aliases: tuple[str, ...] = ()   # older command-line spellings, still read (not shown in docs)

    @property
    def cli(self) -> str:
        return "--" + (self.flag or self.name.replace("_", "-"))

    def spell(self, surface: str) -> str:
        """How a user of `surface` writes this option."""
        if surface == LOCUST:
            return "--" + LOCUST_PREFIX + self.cli[2:]
        if surface == SCENARIO:
            return f"traffic.{self.name}"
        return self.cli


OPTIONS: tuple[Option, ...] = (
    Option("speed", "number", 1.0, f"time multiplier, {MIN_SPEED:g}-{MAX_SPEED:g} (2 plays twice as fast)",
           surfaces=_EVERYWHERE),
    Option("loop", "int", 1, "play the recording N times", surfaces=_EVERYWHERE),
    Option("window", "window", None, "only seconds A to B of the recording (10:70, or durations: 1m:2m30s)",
           metavar="A:B", surfaces=_EVERYWHERE),
    Option("methods", "list", (), "only this method (full or bare name; repeatable, or comma-separated)",
           flag="method", surfaces=_EVERYWHERE),
    Option("flows", "list", (), "only this recorded flow id (repeatable)", flag="flow", item=int,
           surfaces=_EVERYWHERE),
    Option("method_map", "list", (), "name a group of calls whose method is unknown (inspect lists them), for "
           "this replay only; without FLOW, that ref on every flow (repeatable)", metavar="[FLOW:]REF=METHOD",
           surfaces=_EVERYWHERE),
    Option("scale", "number", 1.0, "flow multiplier: 2 replays every recorded connection twice, 0.5 keeps half "
           "of them (a multiplier, where --rate elsewhere is calls/s: --rate is this option's older name)",
           aliases=("rate",), surfaces=_EVERYWHERE),
    # a scenario's own top-level seed plays this part
    Option("seed", "int", 0, "seed for --scale's draw of which connections are kept or doubled"),
    Option("shard_by", "choice", "call", "with several workers: split the calls (even for one connection) or give "
           "each worker whole connections", choices=SHARD_BY),
    Option("timeout", "duration", 10.0, "per-call timeout: seconds, or a duration (500ms, 2s)", metavar="S",
           surfaces=_EVERYWHERE),
    Option("max_in_flight", "int", 256, "per connection; beyond it calls are not sent (counted)"),
    Option("sender", "choice", "auto", "auto (by protocol; gRPC: h2), h2 (lean gRPC over HTTP/2), grpc (through "
           "grpcio), http1 or tcp", choices=SENDER_CHOICES),
    Option("event_loop", "choice", "auto", "auto: uvloop with the lean senders (h2, http1, tcp) when installed",
           choices=EVENT_LOOPS),
    Option("allow_targets", "list", (), "allow this non-loopback host/CIDR (repeatable)", flag="allow-target",
           metavar="HOST"),
    # TLS (any of these turns it on); on a Locust run the files must exist at the same path on every worker.
    Option("tls", "flag", False, "speak TLS to the target (verified with the system CAs or --ca)", group="tls"),
    Option("ca", "file", None, "TLS: trust only the CAs in this PEM file", metavar="FILE", group="tls"),
    Option("cert", "file", None, "TLS: client certificate (PEM) for mTLS", metavar="FILE", group="tls"),
    Option("key", "file", None, "TLS: the client certificate's key (default: in --cert)", metavar="FILE", group="tls"),
    Option("insecure", "flag", False, "TLS without verifying the server's certificate or name", group="tls"),
    Option("server_name", "text", None, "TLS: the name sent as SNI and verified (default: the host)", metavar="NAME",
           group="tls"),
    # What each call carries.
    Option("set_headers", "list", (), "add or replace this header / gRPC metadata on every call, e.g. shadow "
           "credentials (repeatable)", flag="set-header", metavar="NAME=VALUE", group="headers"),
    Option("set_queries", "list", (), "HTTP calls: give query parameter NAME this value where the recording has it, "
           "e.g. 'api_key=shadow-key' for a key the recorder masked to '*' (repeatable)", flag="set-query",
           metavar="NAME=VALUE", group="headers"),
    Option("set_fields", "list", (), "HTTP calls: give the JSON body field at dotted PATH (or the form field PATH) "
           "this value where the recording has it, e.g. 'user.password=shadow-pass' (repeatable)", flag="set-field",
           metavar="PATH=VALUE", group="headers"),
    Option("drop_headers", "list", (), "do not replay recorded headers whose name matches (repeatable)",
           flag="drop-header", metavar="GLOB", group="headers"),
    Option("no_marker", "flag", False, "do not add the header x-shadowtest-replay: 1", group="headers"),
    Option("keep_trace_context", "flag", False, "replay traceparent, tracestate, b3, x-b3-*, uber-trace-id "
           "(stripped by default)", group="headers"),
)
BY_NAME = {o.name: o for o in OPTIONS}


class OptionError(PlanError, ValueError):
    """A replay option's value is bad: `option` (None: several together) and a one-line reason, written
    with the CLI's spelling (`--window ...`) or starting with the option's name (`window 70:10 is empty`)."""

    def __init__(self, option: Option | None, message: str) -> None:
        super().__init__(message)
        self.option = option
        self.message = message

    def spelled(self, surface: str) -> str:
        """The whole message, standing alone, with every option spelled as `surface` writes it."""
        o, text = self.option, self.message
        if "--" in text or o is None:
            return spell(text, surface)
        if text.startswith(o.name) and text[len(o.name):len(o.name) + 1] in (" ", ":"):
            return o.spell(surface) + text[len(o.name):]
        return f"{o.spell(surface)}: {text}"


def spell(message: str, surface: str) -> str:
    """`message` (written with the CLI's --options) with the options spelled for `surface`."""
    if surface == CLI:
        return message
    marks = {}
    for i, o in enumerate(sorted(OPTIONS, key=lambda o: -len(o.cli))):   # --set-header before --set
        mark = f"\0{i}\0"
        marks[mark] = o.spell(surface)
        message = re.sub(re.escape(o.cli) + r"(?![\w-])", mark, message)
    for mark, spelled in marks.items():
        message = message.replace(mark, spelled)
    return message


def offered(surface: str, groups: Iterable[str] = ("replay", "tls", "headers")) -> list[Option]:
    wanted = set(groups)
    return [o for o in OPTIONS if surface in o.surfaces and o.group in wanted]


def defaults() -> dict[str, Any]:
    return {o.name: o.default for o in OPTIONS}


# ---- values -> ReplayOptions ------------------------------------------------------------------------
def parse_window(value: object) -> tuple[float, float]:
    """(start_s, end_s) from "START:END" (seconds or durations; START may be empty: 0) or a pair."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        start, end = parse_seconds(value[0], "window"), parse_seconds(value[1], "window")
        text = f"{start:g}:{end:g}"
    else:
        text = str(value)
        a, sep, b = text.partition(":")
        if not sep or ":" in b or not b.strip():
            raise ValueError(f"window {text!r}: use START:END in seconds from the first call, e.g. 10:70 or 1m:2m")
        start, end = parse_seconds(a or 0, "window"), parse_seconds(b, "window")
    if not start < end:
        raise ValueError(f"window {text} is empty; use START:END with START before END")
    return start, end


def _list(value: object) -> tuple[object, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, (str, int)):
        return (value,)
    if not isinstance(value, Iterable):
        raise ValueError(f"expected a list, got {value!r}")
    return tuple(value)


def _strings(value: object) -> tuple[str, ...]:
    return tuple(str(x) for x in _list(value))


T = TypeVar("T")


def _checked(name: str, make: Callable[[], T]) -> T:
    """make(), with its error (a PlanError, MethodMapError, ShadowError, HeaderError: ValueErrors or
    PlanErrors; TlsConfigError: a SenderError) as an OptionError of option `name`."""
    try:
        return make()
    except (ValueError, PlanError, SenderError) as exc:
        if isinstance(exc, OptionError):
            raise
        raise OptionError(BY_NAME.get(name), " ".join(str(exc).split())) from exc


def schedule_options(values: Mapping[str, Any]) -> ScheduleOptions:
    """The schedule (what and when) of `values`, checked. No engine import: the Locust master uses it."""
    from replay.method_map import parse_method_map

    v = {**defaults(), **values}
    window = _checked("window", lambda: None if v["window"] in (None, "") else parse_window(v["window"]))
    methods = frozenset(m.strip() for item in _list(v["methods"]) for m in str(item).split(",") if m.strip())
    flows = _checked("flows", lambda: frozenset(_flow_id(f) for f in _list(v["flows"])))
    mapped = _checked("method_map", lambda: tuple((flow, ref, m) for (flow, ref), m
                                                  in parse_method_map(_strings(v["method_map"])).items()))
    shadow = _checked("set_queries", lambda: ShadowValues.from_options(_strings(v["set_queries"]),
                                                                       _strings(v["set_fields"])))
    sched = _checked("speed", lambda: ScheduleOptions(
        speed=float(v["speed"]), window=window, methods=methods, flows=flows, loop=int(v["loop"]),
        rate=float(v["scale"]), seed=int(v["seed"]), shard_by=str(v["shard_by"]), method_map=mapped, shadow=shadow))
    try:
        sched.validate()
    except PlanError as exc:   # its message starts with the option it is about: speed, loop, scale, window
        raise OptionError(BY_NAME.get(str(exc).split(" ", 1)[0]), " ".join(str(exc).split())) from exc
    return sched


def _flow_id(value: object) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ValueError(f"flows: {value!r} is not a flow id (a whole number; inspect lists them)") from None


def build(values: Mapping[str, Any]) -> ReplayOptions:
    """The ReplayOptions of `values` (option name -> value; a missing one: its default), every value
    checked; OptionError (one line, naming the option) for a bad one."""
    v = {**defaults(), **values}
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown:
        raise OptionError(None, f"unknown replay option(s): {', '.join(unknown)}")
    sched = schedule_options(v)
    timeout = _checked("timeout", lambda: parse_seconds(v["timeout"], "timeout"))
    if timeout <= 0:
        raise OptionError(BY_NAME["timeout"], f"timeout {timeout:g}: must be above 0")
    max_in_flight = int(v["max_in_flight"])
    if max_in_flight < 1:
        raise OptionError(BY_NAME["max_in_flight"], f"max_in_flight {max_in_flight}: must be at least 1")
    for name in ("sender", "event_loop"):
        if v[name] not in BY_NAME[name].choices:
            raise OptionError(BY_NAME[name], f"{name} {v[name]!r}: expected one of "
                                             f"{', '.join(BY_NAME[name].choices)}")
    tls = _checked("tls", lambda: TlsConfig.from_options(bool(v["tls"]), v["ca"], v["cert"], v["key"],
                                                         bool(v["insecure"]), v["server_name"], str(v["sender"])))
    _checked("set_headers", lambda: HeaderPolicy.from_options(_strings(v["set_headers"])))   # which one is bad
    headers = _checked("drop_headers", lambda: HeaderPolicy.from_options(
        _strings(v["set_headers"]), _strings(v["drop_headers"]), marker=not v["no_marker"],
        keep_trace_context=bool(v["keep_trace_context"])))
    return ReplayOptions(schedule=sched, sender=str(v["sender"]), timeout_s=timeout, max_in_flight=max_in_flight,
                         event_loop=str(v["event_loop"]), allow_targets=_strings(v["allow_targets"]),
                         tls=tls, headers=headers)


def with_schedule(options: ReplayOptions, **changes: Any) -> ReplayOptions:
    """`options` with its schedule changed (shard, loop, method map: what a surface decides itself)."""
    return replace(options, schedule=replace(options.schedule, **changes))


def json_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` as JSON can carry them (tuples as lists), for a Locust master to send to its workers."""
    return {k: list(x) if isinstance(x, (tuple, frozenset, set)) else x for k, x in values.items() if k in BY_NAME}


# ---- surfaces ---------------------------------------------------------------------------------------
F = TypeVar("F", bound=Callable[..., Any])


def click_options(*groups: str) -> Callable[[F], F]:
    """A decorator adding the CLI's options of `groups` (default: all) to a click command."""
    import click

    def decorate(f: F) -> F:
        for o in reversed(offered(CLI, groups or ("replay", "tls", "headers"))):
            f = _click_option(click, o)(f)
        return f
    return decorate


def _click_option(click: Any, o: Option) -> Any:
    common: dict[str, Any] = {"help": o.help}
    if o.metavar:
        common["metavar"] = o.metavar
    if o.kind == "flag":
        return click.option(o.cli, *_old(o), o.name, is_flag=True, **common)
    if o.kind == "list":
        return click.option(o.cli, *_old(o), o.name, multiple=True, type=o.item, **common)
    kinds = {"number": float, "int": int, "window": str, "duration": str, "text": str,
             "file": click.Path(dir_okay=False), "choice": click.Choice(list(o.choices))}
    show = o.default is not None
    return click.option(o.cli, *_old(o), o.name, type=kinds[o.kind], default=o.default, show_default=show, **common)


def _old(o: Option, prefix: str = "") -> list[str]:
    return [f"--{prefix}{a.replace('_', '-')}" for a in o.aliases]


def add_argparse(group: _ArgumentGroup) -> None:
    """Locust's `--shadow-*` replay options on an argparse group (dest: shadow_NAME)."""
    for o in offered(LOCUST):
        names, dest = [o.spell(LOCUST), *_old(o, LOCUST_PREFIX)], "shadow_" + o.name
        if o.kind == "flag":
            group.add_argument(*names, dest=dest, action="store_true", default=False, help=o.help)
        elif o.kind == "list":
            group.add_argument(*names, dest=dest, action="append", default=[], type=o.item, metavar=o.metavar,
                               help=o.help)
        else:
            types = {"number": float, "int": int}
            extra: dict[str, Any] = {"choices": list(o.choices)} if o.choices else {}
            group.add_argument(*names, dest=dest, type=types.get(o.kind, str), default=o.default, metavar=o.metavar,
                               help=spell(o.help, LOCUST), **extra)


def from_argparse(parsed: Namespace) -> dict[str, object]:
    """The replay option values of Locust's parsed options (add_argparse's)."""
    return {o.name: getattr(parsed, "shadow_" + o.name) for o in offered(LOCUST)}
