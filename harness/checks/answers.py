"""responses_valid: every OK response satisfies the rules written in the scenario on its fields.
responses_match: every OK response is the answer the recording, or a known-good reference, gives.

The rules travel to the replay engine before the run (harness/responses.py: a Validator in its
comparer slot decodes each OK response, protobuf for the bundled agent, else JSON, and notes the
rules it broke on the call); the check counts, per phase, the OK calls its rules applied to and those
that broke one, with the first examples.

responses_match (harness/matching.py) compares each response field by field with the recorded one,
or, after the run, with two references sent a seeded sample of the same requests; fields that differ
between two answers the references (or the recording) give to one request are noise and never count.
"""

from __future__ import annotations

import re
from typing import Any

from harness.checks.base import CHECKS, Param, Verdict, nothing_to_judge, phase_window, verdict
from harness.matching import MAX_SAMPLES, MatchSpec, bare, path_of
from harness.responses import INVALID, ResponseRules
from harness.scenario import CheckSpec
from harness.timeline import Timeline


def by_phase(tl: Timeline, judged: list[tuple[float, bool]], bad_key: str, key: str = "checked"
             ) -> dict[str, dict[str, int]]:
    """Counts per phase of the run: {phase: {key: n, bad_key: m}} for (intended s, bad) pairs."""
    out: dict[str, dict[str, int]] = {}
    for t, bad in judged:
        entry = out.setdefault(tl.phase_at(t) or "after the run", {key: 0, bad_key: 0})
        entry[key] += 1
        entry[bad_key] += bad
    return out


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
        bad_ids = {id(c) for c in bad}
        limit = spec.params.get("max_invalid_pct", 0.0)
        said = "; ".join(r.describe() for r in rules.rules)
        examples = [{"t": round(c.intended_s, 3), "method": c.method,
                     "broken": [m[len(tag):] for m in c.invalid if m.startswith(tag)][:3]} for c in bad[:5]]
        evidence = {"checked": len(judged), "invalid": len(bad), "rules": said, "examples": examples,
                    "by_phase": by_phase(tl, [(c.intended_s, id(c) in bad_ids) for c in judged], "invalid")}
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


_ADDRESS = re.compile(r"^[A-Za-z0-9_.\-]+:\d{1,5}$|^\[[0-9A-Fa-f:.]+\]:\d{1,5}$")


def match_spec(spec: CheckSpec) -> MatchSpec:
    """A responses_match check's settings (its parameters were validated on load)."""
    p = spec.params
    against = p.get("against", "reference" if p.get("references") else "recording")
    refs = tuple(p.get("references") or (("agent",) if against == "reference" else ()))
    return MatchSpec(spec.id, against, refs, tuple(p.get("ignore") or ()), float(p.get("tolerance", 0.0)),
                     p.get("method", ""), int(p.get("max_calls", MAX_SAMPLES)))


class ResponsesMatch:
    name = "responses_match"
    params = {"against": Param("choice:recording,reference", help="what a response is compared with "
                                                                   "(default: recording)"),
              "references": Param("strlist", help="[agent] (the bundled agent, started twice) or two "
                                                  "HOST:PORT of known-good builds; the second cancels noise"),
              "ignore": Param("strlist", help="field globs that never count (server_latency_ns, stages*)"),
              "tolerance": Param("number", help="numbers within this (absolute) are equal (default 0)"),
              "phase": Param("phase", help="default: the whole run"),
              "method": Param("str", help="only calls of this method (a suffix: Decide, /api/orders)"),
              "max_mismatch_pct": Param("number", help="compared responses allowed to differ, % (default 0)"),
              "max_calls": Param("int", help=f"calls sent again to the references, a seeded sample (default "
                                             f"{MAX_SAMPLES})")}

    def wrong_params(self, p: dict[str, Any]) -> str | None:
        refs = p.get("references")
        if p.get("against") == "recording" and refs:
            return "references are for against: reference (the recording is the reference otherwise)"
        if refs is not None and list(refs) != ["agent"]:
            if not 1 <= len(refs) <= 2:
                return f"references: expected [agent] or one or two HOST:PORT, got {len(refs)} entries"
            bad = [r for r in refs if not _ADDRESS.match(r)]
            if bad:
                return f"references: {bad[0]!r} is not HOST:PORT (or the single word agent)"
            from replay.errors import TargetNotAllowedError
            from replay.target import check_target

            for ref in refs:     # the references get the run's requests: the same safety as any target
                try:
                    check_target(ref)
                except TargetNotAllowedError as exc:
                    return "references: " + str(exc).split("; pass --allow-target", 1)[0].replace(
                        "replay to", "send the run's requests to") + " (allow it in SHADOWTEST_ALLOW_TARGETS)"
        if not 1 <= p.get("max_calls", MAX_SAMPLES) <= 100_000:
            return "max_calls: expected 1 to 100000"
        return None

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        start, end = phase_window(tl, spec)
        m = match_spec(spec)
        got = (tl.outside.get("matches") or {}).get(spec.id)
        if got is None:
            return nothing_to_judge(spec, "the run compared no response (the check was not prepared)")
        if got.get("error"):
            return verdict(spec, False, f"the references could not answer: {got['error']}")
        noise = set(got.get("noise", ()))
        calls = [(t, method, [d for d in diffs if bare(path_of(d)) not in noise])
                 for t, method, diffs in got.get("calls", ()) if start <= t < end]
        bad = [c for c in calls if c[2]]
        refs = got.get("references") or []
        against = ("the recording" if m.against == "recording" else
                   "the known-good build (the bundled agent, started twice, limiter off)" if m.references == ("agent",)
                   else f"the reference{'s' if len(refs) > 1 else ''} {' and '.join(refs)}")
        evidence: dict[str, Any] = {
            "against": m.against, "compared": len(calls), "mismatched": len(bad), "noise": sorted(noise)[:20],
            "by_phase": by_phase(tl, [(t, bool(d)) for t, _, d in calls], "mismatched", "compared"),
            "fields": _field_counts(bad), "examples": [{"t": round(t, 3), "method": meth, "diffs": d[:5]}
                                                       for t, meth, d in bad[:5]]}
        for key in ("sampled", "of", "references", "unanswered", "undecodable", "unmatched"):
            if got.get(key):
                evidence[key] = got[key]
        if not calls:
            why = "; ".join(f"{n} {w}" for w, n in (got.get("unmatched") or {}).items())
            return nothing_to_judge(spec, f"no OK response in {start:.1f}-{end:.1f}s could be compared with "
                                    f"{against}" + (f" ({why})" if why else ""), **evidence)
        pct = len(bad) / len(calls) * 100
        limit = spec.params.get("max_mismatch_pct", 0.0)
        sample = f" (a sample of {got['sampled']} of {got['of']} OK calls)" if got.get("of", 0) > len(calls) else ""
        quiet = f"; noise cancelled: {', '.join(sorted(noise)[:4])}" + ("..." if len(noise) > 4 else "") if noise else ""
        if pct > limit:
            t, meth, diffs = bad[0]
            return verdict(spec, False, f"{len(bad)} of {len(calls)} responses{sample} differ from {against} "
                           f"({pct:.1f}%, at most {limit:g}%); first at {t:.1f}s ({meth}): {'; '.join(diffs[:3])}"
                           + quiet, **evidence)
        return verdict(spec, True, f"{len(calls) - len(bad)} of {len(calls)} responses{sample} match {against}"
                       + (f"; {len(bad)} differ, within {limit:g}%" if bad else "") + quiet, **evidence)


def _field_counts(bad: list[tuple[float, str, list[str]]]) -> dict[str, int]:
    """How many mismatched calls each field differed in (fields by path without list indices)."""
    out: dict[str, int] = {}
    for _, _, diffs in bad:
        for field in {bare(path_of(d)) for d in diffs}:
            out[field] = out.get(field, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:20])


for _check in (ResponsesValid(), ResponsesMatch()):
    CHECKS.add(_check.name, _check)
