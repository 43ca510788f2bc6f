"""The bindings from the harness's fault appliers to the `faults` package (proxy, CPU, process, registry).

Kept in one module so that when `faults` changes a name, one file changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from harness.errors import RunError
from harness.faultrun import FaultContext, register
from harness.scenario import FaultSpec


def _faults_error() -> type[BaseException]:
    try:
        from faults.errors import FaultsError
        return FaultsError
    except ImportError:  # pragma: no cover - the package is part of this distribution
        return RuntimeError


def check_leftovers() -> list[str]:
    """Faults a crashed run left behind (empty when none), as one line each."""
    try:
        from faults import registry
    except ImportError:
        return []
    return [str(x) for x in registry.check_leftovers()]


def clear_leftovers() -> list[str]:
    """Undo what a crashed run left behind; returns what was undone."""
    from faults import registry

    return [str(x) for x in registry.clear_leftovers()]


class NetworkProxy:
    """An embedded Toxiproxy-compatible proxy listening on 127.0.0.1:0 in front of `upstream`.

    In-process on purpose: its toxics die with the run, so even a SIGKILLed run leaves none behind.
    `toxic(dict)` is a context manager that adds one toxic and removes it on exit; it yields the
    toxic's name and when it took effect on every live connection (time.monotonic()).
    Raises RunError when the proxy cannot start.
    """

    def __init__(self, upstream: str, name: str, seed: int) -> None:
        self.upstream, self.name, self.seed = upstream, name, seed
        self.listen = ""
        self._count = 0
        self._proxy: Any = None

    def __enter__(self) -> NetworkProxy:
        from faults.proxy import EmbeddedToxiproxy

        try:
            self._proxy = EmbeddedToxiproxy(seed=self.seed).start()
            made = self._proxy.create_proxy(self.name, upstream=self.upstream, listen="127.0.0.1:0")
        except (_faults_error(), OSError) as exc:
            self.__exit__()
            raise RunError(f"cannot start the fault proxy in front of {self.upstream}: {exc}") from exc
        self.listen = str(made["listen"])
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proxy is not None:
            self._proxy.stop()
            self._proxy = None

    @property
    def api_url(self) -> str:
        return str(self._proxy.url) if self._proxy is not None else ""

    @contextlib.contextmanager
    def toxic(self, toxic: dict[str, Any]) -> Iterator[tuple[str, float]]:
        self._count += 1
        name = f"{toxic['type']}_{self._count}"
        applied = self._proxy.add_toxic(self.name, toxic["type"], toxic["attributes"], stream=toxic["stream"],
                                        toxicity=toxic["toxicity"], name=name)
        try:
            yield name, applied.applied_at
        finally:
            if self._proxy is not None:
                self._proxy.remove_toxic(self.name, name)


@register("cpu", "contention")
@contextlib.contextmanager
def _contention(spec: FaultSpec, ctx: FaultContext) -> Iterator[str]:
    from faults.cpu import contention

    pid = ctx.running.pid
    kwargs = {"workers": spec.params.get("workers"), "load_pct": spec.params.get("load_pct", 100.0),
              "pin_to_pid": pid if spec.params.get("pin", True) else None}
    with contention(**kwargs) as held:
        yield f"{getattr(held, 'describe', lambda: 'cpu contention')()}"


@register("cpu", "quota")
@contextlib.contextmanager
def _quota(spec: FaultSpec, ctx: FaultContext) -> Iterator[str]:
    from faults.cpu import cpu_quota

    if ctx.running.pid is None:
        raise RunError("a CPU quota needs a target process the harness started (target: agent)")
    with cpu_quota(ctx.running.pid, pct=spec.params["pct"]) as held:
        yield f"{getattr(held, 'describe', lambda: 'quota')()}"


@register("process", "pause")
@contextlib.contextmanager
def _pause(spec: FaultSpec, ctx: FaultContext) -> Iterator[str]:
    from faults.process import pause

    if ctx.running.pid is None:
        raise RunError("pausing needs a target process the harness started (target: agent)")
    with pause(ctx.running.pid, duration_s=spec.params["duration"]):
        yield f"pid {ctx.running.pid} stopped for {spec.params['duration']:g}s"
