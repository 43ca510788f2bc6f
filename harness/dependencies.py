"""A scenario's dependencies: each one started (or reached) before the target, behind its own fault proxy.

    scenario.yaml                         runner (before the target)
      dependencies:                         RedisServer: redis-server on 127.0.0.1:<free port>, its own
        redis: {}                             session, a private temp dir, no persistence, ended by PID
                                            NetworkProxy "st-<scenario>-redis" -> that Redis
                                            the agent gets cache=redis, redis_url=redis://<proxy>/0
      phases: [... faults: [{network: latency, on: redis, latency_ms: 50}]]
                                            -> the toxic goes on the dependency's proxy only

    external target: dependencies: {redis: {address: HOST:PORT, listen: HOST:PORT}}
                                            nothing started; the proxy listens on `listen` (the service
                                            must use it) and forwards to `address`

Redis is ended by its PID (SIGTERM, then SIGKILL) and its folder removed, whatever happens to the run;
it also gets SIGTERM when the harness dies (PR_SET_PDEATHSIG), and a Redis whose harness was killed
with kill -9 before that could act is found by its folder (`shadowtest-redis-<harness pid>-*`, the pid
file inside) and ended on the next run's start (`sweep_stale_redis`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.childserver import ChildServer, stale_folders
from harness.scenario import DependencySpec, Scenario

PREFIX = "shadowtest-redis-"
_READY_TIMEOUT_S = 15.0


def find_redis() -> str | None:
    return shutil.which("redis-server")



def _ping(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """One RESP PING; True on +PONG."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer(ChildServer):
    """A private Redis for one run: `with RedisServer() as r: r.address` ("127.0.0.1:PORT").

    redis-server cannot take port 0, so a free port is probed and another tried when it was taken in
    between. Raises RunError (one line, with the tail of its log) when it cannot start."""

    prefix, name, log_name, ready_timeout_s = PREFIX, "redis-server", "redis.log", _READY_TIMEOUT_S

    def __init__(self, binary: str | None = None) -> None:
        super().__init__(binary or find_redis())
        self.address = ""

    def missing(self) -> str:
        return ("the scenario declares a redis dependency but no `redis-server` is on PATH "
                "(Debian: apt-get install redis-server), or give its address: "
                "dependencies: {redis: {address: HOST:PORT}}")

    def _sweep(self) -> None:
        sweep_stale_redis()

    def _argv(self, port: int) -> list[str]:
        assert self.binary is not None
        return [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.folder, "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning"]

    def _ready(self, port: int) -> bool:
        return _ping("127.0.0.1", port)

    def _started(self) -> None:
        self.address = f"127.0.0.1:{self.port}"


def _is_our_redis(pid: int, folder: Path) -> bool:
    """Whether `pid` is a redis-server of ours working in `folder` (its cwd: --dir chdirs there)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return False
    return (bool(cmdline) and b"redis-server" in os.path.basename(cmdline[0])
            and os.path.realpath(cwd) == os.path.realpath(folder) and uid == os.getuid())


def sweep_stale_redis() -> list[str]:
    """A crashed run's Redis: for each `shadowtest-redis-<pid>-*` folder whose harness is gone, end the
    redis-server its pid file names (only when that process is a redis-server working in that folder,
    so a reused PID is never touched) and remove the folder. Returns what it did, one line each."""
    done: list[str] = []
    for folder, holder in stale_folders(PREFIX):
        for name in ("child.pid", "redis.pid"):      # redis.pid: written by versions before ChildServer
            with contextlib.suppress(OSError, ValueError):
                pid = int(Path(folder, name).read_text().strip())
                if _is_our_redis(pid, folder):
                    os.kill(pid, signal.SIGKILL)     # a leftover with no persistence: nothing to flush
                    done.append(f"redis-server PID {pid} left by run PID {holder}")
        shutil.rmtree(folder, ignore_errors=True)
        done.append(f"folder {folder}")
    return done


@dataclass
class RunningDependency:
    """A dependency as the run reaches it: where it listens, its proxy, what the harness started."""

    spec: DependencySpec
    address: str                      # the dependency itself
    proxy: Any                        # harness.faultimpl.NetworkProxy in front of it
    pid: int | None = None            # the redis-server the harness started (None: external)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def listen(self) -> str:
        return str(self.proxy.listen)

    @property
    def url(self) -> str:
        """What the bundled agent is handed: the proxy's address as a Redis URL."""
        return f"redis://{self.listen}/0"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.spec.kind, "address": self.address, "proxy": self.listen,
                "started_pid": self.pid, "external": self.spec.address is not None,
                "proxy_kind": getattr(self.proxy, "kind", ""), "proxy_pid": getattr(self.proxy, "pid", None)}


def start_dependencies(scenario: Scenario, stack: contextlib.ExitStack) -> dict[str, RunningDependency]:
    """Start (or reach) every dependency and its proxy, entered into `stack` (ended with the run)."""
    from harness.faultimpl import NetworkProxy

    out: dict[str, RunningDependency] = {}
    for dep in scenario.dependencies:
        pid = None
        if dep.address is None:
            server = stack.enter_context(RedisServer())
            address, pid = server.address, server.pid
        else:
            address = dep.address
        proxy = stack.enter_context(NetworkProxy(address, name=f"st-{scenario.name}"[:33] + f"-{dep.name}"[:7],
                                                 seed=scenario.seed, listen=dep.listen or "127.0.0.1:0"))
        out[dep.name] = RunningDependency(dep, address, proxy, pid)
    return out
