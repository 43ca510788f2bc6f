"""One percentile (wire/stats.py, nearest rank) on every reporting path: the same latencies fed through
each path that prints a P50/P95/P99 give the same numbers.

The latencies are whole microseconds below 2,048, where an HDR histogram of 3 significant digits is
exact, so the histogram paths (the replayer's RunStats, the agent's own monitor) must agree to the
microsecond with the list paths (the harness timeline and capacity steps, the traffic generator's
report, the recording summary, the benches' helper).
"""

from __future__ import annotations

import random

import pytest

from agent_under_test.monitor import summary_from_values
from agent_under_test.traffic_lanes import CallResult as TrafficCall
from agent_under_test.traffic_report import summarize as traffic_summary
from capture.summary import _sizes
from harness.capacity import summarise as capacity_step
from harness.timeline import CallResult, Timeline
from replay.stats import RunStats, percentiles_ms
from wire.stats import percentile, percentiles, rank


def _latencies_us(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(50, 2000) for _ in range(n)]


def test_nearest_rank_definition() -> None:
    values = list(range(1, 101))         # 1..100
    assert [percentile(values, q) for q in (0.0, 0.01, 0.5, 0.95, 0.99, 1.0)] == [1, 1, 50, 95, 99, 100]
    assert percentile([7.0], 0.99) == 7.0
    assert rank(0.07, 100) == 7          # 0.07 * 100 is 7.000000000000001 in floating point
    assert rank(0.5, 3) == 2 and rank(0.99, 3) == 3
    assert percentiles([3, 1, 2], (0.5,)) == {0.5: 2}
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)
    with pytest.raises(ValueError, match="outside"):
        percentile([1], 1.5)


@pytest.mark.parametrize("n, seed", [(1, 1), (7, 2), (100, 3), (1000, 4), (4321, 5)])
def test_every_reporting_path_gives_the_same_percentiles(n: int, seed: int) -> None:
    lat_us = _latencies_us(n, seed)
    ms = [u / 1000 for u in lat_us]
    truth = {q: percentile(sorted(lat_us), q) / 1000 for q in (0.5, 0.95, 0.99)}

    # the harness: a timeline's period, and a capacity step (calls due at 0, answered after `ms`)
    calls = [CallResult(intended_s=0.0, sent_s=0.0, done_s=m / 1000, method="/m", outcome="ok") for m in ms]
    tl = Timeline(period_s=10.0, threshold_ms=20.0, phases=[("p", 0.0, 10.0)], calls=calls)
    tl.min_samples = 1
    (period,) = tl.periods
    assert (period.p50_ms, period.p95_ms, period.p99_ms) == tuple(round(truth[q], 3) for q in (0.5, 0.95, 0.99))
    step = capacity_step(calls, 0, 100.0, 10.0, [])
    assert {k: step.percentiles_ms[k] for k in ("p50", "p99")} == {"p50": round(truth[0.5], 3),
                                                                     "p99": round(truth[0.99], 3)}

    # the traffic generator's report
    traffic = [TrafficCall(intended_ns=0, sent_ns=0, done_ns=u * 1000, method="/a.B/C", code="OK", sequence_id=i)
               for i, u in enumerate(lat_us)]
    report = traffic_summary("t", "p", 1, 1.0, 1.0, traffic, 0, 10**9)
    assert (report.p50_ms, report.p95_ms, report.p99_ms) == tuple(round(truth[q], 3) for q in (0.5, 0.95, 0.99))

    # the replayer's histograms and the agent's own monitor (HDR, exact below 2,048 us)
    stats = RunStats()
    for u in lat_us:
        stats._record(stats.latency, u * 1000)
    got = percentiles_ms(stats.latency)
    assert (got["p50"], got["p95"], got["p99"]) == (truth[0.5], truth[0.95], truth[0.99])
    summary = summary_from_values(0, 0.0, 1.0, ms, threshold_ms=20.0, min_samples=1)
    assert (summary.p50_ms, summary.p95_ms, summary.p99_ms) == (truth[0.5], truth[0.95], truth[0.99])

    # the recording summary (its payload sizes: the same rank on integers)
    sizes = _sizes(list(lat_us))
    assert (sizes["p50"], sizes["p99"]) == (round(truth[0.5] * 1000), round(truth[0.99] * 1000))
