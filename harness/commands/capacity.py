"""`shadowtest capacity`: rising open-loop load until an SLO breaks; the knee, the limiter, CI checks.

The measuring is in harness/capacity.py; here: the options, the target's lifecycle (the bundled agent
is started and stopped here, by its PID, as a chaos scenario's `target: agent`), the terminal output and
the files (--json, --png, --junit, --md).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import click

from agent_under_test.arrivals import PATTERNS
from agent_under_test.config import LIMITERS
from agent_under_test.degrade import TIERS
from harness.commands.replay import build_tls, tls_options
from harness.outputs import verdict_exit
from wire.clicktypes import Seconds

_FILE = click.Path(dir_okay=False, path_type=Path)
_RATE = click.FloatRange(min=0, min_open=True)


def _parsed(parse: Any) -> Any:
    """A click callback applying `parse` to the value (each value when repeatable); its CapacityError
    becomes click's BadParameter: one line saying what is expected, exit 2."""
    def callback(_: click.Context, __: click.Parameter, value: Any) -> Any:
        from harness.capacity import CapacityError

        if value is None:
            return None
        try:
            return [parse(v) for v in value] if isinstance(value, tuple) else parse(value)
        except CapacityError as exc:
            raise click.BadParameter(str(exc)) from exc
    return callback


def _parse_slo(v: str) -> Any:
    from harness.capacity import parse_slo
    return parse_slo(v)


def _parse_steps(v: str) -> Any:
    from harness.capacity import parse_steps
    return parse_steps(v)


def _parse_expect(v: str) -> Any:
    from harness.capacity import parse_expect
    return parse_expect(v)


@click.command("capacity")
@click.argument("recording", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--agent", is_flag=True, help="start the bundled agent (stopped at the end) and measure it")
@click.option("--tier", type=click.Choice(TIERS), default="full", show_default=True,
              help="with --agent: the model tier it serves")
@click.option("--limiter", type=click.Choice(LIMITERS.names()), default="seed", show_default=True,
              help="with --agent: its adaptive limiter (refuses with RESOURCE_EXHAUSTED)")
@click.option("--target", metavar="HOST:PORT", help="your service instead (loopback unless allowed)")
@click.option("--allow-target", "allow", multiple=True, metavar="HOST", help="allow this non-loopback host/CIDR")
@click.option("--pid", type=click.IntRange(min=1), help="with --target: the service's process, for its CPU %")
@click.option("--steps", callback=_parsed(_parse_steps), metavar="R1,R2,...",
              help="the offered rates, calls/s, rising (instead of --start/--step/--max)")
@click.option("--start", type=_RATE, metavar="RATE", help="first step's rate, calls/s  [default: 100]")
@click.option("--step", type=_RATE, metavar="RATE", help="added at each step, calls/s  [default: 100]")
@click.option("--max", "top", type=_RATE, metavar="RATE", help="the last step's rate at most  [default: 1000]")
@click.option("--step-s", type=click.FloatRange(0.5, 600), default=5.0, show_default=True, metavar="SECONDS",
              help="how long each step offers its rate")
@click.option("--warmup-s", type=click.FloatRange(0, 600), default=2.0, show_default=True, metavar="SECONDS",
              help="play the first rate this long first, not judged (connections, caches; 0: none)")
@click.option("--confirm", is_flag=True,
              help="a breaking step is run once more at its rate; only a second break ends the ramp")
@click.option("--slo", "slos", multiple=True, callback=_parsed(_parse_slo), metavar="OBJECTIVE",
              help="what a step must meet: pNN<LATENCY (from the intended send), errors<P%, rejected<P% "
                   "(repeatable)  [default: p99<20ms, errors<0.5%]")
@click.option("--pattern", type=click.Choice(PATTERNS.names()), default="poisson",
              show_default=True, help="the generator's arrivals (without RECORDING)")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the generator's arrivals")
@click.option("--timeout", "timeout_s", type=Seconds(0.01, 60), default=2.0, show_default=True,
              help="per call (seconds, or 500ms); a call past it counts as an error")
@click.option("--expect", "expects", multiple=True, callback=_parsed(_parse_expect), metavar="CHECK",
              help="capacity_at_least=RATE or limiter_engages_before_knee; a failed one exits 1 (repeatable)")
@click.option("--json", "--json-out", "json_out", type=_FILE, is_flag=False, flag_value="-",
              help="--json: the steps, knee and verdicts as JSON on stdout; --json-out FILE: to a file")
@click.option("--png", "png_out", type=_FILE, help="draw P99 and goodput against offered load here")
@click.option("--junit", "junit_out", type=_FILE, help="the verdicts as JUnit XML")
@click.option("--md", "md_out", type=_FILE, help="the verdicts and steps as Markdown")
@click.option("--startup-timeout", "startup_timeout_s", type=Seconds(1, 600), default=120.0,
              show_default=True, help="with --agent: how long it may take to start (seconds, or 2m)")
@tls_options
def command(recording: Path | None, agent: bool, tier: str, limiter: str, target: str | None,
            allow: tuple[str, ...], pid: int | None, steps: list[float] | None, start: float | None,
            step: float | None, top: float | None, step_s: float, warmup_s: float, confirm: bool,
            slos: list[Any] | None, pattern: str, seed: int, timeout_s: float, expects: list[Any] | None,
            json_out: Path | None, png_out: Path | None, junit_out: Path | None, md_out: Path | None,
            startup_timeout_s: float, tls: bool, ca: str | None, cert: str | None, key: str | None,
            insecure: bool, server_name: str | None) -> None:
    """Offer rising load, step by step and open loop, until an SLO breaks; report the knee (the last step
    that held), per step the offered rate, goodput, P50/P99 from each call's intended send time, errors,
    refusals and the target's CPU, and where the limiter started refusing.

    Traffic: RECORDING time-warped to each step's rate, or the built-in generator (--pattern). Target:
    --agent (the bundled agent, started and stopped here) or --target HOST:PORT (loopback, or allowed with
    --allow-target). Exit 0; 99 when an --expect failed; 1 when the run was interrupted (Ctrl-C stops the
    steps and the agent and still prints the steps measured); 2 on a usage error.

    \b
    Examples:
      shadowtest capacity --agent --tier light --start 100 --step 100 --max 1000
      shadowtest capacity --agent --steps 100,200,400,800 --slo 'p99<20ms' --slo 'errors<0.5%' --png knee.png
      shadowtest capacity prod.rec --target 127.0.0.1:50051 --pid 4242 --step-s 10 --confirm
      shadowtest capacity --agent --expect capacity_at_least=300 --expect limiter_engages_before_knee \\
          --json cap.json --junit junit.xml --md summary.md
    """
    from harness.capacity import (
        DEFAULT_SLOS,
        CapacityError,
        CapacityReport,
        StepRunner,
        check_step_size,
        ramp_steps,
    )

    if steps is not None and (start, step, top) != (None, None, None):
        raise click.UsageError("give either --steps or --start/--step/--max, not both")
    rates = steps if steps is not None else _ramp(start, step, top, ramp_steps)
    try:
        check_step_size(rates, step_s)
    except CapacityError as exc:
        raise click.BadParameter(str(exc), param_hint="--step-s") from exc
    tls_config = _target_choice(agent, target, pid, tls, build_tls(tls, ca, cert, key, insecure, server_name))
    slo_list = slos or [_parse_slo(text) for text in DEFAULT_SLOS]
    source = _source(recording, pattern)
    with contextlib.ExitStack() as stack:
        running, described = _open(agent, tier, limiter, target, allow, pid, startup_timeout_s, stack, source)
        report = CapacityReport(rates, slo_list, step_s, confirm, described, source.describe(),
                                expectations=list(expects or []))
        runner = StepRunner(running.traffic_address, source, slo_list, step_s, timeout_s, seed,
                            running.pid or running.watch_pid, running.metrics_url, tls_config)
        _header(report, runner)
        _play(report, runner, warmup_s)
    _finish(report, _scenario(agent, tier, limiter, target, pid, source, seed), json_out, png_out, junit_out, md_out)
    sys.exit(verdict_exit(report.passed, report.interrupted is not None))


def _ramp(start: float | None, step: float | None, top: float | None, ramp_steps: Any) -> list[float]:
    from harness.capacity import CapacityError

    try:
        return list(ramp_steps(start or 100.0, step or 100.0, top or 1000.0))
    except CapacityError as exc:
        raise click.BadParameter(str(exc), param_hint="--start/--step/--max") from exc


def _target_choice(agent: bool, target: str | None, pid: int | None, tls: bool, config: Any) -> Any:
    """Exactly one of --agent and --target; --pid and TLS only with --target. Returns the TLS config."""
    if agent == bool(target):
        raise click.UsageError("give --agent (the bundled agent) or --target HOST:PORT (your service)")
    if agent and pid is not None:
        raise click.UsageError("--pid is for --target: with --agent the agent's own PID is read")
    if agent and config is not None:
        raise click.UsageError("the bundled agent speaks cleartext: the TLS options are for --target")
    return config


def _source(recording: Path | None, pattern: str) -> Any:
    from harness.capacity import generator_source, recording_source

    if recording is None:
        return generator_source(pattern)
    from harness.commands.replay import refuse_damaged

    refuse_damaged(recording, salvage=False)        # a damaged file: one line naming the damage
    return recording_source(str(recording))


def _open(agent: bool, tier: str, limiter: str, target: str | None, allow: tuple[str, ...], pid: int | None,
          startup_timeout_s: float, stack: contextlib.ExitStack, source: Any) -> tuple[Any, dict[str, Any]]:
    """Start the agent (entered into `stack`: stopped on every exit) or check and reach --target.
    Returns (harness.target.Running, the target as the JSON describes it)."""
    from harness.capacity import probe
    from harness.target import open_target

    if target is not None:
        from replay.errors import TargetNotAllowedError
        from replay.target import check_target

        try:
            check_target(target, allow)
        except TargetNotAllowedError as exc:
            raise click.UsageError(str(exc)) from exc
        probe(target)
    scenario = _scenario(agent, tier, limiter, target, pid, source, 0)
    running = open_target(scenario, stack, startup_timeout_s)
    described = {"address": running.grpc_address, "pid": running.pid or running.watch_pid,
                 "agent": {"tier": tier, "limiter": limiter} if agent else None}
    return running, described


def _scenario(agent: bool, tier: str, limiter: str, target: str | None, pid: int | None, source: Any,
              seed: int) -> Any:
    """The run as a chaos Scenario without a proxy: what open_target starts, and what the JUnit and
    Markdown writers name."""
    from harness.scenario import AgentTarget, ExternalTarget, Phase, Scenario

    where: Any = AgentTarget({"tier": tier, "limiter": limiter}) if agent else ExternalTarget(str(target), pid=pid)
    return Scenario("capacity", where, source.traffic, (Phase("capacity", 1.0),), seed=seed, proxy=False,
                    source=getattr(source.traffic, "path", None))


def _header(report: Any, runner: Any) -> None:
    t = report.target
    what = (f"agent pid {t['pid']} (tier {t['agent']['tier']}, limiter {t['agent']['limiter']})" if t["agent"]
            else f"pid {t['pid']}" if t["pid"] else "CPU not measured (no --pid)")
    rates = report.rates
    _say(f"capacity: {t['address']}, {what}; {len(rates)} steps {rates[0]:g}..{rates[-1]:g}/s, "
         f"{report.step_s:g}s each; SLO {', '.join(s.text for s in report.slos)}")


def _play(report: Any, runner: Any, warmup_s: float) -> None:
    """Warm up, then the steps until one breaks; Ctrl-C ends the steps (the partial one is dropped)."""
    from harness.capacity import measurement_notes, ramp

    try:
        if warmup_s > 0:
            report.warmup = runner.measure(0, report.rates[0], duration_s=warmup_s)
            _say(f"warm-up {warmup_s:g}s at {report.rates[0]:g}/s (not judged): {_brief(report.warmup)}")
        for result in ramp(report.rates, report.confirm, runner.measure):
            report.steps.append(result)
            verdict = "held" if result.held else "BROKE: " + "; ".join(result.breaches)
            again = f" (re-run of step {result.confirm_of + 1})" if result.confirm_of is not None else ""
            _say(f"step {result.index + 1}{again} {result.rate:g}/s: {_brief(result)} -> {verdict}")
    except KeyboardInterrupt:
        report.interrupted = "SIGINT"
        _say(f"interrupted: {len(report.steps)} step(s) measured; the step in progress is dropped")
    report.notes += measurement_notes(report)


def _brief(step: Any) -> str:
    p = step.percentiles_ms
    ms = (lambda v: "-" if v is None else f"{v:.3g} ms")  # noqa: E731
    cpu = "-" if step.cpu_pct is None else f"{step.cpu_pct:.0f}%"
    return (f"offered {step.offered_rate:.1f}/s, goodput {step.goodput:.1f}/s, p50 {ms(p.get('p50'))}, "
            f"p99 {ms(p.get('p99'))}, errors {step.error_pct:.2f}%, refused {step.rejected}, CPU {cpu}")


def _say(line: str) -> None:
    click.echo(line, err=True)


def _finish(report: Any, scenario: Any, json_out: Path | None, png_out: Path | None, junit_out: Path | None,
            md_out: Path | None) -> None:
    """Print the table and verdicts, write the files asked for."""
    from harness.capacity import plot_capacity, run_result
    from harness.console import is_terminal
    from harness.report.table import print_verdicts

    stdout_json = str(json_out) == "-"
    out = sys.stderr if stdout_json else sys.stdout
    _table(report, out)
    result = run_result(report, scenario)
    print_verdicts(result, out, rich=is_terminal(out))
    if png_out is not None:
        try:
            plot_capacity(report, png_out)
            print(f"report png: {png_out}", file=out)
        except ImportError as exc:
            report.notes.append(f"{png_out} skipped: {exc} (pip install 'shadowtest[plots]')")
    _reports(result, junit_out, md_out, png_out, out)
    for note in report.notes:
        print(f"note: {note}", file=out)
    if json_out is not None:
        text = json.dumps(report.as_dict(), indent=2)
        if stdout_json:
            click.echo(text)
        else:
            _write(json_out, text + "\n")
            print(f"report json: {json_out}", file=out)


def _reports(result: Any, junit_out: Path | None, md_out: Path | None, png_out: Path | None, out: Any) -> None:
    """--junit and --md through the chaos runner's writers."""
    from harness.report.junit import junit_xml
    from harness.report.markdown import markdown

    if junit_out is not None:
        _write(junit_out, junit_xml(result))
        print(f"report junit: {junit_out}", file=out)
    if md_out is not None:
        png = _relative(png_out, md_out) if png_out is not None and png_out.exists() else None
        text = markdown(result, png_name=png, command="capacity")
        _write(md_out, text)
        print(f"report markdown: {md_out}", file=out)


def _relative(path: Path, beside: Path) -> str:
    """`path` as the Markdown file `beside` should link it."""
    try:
        return str(path.resolve().relative_to(beside.resolve().parent))
    except ValueError:
        return str(path.resolve())


def _write(path: Path, text: str) -> None:
    from harness.errors import ReportError

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise ReportError(f"cannot write {path}: {exc.strerror}") from exc


def _table(report: Any, out: Any) -> None:
    """One row per step: rich on a terminal, plain lines elsewhere (CI logs stay greppable)."""
    from harness.console import make_console

    heads = ["step", "rate/s", "offered/s", "goodput/s", "p50 ms", "p99 ms", "errors %", "refused", "CPU %",
             "SLO"]
    rows = [_row(s) for s in report.steps]
    console = make_console(file=out)
    if not console.is_terminal:       # aligned columns, the SLO column last and whole
        widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads) - 1)]
        for row in [heads, *rows]:
            print("  ".join([c.rjust(w) for c, w in zip(row, widths, strict=False)] + [row[-1]]), file=out)
    else:
        from rich.table import Table

        table = Table(title="capacity: steps")
        for h in heads:
            table.add_column(h, justify="right" if h not in ("SLO",) else "left")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    knee = report.knee
    where = "none (the first step broke)" if knee.knee is None and knee.bounded else \
        "none" if knee.knee is None else f"{report.steps[knee.knee].rate:g}/s (step {knee.knee + 1})" + \
        ("" if knee.bounded else ", no step broke: the capacity is at least that")
    limiter = "never refused" if knee.limiter is None else \
        f"first refused at {report.steps[knee.limiter].rate:g}/s (step {knee.limiter + 1}: " \
        f"{report.steps[knee.limiter].rejected} calls)"
    print(f"knee: {where}; limiter: {limiter}", file=out)


def _row(s: Any) -> list[str]:
    ms = (lambda v: "-" if v is None else f"{v:.2f}")  # noqa: E731
    step = f"{s.index + 1}" + ("r" if s.confirm_of is not None else "")
    slo = "held" if s.held else "BROKE " + "; ".join(s.breaches)
    return [step, f"{s.rate:g}", f"{s.offered_rate:.1f}", f"{s.goodput:.1f}", ms(s.percentiles_ms.get("p50")),
            ms(s.percentiles_ms.get("p99")), f"{s.error_pct:.2f}", str(s.rejected),
            "-" if s.cpu_pct is None else f"{s.cpu_pct:.0f}", slo]
