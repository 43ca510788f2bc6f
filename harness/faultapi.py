"""What a fault applier is and where it registers: the one module both `faultrun` (which runs the
appliers) and `faultimpl` (which holds most of them) import, so neither imports the other's half-made
module (`import harness.faultimpl` on its own used to fail on that cycle).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from harness.errors import RunError
from harness.scenario import FaultSpec
from wire.registry import Registry


@dataclass
class FaultContext:
    running: Any            # harness.target.Running
    rng: random.Random
    applied_at: float | None = None   # set by an applier that knows exactly when its fault took effect
    # The target's CPU use, % of one core, over the last `window_s` seconds (None: not measured yet or
    # not our process); the runner fills it from its scheduler samples.
    cpu_use: Callable[[float], float | None] | None = None
    # Set by an applier while its fault is being removed: what the fault was measured to do (the
    # proxy's counts for a toxic, the workers' CPU time, the cgroup's throttling); None: not measured.
    effect: dict[str, Any] | None = None


class Applier(Protocol):
    def __call__(self, spec: FaultSpec, ctx: FaultContext) -> contextlib.AbstractContextManager[str]:
        """A context manager that holds the fault while entered; entering returns a one-line detail."""


APPLIERS: Registry[tuple[str, str], Applier] = Registry("fault", error=RunError)   # by (family, kind)


def register(family: str, *kinds: str) -> Callable[[Applier], Applier]:
    """Decorator: the applier of faults `family: kind` for each of `kinds` (APPLIERS.register by key)."""
    return APPLIERS.register(*((family, kind) for kind in kinds))
