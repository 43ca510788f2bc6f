"""Command-line value types every command shares.

`Seconds`: an option that takes a time reads a bare number as seconds or a duration with its unit
(`--timeout 2`, `--timeout 2s`, `--timeout 500ms`, `--duration 1m30s`), within a range; a bad value is
click's one-line usage error (exit 2) naming the option.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from wire.durations import format_duration, parse_seconds

if TYPE_CHECKING:   # generic from click 8.2 on; pyproject allows 8.1, where it is not subscriptable
    _ParamType = click.ParamType[float, object]
else:
    _ParamType = click.ParamType


class Seconds(_ParamType):
    """A time in seconds (float): a number or a duration; `low`/`high` bound it (`low_open`: above low)."""

    name = "seconds"

    def __init__(self, low: float = 0.0, high: float | None = None, *, low_open: bool = False) -> None:
        self.low, self.high, self.low_open = low, high, low_open

    def get_metavar(self, param: click.Parameter, ctx: click.Context) -> str:
        return "SECONDS"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value          # a default, already seconds
        try:
            seconds = parse_seconds(value)
        except ValueError:
            self.fail(f"{value!r} is not a time: give seconds or a duration like 500ms, 2s, 1m30s", param, ctx)
        too_low = seconds <= self.low if self.low_open else seconds < self.low
        if too_low or (self.high is not None and seconds > self.high):
            rule = f"{'more than' if self.low_open else 'at least'} {format_duration(self.low) if self.low else '0s'}"
            if self.high is not None:
                rule += f" and at most {format_duration(self.high)}"
            self.fail(f"{value!r} must be {rule}", param, ctx)
        return seconds
