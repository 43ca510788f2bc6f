"""RunStats' histograms: the memoised fast record path must leave exactly what hdrh's own would."""

from __future__ import annotations

import random

from replay.stats import RunStats, _hist


def test_fast_recording_matches_hdrh_record_value_exactly() -> None:
    rng = random.Random(7)
    values_ns = [0, -5, 999, 1000, 65_535_999, 65_536_000, 3_600_000_000_000 + 5_000]  # 1 us past the range: clamped
    values_ns += [rng.randrange(0, 80_000_000) for _ in range(20_000)]  # across the 64 ms memo edge
    stats, reference = RunStats(), _hist()
    for ns in values_ns:
        stats._record(stats.lag, ns)
        reference.record_value(min(max(0, ns) // 1000, 3_600_000_000))
    assert stats.lag.get_total_count() == reference.get_total_count() == len(values_ns)
    assert (stats.lag.get_min_value(), stats.lag.get_max_value()) == (reference.get_min_value(), reference.get_max_value())
    assert list(stats.lag.counts) == list(reference.counts)
    assert stats.clamped == 1
    for p in (50, 90, 99, 99.9, 100):
        assert stats.lag.get_value_at_percentile(p) == reference.get_value_at_percentile(p)
