"""Bad input names the wrong field; the risk rules hold every order inside the limits."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from agent_under_test.errors import InvalidSnapshotError
from agent_under_test.market import make_snapshot
from agent_under_test.proto import agent_pb2
from agent_under_test.risk import BUY, HOLD, SELL, Order, RiskLimits, check, propose
from agent_under_test.snapshot import parse_snapshot


def good() -> agent_pb2.MarketSnapshot:
    return make_snapshot(random.Random(0), 1, "AAPL", ts_ns=10**18)


def _break(**edits) -> agent_pb2.MarketSnapshot:
    msg = good()
    for path, value in edits.items():
        if path == "clear_levels":
            del msg.levels[:]
        elif path == "many_levels":
            msg.levels.extend([msg.levels[0]] * value)
        elif path.startswith("level"):
            idx, field = path[5:].split("_", 1)
            setattr(msg.levels[int(idx)], field, value)
        elif path.startswith("tick"):
            idx, field = path[4:].split("_", 1)
            setattr(msg.ticks[int(idx)], field, value)
        else:
            setattr(msg, path, value)
    return msg


@pytest.mark.parametrize("edits, field, words", [
    ({"clear_levels": True}, "levels", "empty order book"),
    ({"many_levels": 70}, "levels", "at most 64"),
    ({"level3_bid_price": math.nan}, "levels[3].bid_price", "nan"),
    ({"level0_ask_price": -1.0}, "levels[0].ask_price", "positive"),
    ({"level2_ask_size": 1e15}, "levels[2].ask_size", "size"),
    ({"level1_bid_size": -5.0}, "levels[1].bid_size", "size"),
    ({"level0_ask_price": 1.0}, "levels[0].ask_price", "crossed"),
    ({"tick4_price": math.inf}, "ticks[4].price", "inf"),
    ({"tick0_ts_ns": -3}, "ticks[0].ts_ns", "timestamp"),
    ({"symbol": ""}, "symbol", "1-32"),
    ({"position": math.nan}, "position", "finite"),
])
def test_each_bad_field_is_named(edits, field, words) -> None:
    with pytest.raises(InvalidSnapshotError) as info:
        parse_snapshot(_break(**edits))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ") and words in str(info.value)


def test_oversize_message_is_rejected_before_parsing() -> None:
    msg = good()
    msg.symbol = "X"
    msg.ticks.extend([msg.ticks[0]] * 200)
    with pytest.raises(InvalidSnapshotError) as info:
        parse_snapshot(msg, max_message_bytes=2048)
    assert info.value.field == "message" and "at most 2048" in str(info.value)


def test_generated_snapshots_are_valid() -> None:
    rng = random.Random(3)
    for i in range(200):
        snap = parse_snapshot(make_snapshot(rng, i, "MSFT", mid=rng.uniform(1, 5000), levels=rng.randint(1, 64)))
        assert (snap.book[:, 2] >= snap.book[:, 0]).all()


LIMITS = RiskLimits(max_position=100, max_order_size=50, price_band_bps=50)


def test_propose_maps_raw_outputs() -> None:
    order = propose(np.array([0.0, 3.0, 0.0, 0.0, 0.0]), 100.0, 99.99, 100.01, LIMITS)
    assert order.side == BUY and order.price == pytest.approx(100.01) and order.size == 25.0
    assert order.confidence == pytest.approx(math.exp(3) / (math.exp(3) + 2))
    sell = propose(np.array([0.0, 0.0, 1.0, 10.0, 10.0]), 100.0, 99.99, 100.01, LIMITS)
    assert sell.side == SELL and sell.price == pytest.approx(99.99 * (1 - 100 / 1e4), rel=1e-6)


def test_price_band_turns_order_into_hold_with_reason() -> None:
    out = check(Order(BUY, 101.0, 10, 0.9), mid=100.0, position=0, limits=LIMITS)
    assert out.side == HOLD and out.size == 0 and out.reason.startswith("price band: 100.0 bps")


def test_position_limit_cuts_size_then_holds() -> None:
    assert check(Order(BUY, 100.1, 50, 0.9), 100.0, position=80, limits=LIMITS).size == 20
    held = check(Order(BUY, 100.1, 50, 0.9), 100.0, position=100, limits=LIMITS)
    assert held.side == HOLD and "position limit" in held.reason
    assert check(Order(SELL, 99.9, 50, 0.9), 100.0, position=100, limits=LIMITS).size == 50
