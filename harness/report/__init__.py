"""Reports of a chaos run: verdict table, results.json, JUnit XML, Markdown summary, PNG timeline."""

from harness.report.write import RunResult, write_reports

__all__ = ["RunResult", "write_reports"]
