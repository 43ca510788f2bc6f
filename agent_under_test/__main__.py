"""`python -m agent_under_test serve ...`: the agent without the harness (same options as `shadowtest agent`)."""

from __future__ import annotations

import sys

import click

from agent_under_test.cli import save_weights_command, serve_command, traffic_command
from agent_under_test.errors import AgentError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """The shadowtest reference trading agent."""


main.add_command(serve_command)
main.add_command(save_weights_command)
main.add_command(traffic_command)

if __name__ == "__main__":
    try:
        main(prog_name="python -m agent_under_test")
    except AgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
