"""The request pipeline, each stage timed:

    parse (validate) -> features (numpy) -> strategy (batched model) -> risk -> order (Decision)

The strategy stage rides the micro-batcher; its queue wait is reported as its own `queue` timing in the
Decision, and the Guard sees the five named stages through on_stage().
"""

from __future__ import annotations

import time

from agent_under_test.batcher import Batcher
from agent_under_test.features import build_features
from agent_under_test.hooks import Guard
from agent_under_test.proto import agent_pb2
from agent_under_test.risk import RiskLimits, check, propose
from agent_under_test.snapshot import parse_snapshot

STAGES = ("parse", "features", "strategy", "risk", "order")


class Pipeline:
    def __init__(self, batcher: Batcher, guard: Guard, limits: RiskLimits | None = None,
                 max_message_bytes: int = 65536) -> None:
        self._batcher, self._guard = batcher, guard
        self.limits = limits or RiskLimits()
        self._max_bytes = max_message_bytes

    async def decide(self, msg: agent_pb2.MarketSnapshot, received_ns: int) -> agent_pb2.Decision:
        """Run one snapshot through every stage.

        Raises:
            InvalidSnapshotError: the parse stage rejected it (nothing was queued).
        """
        stages: list[tuple[str, float]] = []
        t0 = time.perf_counter()
        snap = parse_snapshot(msg, self._max_bytes)
        t1 = time.perf_counter()
        feats = build_features(snap)
        t2 = time.perf_counter()
        result = await self._batcher.submit(feats)
        t3 = time.perf_counter()
        order = check(propose(result.output, feats.mid, feats.best_bid, feats.best_ask, self.limits),
                      feats.mid, snap.position, self.limits)
        t4 = time.perf_counter()
        stages = [("parse", t1 - t0), ("features", t2 - t1), ("queue", result.queue_s),
                  ("strategy", result.forward_s), ("risk", t4 - t3)]
        decision = agent_pb2.Decision(
            sequence_id=snap.sequence_id, symbol=snap.symbol, side=order.side,  # type: ignore[arg-type]
            price=order.price, size=order.size, confidence=order.confidence, tier=result.tier, reason=order.reason,
            batch_size=result.batch_size)
        t5 = time.perf_counter()
        stages.append(("order", t5 - t4))
        for name, seconds in stages:
            decision.stages.add(stage=name, ns=int(seconds * 1e9))
            if name != "queue":
                self._guard.on_stage(name, seconds)
        decision.server_latency_ns = time.perf_counter_ns() - received_ns
        return decision
