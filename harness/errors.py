"""Exceptions raised by the harness (scenarios, runner, checks, reports).

    HarnessError              root: catch this to catch everything below
    +-- ScenarioError         a scenario file is missing or invalid; says file, line and what is expected
    +-- RunError              the run could not start or went wrong (agent, proxy, leftovers, traffic)
    +-- ReportError           a report could not be written

Foreign exceptions (yaml, OSError, the other packages' errors) are mapped at the boundary with
``raise ... from exc`` so the CLI prints one line that says what to do.
"""

from __future__ import annotations


class HarnessError(Exception):
    """Root of every error raised by `harness`."""


class ScenarioError(HarnessError):
    """A scenario is invalid. `file` and `line` (1-based) locate it when known."""

    def __init__(self, message: str, file: str | None = None, line: int | None = None) -> None:
        where = f"{file}:{line}: " if file and line else (f"{file}: " if file else "")
        super().__init__(where + message)
        self.file = file
        self.line = line
        self.reason = message


class RunError(HarnessError):
    """The chaos run could not start, or a part it depends on failed."""


class ReportError(HarnessError):
    """A report file could not be written."""
