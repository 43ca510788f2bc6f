"""Parse stage: validate a MarketSnapshot and turn it into arrays.

Every rejection names the offending field (`levels[3].bid_price`, `ticks[7].ts_ns`, `symbol`, `message`)
so the client can fix the call; the server answers INVALID_ARGUMENT and keeps serving everyone else.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import numpy as np

from agent_under_test.errors import InvalidSnapshotError

if TYPE_CHECKING:
    from agent_under_test.proto import agent_pb2

MAX_LEVELS = 64
MAX_TICKS = 256
MAX_PRICE = 1e9
MAX_SIZE = 1e9          # shares/contracts; anything above is a unit bug upstream, not a market
MAX_POSITION = 1e9
_SYMBOL = re.compile(r"^[A-Za-z0-9._:/-]{1,32}$")
_LEVEL_FIELDS = ("bid_price", "bid_size", "ask_price", "ask_size")
_TICK_FIELDS = ("ts_ns", "price", "size")

BookRow = tuple[float, float, float, float]   # bid_price, bid_size, ask_price, ask_size
TickRow = tuple[float, float, float]          # ts_ns (an int when parsed), price, size


class ParsedSnapshot:
    """A validated snapshot: book[L, 4] = bid_price, bid_size, ask_price, ask_size; ticks[T, 3] = ts_ns,
    price, size (oldest first), as float64 arrays.

    The request path reads `book_rows` / `tick_rows` (the same values as plain tuples, ts_ns an int) and
    never needs the arrays: at ~10 levels building them costs more than the features themselves, so each
    form is made from the other only when first asked for. Construct it from arrays (as before), or from
    rows with `from_rows`.
    """

    __slots__ = ("sequence_id", "symbol", "ts_ns", "position", "_book", "_ticks", "_book_rows", "_tick_rows")

    def __init__(self, sequence_id: int, symbol: str, book: np.ndarray, ticks: np.ndarray, ts_ns: int,
                 position: float) -> None:
        self.sequence_id, self.symbol, self.ts_ns, self.position = sequence_id, symbol, ts_ns, position
        self._book: np.ndarray | None = book
        self._ticks: np.ndarray | None = ticks
        self._book_rows: list[BookRow] | None = None
        self._tick_rows: list[TickRow] | None = None

    @classmethod
    def from_rows(cls, sequence_id: int, symbol: str, book_rows: list[BookRow], tick_rows: list[TickRow],
                  ts_ns: int, position: float) -> ParsedSnapshot:
        snap = cls.__new__(cls)
        snap.sequence_id, snap.symbol, snap.ts_ns, snap.position = sequence_id, symbol, ts_ns, position
        snap._book = snap._ticks = None
        snap._book_rows, snap._tick_rows = book_rows, tick_rows
        return snap

    @property
    def book(self) -> np.ndarray:
        if self._book is None:
            self._book = np.array(self._book_rows, dtype=np.float64).reshape(-1, 4)
        return self._book

    @property
    def ticks(self) -> np.ndarray:
        if self._ticks is None:
            self._ticks = np.array(self._tick_rows, dtype=np.float64).reshape(-1, 3)
        return self._ticks

    @property
    def book_rows(self) -> list[BookRow]:
        rows = self._book_rows
        if rows is None:
            rows = self._book_rows = [(a, b, c, d) for a, b, c, d in self.book.tolist()]
        return rows

    @property
    def tick_rows(self) -> list[TickRow]:
        """ts_ns, price, size per tick, oldest first (ts_ns an int when parsed, a float from an array)."""
        rows = self._tick_rows
        if rows is None:
            rows = self._tick_rows = [(ts, price, size) for ts, price, size in self.ticks.tolist()]
        return rows

    def __repr__(self) -> str:
        return (f"ParsedSnapshot(sequence_id={self.sequence_id!r}, symbol={self.symbol!r}, "
                f"book={self.book!r}, ticks={self.ticks!r}, ts_ns={self.ts_ns!r}, position={self.position!r})")


def _first_bad(bad: np.ndarray) -> tuple[int, int]:
    row, col = np.argwhere(bad)[0]
    return int(row), int(col)


def _book_ok(rows: list[BookRow]) -> bool:
    """Fast path for the common, valid book, on plain floats (cheaper than numpy at ~10 levels): a plain
    loop, no generator (half the cost of all(...)). `0 < bid <= ask < MAX_PRICE` is the three price rules
    at once. NaN fails every comparison, so it takes the slow path, which names the field."""
    for bid, bid_size, ask, ask_size in rows:
        if not (0 < bid <= ask < MAX_PRICE and 0 <= bid_size <= MAX_SIZE and 0 <= ask_size <= MAX_SIZE):
            return False
    return True


def _ticks_ok(rows: list[TickRow]) -> bool:
    """Fast path for valid ticks, like _book_ok."""
    for ts, price, size in rows:
        if not (ts > 0 and 0 < price < MAX_PRICE and 0 <= size <= MAX_SIZE):
            return False
    return True


def _check_book(book: np.ndarray) -> None:
    prices, sizes = book[:, [0, 2]], book[:, [1, 3]]
    for arr, cols, rule, ok in (
        (prices, (0, 2), "must be a finite positive price", lambda a: np.isfinite(a) & (a > 0) & (a < MAX_PRICE)),
        (sizes, (1, 3), f"must be a finite size in [0, {MAX_SIZE:g}]",
         lambda a: np.isfinite(a) & (a >= 0) & (a <= MAX_SIZE)),
    ):
        bad = ~ok(arr)
        if bad.any():
            row, col = _first_bad(bad)
            field = _LEVEL_FIELDS[cols[col]]
            raise InvalidSnapshotError(f"levels[{row}].{field}", f"{rule}, got {float(arr[row, col])!r}")
    crossed = book[:, 2] < book[:, 0]
    if crossed.any():
        row = int(np.argmax(crossed))
        raise InvalidSnapshotError(f"levels[{row}].ask_price",
                                   f"crossed book: ask {float(book[row, 2])!r} below bid {float(book[row, 0])!r}")


def _check_ticks(ticks: np.ndarray) -> None:
    rules = (
        (0, "must be a positive timestamp in ns", lambda a: a > 0),
        (1, "must be a finite positive price", lambda a: np.isfinite(a) & (a > 0) & (a < MAX_PRICE)),
        (2, f"must be a finite size in [0, {MAX_SIZE:g}]", lambda a: np.isfinite(a) & (a >= 0) & (a <= MAX_SIZE)),
    )
    for col, rule, ok in rules:
        bad = ~ok(ticks[:, col])
        if bad.any():
            row = int(np.argmax(bad))
            raise InvalidSnapshotError(f"ticks[{row}].{_TICK_FIELDS[col]}", f"{rule}, got {float(ticks[row, col])!r}")


def parse_snapshot(msg: agent_pb2.MarketSnapshot, max_message_bytes: int = 65536) -> ParsedSnapshot:
    """Validate `msg` (an agent_pb2.MarketSnapshot) and return its arrays.

    Raises:
        InvalidSnapshotError: the first problem found; `.field` names the field.
    """
    size = msg.ByteSize()
    if size > max_message_bytes:
        raise InvalidSnapshotError("message", f"{size} bytes, at most {max_message_bytes}")
    levels, ticks = msg.levels, msg.ticks
    if not levels:
        raise InvalidSnapshotError("levels", f"empty order book (send 1..{MAX_LEVELS} levels)")
    if len(levels) > MAX_LEVELS:
        raise InvalidSnapshotError("levels", f"{len(levels)} levels, at most {MAX_LEVELS}")
    if len(ticks) > MAX_TICKS:
        raise InvalidSnapshotError("ticks", f"{len(ticks)} ticks, at most {MAX_TICKS}")
    symbol = msg.symbol
    if not _SYMBOL.match(symbol):
        raise InvalidSnapshotError("symbol", f"{symbol[:40]!r} is not 1-32 characters of [A-Za-z0-9._:/-]")
    position = msg.position
    if not math.isfinite(position) or abs(position) > MAX_POSITION:
        raise InvalidSnapshotError("position", f"must be finite with |position| <= {MAX_POSITION:g}, got {position!r}")
    rows: list[BookRow] = [(lv.bid_price, lv.bid_size, lv.ask_price, lv.ask_size) for lv in levels]
    if not _book_ok(rows):
        _check_book(np.array(rows, dtype=np.float64))   # finds and names the first bad value
    tick_rows: list[TickRow] = [(t.ts_ns, t.price, t.size) for t in ticks]
    if not _ticks_ok(tick_rows):
        _check_ticks(np.array(tick_rows, dtype=np.float64).reshape(-1, 3))
    return ParsedSnapshot.from_rows(msg.sequence_id, symbol, rows, tick_rows, msg.ts_ns,
                                    position)
