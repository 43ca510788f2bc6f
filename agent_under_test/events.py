"""The guard's event log: every period summary, limiter adjustment, alert transition and tier change.

Each event is a flat JSON object:
    {"seq": 1, "ts": <wall seconds>, "mono": <monotonic seconds>,
     "type": "period"|"limiter"|"alert"|"tier"|"circuit", ...}
("circuit": a dependency's circuit breaker moved: {"dependency": "redis", "from": ..., "to": ...}.)
`seq` counts from 1 with no gaps, so a reader resumes with `since=<last seq seen>`. Subscribers block
in `wait_after()` and wake on each append; the log keeps the newest `max_events`.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from wire.clock import Clock

EVENT_TYPES = ("period", "limiter", "alert", "tier", "circuit")
Event = dict[str, Any]


class EventLog:
    """Thread-safe, append-only, bounded."""

    def __init__(self, clock: Clock, max_events: int = 100_000) -> None:
        self._clock = clock
        self._events: deque[Event] = deque(maxlen=max_events)
        self._seq = 0
        self._cond = threading.Condition()
        self._closed = False
        self._listeners: list[Callable[[Event], None]] = []

    @property
    def last_seq(self) -> int:
        return self._seq

    def emit(self, kind: str, fields: dict[str, object], mono: float | None = None) -> Event:
        """Append one event of `kind`; `mono` defaults to the clock's now. Returns the event."""
        if kind not in EVENT_TYPES:
            raise ValueError(f"unknown event type {kind!r}")
        with self._cond:
            self._seq += 1
            event: Event = {"seq": self._seq, "ts": self._clock.wall(),
                                        "mono": self._clock.now() if mono is None else mono, "type": kind}
            event.update(fields)
            self._events.append(event)
            self._cond.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a broken listener must not break the request path
                pass
        return event

    def add_listener(self, listener: Callable[[Event], None]) -> None:
        """Call `listener(event)` after each append (errors in it are swallowed)."""
        with self._cond:
            self._listeners.append(listener)

    def since(self, seq: int = 0, kind: str | None = None) -> list[Event]:
        """Events with seq > `seq` still held, oldest first, optionally of one `kind`."""
        with self._cond:
            return [e for e in self._events if int(e["seq"]) > seq and (kind is None or e["type"] == kind)]

    def wait_after(self, seq: int, timeout: float) -> list[Event]:
        """Block up to `timeout` s for events after `seq`; [] on timeout or once the log is closed."""
        with self._cond:
            if self._seq <= seq and not self._closed:
                self._cond.wait(timeout)
        return self.since(seq)

    def close(self) -> None:
        """Wake every waiter for good (the endpoint is shutting down)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed


def to_line(event: Event) -> bytes:
    """One event as a JSON line."""
    return (json.dumps(event, separators=(",", ":"), allow_nan=False) + "\n").encode()
