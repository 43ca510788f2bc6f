"""The bindings from the harness's fault appliers to the `faults` package (proxy, CPU, process, registry).

Kept in one module so that when `faults` changes a name, one file changes. Every fault here is a
`faults` context manager: recorded in the crash-safe state file before it takes effect, undone on
exit, and found by `check_leftovers()` if a run was killed before it could undo it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from harness.errors import RunError
from harness.faultapi import FaultContext, register
from harness.scenario import FaultSpec


def check_leftovers() -> list[str]:
    """Faults a crashed run left behind (empty when none), one line each.

    Raises RunError when the fault state cannot be read (it says which file)."""
    from faults.cleanup import check_leftovers as check
    from faults.errors import FaultsError

    try:
        return [left.describe() for left in check()]
    except FaultsError as exc:
        raise RunError(f"cannot check for leftover faults: {exc}") from exc


def clear_leftovers() -> list[str]:
    """Undo what a crashed run left behind; returns what was undone. Raises RunError if some failed."""
    from faults.cleanup import clear_leftovers as clear

    result = clear()
    if result.failed:
        raise RunError("could not undo leftover faults: " + "; ".join(f"{left.describe()}: {why}"
                                                                    for left, why in result.failed))
    return [left.describe() for left in result.cleared]


@dataclass
class HeldToxic:
    """One toxic held by `NetworkProxy.toxic`: its name, when the API confirmed it (time.monotonic()),
    and, once it is being removed, what our proxy measured it did (None: toxiproxy-server, which does
    not measure, or the proxy did not answer)."""

    name: str
    applied_at: float
    effect: dict[str, Any] | None = None


class NetworkProxy:
    """A Toxiproxy in front of `upstream` with a proxy listening on 127.0.0.1:0: a toxiproxy-server on
    PATH when there is one (and no call-level gRPC toxic is wanted), else ours in a child process (never in the harness's own process, where
    it would compete with the replayer for the GIL and show up as send lag). The child dies with the
    harness, taking its toxics with it. `toxic(dict)` holds one toxic while entered and yields a
    `HeldToxic`, whose `effect` is read from our proxy right before the toxic is removed.

    Raises RunError when the proxy cannot start.
    """

    def __init__(self, upstream: str, name: str, seed: int, call_toxics: bool = False,
                 listen: str = "127.0.0.1:0") -> None:
        self.upstream, self.name, self.seed = upstream, name, seed
        self.want_listen = listen          # a dependency's proxy may be asked to listen on a fixed address
        self.call_toxics = call_toxics     # grpc_delay/grpc_error wanted: only our proxy has them
        self.listen = ""
        self.kind = ""
        self._count = 0
        self._net: Any = None
        self._child: Any = None

    def __enter__(self) -> NetworkProxy:
        import shutil

        from faults.errors import FaultsError
        from faults.network import NetworkFaults
        from faults.proxy import spawn_proxy_server

        try:
            url = None
            if self.call_toxics or not shutil.which("toxiproxy-server"):
                self._child = spawn_proxy_server(seed=self.seed)
                url = self._child.url
            self._net = NetworkFaults(url=url, seed=self.seed).start()
            made = self._net.proxy(self.name, upstream=self.upstream, listen=self.want_listen)
        except (FaultsError, OSError) as exc:
            self.__exit__()
            raise RunError(f"cannot start the fault proxy in front of {self.upstream}: {exc}") from exc
        self.listen = str(made.listen)
        self.kind = "shadowtest proxy (child process)" if self._child is not None else "toxiproxy-server"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._net is not None:
            self._net.stop()
            self._net = None
        if self._child is not None:
            self._child.stop()
            self._child = None

    @property
    def pid(self) -> int | None:
        """Our proxy's child process (None: toxiproxy-server, or not running)."""
        return int(self._child.proc.pid) if self._child is not None else None

    @property
    def api_url(self) -> str:
        return str(self._net.url) if self._net is not None else ""

    @contextlib.contextmanager
    def toxic(self, toxic: dict[str, Any]) -> Iterator[HeldToxic]:
        self._count += 1
        name = f"{toxic['type']}_{self._count}"
        with self._net.toxic(self.name, toxic["type"], toxic["attributes"], stream=toxic["stream"],
                             toxicity=toxic["toxicity"], name=name):
            # The API answers once the toxic runs on every live connection (ours documents it).
            held = HeldToxic(name, time.monotonic())
            try:
                yield held
            finally:
                held.effect = self.effect_of(name)

    @contextlib.contextmanager
    def down(self) -> Iterator[float]:
        """The link unreachable while entered: the proxy disabled (stops listening, closes every
        connection: Toxiproxy's `enabled: false`), enabled again on exit on the same address. Yields
        when the API confirmed it (time.monotonic()). The proxy runs in a child of this process (or a
        toxiproxy-server it spawned), so a run killed meanwhile takes the disabled proxy with it."""
        proxy = self._net.client.get_proxy(self.name)
        if proxy is None:
            raise RunError(f"proxy {self.name} not found on {self.api_url}")
        proxy.disable()
        try:
            yield time.monotonic()
        finally:
            again = self._net.client.get_proxy(self.name) if self._net is not None else None
            if again is not None:
                again.enable()

    def effect_of(self, toxic_name: str) -> dict[str, Any] | None:
        """What our proxy measured the toxic did so far; None with toxiproxy-server (no such endpoint)."""
        if self._net is None or self._child is None:
            return None
        effects = self._net.effects(self.name)
        found = effects.get(toxic_name) if effects else None
        return found if isinstance(found, dict) else None


def _pid(ctx: FaultContext, what: str) -> int:
    if ctx.running.pid is None:
        raise RunError(f"{what} needs a target process the harness started (target: agent)")
    return int(ctx.running.pid)


@register("cpu", "contention")
@contextlib.contextmanager
def _contention(spec: FaultSpec, ctx: FaultContext) -> Iterator[str]:
    from faults.cpu import cpu_contention

    pin = spec.params.get("pin", True)
    with cpu_contention(target_pid=ctx.running.pid if pin else None, workers=spec.params.get("workers"),
                        load_pct=int(spec.params.get("load_pct", 100))) as held:
        ctx.applied_at = held.started_at
        try:
            yield (f"{held.workers} {held.method} worker(s) at {held.load_pct}% on CPUs {held.cpus} "
                   f"(PIDs {held.pids})")
        finally:
            ctx.effect = contention_effect(held, time.monotonic())   # before the workers are killed


def contention_effect(held: Any, now: float) -> dict[str, Any]:
    """What contention workers (`faults.cpu.Contention`) burned since they started, against what was asked."""
    window = max(1e-6, now - held.started_at)
    burned = max(0.0, held.cpu_seconds() - held.start_cpu_s)
    return {"cpu_s": round(burned, 3), "window_s": round(window, 3), "burned_cores": round(burned / window, 3),
            "asked_cores": round(held.asked_cores(), 3), "workers": held.workers, "load_pct": held.load_pct,
            "cpus": len(held.cpus)}


@register("cpu", "quota")
@contextlib.contextmanager
def _quota(spec: FaultSpec, ctx: FaultContext) -> Iterator[str]:
    from faults.cpu import cpu_quota

    pid = _pid(ctx, "a CPU quota")
    period_ms = int(spec.params.get("period_ms", 100))
    pct, why = quota_pct(spec.params, ctx, period_ms)
    with cpu_quota(pid, cpus=pct / 100.0, period_us=period_ms * 1000) as held:
        before = held.throttling()
        try:
            yield (f"PID {pid} limited to {held.quota_us}us per {held.period_us}us{why} "
                   f"(cgroup v{held.version} {held.path})")
        finally:
            ctx.effect = quota_effect(held, before, held.throttling())


def quota_effect(held: Any, before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, Any]:
    """The cgroup's throttling over the quota's window (`faults.cpu.Quota`), or why it is unknown."""
    out: dict[str, Any] = {"quota_us": held.quota_us, "period_us": held.period_us, "cgroup": held.path}
    if before is None or after is None:
        return out | {"unreadable": f"cannot read {held.path}/cpu.stat"}
    return out | {k: after[k] - before.get(k, 0) for k in ("nr_periods", "nr_throttled", "throttled_us")}


QUOTA_USE_WINDOW_S = 2.0     # pct_of_use: the target's CPU use over this long before the fault


def quota_pct(params: dict[str, Any], ctx: FaultContext, period_ms: int) -> tuple[float, str]:
    """The quota in % of one core: `pct` as given, or `pct_of_use` of what the target used in the last
    QUOTA_USE_WINDOW_S (at least the kernel's 1 ms a period); and a note saying how it was reached."""
    if "pct" in params:
        return float(params["pct"]), ""
    use = ctx.cpu_use(QUOTA_USE_WINDOW_S) if ctx.cpu_use is not None else None
    if use is None:
        raise RunError(f"cpu: quota pct_of_use needs the target's CPU use over the {QUOTA_USE_WINDOW_S:g} s "
                       "before the fault, which was not measured yet (start the fault later with `after:`, "
                       "or give pct)")
    floor = 100.0 / period_ms                      # 1 ms of CPU a period, the kernel's smallest quota
    pct = min(100.0, max(floor, use * float(params["pct_of_use"]) / 100.0))
    return pct, f" ({params['pct_of_use']:g}% of the {use:.1f}% of a core it used in the last {QUOTA_USE_WINDOW_S:g} s)"


@register("process", "pause")
@contextlib.contextmanager
def _pause(spec: FaultSpec, ctx: FaultContext) -> Iterator[str]:
    from faults.process import paused

    pid = _pid(ctx, "pausing")
    with paused(pid, duration_s=spec.params["duration"]) as held:
        ctx.applied_at = held.paused_at
        yield f"PID {pid} stopped (SIGSTOP) for {spec.params['duration']:g}s"
