"""responses_match: field-by-field comparison, Diffy-style noise, the seeded sample, the verdict's counts
per phase, and scenario errors with file and line. Real targets: test_scenario_http_faults.py (against a
recording, nginx) and test_checks_broken_agents.py (against two known-good agents)."""

from __future__ import annotations

from typing import Any

import pytest

from harness.checks import CHECKS
from harness.matching import (
    MatchSpec,
    RecordingNoise,
    Reservoir,
    Sample,
    against_references,
    bare,
    diff_lines,
    differing,
    flatten,
    same,
)
from harness.scenario import CheckSpec
from harness.scenario_load import ScenarioError, load_scenario_text
from harness.timeline import Timeline


def test_documents_flatten_to_paths_and_numbers_compare_within_tolerance() -> None:
    doc = {"side": "BUY", "risk": {"limit": 3}, "levels": [{"bid": 1.0}, {"bid": 2.0}], "tags": []}
    assert flatten(doc) == {"levels[0].bid": 1.0, "levels[1].bid": 2.0, "risk.limit": 3, "side": "BUY", "tags": []}
    assert bare("levels[12].bid") == "levels.bid"
    assert same(0.4205423770305291, 0.420542370192162, 0.0)          # float32 batch rounding: 1.6e-8 relative
    assert not same(0.42, 0.43, 0.0) and same(0.42, 0.43, 0.02)
    assert same("12", 12, 0.0) and not same("BUY", "SELL", 1.0) and not same(True, 1, 0.0)
    d = differing(flatten({"a": 1, "b": [1, 2]}), flatten({"a": 2, "b": [1]}), 0.0)
    assert d == {"a": (1, 2), "b[1]": (2, None)}
    assert diff_lines(d, noise={"a"}, globs=()) == ["b[1]: 2 != missing"]
    assert diff_lines(d, noise=set(), globs=("b",)) == ["a: 1 != 2"]


def test_the_recording_teaches_its_own_noise_from_identical_requests() -> None:
    noise = RecordingNoise()
    noise.add(b"GET /a", {"id": 1, "ts": 100}, 0.0)
    noise.add(b"GET /b", {"id": 2, "ts": 200}, 0.0)          # another request: nothing learnt
    assert noise.noise == set()
    noise.add(b"GET /a", {"id": 1, "ts": 300}, 0.0)          # the same request, another ts: ts is noise
    assert noise.noise == {"ts"}


def test_the_sample_is_seeded_and_bounded() -> None:
    def draw(seed: int) -> list[int]:
        r = Reservoir(10, seed)
        for i in range(1000):
            r.offer(Sample(i, i / 100, "/M", b"", b""))
        assert r.seen == 1000 and len(r.items) == 10
        return [s.index for s in r.items]

    assert draw(3) == draw(3) and draw(3) != draw(4)
    assert max(draw(3)) > 100          # uniform over the run, not its first calls


def _decode(method: str, data: bytes) -> Any:
    import json
    return json.loads(data)


def test_fields_the_two_references_disagree_on_never_count() -> None:
    spec = MatchSpec("responses_match", "reference", ("a:1", "b:1"))
    samples = [Sample(i, float(i), "/M", b"", b'{"answer": %d, "took": %d}' % (i, 9)) for i in range(3)]
    primary = [b'{"answer": 0, "took": 1}', b'{"answer": 1, "took": 2}', b'{"answer": 5, "took": 3}']
    secondary = [b'{"answer": 0, "took": 4}', None, b'{"answer": 5, "took": 5}']
    out = against_references(spec, samples, primary, secondary, _decode)
    assert out["noise"] == ["took"]
    assert out["calls"] == [(0.0, "/M", []), (1.0, "/M", []), (2.0, "/M", ["answer: 5 != 2"])]
    # a reference that did not answer leaves the call out, counted
    out = against_references(spec, samples, [None, *primary[1:]], secondary, _decode)
    assert out["unanswered"] == 1 and len(out["calls"]) == 2


def _timeline(matches: dict[str, Any]) -> Timeline:
    return Timeline(period_s=1.0, threshold_ms=20.0, phases=[("before", 0.0, 10.0), ("after", 10.0, 20.0)],
                    calls=[], outside={"matches": matches})


def test_the_verdict_counts_per_phase_and_applies_the_noise_learnt_late() -> None:
    calls = [(t * 0.5, "/M", ["ts: 1 != 2"] if t % 2 else []) for t in range(20)]            # only noise, before
    calls += [(10 + t * 0.5, "/M", ["side: \"BUY\" != \"SELL\""] if t < 5 else []) for t in range(20)]
    got = {"calls": calls, "noise": ["ts"]}
    tl = _timeline({"responses_match[before]": got, "responses_match[after]": got, "responses_match": got})
    check = CHECKS["responses_match"]
    before = check.evaluate(tl, CheckSpec("responses_match", {"phase": "before"}))
    assert before.passed and before.summary == "20 of 20 responses match the recording; noise cancelled: ts"
    after = check.evaluate(tl, CheckSpec("responses_match", {"phase": "after"}))
    assert not after.passed
    assert after.summary == ('5 of 20 responses differ from the recording (25.0%, at most 0%); first at 10.0s '
                             '(/M): side: "BUY" != "SELL"; noise cancelled: ts')
    assert after.evidence["fields"] == {"side": 5} and len(after.evidence["examples"]) == 5
    whole = check.evaluate(tl, CheckSpec("responses_match", {})).evidence["by_phase"]
    assert whole == {"before": {"compared": 20, "mismatched": 0}, "after": {"compared": 20, "mismatched": 5}}
    assert check.evaluate(tl, CheckSpec("responses_match", {"phase": "after", "max_mismatch_pct": 30})).passed
    nothing = check.evaluate(_timeline({"responses_match": {"calls": [], "unmatched": {"no response was "
                                                                                       "recorded": 7}}}),
                             CheckSpec("responses_match", {}))
    assert nothing.skipped and "(7 no response was recorded)" in nothing.summary


BASE = """\
name: m
target: {agent: {}}
traffic: {generator: {rate: 10}}
phases: [{name: only, duration: 2s}]
expect:
  - responses_match: PARAMS
"""


@pytest.mark.parametrize("params,error", [
    ("{against: recording, references: [agent]}", "references are for against: reference"),
    ("{references: [a:1, b:2, c:3]}", "expected [agent] or one or two HOST:PORT, got 3 entries"),
    ("{references: ['no port']}", "'no port' is not HOST:PORT"),
    ("{against: sideways}", "expected one of recording, reference"),
    ("{references: ['10.255.255.1:50051', '127.0.0.1:1']}", "refusing to send the run's requests to 10.255.255.1:50051"),
])
def test_bad_parameters_name_the_file_and_line(params: str, error: str) -> None:
    with pytest.raises(ScenarioError) as e:
        load_scenario_text(BASE.replace("PARAMS", params), "m.yaml")
    assert str(e.value).startswith("m.yaml:6: ") and error in str(e.value), str(e.value)


def test_good_parameters_load() -> None:
    s = load_scenario_text(BASE.replace("PARAMS", "{against: reference, references: ['127.0.0.1:5001', "
                                                  "'[::1]:5002'], ignore: [stages*], tolerance: 0.01}"), "m.yaml")
    assert list(s.expect[0].params["references"]) == ["127.0.0.1:5001", "[::1]:5002"]
