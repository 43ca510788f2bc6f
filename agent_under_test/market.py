"""Realistic market snapshots: random-walk prices, a book around the mid, recent ticks, rare wide levels.

`make_snapshot` builds one snapshot from a seeded `random.Random` (others use it to build test
recordings); `MarketSim` keeps a per-symbol mid and position walking between snapshots, as live
traffic would. No torch, no grpc: protobuf only.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from agent_under_test.proto import agent_pb2

DEFAULT_LEVELS = 10
DEFAULT_TICKS = 16
WIDE_LEVEL_PROB = 0.05  # now and then one level's spread is an outlier (the model down-weights it)


def _book(rng: random.Random, mid: float, n_levels: int, spread_bps: float) -> list[agent_pb2.BookLevel]:
    half = mid * spread_bps / 2e4 * (1.0 + 0.5 * rng.random())
    step = mid * 1e-4
    wide = rng.randrange(1, n_levels) if n_levels > 3 and rng.random() < WIDE_LEVEL_PROB else -1
    levels = []
    for i in range(n_levels):
        extra = 10 * half if i == wide else 0.0
        levels.append(agent_pb2.BookLevel(
            bid_price=round(mid - half - i * step - extra, 4),
            bid_size=round(rng.lognormvariate(math.log(100 * (1 + 0.3 * i)), 0.5), 2),
            ask_price=round(mid + half + i * step + extra, 4),
            ask_size=round(rng.lognormvariate(math.log(100 * (1 + 0.3 * i)), 0.5), 2)))
    return levels


def _ticks(rng: random.Random, mid: float, n_ticks: int, ts_ns: int, gap_ns: int) -> list[agent_pb2.Tick]:
    """Trades walking back in time from `ts_ns` to the oldest, returned oldest first."""
    out, price, t = [], mid, ts_ns
    for _ in range(n_ticks):
        out.append(agent_pb2.Tick(ts_ns=t, price=round(price, 4), size=float(rng.randint(1, 500))))
        price *= math.exp(rng.gauss(0.0, 2e-4))
        t -= max(1, int(rng.expovariate(1.0 / gap_ns)))
    return out[::-1]


def make_snapshot(rng: random.Random, sequence_id: int, symbol: str, *, mid: float = 100.0,
                  levels: int = DEFAULT_LEVELS, ticks: int = DEFAULT_TICKS, ts_ns: int | None = None,
                  position: float = 0.0, spread_bps: float = 2.0,
                  tick_gap_ns: int = 20_000_000) -> agent_pb2.MarketSnapshot:
    """One valid snapshot around `mid`: `levels` book levels (best first), `ticks` trades (oldest first).

    Every random choice comes from `rng`, so the same seed gives the same bytes (ts_ns aside: pass it
    to pin that too).
    """
    ts = time.time_ns() if ts_ns is None else ts_ns
    return agent_pb2.MarketSnapshot(
        sequence_id=sequence_id, symbol=symbol, levels=_book(rng, mid, levels, spread_bps),
        ticks=_ticks(rng, mid, ticks, ts, tick_gap_ns), ts_ns=ts, position=position)


@dataclass
class MarketSim:
    """Per-symbol random walks of mid price and position; `next()` returns the symbol's next snapshot."""

    rng: random.Random
    symbols: list[str] = field(default_factory=lambda: ["AAPL", "MSFT", "NVDA", "TSLA"])
    volatility: float = 5e-4     # per-snapshot log-return std
    levels: int = DEFAULT_LEVELS
    ticks: int = DEFAULT_TICKS
    _mid: dict[str, float] = field(default_factory=dict)
    _pos: dict[str, float] = field(default_factory=dict)

    def next(self, sequence_id: int, symbol: str | None = None, ts_ns: int | None = None) -> agent_pb2.MarketSnapshot:
        sym = symbol or self.rng.choice(self.symbols)
        mid = self._mid.get(sym) or 50.0 + 450.0 * self.rng.random()
        mid *= math.exp(self.rng.gauss(0.0, self.volatility))
        pos = max(-900.0, min(900.0, self._pos.get(sym, 0.0) + self.rng.choice((-10.0, 0.0, 10.0))))
        self._mid[sym], self._pos[sym] = mid, pos
        return make_snapshot(self.rng, sequence_id, sym, mid=mid, levels=self.levels, ticks=self.ticks,
                             ts_ns=ts_ns, position=pos)


def symbol_names(n: int) -> list[str]:
    """`n` distinct ticker-like symbols (SYM000, SYM001, ... past the four well-known ones)."""
    base = ["AAPL", "MSFT", "NVDA", "TSLA"]
    return (base + [f"SYM{i:03d}" for i in range(max(0, n - len(base)))])[:n]
