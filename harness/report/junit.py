"""JUnit XML: one testsuite per scenario, one testcase per check, the evidence in the failure text."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from harness import __version__
from harness.outputs import schema

if TYPE_CHECKING:
    from harness.report.write import RunResult


def junit_xml(result: RunResult) -> str:
    """The run as JUnit XML (what CI systems show as a test report). Under --strict a skipped check is
    a failure (type "skipped"), as it is for the run."""
    strict = result.strict
    failures = sum(not v.passed or (strict and v.skipped) for v in result.verdicts)
    suite = ET.Element("testsuite", name=f"shadowtest.{result.scenario.name}", tests=str(len(result.verdicts)),
                       failures=str(failures), skipped=str(0 if strict else result.skipped), errors="1" if result.interrupted else "0",
                       time=f"{result.timeline.duration_s:.3f}")
    props = ET.SubElement(suite, "properties")
    for key, value in (("schema", schema("results")), ("shadowtest_version", __version__), ("seed", result.scenario.seed), ("source", result.scenario.source or ""),
                       ("partial", result.timeline.partial), ("strict", strict)):
        ET.SubElement(props, "property", name=key, value=str(value))
    for f in result.timeline.faults:   # every fault window, as the Markdown table shows it
        when = " ".join(f"{k} {'-' if t is None else f'{t:.2f}s'}" for k, t in
                        (("asked", f.requested_s), ("took effect", f.applied_s), ("removed", f.removed_s)))
        ET.SubElement(props, "property", name="fault", value=f"{f.label} [{f.phase}] {when}: {f.error or f.detail}")
    for v in result.verdicts:
        case = ET.SubElement(suite, "testcase", classname=f"shadowtest.{result.scenario.name}", name=v.id,
                             time="0")
        if v.skipped and strict:
            fail = ET.SubElement(case, "failure", message=f"skipped under --strict: {v.summary}", type="skipped")
            fail.text = json.dumps(v.evidence, indent=2, default=str)
        elif v.skipped:
            ET.SubElement(case, "skipped", message=v.summary)
        elif not v.passed:
            fail = ET.SubElement(case, "failure", message=v.summary, type=v.kind)
            fail.text = json.dumps(v.evidence, indent=2, default=str)
        else:
            ET.SubElement(case, "system-out").text = v.summary
    if result.interrupted:
        case = ET.SubElement(suite, "testcase", classname=f"shadowtest.{result.scenario.name}", name="run")
        ET.SubElement(case, "error", message=f"run interrupted: {result.interrupted}", type="interrupted")
    ET.indent(suite)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"
