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
        applier = APPLIERS.get((spec.family, spec.kind))
        if applier is None:
            raise RunError(f"no applier for fault {spec.family}: {spec.kind}")
        stack = contextlib.ExitStack()
        self.ctx.applied_at = None
        try:
            detail = stack.enter_context(applier(spec, self.ctx))
        except BaseException:
            stack.close()
            raise
        self._held[key] = (spec.label, stack)
        return detail or "", self.ctx.applied_at

    def remove(self, key: int) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            label, stack = held
            try:
                stack.close()
            except Exception as exc:  # noqa: BLE001 -- keep removing the others; say what stayed
                self.log(f"fault {label} could not be removed cleanly: {exc} (run `shadowtest faults clear`)")

    def close(self) -> None:
        """Undo every fault still held, newest first (idempotent)."""
        for key in reversed(list(self._held)):
            self.remove(key)

    def active_labels(self) -> list[str]:
        return [label.split(" ")[0] for label, _ in self._held.values()]


# ---- network faults: toxics on the proxy in front of the target -----------------------------------
_TOXIC_ATTRS = {"latency": {"latency_ms": "latency", "jitter_ms": "jitter"},
                "bandwidth": {"rate_kbps": "rate"}, "slow_close": {"delay_ms": "delay"},
                "timeout": {"timeout_ms": "timeout"}, "reset_peer": {"timeout_ms": "timeout"},
                "slicer": {"average_size": "average_size", "size_variation": "size_variation",
                           "delay_us": "delay"},
                "limit_data": {"bytes": "bytes"}}


def toxic_of(spec: FaultSpec) -> dict[str, Any]:
    """The Toxiproxy toxic (type, stream, toxicity, attributes) for a network fault spec."""
    attrs = {api: int(spec.params[ours]) for ours, api in _TOXIC_ATTRS[spec.kind].items() if ours in spec.params}
    return {"type": spec.kind, "stream": spec.params.get("stream", "downstream"),
            "toxicity": float(spec.params.get("toxicity", 1.0)), "attributes": attrs}


@register("network", *_TOXIC_ATTRS)
@contextlib.contextmanager
def _network(spec: FaultSpec, ctx: FaultContext) -> Iterator[str]:
    proxy = ctx.running.proxy
    if proxy is None:
        raise RunError("a network fault needs the proxy: remove `proxy: false` from the scenario")
    toxic = toxic_of(spec)
    with proxy.toxic(toxic) as (name, applied_at):
        ctx.applied_at = applied_at
        yield f"toxic {name}: {toxic['type']} {toxic['attributes']} {toxic['stream']}"


__all__ = ["APPLIERS", "Applier", "FaultContext", "FaultSession", "NetworkProxy", "check_leftovers",
           "clear_leftovers", "register", "toxic_of"]
