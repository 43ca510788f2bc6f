"""The check interface, verdicts, and the registry of checks by name.

A check reads the run's `Timeline` (client-side truth, the agent's events and scraped metrics) and
returns a `Verdict`: passed or not, one line that says why, and the evidence behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from harness.scenario import CheckSpec
    from harness.timeline import Timeline


@dataclass(frozen=True)
class Param:
    """One argument a check (or fault) accepts in a scenario file.

    `type` is one of: phase, number, int, duration, str, bool, strlist, grpc_status (a code 1..16 or
    its name, e.g. UNAVAILABLE).
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


CHECKS: dict[str, Check] = {}


def register(check: Check) -> Check:
    """Add a check to the registry under its `name` (used as a decorator on an instance's class)."""
    CHECKS[check.name] = check
    return check


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


def nothing_to_judge(spec: CheckSpec, why: str, **evidence: Any) -> Verdict:
    """A skipped verdict: the run gave the check nothing to judge (`why` says what did not happen)."""
    return Verdict(id=spec.id, kind=spec.kind, passed=True, summary=f"nothing to judge: {why}",
                   evidence=evidence, phase=spec.params.get("phase"), skipped=True)
