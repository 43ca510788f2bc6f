"""wire/clicktypes.Seconds: a command-line time reads seconds or a duration with its unit, within a range,
and a bad one is click's one-line usage error naming the option."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from wire.clicktypes import Seconds


@click.command()
@click.option("--timeout", type=Seconds(0.01, 60), default=2.0, show_default=True)
@click.option("--duration", type=Seconds(0, low_open=True))
def _cmd(timeout: float, duration: float | None) -> None:
    click.echo(f"{timeout!r} {duration!r}")


@pytest.mark.parametrize("args, out", [
    ([], "2.0 None"),
    (["--timeout", "1.5"], "1.5 None"),
    (["--timeout", "500ms", "--duration", "90"], "0.5 90.0"),
    (["--duration", "1m30s"], "2.0 90.0"),
    (["--timeout", "1m"], "60.0 None"),
])
def test_seconds_or_a_duration_read_the_same(args: list[str], out: str) -> None:
    res = CliRunner().invoke(_cmd, args)
    assert res.exit_code == 0 and res.output.strip() == out, res.output


@pytest.mark.parametrize("args, said", [
    (["--timeout", "61"], "'61' must be at least 10ms and at most 1m"),
    (["--timeout", "5ms"], "'5ms' must be at least 10ms and at most 1m"),
    (["--duration", "0"], "'0' must be more than 0s"),
    (["--duration", "-3"], "'-3' is not a time: give seconds or a duration like 500ms, 2s, 1m30s"),
    (["--duration", "soon"], "'soon' is not a time"),
    (["--duration", "1e400"], "'1e400' is not a time"),
])
def test_a_bad_time_is_a_usage_error_naming_the_option(args: list[str], said: str) -> None:
    res = CliRunner().invoke(_cmd, args)
    assert res.exit_code == 2 and f"Invalid value for '{args[0]}': {said}" in res.output, res.output
