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
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import RunError
from harness.prom import log_tail
from harness.scenario import DependencySpec, Scenario
from wire.process import end_child, free_port, spawn

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


class RedisServer:
    """A private Redis for one run: `with RedisServer() as r: r.address` ("127.0.0.1:PORT").

    redis-server cannot take port 0, so a free port is probed and another tried when it was taken in
    between. Raises RunError (one line, with the tail of its log) when it cannot start."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or find_redis()
        self.address = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.folder = ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> RedisServer:
        if not self.binary:
            raise RunError("the scenario declares a redis dependency but no `redis-server` is on PATH "
                           "(Debian: apt-get install redis-server), or give its address: "
                           "dependencies: {redis: {address: HOST:PORT}}")
        sweep_stale_redis()
        self.folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        assert self.binary is not None
        log_path = Path(self.folder, "redis.log")
        last = ""
        for _ in range(3):
            port = free_port()
            with open(log_path, "wb") as log:
                self.proc = spawn(
                    [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--dir", self.folder, "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning"],
                    stdout=log, stderr=subprocess.STDOUT)
            Path(self.folder, "redis.pid").write_text(str(self.proc.pid))
            if self._wait_ready(port):
                self.address = f"127.0.0.1:{port}"
                return
            last = log_tail(log_path)
            self._stop_proc()
            if "in use" not in last:
                break
        raise RunError(f"redis-server did not start: {last or 'no output'}")

    def _wait_ready(self, port: int) -> bool:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if _ping("127.0.0.1", port):
                return True
            time.sleep(0.05)
        return False

    def _stop_proc(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            end_child(proc)

    def __exit__(self, *exc: object) -> None:
        self._stop_proc()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = ""


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
    from harness.prom import sweep_stale

    done: list[str] = []
    root = Path(tempfile.gettempdir())
    try:
        folders = [e for e in root.iterdir() if e.name.startswith(PREFIX)][:1000]
    except OSError:
        return done
    for folder in folders:
        holder = folder.name[len(PREFIX):].split("-", 1)[0]
        if not holder.isdigit() or folder.is_symlink() or not folder.is_dir() or _alive(int(holder)):
            continue
        with contextlib.suppress(OSError, ValueError):
            pid = int(Path(folder, "redis.pid").read_text().strip())
            if _is_our_redis(pid, folder):
                os.kill(pid, signal.SIGKILL)     # a leftover with no persistence: nothing to flush
                done.append(f"redis-server PID {pid} left by run PID {holder}")
    done += [f"folder {f}" for f in sweep_stale(PREFIX)]
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
