"""responses_valid: every OK response satisfies the rules written in the scenario on its fields.

The rules travel to the replay engine before the run (harness/responses.py: a Validator in its
comparer slot decodes each OK response, protobuf for the bundled agent, else JSON, and notes the
rules it broke on the call); the check counts, per phase, the OK calls its rules applied to and those
that broke one, with the first examples.
"""

from __future__ import annotations

from harness.checks.base import Param, Verdict, nothing_to_judge, phase_window, register, verdict
from harness.responses import INVALID, ResponseRules
from harness.scenario import CheckSpec
from harness.timeline import Timeline


class ResponsesValid:
    name = "responses_valid"
    params = {"rules": Param("rules", required=True, help="[{field: PATH, min/max/in/non_empty/equals_request}]"),
              "phase": Param("phase", help="default: the whole run"),
              "method": Param("str", help="only calls of this method (a suffix: Decide, /api/orders)"),
              "max_invalid_pct": Param("number", help="OK responses allowed to break a rule, % (default 0)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        start, end = phase_window(tl, spec)
        rules = ResponseRules(spec.params["rules"], spec.params.get("method", ""))
        tag = f"{INVALID}[{spec.id}]: "
        judged = [c for c in tl.calls if c.outcome == "ok" and start <= c.intended_s < end and rules.applies(c.method)]
        bad = [c for c in judged if any(m.startswith(tag) for m in c.invalid)]
        limit = spec.params.get("max_invalid_pct", 0.0)
        said = "; ".join(r.describe() for r in rules.rules)
        examples = [{"t": round(c.intended_s, 3), "method": c.method,
                     "broken": [m[len(tag):] for m in c.invalid if m.startswith(tag)][:3]} for c in bad[:5]]
        evidence = {"checked": len(judged), "invalid": len(bad), "rules": said, "examples": examples}
        if not judged:
            return nothing_to_judge(spec, "no OK response " + (f"of {rules.method} " if rules.method else "")
                                    + f"in {start:.1f}-{end:.1f}s to check", **evidence)
        pct = len(bad) / len(judged) * 100
        if pct > limit:
            first = bad[0]
            broke = ", ".join(m[len(tag):] for m in first.invalid if m.startswith(tag))
            return verdict(spec, False, f"{len(bad)} of {len(judged)} OK responses ({pct:.1f}%) broke a rule, at "
                           f"most {limit:g}% allowed; first at {first.intended_s:.1f}s ({first.method}): {broke}",
                           **evidence)
        return verdict(spec, True, f"{len(judged) - len(bad)} of {len(judged)} OK responses kept every rule "
                       f"({said})" + (f"; {len(bad)} did not, within {limit:g}%" if bad else ""), **evidence)


register(ResponsesValid())
