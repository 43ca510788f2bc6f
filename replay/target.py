"""Safety: replay only to allowed targets (loopback by default).

A target is allowed when every address its host resolves to is loopback, or when the host (name or
address) or one of its addresses falls in the allowlist: `--allow-target` values, the
SHADOWTEST_ALLOW_TARGETS environment variable (comma separated) and the file
~/.config/shadowtest/allow-targets (one entry a line, '#' comments). Entries are host names,
addresses or CIDR networks.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from replay.errors import TargetNotAllowedError

CONFIG_FILE = Path("~/.config/shadowtest/allow-targets")


def split_target(target: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port). Raises TargetNotAllowedError on a malformed one."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise TargetNotAllowedError(f"target {target!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    return host.strip("[]"), int(port)


def configured_allowlist(config_file: Path | None = None) -> list[str]:
    """Entries from the environment variable and the config file (missing file: none)."""
    entries = [e.strip() for e in os.environ.get("SHADOWTEST_ALLOW_TARGETS", "").split(",") if e.strip()]
    path = (config_file or CONFIG_FILE).expanduser()
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                entries.append(line)
    return entries


def _resolve(host: str) -> list[str]:
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None)})
    except socket.gaierror as exc:
        raise TargetNotAllowedError(f"cannot resolve target host {host!r}: {exc.strerror}") from exc


def _in(addr: str, entry: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]) in ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False


def check_target(target: str, allow: Iterable[str] = (), *, use_config: bool = True) -> str:
    """Return `target` when it may receive replayed traffic, else raise TargetNotAllowedError."""
    host, _ = split_target(target)
    entries = list(allow) + (configured_allowlist() if use_config else [])
    if host in entries:
        return target
    addrs = _resolve(host)
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        return target
    if addrs and all(any(_in(a, e) for e in entries) for a in addrs):
        return target
    raise TargetNotAllowedError(
        f"refusing to replay to {target} ({', '.join(addrs)}): not loopback and not allowed; "
        f"pass --allow-target {host} if this is really a shadow environment")
