"""Checks: each turns the run's timeline into a verdict with evidence (see `base.Check`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.checks import alerts, answers, dependency, limiter, memory, rule, service, tier  # noqa: F401  (register the checks)
from harness.checks.base import CHECKS, Check, Param, Verdict, no_calls, verdict

if TYPE_CHECKING:
    from collections.abc import Iterable

    from harness.scenario import CheckSpec
    from harness.timeline import Timeline

__all__ = ["CHECKS", "Check", "Param", "Verdict", "verdict", "evaluate_all"]


def evaluate_all(timeline: Timeline, specs: Iterable[CheckSpec]) -> list[Verdict]:
    """Run every check in `specs`; a check that crashes becomes a failed verdict that says so. A check
    bound to a phase that had no calls is skipped ("no calls in the phase"), never judged."""
    out = []
    for spec in specs:
        check = CHECKS[spec.kind]
        try:
            out.append(no_calls(timeline, spec, check.params) or check.evaluate(timeline, spec))
        except Exception as exc:  # noqa: BLE001 -- one broken check must not hide the others' verdicts
            out.append(verdict(spec, False, f"check crashed: {type(exc).__name__}: {exc}"))
    return out
