"""Correct answers, not only answers: rules on the fields of every OK response (`responses_valid`).

    scenario expect: responses_valid {rules: [...]} --> ResponseRules --> Validator (the replay engine's
    comparer slot: it sees every call's request and responses) --> per call, the rules it broke --> the
    check counts them per phase, with the first examples

A response is read as protobuf (the method's output type, from the bundled agent's modules, a protoset
or the target's reflection) or as JSON (an HTTP body), then as a mapping: field paths are dotted
(`risk.limit`), a list's elements are each checked (`items.qty`). Rules: `min`/`max` (numbers),
`in` (a list of allowed values; protobuf enums by name), `non_empty`, `equals_request` (the same
field, or the named one, of the call's request: a sequence id echoed back).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from harness.matching import (
    MatchSpec,
    RecordingNoise,
    Reservoir,
    Sample,
    diff_lines,
    differing,
    flatten,
    number,
)

MAX_RULES = 50
MAX_EXAMPLES = 5
MAX_MATCHED = 1_000_000     # calls a responses_match check keeps (intended time, method, differences)


@dataclass(frozen=True)
class ResponseRule:
    field: str
    min: float | None = None
    max: float | None = None
    allowed: tuple[Any, ...] | None = None
    non_empty: bool = False
    equals_request: str | None = None

    def describe(self) -> str:
        parts = []
        if self.min is not None:
            parts.append(f">= {self.min:g}")
        if self.max is not None:
            parts.append(f"<= {self.max:g}")
        if self.allowed is not None:
            parts.append(f"in {list(self.allowed)}")
        if self.non_empty:
            parts.append("non-empty")
        if self.equals_request:
            parts.append(f"== request.{self.equals_request}")
        return f"{self.field} {' and '.join(parts)}"


@dataclass(frozen=True)
class ResponseRules:
    rules: tuple[ResponseRule, ...]
    method: str = ""                # only calls whose method ends with this ("" = all)

    def applies(self, method: str | None) -> bool:
        return not self.method or bool(method) and (method == self.method or str(method).endswith(self.method))


def values_at(doc: Any, path: str) -> list[Any]:
    """Every value at the dotted `path` of a decoded document (lists fan out); [] when absent."""
    out = [doc]
    for key in path.split("."):
        nxt: list[Any] = []
        for v in out:
            for item in (v if isinstance(v, list) else [v]):
                if isinstance(item, dict) and key in item:
                    nxt.append(item[key])
        out = nxt
    return [x for v in out for x in (v if isinstance(v, list) else [v])]


def broken_rules(rule: ResponseRule, response: Any, request: Any) -> str | None:
    """What `response` does wrong under `rule` (one line), or None."""
    got = values_at(response, rule.field)
    if not got:
        if rule.non_empty or rule.equals_request or rule.min is not None or rule.max is not None:
            return f"{rule.field}: missing"
        return None
    for v in got:
        if rule.non_empty and v in ("", [], {}, None, 0, "0"):
            return f"{rule.field}: empty"
        if rule.min is not None or rule.max is not None:
            n = number(v)
            if n is None or not math.isfinite(n):
                return f"{rule.field}: {v!r} is not a number"
            if rule.min is not None and n < rule.min:
                return f"{rule.field}: {n:g} < {rule.min:g}"
            if rule.max is not None and n > rule.max:
                return f"{rule.field}: {n:g} > {rule.max:g}"
        if rule.allowed is not None and v not in rule.allowed and number(v) not in rule.allowed:
            return f"{rule.field}: {v!r} not in {list(rule.allowed)}"
    if rule.equals_request:
        want = values_at(request, rule.equals_request)
        if got != want:
            return f"{rule.field}: {got[0] if len(got) == 1 else got!r} != request.{rule.equals_request} " \
                   f"{want[0] if len(want) == 1 else want!r}"
    return None


INVALID = "invalid"     # the prefix of the lines a Validator returns: "invalid[CHECK ID]: what broke"


class Validator:
    """The replay engine's comparer slot, used to judge every response against the scenario's rules
    (one rule set per `responses_valid` check, by its id). `compare` returns the broken rules of one
    call as "invalid[ID]: ..." lines; `summary` the counts."""

    def __init__(self, sets: dict[str, ResponseRules], descriptors: Any = None,
                 matches: dict[str, MatchSpec] | None = None, seed: int = 0) -> None:
        self.sets, self.descriptors = sets, descriptors
        self.matches = matches or {}
        # the request is decoded only for a rule that compares with it
        self._needs_request = any(r.equals_request for rules in sets.values() for r in rules.rules)
        self.checked = self.invalid = self.undecodable = 0
        self.examples: list[dict[str, Any]] = []
        # responses_match: per check, the compared calls (intended s, method, diff lines), the recording's
        # own noise, the calls the recording cannot answer for, and the sample kept for the references
        self.matched: dict[str, list[tuple[float, str, list[str]]]] = {k: [] for k in self.matches}
        self.noise = {k: RecordingNoise() for k in self.matches}
        self.unmatched: dict[str, dict[str, int]] = {k: {} for k in self.matches}
        self.samples = {k: Reservoir(m.max_calls, seed) for k, m in self.matches.items()}

    def compare(self, planned: Any, outcome: Any) -> list[str]:
        if outcome.outcome != "ok":
            return []
        for k, spec in self.matches.items():
            if spec.applies(planned.method):
                self._match(k, spec, planned, outcome)
        sets = {k: r for k, r in self.sets.items() if r.applies(planned.method)}
        if not sets:
            return []
        self.checked += 1
        response = self._decode(planned.method, b"".join(outcome.responses[:1]), output=True)
        if response is None:
            self.undecodable += 1
            return [f"{INVALID}[{k}]: the response could not be decoded (neither protobuf with the method's "
                    "type nor JSON)" for k in sets]
        request = self._decode(planned.method, planned.messages[0].data if planned.messages else b"",
                               output=False) if self._needs_request else None
        out = [f"{INVALID}[{k}]: {b}" for k, rules in sets.items() for r in rules.rules
               if (b := broken_rules(r, response, request or {})) is not None]
        if out:
            self.invalid += 1
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append({"method": planned.method, "broken": out[:3]})
        return out

    def _match(self, key: str, spec: MatchSpec, planned: Any, outcome: Any) -> None:
        """One OK call for a responses_match check: kept for the references, or compared with its
        recorded response now (the recording's noise learnt on the way)."""
        request = planned.messages[0].data if planned.messages else b""
        got_raw = b"".join(outcome.responses[:1])
        method = planned.method or "?"
        if spec.against == "reference":
            self.samples[key].offer(Sample(planned.index, planned.due_ns / 1e9, method, request, got_raw))
            return
        why = planned.not_comparable or (None if planned.expected_responses else "no response was recorded")
        want = got = None
        if why is None:
            want = self._document(planned, planned.expected_responses[0])
            got = self._document(planned, got_raw)
            why = "undecodable" if want is None or got is None else None
        if why is not None:
            left = self.unmatched[key]
            if why in left or len(left) < 20:
                left[why] = left.get(why, 0) + 1
            return
        fw = flatten(want)
        # the same request: its method, path, headers and body (a header that varies only makes two
        # requests look different, never two answers look like noise)
        same_request = repr((method, planned.metadata)).encode() + b"\0" + request
        self.noise[key].add(same_request, fw, spec.tolerance)
        if len(self.matched[key]) < MAX_MATCHED:
            lines = diff_lines(differing(fw, flatten(got), spec.tolerance), self.noise[key].noise, spec.ignore)
            self.matched[key].append((planned.due_ns / 1e9, method, lines))

    def _document(self, planned: Any, data: bytes) -> Any:
        """A response as a document to compare: protobuf or JSON; an HTTP body that is neither, as its
        text (`body`), compared whole."""
        doc = self._decode(planned.method, data, output=True)
        if doc is None and planned.protocol in ("http1", "http2"):
            return {"body": data.decode("utf-8", "replace")}
        return doc

    def decode_response(self, method: str, data: bytes) -> Any:
        return self._decode(method, data, output=True)

    def summary(self) -> dict[str, Any]:
        return {"responses_checked": self.checked, "responses_invalid": self.invalid,
                "undecodable": self.undecodable, "examples": self.examples}

    def _decode(self, method: str | None, data: bytes, output: bool) -> Any:
        cls = self._message_class(method, output)
        if cls is not None:
            from google.protobuf.json_format import MessageToDict
            from google.protobuf.message import DecodeError

            try:
                msg = cls.FromString(data)
            except DecodeError:
                return None
            return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        try:
            return json.loads(data) if data else {}
        except (ValueError, UnicodeDecodeError):
            return None

    def _message_class(self, method: str | None, output: bool) -> Any:
        if self.descriptors is None:
            return None
        return self.descriptors.output_class(method) if output else self.descriptors.input_class(method)
