"""The check interface, verdicts, and the registry of checks by name.

A check reads the run's `Timeline` (client-side truth, the agent's events and scraped metrics) and
returns a `Verdict`: passed or not, one line that says why, and the evidence behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from harness.timeline import Timeline
from wire.registry import Registry

if TYPE_CHECKING:
    from harness.scenario import CheckSpec


@dataclass(frozen=True)
class Param:
    """One argument a check (or fault) accepts in a scenario file.

    `type` is one of: phase, phases (a list of phase names), number, int, duration, str, bool, strlist, list (strings or whole numbers, as strings), grpc_status (a code 1..16 or
    its name, e.g. UNAVAILABLE), loop (a whole number or `until_end`), rules (responses_valid's list of
    field rules), choice:A,B,...
    """

    type: str
    required: bool = False
    default: Any = None
    help: str = ""


@dataclass
class Verdict:
    id: str
    kind: str
    passed: bool
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    phase: str | None = None
    # Nothing to judge (no fault fired, nothing was cut): not a failure, and never shown as a pass.
    skipped: bool = False

    @property
    def status(self) -> str:
        """pass | fail | skipped (a skipped verdict does not fail the run but is no pass either)."""
        return "skipped" if self.skipped else "pass" if self.passed else "fail"

    @property
    def mark(self) -> str:
        return {"pass": "PASS", "fail": "FAIL", "skipped": "SKIP"}[self.status]

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "check": self.kind, "passed": self.passed, "status": self.status,
                "summary": self.summary, "phase": self.phase, "evidence": self.evidence}


class Check(Protocol):
    name: str
    params: dict[str, Param]

    def evaluate(self, timeline: Timeline, spec: CheckSpec) -> Verdict:
        """Judge the timeline; never raises for missing data (that is a failed verdict saying so)."""


CHECKS: Registry[str, Check] = Registry("check")   # each module adds its checks: CHECKS.add(check.name, check)


def phase_window(tl: Timeline, spec: CheckSpec) -> tuple[float, float]:
    """(start, end) in run seconds of the check's `phase`, the whole run without one, (0, 0) for a
    phase the run never reached."""
    name = spec.params.get("phase")
    if not name:
        return 0.0, tl.duration_s
    return tl.phase_bounds(name) or (0.0, 0.0)


def verdict(spec: CheckSpec, passed: bool, summary: str, **evidence: Any) -> Verdict:
    """A verdict for `spec` with its id and phase filled in."""
    return Verdict(id=spec.id, kind=spec.kind, passed=passed, summary=summary, evidence=evidence,
                   phase=spec.params.get("phase"))


def no_calls(tl: Timeline, spec: CheckSpec, params: dict[str, Param]) -> Verdict | None:
    """A skipped verdict when a phase the check is bound to (its `phase`, or any other phase parameter
    such as a baseline) had no calls, or, for a check of the whole run, when the run had none; None
    otherwise. A check judged on a phase without traffic would judge nothing (a silent alert, a
    limiter at rest), so it never passes: the traffic ran out, or never covered that phase."""
    names = [str(v) for k, v in spec.params.items() if k in params and params[k].type == "phase" and v]
    if not names:
        if tl.calls_due(0.0, tl.duration_s) or not tl.phases:
            return None
        return nothing_to_judge(spec, f"no calls in the run (0.0-{tl.duration_s:.1f}s)", calls=0)
    for name in names:
        bounds = tl.phase_bounds(name)
        if bounds is None:        # a phase an interrupted run never reached: the check says what it makes of it
            continue
        start, end = bounds
        if not tl.calls_due(start, end):
            return nothing_to_judge(spec, f"no calls in the phase {name!r} ({start:.1f}-{end:.1f}s)", calls=0,
                                    phase_s=[round(start, 3), round(end, 3)])
    return None


def nothing_to_judge(spec: CheckSpec, why: str, **evidence: Any) -> Verdict:
    """A skipped verdict: the run gave the check nothing to judge (`why` says what did not happen)."""
    return Verdict(id=spec.id, kind=spec.kind, passed=True, summary=f"nothing to judge: {why}",
                   evidence=evidence, phase=spec.params.get("phase"), skipped=True)
