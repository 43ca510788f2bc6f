"""Start the agent as a subprocess and wait until it is ready (tests, capture, replay, chaos use this).

    with AgentProcess(tier="light", limiter="gradient") as agent:
        channel = grpc.insecure_channel(agent.grpc_address)
        ...                                      # on exit: SIGTERM, wait, SIGKILL if needed

No torch here: the launcher runs on hosts that only record or replay.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agent_under_test.errors import LaunchError
from wire.process import spawn

_PKG_ROOT = str(Path(__file__).resolve().parent.parent)

def serve_args(options: dict[str, Any]) -> list[str]:
    """CLI flags for `serve` from keyword options.

    port=0 -> --port 0; True/False -> --flag/--no-flag; None is left out, except metrics_port=None
    -> --metrics-port -1 (no metrics endpoint).
    """
    args: list[str] = []
    for key, value in options.items():
        name = key.replace("_", "-")
        if key == "metrics_port" and value is None:
            value = -1
        if value is None:
            continue
        if isinstance(value, bool):
            args.append(f"--{name}" if value else f"--no-{name}")
        else:
            args += [f"--{name}", str(value)]
    return args


class AgentProcess:
    """The agent in a child process: `python -m agent_under_test serve --port 0 --metrics-port 0 ...`.

    Args:
        startup_timeout_s: how long to wait for the ready line (model load + warm-up).
        stop_timeout_s: after SIGTERM, how long to wait before SIGKILL.
        env: extra environment variables for the child.
        **serve_options: any `serve` option by its Python name (tier="light", limiter="seed", ...).

    Raises (on enter):
        LaunchError: the child exited or timed out before it was ready; the message has its stderr tail.
    """

    def __init__(self, *, startup_timeout_s: float = 90.0, stop_timeout_s: float = 10.0,
                 env: dict[str, str] | None = None, **serve_options: Any) -> None:
        self.options = {"host": "127.0.0.1", "port": 0, "metrics_port": 0, **serve_options}
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self._env = env or {}
        self._dir = tempfile.TemporaryDirectory(prefix="shadowtest-agent-")
        self.log_path = Path(self._dir.name) / "agent.log"
        self._ready_path = Path(self._dir.name) / "ready.json"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self.returncode: int | None = None

    @property
    def grpc_address(self) -> str:
        return str(self.ready["grpc"])

    @property
    def metrics_url(self) -> str | None:
        return self.ready.get("metrics")

    @property
    def pid(self) -> int:
        assert self.proc is not None, "AgentProcess not started"
        return self.proc.pid

    def command(self) -> list[str]:
        opts = {**self.options, "ready_file": str(self._ready_path)}
        return [sys.executable, "-m", "agent_under_test", "serve", *serve_args(opts)]

    def start(self) -> AgentProcess:
        env = {**os.environ, **self._env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_ROOT, env.get("PYTHONPATH")) if p)
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it; a file never blocks like a pipe
        try:
            # a crashed test or harness leaves no agent behind (spawn's death signal)
            self.proc = spawn(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        except OSError as exc:
            raise LaunchError(f"cannot start the agent ({exc}); is {sys.executable} runnable?") from exc
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()  # the message already holds the log tail; leave no child or temp dir behind
            self._dir.cleanup()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._ready_path.exists():
                self.ready = json.loads(self._ready_path.read_text())
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise LaunchError(f"agent exited with status {self.proc.returncode} before it was ready:\n"
                                  f"{self.log_tail()}")
            time.sleep(0.05)
        raise LaunchError(f"agent not ready after {self.startup_timeout_s:g} s (model load and warm-up); "
                          f"raise startup_timeout_s or check the log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        """The last lines the child wrote to stdout/stderr."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no output)"

    def stop(self) -> int | None:
        """SIGTERM, wait `stop_timeout_s` for the drain, then SIGKILL. Returns the exit status."""
        if self.proc is None or self.returncode is not None:
            return self.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        return self.returncode

    def __enter__(self) -> AgentProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()
