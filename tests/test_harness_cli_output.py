"""Command-line output off a terminal: one line per error, whole values in tables, no colour codes.

A CI log is read with grep: an error wrapped at 80 (or COLUMNS) columns splits the path it names, and
the outcome of a test then depends on how long its temp directory is. Each test here uses a path of
300+ characters and COLUMNS=40, and judges what the real command line writes.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import cli
from harness.console import PLAIN_WIDTH, make_console, print_error
from replay.testing import write_unary_recording
from wire.process import spawn

ROOT = Path(__file__).resolve().parent.parent
MS = 1_000_000
ESC = "\x1b"


def _long_dir(base: Path) -> Path:
    """A directory of 300+ characters under `base`, with a space and rich-markup-like brackets in it."""
    d = base / "run 1" / "[bold]not-markup[/]"
    i = 0
    while len(str(d)) < 300:
        d, i = d / f"{'d' * 40}{i}", i + 1
    return d


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR")}
    return env | {"COLUMNS": "40", "PYTHONPATH": str(ROOT)} | extra


def _shadowtest(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The real CLI in a child process with stdin, stdout and stderr all not a terminal."""
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)


_MISSING_CASES = {
    "inspect": lambda f, tmp: ["inspect", f],
    "export": lambda f, tmp: ["export", f, "-o", str(tmp / "out.pcapng")],
    "replay": lambda f, tmp: ["replay", f, "--target", "127.0.0.1:1"],
}


@pytest.mark.parametrize("force", [False, True], ids=["plain-env", "FORCE_COLOR"])
@pytest.mark.parametrize("cmd", sorted(_MISSING_CASES))
def test_user_error_is_one_whole_line_from_a_subprocess(tmp_path: Path, cmd: str, force: bool) -> None:
    missing = str(_long_dir(tmp_path) / "nope.rec")
    extra = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"} if force else {}
    res = _shadowtest(*_MISSING_CASES[cmd](missing, tmp_path), env=_env(**extra))
    assert res.returncode == 1, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and missing in lines[0] and "no such recording" in lines[0]
    assert ESC not in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize("cmd", sorted(_MISSING_CASES))
def test_user_error_is_one_whole_line_through_clirunner(tmp_path: Path, cmd: str) -> None:
    missing = str(_long_dir(tmp_path) / "nope.rec")
    res = CliRunner().invoke(cli, _MISSING_CASES[cmd](missing, tmp_path), env={"COLUMNS": "40"})
    assert res.exit_code == 1, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and missing in lines[0], res.stderr
    assert ESC not in res.stderr and res.stdout == ""


def test_usage_errors_stay_as_click_prints_them() -> None:
    res = CliRunner().invoke(cli, ["inspect"], env={"COLUMNS": "40"})
    assert res.exit_code == 2
    lines = res.stderr.splitlines()
    assert lines[0] == "Usage: cli inspect [OPTIONS] FILE" and lines[1].startswith("Try 'cli inspect ")
    assert lines[-1] == "Error: Missing argument 'FILE'." and res.stdout == ""


def test_a_message_with_line_breaks_and_markup_prints_as_one_literal_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    print_error("first part\n   second [bold]part[/]\r\nthird :smile: part")
    err = capsys.readouterr().err
    assert err == "error: first part second [bold]part[/] third :smile: part\n"


def test_plain_console_ignores_columns_and_force_color(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.table import Table

    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("FORCE_COLOR", "1")
    out = io.StringIO()
    console = make_console(file=out)
    assert not console.is_terminal and console.width == PLAIN_WIDTH
    value = "v" * 150 + " " + "w" * 150
    console.print(f"[bold red]summary:[/] {value}")
    table = Table(title="t")
    table.add_column("check", no_wrap=True)
    table.add_column("evidence", overflow="fold")
    table.add_row("a", value)
    console.print(table)
    text = out.getvalue()
    assert ESC not in text
    assert text.splitlines()[0] == f"summary: {value}"
    assert sum(value in line for line in text.splitlines()) == 2   # the line above, and the table's row


def test_inspect_summary_keeps_every_value_on_one_line(tmp_path: Path) -> None:
    d = _long_dir(tmp_path)
    d.mkdir(parents=True)
    rec = d / "r.rec"
    write_unary_recording(rec, [i * 5 * MS for i in range(40)], flows=2)
    res = _shadowtest("inspect", str(rec), env=_env())
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert f"file: {rec}" in lines
    # Every line is "key: value" (or "method NAME: n"): none is the tail of a value wrapped off the line before.
    assert all(re.match(r"^[a-z_]+( \S+)?: ", line) for line in lines), res.stdout
    assert ESC not in res.stdout


def test_inspect_tables_off_a_terminal_keep_every_value_whole(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from capture.salvage import open_salvaged
    from capture.summary import summarize
    from harness.commands.inspect import _rich

    d = _long_dir(tmp_path)
    d.mkdir(parents=True)
    rec = d / "r.rec"
    method = "/" + "pkg." * 30 + "Service/Decide"
    write_unary_recording(rec, [i * 5 * MS for i in range(40)], method=method)
    with open_salvaged(str(rec)) as r:
        report = summarize(r)
    _rich(report)   # the rich layout, here on a captured (non-terminal) stdout
    out = capsys.readouterr().out
    assert ESC not in out
    assert any(str(rec) in line for line in out.splitlines()), out
    assert any(method in line and "40" in line for line in out.splitlines()), out


def test_verdict_table_off_a_terminal_keeps_each_check_on_one_line() -> None:
    from harness.checks import evaluate_all
    from harness.report import RunResult
    from harness.report.table import print_verdicts
    from harness.scenario_load import load_scenario_text
    from harness.timeline import CallResult, MetricSample, Timeline

    s = load_scenario_text("name: long\nseed: 1\ntarget: {agent: {}}\ntraffic: {generator: {rate: 20}}\n"
                           "phases: [{name: baseline, duration: 2s}]\nexpect:\n  - {alert_silent: {phase: baseline}}\n")
    calls = [CallResult(i * 0.05, i * 0.05, i * 0.05 + 0.005, "/Decide", "ok") for i in range(40)]
    gauge = [MetricSample(t, {'agent_alert_firing{alert="P99High"}': 0.0}) for t in (0.0, 2.0)]  # silence seen
    tl = Timeline(1.0, 20.0, [("baseline", 0.0, 2.0)], calls=calls, samples=gauge, min_samples=5)
    evidence = "the alert stayed inactive in every period; " + "x" * 300
    verdicts = [replace(v, summary=evidence) for v in evaluate_all(tl, s.expect)]
    out = io.StringIO()
    print_verdicts(RunResult(s, tl, verdicts), out, rich=True)   # rich asked for, on a non-terminal stream
    lines = out.getvalue().splitlines()
    assert ESC not in out.getvalue()
    assert any(verdicts[0].id in line and evidence in line for line in lines), out.getvalue()
    assert lines[-1].endswith("1/1 checks passed")


def test_error_on_a_terminal_is_red_and_still_one_line(tmp_path: Path) -> None:
    import pty
    import select

    missing = str(_long_dir(tmp_path) / "nope.rec")
    master, slave = pty.openpty()
    try:
        proc = spawn([sys.executable, "-m", "harness.cli", "inspect", missing], stderr=slave,
                     env=_env(TERM="xterm-256color"), cwd=str(ROOT))
        os.close(slave)
        slave = -1
        chunks = []
        while select.select([master], [], [], 30)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:   # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=30) == 1
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    err = b"".join(chunks).decode()
    assert ESC in err   # on a terminal: colour, as before
    plain = re.sub(r"\x1b\[[0-9;]*m", "", err)
    lines = plain.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and missing in lines[0], plain
