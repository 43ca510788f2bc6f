"""`shadowtest locust`: Locust with shadowtest's replay user (replay/locust_user.py), from the installed package."""

from __future__ import annotations

import importlib.util
import os
import sys

import click

_MODULE = "replay.locust_user"


def locustfile() -> str:
    """The installed path of the replay locustfile (found without importing it: it monkey-patches)."""
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or not spec.origin:
        raise click.ClickException(f"{_MODULE} is not installed with this shadowtest")
    return spec.origin


@click.command("locust", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                           "help_option_names": []})
@click.option("--print-locustfile", is_flag=True, help="print the locustfile's path (for `locust -f PATH`) and exit")
@click.argument("locust_args", nargs=-1, type=click.UNPROCESSED)
def command(print_locustfile: bool, locust_args: tuple[str, ...]) -> None:
    """Run Locust with the replay user: every argument goes to Locust (`shadowtest locust --help`
    lists Locust's options and the --shadow-* ones).

    \b
    Examples:
      shadowtest locust --master --headless --expect-workers 2 -u 2 -r 2 --run-time 5m \\
          --host 127.0.0.1:50051 --shadow-recording prod.rec
      shadowtest locust --worker --master-host 10.0.0.5
      locust -f "$(shadowtest locust --print-locustfile)" --headless --host 127.0.0.1:50051 --shadow-recording prod.rec
    """
    path = locustfile()
    if print_locustfile:
        click.echo(path)
        return
    if importlib.util.find_spec("locust") is None:
        raise click.ClickException("Locust is not installed: pip install 'shadowtest[locust]'")
    if "-h" in locust_args or "--help" in locust_args:
        _help(click.get_current_context())
        return
    argv = [sys.executable, "-m", _MODULE, *locust_args]   # replay.locust_user.launch
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def _help(ctx: click.Context) -> None:
    """This command's own help (its usage, --print-locustfile, the examples), then Locust's options as
    Locust prints them with the replay user's (--shadow-*), under this command's name."""
    import subprocess

    click.echo(ctx.get_help().replace("[OPTIONS] [LOCUST_ARGS]...", "[--print-locustfile] [LOCUST OPTIONS]..."))
    done = subprocess.run([sys.executable, "-m", _MODULE, "--help"], capture_output=True, text=True, timeout=120)
    text = done.stdout or done.stderr
    if text.startswith("Usage: locust"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
    click.echo("\nLocust's options, passed through (the replay user's are the --shadow-* ones):")
    click.echo(text.rstrip())
