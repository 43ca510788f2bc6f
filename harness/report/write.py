"""Write every report of a run under one directory, and say where each one is.

    RunResult (scenario, timeline, verdicts, log)
        +--> results.json      everything, for machines
        +--> junit.xml         one testcase per check (or --junit PATH)
        +--> summary.md        for CI job pages ($GITHUB_STEP_SUMMARY)
        +--> timeline.png      percentiles, fault windows, limiter, alert bands, tier
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.checks import Verdict
from harness.errors import ReportError
from harness.outputs import stamped
from harness.scenario import Scenario
from harness.timeline import Timeline


@dataclass
class RunResult:
    scenario: Scenario
    timeline: Timeline
    verdicts: list[Verdict]
    log: list[str] = field(default_factory=list)          # timestamped runner log lines
    started_wall: float = 0.0
    interrupted: str | None = None                        # why the run ended early, if it did
    notes: list[str] = field(default_factory=list)        # e.g. which capture fallback and why

    @property
    def strict(self) -> bool:
        """`chaos run --strict`: a skipped check (nothing to judge) fails the run."""
        return self.scenario.strict

    @property
    def skipped(self) -> int:
        return sum(v.skipped for v in self.verdicts)

    @property
    def passed(self) -> bool:
        # Skipped verdicts fail nothing, but a run whose every check had nothing to judge passed nothing;
        # under --strict any skipped check fails the run.
        return (self.interrupted is None and bool(self.verdicts) and all(v.passed for v in self.verdicts)
                and any(not v.skipped for v in self.verdicts) and not (self.strict and self.skipped))

    def headline(self, partial: str = " (partial)") -> str:
        """PASSED, FAILED, INTERRUPTED (partial), or FAILED (--strict: ...) when only skipped checks failed it."""
        if self.passed:
            return "PASSED"
        if self.interrupted:
            return "INTERRUPTED" + partial
        if self.strict and self.skipped and all(v.passed for v in self.verdicts):
            return f"FAILED (--strict: {self.skipped} check{'s' if self.skipped != 1 else ''} skipped)"
        return "FAILED"

    def tally(self) -> str:
        """'7/8 checks passed' (+ ', 1 skipped: nothing to judge' when some had nothing to judge)."""
        passed = sum(v.passed and not v.skipped for v in self.verdicts)
        out = f"{passed}/{len(self.verdicts)} checks passed"
        return out + (f", {self.skipped} skipped (nothing to judge)" if self.skipped else "")

    def as_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario.name, "source": self.scenario.source, "seed": self.scenario.seed,
                "started_wall": self.started_wall, "duration_s": self.timeline.duration_s,
                "passed": self.passed, "strict": self.strict, "interrupted": self.interrupted,
                "partial": self.timeline.partial,
                "checks": {"total": len(self.verdicts), "failed": sum(not v.passed for v in self.verdicts),
                           "skipped": self.skipped},
                "verdicts": [v.as_dict() for v in self.verdicts], "notes": self.notes, "log": self.log,
                "dependencies": self.timeline.outside.get("dependencies", []),
                "timeline": self.timeline.as_dict()}


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise ReportError(f"cannot write {path}: {exc.strerror}; pick a writable --report-dir") from exc


def write_reports(result: RunResult, report_dir: str | os.PathLike[str], junit: str | None = None,
                  png: bool = True) -> dict[str, str]:
    """Write results.json, junit.xml, summary.md and timeline.png; return {kind: path}.

    A PNG that cannot be drawn (matplotlib missing) is skipped and noted, never fatal: the
    verdicts matter more than the picture. Raises ReportError when a file cannot be written.
    """
    from harness.report.junit import junit_xml
    from harness.report.markdown import markdown

    out = Path(report_dir)
    paths = {"json": out / "results.json", "junit": Path(junit) if junit else out / "junit.xml",
             "markdown": out / "summary.md", "png": out / "timeline.png"}
    written: dict[str, str] = {}
    if png:
        try:
            from harness.report.plot import plot_timeline
            plot_timeline(result, paths["png"])
            written["png"] = str(paths["png"])
        except ImportError as exc:
            result.notes.append(f"timeline.png skipped: {exc} (pip install 'shadowtest[plots]')")
    _write(paths["json"], json.dumps(stamped("results", result.as_dict()), indent=2, default=_jsonable))
    written["json"] = str(paths["json"])
    _write(paths["junit"], junit_xml(result))
    written["junit"] = str(paths["junit"])
    _write(paths["markdown"], markdown(result, png_name="timeline.png" if "png" in written else None))
    written["markdown"] = str(paths["markdown"])
    return written


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "__dict__"):
        return vars(value)
    return str(value)
