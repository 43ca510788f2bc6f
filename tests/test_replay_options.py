"""One declaration of the replay options (replay/options.py) makes all three surfaces: the same values
given to `shadowtest replay`, to `shadowtest locust` (--shadow-*) and to a scenario's `traffic:` build
the same ReplayOptions, and a bad value is refused by each with the option spelled its own way."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from harness.cli import cli
from harness.scenario import RecordingTraffic
from harness.scenario_load import load_scenario_text
from replay.options import (
    CLI,
    LOCUST,
    OPTIONS,
    SCENARIO,
    OptionError,
    add_argparse,
    build,
    from_argparse,
    offered,
    parse_window,
    schedule_options,
)

ROOT = Path(__file__).resolve().parent.parent
CA = str(ROOT / "tests" / "data" / "missing-ca.pem")


def _cli_values(args: list[str]) -> dict[str, Any]:
    """What `shadowtest replay FILE --target T ARGS` hands the options model (click's parsing, no run)."""
    command = cli.commands["replay"]
    ctx = command.make_context("replay", ["x.rec", "--target", "127.0.0.1:1", *args], resilient_parsing=False)
    names = {o.name for o in OPTIONS}
    return {k: v for k, v in ctx.params.items() if k in names}


def _locust_values(args: list[str]) -> dict[str, Any]:
    """What `shadowtest locust ... ARGS` hands the model: the same argparse options Locust's parser gets."""
    parser = argparse.ArgumentParser()
    add_argparse(parser.add_argument_group("shadowtest replay"))
    return from_argparse(parser.parse_args(args))


def _scenario_traffic(lines: str) -> RecordingTraffic:
    text = f"""\
name: s
target: {{agent: {{}}}}
traffic:
  recording: p.rec
{lines}
phases: [{{name: a, duration: 2s}}]
"""
    traffic = load_scenario_text(text, "s.yaml").traffic
    assert isinstance(traffic, RecordingTraffic)
    return traffic


def test_every_option_is_offered_on_each_surface_it_declares() -> None:
    replay_help = subprocess.run([sys.executable, "-m", "harness.cli", "replay", "--help"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60).stdout
    locust_help = subprocess.run([sys.executable, "-m", "harness.cli", "locust", "--help"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60).stdout
    for o in offered(CLI):
        assert o.cli in replay_help, o.name
    for o in offered(LOCUST):
        assert o.spell(LOCUST) in locust_help, o.name
    # a scenario knows every key it is offered (an unknown key is refused with the list of known ones)
    with pytest.raises(Exception) as info:
        _scenario_traffic("  nonsense: 1")
    for o in offered(SCENARIO):
        assert o.name in str(info.value), o.name
    assert "sender" not in str(info.value)   # a command's option, not a scenario's


def test_the_same_values_build_the_same_options_from_the_cli_and_locust() -> None:
    args = ["--speed", "2", "--loop", "3", "--window", "10:70", "--method", "Decide", "--method", "Ping",
            "--flow", "4", "--scale", "1.5", "--seed", "9", "--shard-by", "connection", "--timeout", "500ms",
            "--max-in-flight", "8", "--sender", "http1", "--allow-target", "10.0.0.0/8",
            "--set-header", "authorization=Bearer shadow", "--drop-header", "x-debug-*", "--no-marker",
            "--keep-trace-context", "--set-query", "api_key=k", "--set-field", "user.password=p",
            "--method-map", "3:hpack:5=/pkg.Svc/M", "--insecure"]
    from_cli = build(_cli_values(args))
    from_locust = build(_locust_values([a.replace("--", "--shadow-", 1) if a.startswith("--") else a for a in args]))
    assert from_cli == from_locust
    s = from_cli.schedule
    assert (s.speed, s.loop, s.window, s.methods, s.flows, s.rate, s.seed, s.shard_by) == \
        (2.0, 3, (10.0, 70.0), frozenset({"Decide", "Ping"}), frozenset({4}), 1.5, 9, "connection")
    assert s.method_map == ((3, "hpack:5", "/pkg.Svc/M"),)
    assert s.shadow.queries == (("api_key", "k"),) and s.shadow.fields == (("user.password", "p"),)
    assert (from_cli.timeout_s, from_cli.max_in_flight, from_cli.sender, from_cli.allow_targets) == \
        (0.5, 8, "http1", ("10.0.0.0/8",))
    assert from_cli.tls is not None and from_cli.tls.insecure
    assert from_cli.headers is not None and from_cli.headers.set_headers == (("authorization", "Bearer shadow"),)
    assert not from_cli.headers.marker and from_cli.headers.keep_trace_context
    # defaults agree too, and --rate (the older name of --scale) still reads on both
    assert build(_cli_values([])) == build(_locust_values([])) == build({})
    assert build(_cli_values(["--rate", "2"])).schedule.rate == build(_locust_values(["--shadow-rate", "2"])).schedule.rate \
        == build(_cli_values(["--scale", "2"])).schedule.rate == 2.0


def test_a_scenario_plays_the_schedule_the_cli_would() -> None:
    traffic = _scenario_traffic("  speed: 2\n  window: 10s:1m10s\n  methods: [Decide, Ping]\n  flows: [4]\n"
                                "  method_map: ['3:hpack:5=/pkg.Svc/M']\n  timeout: 500ms\n  scale: 2")
    cli_args = ["--speed", "2", "--window", "10:70", "--method", "Decide,Ping", "--flow", "4",
                "--method-map", "3:hpack:5=/pkg.Svc/M", "--scale", "2"]
    assert schedule_options(traffic.replay_values()) == build(_cli_values(cli_args)).schedule
    assert traffic.timeout_ms == 500
    assert _scenario_traffic("  timeout_ms: 250").timeout_ms == 250   # the older spelling still reads


@pytest.mark.parametrize("text", ["10:70", "10s:1m10s", "10:1m10s", "10.0:70.0"])
def test_one_window_syntax_everywhere(text: str) -> None:
    assert parse_window(text) == (10.0, 70.0)
    assert build(_cli_values(["--window", text])).schedule.window == (10.0, 70.0)
    assert build(_locust_values(["--shadow-window", text])).schedule.window == (10.0, 70.0)
    assert _scenario_traffic(f"  window: '{text}'").window == (10.0, 70.0)


@pytest.mark.parametrize("args, cli_says, locust_says, scenario", [
    (["--window", "70:10"], "--window 70:10 is empty", "--shadow-window 70:10 is empty", "window: '70:10'"),
    (["--speed", "500"], "--speed 500.0 is outside", "--shadow-speed 500.0 is outside", "speed: 500"),
    (["--set-header", "nocolon"], "--set-header: 'nocolon'", "--shadow-set-header: 'nocolon'", None),
    (["--method-map", "junk"], "--method-map", "--shadow-method-map", "method_map: [junk]"),
    (["--ca", CA, "--insecure"], "--insecure skips verification: --ca", "--shadow-insecure skips verification: "
     "--shadow-ca", None),
])
def test_a_bad_value_is_refused_by_each_surface_in_its_own_spelling(args: list[str], cli_says: str,
                                                                    locust_says: str, scenario: str | None) -> None:
    with pytest.raises(OptionError) as cli_err:
        build(_cli_values(args))
    assert cli_says in cli_err.value.spelled(CLI)
    with pytest.raises(OptionError) as locust_err:
        build(_locust_values([a.replace("--", "--shadow-", 1) if a.startswith("--") else a for a in args]))
    assert locust_says in locust_err.value.spelled(LOCUST)
    if scenario:
        with pytest.raises(Exception) as scen_err:
            _scenario_traffic(f"  {scenario}")
        assert str(scen_err.value).startswith("s.yaml:") and "traffic." in str(scen_err.value), scen_err.value
    # and the real CLI: exit 2, one line, nothing run
    res = CliRunner().invoke(cli, ["replay", "x.rec", "--target", "127.0.0.1:1", *args])
    assert res.exit_code == 2 and cli_says in res.output, res.output
