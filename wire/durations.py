"""Durations as people write them in scenarios: "15s", "500ms", "1m30s", "2h", or a bare number of seconds."""

from __future__ import annotations

import math
import re

MAX_DURATION_S = 24 * 3600.0   # the longest duration a scenario may give (a phase, a fault, a check window)

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_duration(value: object) -> float:
    """Seconds from "15s", "500ms", "1m30s", "1.5s" or a number (seconds).

    Raises ValueError with what is expected when `value` is not a non-negative, finite duration.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 15s or 500ms, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"expected a finite duration like 15s or 500ms, got {value!r}")
        if value < 0:
            raise ValueError(f"expected a non-negative duration, got {value!r}")
        return float(value)
    text = str(value).strip().replace(" ", "")
    pos, total = 0, 0.0
    for match in _PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos == 0 or pos != len(text):
        raise ValueError(f"expected a duration like 15s, 500ms or 1m30s, got {value!r}")
    return total


def parse_seconds(value: object, what: str = "duration") -> float:
    """Seconds from a bare number (seconds, also as text: "10", "1.5") or a duration ("500ms", "1m30s"),
    at most MAX_DURATION_S; ValueError starting with `what` otherwise. What a command-line option that
    takes a time reads (`--timeout 2` and `--timeout 2s` mean the same)."""
    if isinstance(value, str):
        value = value.strip()
        try:
            value = float(value)
        except ValueError:
            pass
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if seconds > MAX_DURATION_S:
        raise ValueError(f"{what}: {seconds:g} s is out of range (at most {MAX_DURATION_S:g} s)")
    return seconds


def format_duration(seconds: float) -> str:
    """A short human form (parse_duration reads it back): 0.5 -> "500ms", 15 -> "15s", 90 -> "1m30s",
    5400 -> "1h30m", 86400 -> "24h"."""
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{int(hours)}h" if hours else "", f"{int(minutes)}m" if minutes else "", f"{secs:g}s" if secs else ""]
    return "".join(parts)
