"""Adaptive limiters: one small interface, policies registered by name (`seed`, `gradient`, `off`).

    admit() --try_acquire(now)--> token bucket: a token -> None (admitted)
                                                no token -> retry-after seconds (rejected, never queued)
    tick()  --on_period(summary)--> policy sets the bucket's rate for the next period (an Adjustment)

Rates are floats in calls/s so a small rate still grows (1 x 1.1 = 1.1, never rounded back to 1).
The burst allowance is explicit: `burst_s` seconds of the current rate, at least one call.
The `gradient` formula, its defaults and why are in docs/protection.md.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from agent_under_test.monitor import INSUFFICIENT, PeriodSummary


@dataclass(frozen=True)
class LimiterSettings:
    threshold_ms: float = 20.0
    initial_rate: float = 2000.0
    min_rate: float = 10.0
    max_rate: float = 20000.0
    burst_s: float = 0.05


@dataclass(frozen=True)
class Adjustment:
    policy: str
    old_rate: float
    new_rate: float
    reason: str

    def event_fields(self) -> dict[str, object]:
        # Rounded for readers (x0.9 chains print as 258.11499999999995 otherwise); the limiter keeps full precision.
        return {"policy": self.policy, "old_rate": round(self.old_rate, 6), "new_rate": round(self.new_rate, 6),
                "reason": self.reason}


class Limiter(Protocol):
    policy: str

    @property
    def rate(self) -> float:
        """Admitted calls/s allowed now (`inf` when not limiting)."""

    def try_acquire(self, now: float) -> float | None:
        """None to admit one call at monotonic time `now`; else the retry-after hint in seconds."""

    def on_period(self, summary: PeriodSummary) -> Adjustment | None:
        """Adapt to the period just closed; the adjustment made, or None when the rate is unchanged."""

    def set_threshold(self, threshold_ms: float) -> None:
        """Judge P99 against `threshold_ms` from the next period on."""


class TokenBucket:
    """Refills at `rate` tokens/s up to `burst` tokens; starts full."""

    def __init__(self, rate: float, burst_s: float, now: float | None = None) -> None:
        self.burst_s = burst_s
        self.rate = rate
        self.tokens = self.capacity
        self.last = now

    @property
    def capacity(self) -> float:
        return max(1.0, self.rate * self.burst_s)

    def take(self, now: float) -> float | None:
        """Take one token; None on success, else seconds until one is there."""
        if self.last is not None and now > self.last:
            self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now if self.last is None else max(self.last, now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return None
        return (1.0 - self.tokens) / self.rate

    def set_rate(self, rate: float) -> None:
        # Keep the tokens already earned, but never more than the new burst allows.
        self.rate = rate
        self.tokens = min(self.tokens, self.capacity)


class _BucketLimiter:
    """Shared plumbing: a token bucket whose rate a policy moves within [min_rate, max_rate]."""

    policy = "base"

    def __init__(self, settings: LimiterSettings) -> None:
        if not 0 < settings.min_rate <= settings.max_rate:
            raise ValueError(f"limiter: need 0 < min_rate <= max_rate, got {settings.min_rate}, "
                             f"{settings.max_rate}")
        self.s = settings
        start = float(min(settings.max_rate, max(settings.min_rate, settings.initial_rate)))
        self.bucket = TokenBucket(start, settings.burst_s)

    def set_threshold(self, threshold_ms: float) -> None:
        self.s = dataclasses.replace(self.s, threshold_ms=threshold_ms)

    @property
    def rate(self) -> float:
        return self.bucket.rate

    def try_acquire(self, now: float) -> float | None:
        return self.bucket.take(now)

    def _move(self, new_rate: float, reason: str) -> Adjustment | None:
        new_rate = min(self.s.max_rate, max(self.s.min_rate, new_rate))
        old = self.bucket.rate
        if new_rate == old:
            return None
        self.bucket.set_rate(new_rate)
        return Adjustment(self.policy, old, new_rate, reason)


class SeedLimiter(_BucketLimiter):
    """The rule we start from: x0.9 when the period's P99 exceeds the threshold, else x1.1.

    A period with no finished calls holds the rate (no evidence either way). A period with fewer calls
    than the alert's minimum still counts: its P99 is then its slowest call, which errs towards backing off.
    """

    policy = "seed"

    def on_period(self, summary: PeriodSummary) -> Adjustment | None:
        if summary.count == 0 or summary.p99_ms is None:
            return None
        p99, limit = summary.p99_ms, self.s.threshold_ms
        if p99 > limit:
            return self._move(self.rate * 0.9, f"p99 {p99:.3f} ms > {limit:g} ms: x0.9")
        return self._move(self.rate * 1.1, f"p99 {p99:.3f} ms <= {limit:g} ms: x1.1")


@dataclass(frozen=True)
class GradientParams:
    window: int = 5             # periods in the smoothed P99 (their median): one or two noisy periods never move it
    low: float = 0.75           # grow while this period's and the smoothed P99 are both below low x T
    high: float = 0.9           # trim while both are above high x T; in between hold (Vegas' alpha/beta band)
    step: float = 0.10          # most change per period outside an overload (trim >= x0.9, growth <= x1.1)
    surge: float = 3.0          # P99 above surge x T while the median call waits: overload, cut deep at once
    queue_p50: float = 0.5      # P50 above this x T: the median call waits, so the breach is our own queue
    min_cut: float = 0.5        # deepest single cut (x0.5), like Gradient2's gradient floor
    max_cut: float = 0.95       # mildest deep cut
    draining: float = 0.8       # P99 below this x the last period's: the last cut is working, hold
    trim_span: float = 0.25     # a full-step trim once lo is this x T above high x T; less in proportion
    futile: float = 0.9         # cut by step+ and P99 not below this x what it was: not our rate, undo
    knee: float = 0.95          # below knee x good, return by halving the gap
    probe: float = 0.01         # above it, probe 1 %, 2 %, 4 % ... (at most `step`) per healthy period
    headroom: float = 2.0       # when not limiting, stay within headroom x offered rate
    probe_cap: float = 0.04     # largest probe above the good rate
    cliff_zone: float = 0.9     # within this x the last rate that queued, probe only `plateau_probe` a period ...
    plateau_probe: float = 0.005
    plateau_periods: int = 10   # ... for this many healthy periods, then forget it (capacity may have grown)
    busy: float = 0.85          # with saturation known: the serving thread's busy share to hold ...
    busy_step: float = 0.5      # largest growth a period towards it (x1.5); cuts at most `step`
    busy_futile: float = 0.5    # limiting, cut by busy_futile_cut+ on saturation and it fell under this share of
                                # what the cut would take off were refusing free: refusals keep the thread busy,
    busy_futile_cut: float = 0.1  # go by latency (one step: waiting for more cuts starves the server longer)
    ceiling_share: float = 1 / 3   # not limiting: ceiling = done x (estimate / done)^this


class GradientLimiter(_BucketLimiter):
    """Rate-based controller on the serving thread's saturation (held at `busy`) guarded by P99 with
    Gradient2/Vegas rules: smoothed signal, a deadband, bounded steps (docs/protection.md).

    T threshold, P period, done = completed calls/s, p = this period's P99, s = median P99 of the last
    `window` periods (its low/high median while fewer), lo/hi = min/max(p, s), good = highest completed
    rate seen with hi <= high x T
    insufficient period (fewer than min_samples calls): calls refused -> rate*(1 + step), else hold
    queueing: p > T and p50 > queue_p50 x T;  overload: queueing and (p > surge x T or the last period queued)
    overload or lo > high x T (a cutting episode; it ends at the first period with hi <= high x T):
        in an episode and p < draining x last p:  hold (the last cut is draining the queue)
        overload, good < rate <= good*(1 + step), no deep cut yet in this episode:
            step back: rate = knee x good (a probe found the cliff; if the queue stays, the next period cuts deep)
        overload, and rate > good or no deep cut yet in this episode:
            deep cut:  rate = min(rate, done) * clamp(1 - (p-T)/P, min_cut, max_cut)
        overload otherwise (a confirmed queue is ours):  trim
        tail-only breach:  fewer than `window` periods since this episode's last cut: hold (wait)
            else if the rate is step+ below where the episode began and hi >= futile x hi then:
                after a deep cut in this episode hold, else back to the rate the episode began at
                (cutting did not lower the latency: not our rate; undo rather than starve, test again)
            else trim
        trim:  rate = min(rate, done*(1 + step)) * (1 - step * min(1, (lo - high T) / (trim_span T)))
        every cut lowers good to at most the rate that breached; an overload cut sets cliff = min(rate, done);
        every cut clears the saturation estimates
    saturation u known (the serving thread's busy share; the rules above still come first):
        est = low median of the last `window` (done x busy / u), cleared by a cut and when refusing starts
        not limiting: est >= done: rate = min(headroom x done, max(done x (1 + probe), done (est/done)^ceiling_share))
                      else         rate = max(est, done x (1 - step))
        limiting: est > rate and hi >= low x T: hold; else rate = clamp(est, min(rate, done(1 + step)) x
                  (1 - step), rate x (1 + busy_step)); moves under `probe` of the rate are not made
        limiting, cut on saturation by busy_futile_cut+ since (rate0, u0) and u0 - u < busy_futile x u0 x (1 - rate/rate0):
                  refusing costs the thread about what serving did (cutting only turned served calls into
                  refused ones): back to rate0, and the latency rules below decide until limiting ends
    saturation unknown:
    hi >= low x T:  hold (the deadband), except not limiting above headroom x offered: come down to it
    else grow, h = 1 - hi / (low x T):
        not limiting:                  rate = min(rate*(1 + step*h), headroom x offered)
        limiting, rate < knee x good:  rate = max(rate*(1 + step*h), rate + (knee x good - rate)/2)
        limiting, else (probe k):      rate = rate*(1 + min(cap, probe*2^k)), k = 0, 1, 2 ... (not reset by a
                                       hold), cap = step below good, probe_cap above; within cliff_zone x
                                       cliff at most plateau_probe, for plateau_periods, then cliff = None
    """

    policy = "gradient"

    def __init__(self, settings: LimiterSettings, params: GradientParams | None = None) -> None:
        super().__init__(settings)
        self.p = params or GradientParams()
        self.good: float | None = None
        self.recent: deque[float] = deque(maxlen=self.p.window)
        self.last_p99: float | None = None
        self.queued = False                           # the last period was a queueing breach
        self.cutting: tuple[float, float] | None = None   # (rate, hi) when this cutting episode began
        self.deep_cut = False                         # a deep cut was made in this episode
        self.probes = 0
        self.since_cut = 0      # periods since the last cut (or undo) of this episode
        self.cliff: float | None = None   # the last rate at which our own queue formed
        self.plateau = 0        # healthy periods spent probing near it
        self.estimates: deque[float] = deque(maxlen=self.p.window)   # rate at the saturation target, per period
        self.limited = False    # the last period refused calls
        self.busy_cuts: tuple[float, float] | None = None   # (rate, saturation) when cutting on saturation began
        self.busy_blind = False  # saturation proved to be the refusals' while limiting: latency rules until it ends

    def on_period(self, summary: PeriodSummary) -> Adjustment | None:
        if summary.count == 0 or summary.p99_ms is None:
            return None
        if summary.state == INSUFFICIENT:
            # Too few calls to know a P99 (the slowest call stands in for it). Grow only when calls were
            # refused, never cut: cutting on no evidence is how a limiter starves itself at its floor.
            if summary.rejected == 0:
                return None
            return self._move(self.rate * (1 + self.p.step), f"too few calls to judge and calls refused: "
                                                               f"x{1 + self.p.step:g}")
        p99, last, t = summary.p99_ms, self.last_p99, self.s.threshold_ms
        self.last_p99 = p99
        if summary.rejected and not self.limited:
            self.estimates.clear()   # refusing costs the thread too: estimates from before do not hold
        self.limited = summary.rejected > 0
        if not self.limited:
            self.busy_blind, self.busy_cuts = False, None
        self.since_cut += 1
        self.recent.append(p99)
        # The window's median (low and high median while it is not full: two periods that disagree
        # are no evidence either way); lo/hi: the current period and the window must agree to act.
        lo = min(p99, statistics.median_low(self.recent))
        hi = max(p99, statistics.median_high(self.recent))
        queueing = p99 > t and summary.p50_ms is not None and summary.p50_ms > self.p.queue_p50 * t
        overload, self.queued = queueing and (p99 > self.p.surge * t or self.queued), queueing
        if overload or lo > self.p.high * t:
            self.probes = 0
            if self.cutting is not None and last is not None and p99 < self.p.draining * last:
                return None      # our last cut is draining the queue: cutting again would overshoot
            return self._cut(p99, lo, hi, summary, overload)
        self.cutting, self.deep_cut = None, False
        if hi <= self.p.high * t:
            done = summary.count / summary.seconds
            self.good = done if self.good is None else max(self.good, done)
        if summary.saturation is not None and not self.busy_blind:
            return self._track(summary, summary.saturation, hi < self.p.low * t)
        if hi >= self.p.low * t:
            return self._cap(summary)   # the band: hold; probing resumes where it was (a noisy period is no cut)
        return self._grow(summary, 1.0 - hi / (self.p.low * t))

    def _cut(self, p99: float, lo: float, hi: float, summary: PeriodSummary, overload: bool) -> Adjustment | None:
        t, old, done = self.s.threshold_ms, self.rate, summary.count / summary.seconds
        if self.cutting is None:
            self.cutting, self.deep_cut = (min(old, done * (1.0 + self.p.step)), hi), False
            self.since_cut = self.p.window   # the first trim of an episode needs no wait
        above_good = self.good is None or old > self.good
        if overload and self.good is not None and self.good < old <= self.good * (1.0 + self.p.step) \
                and not self.deep_cut:
            # A probe past the rate that last worked found the cliff: step back under it. If the queue
            # stays there, capacity itself fell, and the next period (now at or below good) cuts deep.
            base, g = self.p.knee * self.good, 1.0
            reason = f"p99 {p99:.3f} ms > {t:g} ms just above the good rate {self.good:.1f}/s: back under it"
        elif overload and (above_good or not self.deep_cut):
            # Little's law: done x (p99 - T) calls wait beyond T; admitting that much less drains them in a
            # period. At or below a rate known to be good only once per episode: if the queue stays after
            # that, the rate is not what drives it, and cutting deep again would only starve the server.
            g = min(self.p.max_cut, max(self.p.min_cut, 1.0 - (p99 - t) / 1000.0 / summary.seconds))
            base = min(old, done)    # in a queue, `done` is what the server can do now
            self.recent.clear()      # the window saw the old rate; judge the new one on its own periods
            self.deep_cut = True
            reason = f"p99 {p99:.3f} ms > {t:g} ms, our queue: {base:.1f}/s x{g:.3f}"
        else:
            # A confirmed queue (the median call waits, two periods running) is ours: trim on every
            # period. Only a tail-only breach waits for evidence and may turn out not to be ours.
            if not overload and self.since_cut < self.p.window:
                return None          # the window still holds periods from before the last cut: wait
            if not overload and self._futile(hi):
                if self.deep_cut:
                    return None      # a queue we cut deep for may still be draining slowly: hold, never undo
                # Cutting did not lower the latency: the rate is not what drives it (outside contention,
                # the cost of refusing calls, noise). Undo the cuts rather than starve the server, and
                # test again from there: the rate then swings one step, never drifts to the floor.
                rate0 = self.cutting[0] if self.cutting is not None else old
                self.cutting, self.since_cut = (rate0, hi), 0
                return self._move(rate0, f"cuts to {old:.1f}/s did not lower p99 ({hi:.3f} ms): back to {rate0:.1f}/s")
            # In proportion to how far above high x T the signal is (full step at trim_span x T): latency rises
            # steeply with rate near the knee, so a cut as large as the latency excess would overshoot.
            # From what was admitted, not from an unused limit; but `done` undercounts while calls are
            # still in flight at the period's end, so allow it `step` of slack (a trim stays a trim).
            g = 1.0 - self.p.step * min(1.0, (lo - self.p.high * t) / (self.p.trim_span * t))
            base = min(old, done * (1.0 + self.p.step))
            reason = f"p99 {lo:.3f} ms (smoothed) > {self.p.high * t:g} ms: {base:.1f}/s x{g:.3f}"
        if self.good is not None:
            self.good = min(self.good, old)   # a rate that breached is not good
        if overload:
            self.cliff, self.plateau = min(old, done), 0   # in a queue, what completed is the capacity
        self.since_cut = 0
        self.estimates.clear()   # they saw the rate that breached
        self.busy_cuts = None
        return self._move(base * g, reason)

    def _track(self, summary: PeriodSummary, busy: float, may_grow: bool) -> Adjustment | None:
        """Hold the serving thread's saturation at `busy`: a signal that rises with the load long before
        P99 does (P99 stays flat up to the cliff), so the rate can sit close under the cliff without
        probing it. Each period estimates the rate at the target, done x busy/measured (it errs towards
        the current rate, because part of a thread's work does not scale with the rate: the rate
        converges without overshoot); the rate follows the median of the last `window` estimates
        (one noisy period moves nothing), at most `step` down and `busy_step` up a period."""
        done = summary.count / summary.seconds
        self.estimates.append(done * self.p.busy / max(busy, 1e-3))
        est = statistics.median_low(self.estimates)
        if summary.rejected == 0:
            # Not limiting: the rate is a ceiling the load has not reached. Keep it between the load and
            # the estimate, nearer the load (at least 1 % above it), so that a surge beyond what the
            # thread can take is refused at once rather than queued; once the estimate is below the
            # load, it is the ceiling (and limiting starts).
            if est >= done:
                target = min(self.p.headroom * done,
                             max(done * (est / done) ** self.p.ceiling_share, done * (1 + self.p.probe)))
            else:
                target = max(est, done * (1 - self.p.step))
        elif est > self.rate and not may_grow:
            return None    # the latency sits in the band: no growth, whatever the thread says
        else:
            target = min(est, self.rate * (1 + self.p.busy_step))
            target = max(target, min(self.rate, done * (1 + self.p.step)) * (1 - self.p.step))
            if target >= self.rate:
                if self.busy_cuts is not None and target > self.busy_cuts[0]:
                    self.busy_cuts = None      # back above where the cuts began: that episode is over
            elif self.busy_cuts is None:
                self.busy_cuts = (self.rate, busy)
            elif self._busy_futile(busy):
                rate0, busy0 = self.busy_cuts
                self.busy_blind, self.busy_cuts = True, None
                self.estimates.clear()
                return self._move(rate0, f"cuts to {self.rate:.1f}/s left the saturation at {busy:.3f} "
                                                         f"(from {busy0:.3f}): refusing keeps the thread busy; back to "
                                                         f"{rate0:.1f}/s, the latency decides while refusing")
        if abs(target - self.rate) <= self.p.probe * self.rate:
            return None
        return self._move(target, f"saturation {busy:.3f} (target {self.p.busy:g}): rate for it "
                                  f"~{est:.1f}/s, moving to {target:.1f}/s")

    def _busy_futile(self, busy: float) -> bool:
        """True when saturation cuts took the rate down by `busy_futile_cut`+ and the saturation fell by less than
        `busy_futile` of what those cuts would take off if refusing cost nothing (a share of it in
        proportion to the rate): the thread spends on the refused calls what it saved on the served."""
        assert self.busy_cuts is not None
        rate0, busy0 = self.busy_cuts
        if self.rate > rate0 * (1 - self.p.busy_futile_cut) + 1e-9:
            return False
        return busy0 - busy < self.p.busy_futile * busy0 * (1 - self.rate / rate0)

    def _futile(self, hi: float) -> bool:
        """True when this episode has cut the rate by `step`+ and the latency did not follow (judged on
        the pessimistic signal, so one lucky period does not count as success)."""
        if self.cutting is None:
            return False
        rate0, p99_0 = self.cutting
        if self.rate > rate0 * (1 - self.p.step) + 1e-9:
            return False
        if hi < self.p.futile * p99_0:
            self.cutting = (self.rate, hi)    # it worked: the next cuts are judged from here
            return False
        return True

    def _cap(self, summary: PeriodSummary) -> Adjustment | None:
        """Hold, but when not limiting never sit above headroom x the offered rate (no runaway to the ceiling)."""
        offered = (summary.count + summary.rejected) / summary.seconds
        if summary.rejected > 0 or self.rate <= self.p.headroom * offered:
            return None
        return self._move(self.p.headroom * offered, f"not limiting: {self.p.headroom:g}x offered {offered:.1f}/s")

    def _grow(self, summary: PeriodSummary, h: float) -> Adjustment | None:
        grown = self.rate * (1.0 + self.p.step * h)
        if summary.rejected == 0:
            self.probes = 0
            cap = self.p.headroom * (summary.count + summary.rejected) / summary.seconds
            if grown > cap:
                return self._move(cap, f"not limiting: {self.p.headroom:g}x offered {cap / self.p.headroom:.1f}/s")
            return self._move(grown, f"not limiting, headroom {h:.2f}: x{grown / self.rate:.3f}")
        knee = None if self.good is None else self.p.knee * self.good
        if knee is not None and self.rate < knee:
            self.probes = 0
            new = max(grown, self.rate + (knee - self.rate) / 2)
            return self._move(new, f"limiting, below the {knee:.1f}/s knee: halve the gap")
        # Doubling probes; past the good rate, where the cliff may be, at most `probe_cap` a period; close
        # to the rate that last queued (CUBIC's plateau), `plateau_probe` until it has held a while.
        cap = self.p.step if self.good is not None and self.rate < self.good else self.p.probe_cap
        step = min(cap, self.p.probe * 2 ** self.probes)
        if self.cliff is not None and self.rate * (1 + step) >= self.p.cliff_zone * self.cliff:
            step = min(step, self.p.plateau_probe)
            self.plateau += 1
            if self.plateau >= self.p.plateau_periods:
                self.cliff = None
        self.probes += 1
        return self._move(self.rate * (1 + step), f"limiting, headroom {h:.2f}: probe x{1 + step:.4f}")


class OffLimiter:
    """No limit: admits everything, never adjusts."""

    policy = "off"
    rate = math.inf

    def __init__(self, settings: LimiterSettings) -> None:
        self.s = settings

    def try_acquire(self, now: float) -> float | None:
        return None

    def on_period(self, summary: PeriodSummary) -> Adjustment | None:
        return None

    def set_threshold(self, threshold_ms: float) -> None:
        self.s = dataclasses.replace(self.s, threshold_ms=threshold_ms)


def make_limiter(name: str, settings: LimiterSettings) -> Limiter:
    """The limiter registered as `name`. Raises ValueError naming the known policies."""
    from agent_under_test.config import LIMITERS

    factory: Callable[[LimiterSettings], Limiter] = LIMITERS.get(name)
    return factory(settings)
