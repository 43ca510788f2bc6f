"""`shadowtest demo`."""

from __future__ import annotations

import sys

import click

from capture.backends import BACKENDS
from harness.outputs import verdict_exit


@click.command("demo")
@click.option("--report-dir", type=click.Path(file_okay=False), default="demo-out",
              show_default=True, help="where the recording and every report go")
@click.option("--record-s", type=click.FloatRange(3, 120), default=12.0, show_default=True,
              help="seconds of production traffic to record")
@click.option("--rate", type=click.FloatRange(1, 2000), default=60.0, show_default=True,
              help="production calls per second")
@click.option("--seed", type=int, default=7, show_default=True, help="seeds traffic, jitter and every choice")
@click.option("--backend", "backends", multiple=True, type=click.Choice(BACKENDS.names()),
              help="capture backends to try in order (default: ebpf, then pcap, then proxy)")
def command(report_dir: str, record_s: float, rate: float, seed: int, backends: tuple[str, ...]) -> None:
    """The whole story on one machine in about 80 seconds.

    Starts the agent, records production-like traffic with eBPF (or says which fallback it used and
    why), replays the recording at 2x through the fault proxy while network jitter and CPU
    contention hit a fresh agent, checks the alert, the limiter, degradation, recovery and
    accounting, and prints the verdicts and where the reports are. Exit 0 when every check passes, 99 when one fails, 1 when a step could not run.

    \b
    Examples:
      shadowtest demo
      shadowtest demo --report-dir /tmp/demo --backend proxy
    """
    from harness.console import is_terminal
    from harness.demo import BACKENDS, run_demo
    from harness.report.table import print_verdicts

    result, paths = run_demo(report_dir, record_s=record_s, rate=rate, seed=seed,
                             backends=backends or BACKENDS)
    print_verdicts(result, sys.stdout, rich=is_terminal(sys.stdout))
    for kind, path in paths.items():
        click.echo(f"report {kind}: {path}")
    sys.exit(verdict_exit(result.passed, result.interrupted is not None))
