"""Apply a scenario's faults through the `faults` package, one small applier per fault kind.

    FaultSession.apply(spec) --> APPLIERS[(family, kind)](spec, ctx) --> context manager (entered)
    FaultSession.remove(key) --> exits that one;  close() --> exits all, newest first

The `faults` package registers every fault in its crash-safe state file before it takes effect
and undoes it on exit and on signals; this module only maps scenario parameters onto it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

from harness.errors import RunError
from harness.faultapi import APPLIERS, Applier, FaultContext, register
from harness.faultimpl import NetworkProxy, check_leftovers, clear_leftovers  # also registers cpu/process
from harness.faultspecs import CALL_FAULTS, GRPC_STATUS
from harness.scenario import FaultSpec


class FaultSession:
    """Holds the faults of one run; every fault is undone by `remove` or, at the latest, `close`."""

    def __init__(self, running: Any, seed: int, log: Callable[[str], None]) -> None:
        self.ctx = FaultContext(running, random.Random(seed))
        self.log = log
        self._held: dict[int, tuple[str, contextlib.ExitStack]] = {}

    def apply(self, spec: FaultSpec, key: int) -> tuple[str, float | None]:
        """Start a fault; returns what took effect and when (time.monotonic(), None if the applier
        cannot tell: then it is when this returns). Raises RunError (or the faults error) when it cannot."""
        applier = APPLIERS.get((spec.family, spec.kind))   # RunError naming the known faults
        stack = contextlib.ExitStack()
        self.ctx.applied_at = None
        try:
            detail = stack.enter_context(applier(spec, self.ctx))
        except BaseException:
            stack.close()
            raise
        self._held[key] = (spec.label, stack)
        return detail or "", self.ctx.applied_at

    def remove(self, key: int) -> dict[str, Any] | None:
        """Undo one fault; returns what it was measured to do, when its applier measured it."""
        held = self._held.pop(key, None)
        self.ctx.effect = None
        if held is not None:
            label, stack = held
            try:
                stack.close()
            except Exception as exc:  # noqa: BLE001 -- keep removing the others; say what stayed
                self.log(f"fault {label} could not be removed cleanly: {exc} (run `shadowtest faults clear`)")
        effect, self.ctx.effect = self.ctx.effect, None
        return effect

    def close(self) -> None:
        """Undo every fault still held, newest first (idempotent)."""
        for key in reversed(list(self._held)):
            self.remove(key)

    def active_labels(self) -> list[str]:
        """The faults in effect, short: `network:latency`, or `network:latency@redis` on a dependency."""
        out = []
        for label, _ in self._held.values():
            words = label.split(" ")
            on = words[2] if len(words) > 2 and words[1] == "on" else ""
            out.append(words[0] + (f"@{on}" if on else ""))
        return out


# ---- network faults: toxics on the proxy in front of the target -----------------------------------
_TOXIC_ATTRS = {"latency": {"latency_ms": "latency", "jitter_ms": "jitter"},
                "bandwidth": {"rate_kbps": "rate"}, "slow_close": {"delay_ms": "delay"},
                "timeout": {"timeout_ms": "timeout"}, "reset_peer": {"timeout_ms": "timeout"},
                "slicer": {"average_size": "average_size", "size_variation": "size_variation",
                           "delay_us": "delay"},
                "limit_data": {"bytes": "bytes"},
                # call-level toxics of shadowtest's proxy (docs/faults.md): per call, not per connection
                "grpc_delay": {"delay_ms": "delay", "jitter_ms": "jitter", "share": "share", "method": "method"},
                "grpc_error": {"status": "status", "message": "message", "share": "share", "method": "method"},
                "http_delay": {"delay_ms": "delay", "jitter_ms": "jitter", "share": "share", "method": "method",
                               "path": "path", "header": "header"},
                "http_error": {"status": "status", "body": "body", "share": "share", "method": "method",
                               "path": "path", "header": "header"}}
_CALL_TOXICS = CALL_FAULTS
_AS_GIVEN = {"share": float, "method": str, "message": str, "path": str, "header": str, "body": str}


def toxic_of(spec: FaultSpec) -> dict[str, Any]:
    """The Toxiproxy toxic (type, stream, toxicity, attributes) for a network fault spec."""
    params = dict(spec.params)
    if "share_pct" in params:
        params["share"] = params.pop("share_pct") / 100.0
    attrs = {api: _AS_GIVEN.get(ours, int)(params[ours]) for ours, api in _TOXIC_ATTRS[spec.kind].items()
             if ours in params}
    # A call toxic acts on the client's calls whatever its stream; "upstream" names where it acts.
    stream = "upstream" if spec.kind in _CALL_TOXICS else params.get("stream", "downstream")
    return {"type": spec.kind, "stream": stream, "toxicity": float(params.get("toxicity", 1.0)), "attributes": attrs}


def proxy_of(spec: FaultSpec, ctx: FaultContext) -> Any:
    """The proxy a network fault acts on: the dependency's (`on: redis`) or the target's inbound one."""
    if spec.on is not None:
        dependency = getattr(ctx.running, "dependencies", {}).get(spec.on)
        if dependency is None:
            raise RunError(f"no dependency {spec.on!r} is running (the scenario's dependencies: "
                           f"{', '.join(getattr(ctx.running, 'dependencies', {})) or 'none'})")
        return dependency.proxy
    proxy = ctx.running.proxy
    if proxy is None:
        raise RunError("a network fault needs the proxy: remove `proxy: false` from the scenario")
    return proxy


@register("network", "down")
@contextlib.contextmanager
def _down(spec: FaultSpec, ctx: FaultContext) -> Iterator[str]:
    proxy = proxy_of(spec, ctx)
    with proxy.down() as at:
        ctx.applied_at = at
        where = f"{spec.on}'s" if spec.on else "the target's inbound"
        yield (f"proxy {proxy.name} disabled: {where} link unreachable ({proxy.listen} refuses connections, "
               "live ones closed)")


@register("network", *_TOXIC_ATTRS)
@contextlib.contextmanager
def _network(spec: FaultSpec, ctx: FaultContext) -> Iterator[str]:
    proxy = proxy_of(spec, ctx)
    toxic = toxic_of(spec)
    if spec.kind in _CALL_TOXICS and proxy.kind == "toxiproxy-server":
        raise RunError(f"network: {spec.kind} is a call-level toxic of shadowtest's own proxy; toxiproxy-server "
                       "(found on PATH) has no such toxic: take it off PATH for this scenario")
    held = None
    try:
        with proxy.toxic(toxic) as held:
            ctx.applied_at = held.applied_at
            yield f"toxic {held.name}: {toxic['type']} {toxic['attributes']} {toxic['stream']}{_call_note(toxic)}"
    finally:
        if held is not None:
            ctx.effect = held.effect   # read from the proxy right before the toxic was removed


def _call_note(toxic: dict[str, Any]) -> str:
    """What a call toxic does, in words (the report's fault table shows it)."""
    a = toxic["attributes"]
    if toxic["type"] not in _CALL_TOXICS:
        return ""
    if toxic["type"].startswith("http_"):
        picked = " ".join(x for x in (a.get("method"), a.get("path")) if x) or "all"
        who = f"{a.get('share', 1.0) * 100:g}% of {picked} requests" + (
            f" with {a['header']}" if a.get("header") else "")
        if toxic["type"] == "http_error":
            code = int(a.get("status", 503))
            return f" ({who} answered {code} {_http_phrase(code)} by the proxy)"
        return f" ({who} held {a.get('delay', 0)} ms +/- {a.get('jitter', 0)} ms)"
    who = f"{a.get('share', 1.0) * 100:g}% of {a.get('method') or 'all'} calls"
    if toxic["type"] == "grpc_error":
        code = int(a.get("status", 14))
        return f" ({who} fail with {code} {GRPC_STATUS.get(code, '')})"
    return f" ({who} held {a.get('delay', 0)} ms +/- {a.get('jitter', 0)} ms)"


def _http_phrase(code: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return ""


__all__ = ["APPLIERS", "Applier", "FaultContext", "FaultSession", "NetworkProxy", "check_leftovers",
           "clear_leftovers", "register", "toxic_of"]
