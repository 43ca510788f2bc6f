"""The request pipeline, each stage timed:

    parse (validate) -> features (numpy) -> strategy (batched model) -> risk -> order (Decision)

The strategy stage rides the micro-batcher; its queue wait is reported as its own `queue` timing in the
Decision, and the Guard sees the five named stages through on_stage().

With a response cache (cache.py) a hit skips the batcher: parse -> features -> cache -> risk -> order,
Decision.cache saying where the answer came from ("local", "redis", "stale"; "" when computed now).
"""

from __future__ import annotations

import time

from agent_under_test.batcher import Batcher
from agent_under_test.cache import AskRedis, Hit, Probe, ResponseCache
from agent_under_test.features import Features, build_features
from agent_under_test.hooks import Guard
from agent_under_test.proto import agent_pb2
from agent_under_test.risk import BUY, HOLD, SELL, RiskLimits, check, propose
from agent_under_test.snapshot import ParsedSnapshot, parse_snapshot

STAGES = ("parse", "features", "strategy", "risk", "order")
# risk's sides (plain ints) as the Decision's enum: the same numbers, checked here once
_SIDES = (agent_pb2.HOLD, agent_pb2.BUY, agent_pb2.SELL)
assert _SIDES == (HOLD, BUY, SELL), "agent.proto's Side and risk.py's sides disagree"


class Pipeline:
    def __init__(self, batcher: Batcher, guard: Guard, limits: RiskLimits | None = None,
                 max_message_bytes: int = 65536, cache: ResponseCache | None = None) -> None:
        self._batcher, self._guard = batcher, guard
        self.limits = limits or RiskLimits()
        self._max_bytes = max_message_bytes
        self._cache = cache

    async def decide(self, msg: agent_pb2.MarketSnapshot, received_ns: int) -> agent_pb2.Decision:
        """Run one snapshot through every stage.

        Raises:
            InvalidSnapshotError: the parse stage rejected it (nothing was queued).
        """
        perf = time.perf_counter
        t0 = perf()
        snap = parse_snapshot(msg, self._max_bytes)
        t1 = perf()
        feats = build_features(snap)
        t2 = perf()
        cache_s = None
        if self._cache is not None:
            probe = self._cache.probe(snap.symbol, snap.position, feats)
            hit = self._cache.lookup_now(probe)
            if isinstance(hit, AskRedis):        # the one case that awaits: a round trip to Redis
                hit = await self._cache.lookup_redis(probe)
            cache_s = perf() - t2
            if hit is not None:
                return self._from_cache(snap, feats, probe, hit, t1 - t0, t2 - t1, cache_s, received_ns)
        result = await self._batcher.submit(feats)
        t3 = perf()
        order = check(propose(result.output, feats.mid, feats.best_bid, feats.best_ask, self.limits),
                      feats.mid, snap.position, self.limits)
        t4 = perf()
        parse_s, features_s, risk_s = t1 - t0, t2 - t1, t4 - t3
        # The stages go into the constructor as dicts: one call instead of six stages.add() (half the cost).
        stages = [{"stage": "parse", "ns": int(parse_s * 1e9)},
                  {"stage": "features", "ns": int(features_s * 1e9)},
                  {"stage": "queue", "ns": int(result.queue_s * 1e9)},
                  {"stage": "strategy", "ns": int(result.forward_s * 1e9)},
                  {"stage": "risk", "ns": int(risk_s * 1e9)}]
        if cache_s is not None:   # a miss: the lookup (a Redis wait included) before the queue
            stages.insert(2, {"stage": "cache", "ns": int(cache_s * 1e9)})
        decision = agent_pb2.Decision(
            sequence_id=snap.sequence_id, symbol=snap.symbol, side=_SIDES[order.side],
            price=order.price, size=order.size, confidence=order.confidence, tier=result.tier, reason=order.reason,
            batch_size=result.batch_size, stages=stages)
        order_s = perf() - t4
        decision.stages.add(stage="order", ns=int(order_s * 1e9))
        on_stage = self._guard.on_stage
        on_stage("parse", parse_s)
        on_stage("features", features_s)
        on_stage("strategy", result.forward_s)
        on_stage("risk", risk_s)
        on_stage("order", order_s)
        if self._cache is not None and cache_s is not None:
            on_stage("cache", cache_s)
            self._cache.store(probe, result.output, result.tier)
        decision.server_latency_ns = time.perf_counter_ns() - received_ns
        return decision

    def _from_cache(self, snap: ParsedSnapshot, feats: Features, probe: Probe, hit: Hit, parse_s: float,
                    features_s: float, cache_s: float, received_ns: int) -> agent_pb2.Decision:
        """The answer to THIS request from a cached model output: its own risk check, sequence_id and
        symbol; a stale hit also starts one background refresh through the batcher."""
        assert self._cache is not None, "only called with a cache"
        perf = time.perf_counter
        if hit.source == "stale":
            self._cache.revalidate(probe, hit.entry, lambda: self._compute(feats))
        t3 = perf()
        entry = hit.entry
        order = check(propose(entry.output, feats.mid, feats.best_bid, feats.best_ask, self.limits),
                      feats.mid, snap.position, self.limits)
        t4 = perf()
        risk_s = t4 - t3
        decision = agent_pb2.Decision(
            sequence_id=snap.sequence_id, symbol=snap.symbol, side=_SIDES[order.side],
            price=order.price, size=order.size, confidence=order.confidence, tier=entry.tier, reason=order.reason,
            batch_size=0, cache=hit.source,
            stages=[{"stage": "parse", "ns": int(parse_s * 1e9)},
                    {"stage": "features", "ns": int(features_s * 1e9)},
                    {"stage": "cache", "ns": int(cache_s * 1e9)},
                    {"stage": "risk", "ns": int(risk_s * 1e9)}])
        order_s = perf() - t4
        decision.stages.add(stage="order", ns=int(order_s * 1e9))
        on_stage = self._guard.on_stage
        on_stage("parse", parse_s)
        on_stage("features", features_s)
        on_stage("cache", cache_s)
        on_stage("risk", risk_s)
        on_stage("order", order_s)
        decision.server_latency_ns = time.perf_counter_ns() - received_ns
        return decision

    async def _compute(self, feats: Features) -> tuple[tuple[float, ...], str]:
        """The slow path alone (a stale entry's refresh): the model's output row and tier."""
        result = await self._batcher.submit(feats)
        return tuple(result.output), result.tier
