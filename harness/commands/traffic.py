"""`shadowtest traffic`: production-like open-loop load against an agent (see agent_under_test.traffic),
with replay's TLS options (--tls, --ca, --cert/--key, --server-name) for a target that speaks TLS."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from agent_under_test.cli import _print_report, _require_agent_extra
from agent_under_test.cli import traffic_command as _plain
from harness.commands.replay import build_tls, tls_options
from harness.outputs import stamped


def _traffic(tls: bool, ca: str | None, cert: str | None, key: str | None, insecure: bool, server_name: str | None,
             **kw: Any) -> None:
    """The agent's traffic command (one report, every path stamped as shadowtest's output), with TLS."""
    config = build_tls(tls, ca, cert, key, insecure, server_name, sender="grpc")  # grpcio: always verifies
    _require_agent_extra("numpy")
    from agent_under_test.traffic import run_traffic

    report = run_traffic(kw["target"], kw["rate"], kw["duration_s"], kw["pattern"], kw["seed"], kw["stream_share"],
                         symbols=kw["symbols"], streams=kw["streams"], log_sent=kw["log_sent"],
                         connect_timeout_s=kw["connect_timeout"], extra={"tls": config} if config else {})
    doc = json.dumps(stamped("traffic", report.to_dict()), indent=2)
    if kw["json_out"] == "-":
        click.echo(doc)
    else:
        if kw["json_out"]:
            with open(kw["json_out"], "w") as f:
                f.write(doc + "\n")
        _print_report(report)
    sys.exit(0 if report.ok else 1)


def _tls_params() -> list[click.Parameter]:
    marked = tls_options(lambda: None)  # click keeps decorator options on the function, last first
    return list(reversed(getattr(marked, "__click_params__", [])))


command = click.Command(
    "traffic", callback=_traffic, params=list(_plain.params) + _tls_params(), help=_plain.help,
    short_help=_plain.short_help, epilog="TLS: --tls (system CAs) or --ca FILE, --cert/--key for mTLS, --server-name NAME; grpcio always "
           "verifies, so --insecure is refused.")

__all__ = ["command"]
