"""`shadowtest agent`: the reference trading agent (serve, save-weights).

A thin wrapper: the commands themselves live in agent_under_test.cli so the agent also runs standalone
as `python -m agent_under_test serve ...` without the harness.
"""

from __future__ import annotations

import click

from agent_under_test.cli import save_weights_command, serve_command


@click.group("agent")
def command() -> None:
    """The reference gRPC trading agent under test.

    \b
    Examples:
      shadowtest agent serve --port 50051 --metrics-port 9464 --device auto --tier full
      shadowtest agent serve --port 0 --ready-file /tmp/agent.json --limiter gradient
      shadowtest agent save-weights /tmp/weights.pt --seed 7
    """


command.add_command(serve_command)
command.add_command(save_weights_command)
