"""The `shadowtest` command line: a thin click front over the packages.

Every subcommand lives in its own module under `harness/commands/` and exports `command`.
Exit codes: 0 success, 1 a check or the run failed, 2 usage error (click's own convention).
A user mistake prints one red line that says what to do, never a traceback, and never wrapped: one line
on stderr whatever its length (consoles come from `harness.console`).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import click

from harness import __version__, commands
from harness.console import print_error

# Package roots whose errors are user-facing: their messages already say what to do.
_USER_ERROR_MODULES = ("capture.errors", "replay.errors", "faults.errors", "agent_under_test.errors",
                       "harness.errors")


def _user_error_types() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = []
    for name in _USER_ERROR_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        root = getattr(mod, "ROOT", None) or next(
            (v for k, v in vars(mod).items() if isinstance(v, type) and issubclass(v, Exception)
             and k.endswith("Error") and v.__module__ == name and v.__base__ is Exception), None)
        if root is not None:
            found.append(root)
    return tuple(found)


class _Main(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except _user_error_types() as exc:
            # One line per error, whatever its length or COLUMNS: greppable in CI logs. click's own
            # usage errors (exit 2) are not caught here and stay as click prints them.
            print_error(exc)
            sys.exit(1)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="shadowtest")
def cli() -> None:
    """shadowtest: record real traffic, replay it with its timing, inject faults, verify the verdict.

    \b
    Examples:
      shadowtest doctor                       what works on this host
      shadowtest demo                         the whole story in about a minute
      shadowtest chaos run scenarios/jitter-and-cpu.yaml --report-dir out/
    """


def _load_commands() -> None:
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"harness.commands.{info.name}")
        cmd = getattr(module, "command", None)
        if isinstance(cmd, click.Command):
            cli.add_command(cmd)


_load_commands()


def main() -> None:
    # gRPC core logs at INFO when the harness forks stress workers beside live channels; users who
    # want gRPC's own chatter can still set GRPC_VERBOSITY themselves.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    cli(prog_name="shadowtest")


if __name__ == "__main__":
    main()
