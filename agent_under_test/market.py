"""Realistic market snapshots: random-walk prices, a book around the mid, recent ticks, rare wide levels.

`make_snapshot` builds one snapshot from a seeded `random.Random` (others use it to build test
recordings); `MarketSim` keeps a per-symbol mid and position walking between snapshots, as live
traffic would. No torch, no grpc: protobuf only.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
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
class _Symbol:
    mid: float
    position: float = 0.0
    ticks: deque[agent_pb2.Tick] = field(default_factory=deque)


@dataclass
class MarketSim:
    """Per-symbol random walks of mid price and position, and a rolling window of recent trades;
    `next()` returns the symbol's next snapshot (a few new trades each time, like a live feed)."""

    rng: random.Random
    symbols: list[str] = field(default_factory=lambda: ["AAPL", "MSFT", "NVDA", "TSLA"])
    volatility: float = 5e-4     # per-snapshot log-return std
    levels: int = DEFAULT_LEVELS
    ticks: int = DEFAULT_TICKS
    _state: dict[str, _Symbol] = field(default_factory=dict)

    def next(self, sequence_id: int, symbol: str | None = None, ts_ns: int | None = None) -> agent_pb2.MarketSnapshot:
        rng = self.rng
        sym = symbol or rng.choice(self.symbols)
        ts = time.time_ns() if ts_ns is None else ts_ns
        st = self._state.get(sym)
        if st is None:
            st = self._state[sym] = _Symbol(50.0 + 450.0 * rng.random())
            st.ticks.extend(_ticks(rng, st.mid, self.ticks, ts, 20_000_000))
        st.mid *= math.exp(rng.gauss(0.0, self.volatility))
        st.position = max(-900.0, min(900.0, st.position + rng.choice((-10.0, 0.0, 10.0))))
        self._trade(st, ts)
        return agent_pb2.MarketSnapshot(sequence_id=sequence_id, symbol=sym, levels=_book(rng, st.mid, self.levels, 2.0),
                                        ticks=st.ticks, ts_ns=ts, position=st.position)

    def _trade(self, st: _Symbol, ts: int) -> None:
        """One or two new trades near the mid; the oldest fall out of the window."""
        last = st.ticks[-1].ts_ns if st.ticks else 0
        for _ in range(1 if self.rng.random() < 0.7 else 2):
            last = max(ts, last + 1)  # trades stay in time order even if the caller's clock steps back
            st.ticks.append(agent_pb2.Tick(ts_ns=last, price=round(st.mid * math.exp(self.rng.gauss(0.0, 2e-4)), 4),
                                           size=float(1 + int(self.rng.random() * 500))))
        while len(st.ticks) > self.ticks:
            st.ticks.popleft()


def symbol_names(n: int) -> list[str]:
    """`n` distinct ticker-like symbols (SYM000, SYM001, ... past the four well-known ones)."""
    base = ["AAPL", "MSFT", "NVDA", "TSLA"]
    return (base + [f"SYM{i:03d}" for i in range(max(0, n - len(base)))])[:n]
