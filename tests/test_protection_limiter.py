"""Limiter policies in virtual time: exact seed trajectories, bucket and burst, the gradient's formula."""

from __future__ import annotations

import math
import random

import pytest

from agent_under_test.limiter import (
    GradientLimiter,
    LimiterSettings,
    SeedLimiter,
    TokenBucket,
    make_limiter,
)
from agent_under_test.monitor import PeriodSummary

T = 20.0


def period(p99: float | None, count: int = 100, rejected: int = 0, seconds: float = 1.0, n: int = 1,
           p50: float | None = None) -> PeriodSummary:
    """One period's summary; P50 defaults to the P99 (a queue: every call waits alike)."""
    state = "insufficient" if p99 is None else ("breaching" if p99 > T else "healthy")
    if p99 is not None and count < 20:
        state = "insufficient"
    return PeriodSummary(period=n, start=0.0, end=seconds, count=count if p99 is not None else 0, ok=count,
                         invalid=0, errors=0, rejected=rejected, p50_ms=p99 if p50 is None else p50,
                         p95_ms=p99, p99_ms=p99, state=state)


def trajectory(limiter, p99s):
    out = []
    for i, p99 in enumerate(p99s, 1):
        limiter.on_period(period(p99, n=i))
        out.append(limiter.rate)
    return out


def test_seed_follows_x09_x11_exactly_for_a_p99_sequence():
    lim = SeedLimiter(LimiterSettings(threshold_ms=T, initial_rate=100.0, min_rate=1.0, max_rate=1e6))
    got = trajectory(lim, [30.0, 30.0, 10.0, 20.0, 25.0, 5.0])
    # 20.0 is not above the threshold: it grows.
    want = [100.0 * 0.9]
    for f in (0.9, 1.1, 1.1, 0.9, 1.1):
        want.append(want[-1] * f)
    assert got == pytest.approx(want, rel=1e-12)
    assert got[:3] == pytest.approx([90.0, 81.0, 89.1])


def test_seed_stops_at_floor_and_ceiling_and_reports_no_adjustment_there():
    lim = SeedLimiter(LimiterSettings(threshold_ms=T, initial_rate=11.0, min_rate=10.0, max_rate=12.0))
    adj = lim.on_period(period(50.0))
    assert adj is not None and (adj.old_rate, adj.new_rate) == (11.0, 10.0) and "x0.9" in adj.reason
    assert lim.on_period(period(50.0)) is None and lim.rate == 10.0
    assert trajectory(lim, [1.0, 1.0, 1.0]) == pytest.approx([11.0, 12.0, 12.0])


def test_seed_small_rate_still_grows_as_a_float():
    lim = SeedLimiter(LimiterSettings(threshold_ms=T, initial_rate=1.0, min_rate=0.5, max_rate=100.0))
    assert trajectory(lim, [1.0, 1.0, 1.0]) == pytest.approx([1.1, 1.21, 1.331])


def test_seed_holds_on_a_period_without_calls():
    lim = SeedLimiter(LimiterSettings(initial_rate=100.0))
    assert lim.on_period(period(None)) is None and lim.rate == 100.0


def test_bucket_burst_is_explicit_and_rejections_carry_the_retry_hint():
    bucket = TokenBucket(rate=10.0, burst_s=0.5, now=0.0)
    assert [bucket.take(0.0) for _ in range(5)] == [None] * 5
    assert bucket.take(0.0) == pytest.approx(0.1)
    assert bucket.take(0.05) == pytest.approx(0.05)
    assert bucket.take(0.1) is None
    # A tiny rate still has room for one call.
    assert TokenBucket(rate=1.0, burst_s=0.05, now=0.0).take(0.0) is None


def test_bucket_keeps_earned_tokens_but_never_above_the_new_burst():
    bucket = TokenBucket(rate=100.0, burst_s=0.1, now=0.0)
    assert bucket.tokens == 10.0
    bucket.set_rate(20.0)
    assert bucket.tokens == 2.0


def test_off_admits_everything_and_unknown_names_are_refused():
    off = make_limiter("off", LimiterSettings())
    assert all(off.try_acquire(0.0) is None for _ in range(10_000)) and math.isinf(off.rate)
    with pytest.raises(ValueError, match="gradient, off, seed"):
        make_limiter("nope", LimiterSettings())


def test_gradient_cut_drains_the_queue_beyond_the_threshold_in_one_period():
    lim = GradientLimiter(LimiterSettings(threshold_ms=T, initial_rate=1000.0, max_rate=1e5))
    adj = lim.on_period(period(200.0, count=800, rejected=0))
    # 180 ms over T at 800/s done: drain factor 1 - 0.18 = 0.82, applied to what completed, not the rate.
    assert adj.new_rate == pytest.approx(800.0 * 0.82)
    lim.on_period(period(900.0, count=600, rejected=10))     # worse: 1 - 0.88 is clamped to the deepest cut
    assert lim.rate == pytest.approx(600.0 * 0.5)
    assert lim.on_period(period(300.0, count=300, rejected=10)) is None   # 300 < 0.8 x 900: draining, hold
    lim.on_period(period(290.0, count=300, rejected=10))     # no longer improving fast: cut again
    assert lim.rate == pytest.approx(300.0 * 0.73)
    lim.on_period(period(21.0, count=200, rejected=10))      # a mild breach (21 < 0.8 x 290 drains: hold)
    lim.on_period(period(21.0, count=200, rejected=10))      # a mild breach that stays: the mildest cut
    assert lim.rate == pytest.approx(200.0 * 0.95)


def test_gradient_remembers_the_good_rate_and_forgets_it_when_it_breaches():
    lim = GradientLimiter(LimiterSettings(threshold_ms=T, initial_rate=2000.0, max_rate=1e5))
    lim.on_period(period(5.0, count=1000))                   # healthy at 1000/s: good = 1000, rate = 2000
    assert lim.good == 1000.0 and lim.rate == 2000.0
    lim.on_period(period(400.0, count=1900))                 # the step: cut from the good rate, not from 1900
    assert lim.rate == pytest.approx(1000.0 * 0.62) and lim.good == 1000.0
    lim.bucket.set_rate(1000.0)
    lim.on_period(period(420.0, count=1000, rejected=5))     # growing breach at the good rate: deep cut,
    assert lim.rate == pytest.approx(1000.0 * 0.6) and lim.good == pytest.approx(900.0)   # good decays
    lim.on_period(period(450.0, count=600, rejected=5))      # still growing: the rate is not the cause,
    assert lim.rate == pytest.approx(600.0 * 0.9)             # so no second deep cut in this episode


def test_gradient_cuts_like_seed_when_latency_is_high_but_not_from_our_queue():
    lim = GradientLimiter(LimiterSettings(threshold_ms=T, initial_rate=800.0, max_rate=1e5))
    lim.good, lim.last_p99 = 1000.0, 400.0
    # P99 high but the median call is quick (4 ms): not our queue, so x0.9 like seed, no deep cut.
    adj = lim.on_period(period(380.0, count=800, rejected=5, p50=4.0))
    assert adj.new_rate == pytest.approx(720.0) and lim.good == 1000.0 and "not our queue" in adj.reason


def test_gradient_never_cuts_on_too_few_calls_and_climbs_off_its_floor():
    lim = GradientLimiter(LimiterSettings(threshold_ms=T, initial_rate=10.0, min_rate=10.0, max_rate=1e5))
    assert lim.on_period(period(500.0, count=10, rejected=0)) is None            # no evidence, no refusals
    assert lim.on_period(period(500.0, count=10, rejected=30)).new_rate == pytest.approx(11.0)


def test_gradient_halves_the_gap_to_the_knee_then_probes_with_doubling_steps():
    lim = GradientLimiter(LimiterSettings(threshold_ms=T, initial_rate=500.0, max_rate=1e5))
    lim.good = 1000.0
    knee = 950.0
    rates = []
    for _ in range(4):
        lim.on_period(period(5.0, count=int(lim.rate), rejected=50))
        rates.append(lim.rate)
    want, r = [], 500.0
    for _ in range(4):
        r = max(r * (1 + 0.1 * 0.75), r + (knee - r) / 2)
        want.append(r)
    assert rates == pytest.approx(want)
    lim.bucket.set_rate(knee)
    steps = []
    for _ in range(5):                                   # headroom 0.5: 1 %, 2 %, 4 %, 8 %, 10 % (cap) x 0.5
        before = lim.rate
        lim.on_period(period(10.0, count=int(before), rejected=50))
        steps.append(lim.rate / before - 1)
    assert steps == pytest.approx([0.005, 0.01, 0.02, 0.04, 0.05])
    lim.on_period(period(30.0, count=1000, rejected=50))  # a breach restarts probing from 1 %
    assert lim.probes == 0


def test_gradient_does_not_run_away_while_not_limiting():
    lim = GradientLimiter(LimiterSettings(threshold_ms=T, initial_rate=2000.0, max_rate=20000.0))
    adj = lim.on_period(period(2.0, count=300, rejected=0))
    assert adj.new_rate == pytest.approx(600.0) and "not limiting" in adj.reason
    seed = SeedLimiter(LimiterSettings(threshold_ms=T, initial_rate=2000.0, max_rate=20000.0))
    assert trajectory(seed, [2.0] * 30)[-1] == 20000.0


def simulate(policy: str, capacity: float = 1000.0, periods: int = 60, step: tuple[int, int] = (10, 40),
             base_x: float = 1.0, hiccups: random.Random | None = None):
    """A single-queue plant: per period, admitted = min(offered, rate), the server completes at most
    `capacity`, and P99 is 5 ms plus the wait behind the backlog (plus, with `hiccups`, a 20-300 ms
    spike in one period of five, as on a shared machine). Offered load is base_x x the capacity, 2x
    during `step`."""
    lim = make_limiter(policy, LimiterSettings(threshold_ms=T, initial_rate=2000.0, min_rate=10.0,
                                               max_rate=20000.0))
    backlog, rows = 0.0, []
    for n in range(periods):
        offered = capacity * (2.0 if step[0] <= n < step[1] else base_x)
        admitted = min(offered, lim.rate)
        done = min(capacity, backlog + admitted)
        backlog = backlog + admitted - done
        p99 = p50 = 5.0 + 1000.0 * backlog / capacity
        if hiccups is not None and hiccups.random() < 0.2:
            p99 += hiccups.uniform(20.0, 300.0)      # a tail spike: the median call is not slowed
        lim.on_period(period(p99, count=max(1, int(done)), rejected=int(offered - admitted), n=n, p50=p50))
        rows.append((n, p99, lim.rate, done))
    return rows


def recovery_periods(rows, start: int) -> int:
    return next(n for n, p99, _, _ in rows if n >= start and p99 <= T) - start


def test_gradient_recovers_at_least_twice_as_fast_as_seed_and_holds_steady():
    seed, grad = simulate("seed", periods=120, step=(10, 100)), simulate("gradient", periods=120, step=(10, 100))
    assert recovery_periods(grad, 10) * 2 <= recovery_periods(seed, 10)
    steady = [rate for n, _, rate, _ in grad if 80 <= n < 100]
    mid = (max(steady) + min(steady)) / 2
    assert (max(steady) - min(steady)) / 2 <= 0.10 * mid
    goodput = lambda rows: sum(done for n, p99, _, done in rows if 10 <= n < 100 and p99 <= T)  # noqa: E731
    assert goodput(grad) >= goodput(seed)


def test_gradient_does_not_collapse_under_latency_hiccups_that_are_not_its_queue():
    # 1.5x the capacity offered throughout, with seeded random spikes: cutting deep on every spike
    # would starve the server; gradient must keep completing near capacity and keep more calls in SLO.
    runs = {p: simulate(p, periods=120, step=(0, 0), base_x=1.5, hiccups=random.Random(3))[20:]
            for p in ("seed", "gradient")}
    done = {p: sum(d for *_, d in rows) / len(rows) for p, rows in runs.items()}
    in_slo = {p: sum(d for _, p99, _, d in rows if p99 <= T) for p, rows in runs.items()}
    assert done["gradient"] >= 0.85 * 1000.0
    assert in_slo["gradient"] > in_slo["seed"]
