"""The one place that makes rich Consoles for the command line.

On a terminal a console is rich's own: colours, tables and live views fitted to the window. Anywhere
else (a pipe, a file, CI, click's CliRunner) every line stays one line, whatever its length and
whatever COLUMNS says: no hard wrapping, no cropping, no colour or cursor codes (FORCE_COLOR and
TTY_COMPATIBLE do not turn them back on), so logs stay greppable and tables keep each value whole.

    console = make_console()              # stdout
    console = make_console(stderr=True)   # stderr
    console = make_console(file=stream)   # any stream (the live view, the verdict table)
    print_error("no such recording: /a/long/path")   # "error: ..." on stderr, always one line
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

from rich.console import Console
from rich.control import strip_control_codes
from rich.text import Text

# Wide enough that no value in a table is folded off a terminal; text printed through a plain console
# is never wrapped at all (soft_wrap), so this only bounds how wide a table may grow.
PLAIN_WIDTH = 100_000

_NEWLINES = re.compile(r"\s*[\r\n]+\s*")


def is_terminal(stream: IO[str] | None) -> bool:
    """Whether `stream` is an interactive terminal (False for pipes, files, StringIO, CliRunner)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (ValueError, OSError):   # closed or detached stream
        return False


def make_console(*, stderr: bool = False, file: IO[str] | None = None) -> Console:
    """A Console writing to `file` (default: the current sys.stdout, or sys.stderr with `stderr`).

    The target is looked at now: make the console where it is used, not at import time, so that a
    redirected or captured stream (CliRunner) is the one judged.
    """
    target = file if file is not None else (sys.stderr if stderr else sys.stdout)
    if is_terminal(target):
        return Console(file=file, stderr=stderr)
    return Console(file=file, stderr=stderr, width=PLAIN_WIDTH, soft_wrap=True, force_terminal=False,
                   force_interactive=False, color_system=None, no_color=True, highlight=False, emoji=False)


def one_line(message: object) -> str:
    """`message` as one line: line breaks (and the blanks around them) become one space."""
    return strip_control_codes(_NEWLINES.sub(" ", str(message).strip()))


def print_error(message: object, *, prefix: str = "error:") -> None:
    """`prefix message` on stderr as exactly one line: red on a terminal, plain elsewhere; never wrapped,
    never read as rich markup (a path with [brackets] prints as it is)."""
    line = Text.assemble((prefix, "bold red"), " ", one_line(message))
    make_console(stderr=True).print(line, soft_wrap=True, highlight=False)


@contextmanager
def progress(label: str, unit: str, *, stream: IO[str] | None = None) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar for a long command (import, export, redact, record --finish) on stderr, shown only
    when it is a terminal and removed when done. Yields `update(done, total)`, counted in `unit`; elsewhere
    (a pipe, CI, a log) None, so nothing is printed and the command does no progress work at all (no
    count of its rows, no per-packet check)."""
    target = stream if stream is not None else sys.stderr
    if not is_terminal(target):
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
               TimeElapsedColumn()]
    with Progress(*columns, console=make_console(file=target), transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total or None)
