"""Interop with nghttp2's h2load (C; shares no code with grpcio or with this project).

h2load drives the lean server's (agent_under_test/h2server.py) unary echo method as gRPC: POST with
`content-type: application/grpc` and `te: trailers`, the body one length-prefixed message (`-d FILE`),
many streams per connection. Every request must succeed (2xx, none failed or errored), the handler must
see every message intact, and the server must log no protocol or stream error. A second run gives
h2load 64 KiB windows and 256 KiB messages, so the server has to wait for its WINDOW_UPDATEs.

h2load comes from the Debian package nghttp2-client, which scripts/setup.sh (`make test`) installs.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent_under_test.h2server import LeanServer

H2LOAD = shutil.which("h2load")
SERVICE = "interop.Bytes"

pytestmark = pytest.mark.skipif(
    H2LOAD is None, reason="h2load is not installed (Debian package nghttp2-client); run `make test`, "
                           "whose scripts/setup.sh installs it, or apt-get install nghttp2-client")


class Hosted:
    """A LeanServer with an Echo method on 127.0.0.1 port 0, in its own thread and event loop."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.loop_errors: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(lambda _, ctx: self.loop_errors.append(str(ctx.get("exception")
                                                                                   or ctx.get("message"))))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = LeanServer()
        echo = grpc.unary_unary_rpc_method_handler(self.echo)
        self.server.add_registered_method_handlers(SERVICE, {"Echo": echo})
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)

    async def echo(self, request: bytes, ctx: Any) -> bytes:
        self.requests.append(request)
        return request

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def lean() -> Iterator[Hosted]:
    hosted = Hosted()
    yield hosted
    hosted.close()


def _h2load(port: int, body: Path, *options: str) -> dict[str, int]:
    """Run h2load against the Echo method; its request counts, status-code counts and response DATA bytes."""
    assert H2LOAD is not None
    cmd = [H2LOAD, *options, "-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers",
           "-H", "grpc-timeout: 10S", f"http://127.0.0.1:{port}/{SERVICE}/Echo"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"h2load exited {proc.returncode}:\n{out[-3000:]}"
    req = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                    r"(\d+) errored, (\d+) timeout", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    data = re.search(r"traffic: .* \((\d+)\) data", out)
    assert req and codes and data, f"cannot read h2load's summary:\n{out[-3000:]}"
    names = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
    counts = dict(zip(names, map(int, req.groups()), strict=True))
    counts.update(zip(("2xx", "3xx", "4xx", "5xx"), map(int, codes.groups()), strict=True))
    counts["data"] = int(data.group(1))  # response DATA bytes received
    assert "Application protocol: h2c" in out, out[-3000:]
    return counts


def _grpc_body(tmp_path: Path, payload: bytes) -> Path:
    body = tmp_path / "body.bin"
    body.write_bytes(b"\x00" + len(payload).to_bytes(4, "big") + payload)  # uncompressed, 4-byte length
    return body


def _server_problems(caplog: pytest.LogCaptureFixture, lean: Hosted) -> list[str]:
    """What the server logged at WARNING or above, or any stream error (INFO), and its loop's errors."""
    logged = [f"{r.levelname}: {r.getMessage()}" for r in caplog.records if r.name.startswith("agent_under_test")
              and (r.levelno >= logging.WARNING or "error" in r.getMessage())]
    return logged + lean.loop_errors


@pytest.mark.timeout(60)
def test_h2load_unary_grpc_calls_all_succeed(lean: Hosted, tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent_under_test")
    payload = b"h2load->lean " * 8
    n = 2000
    counts = _h2load(lean.port, _grpc_body(tmp_path, payload), "-n", str(n), "-c", "4", "-m", "16")
    assert counts == {"total": n, "started": n, "done": n, "succeeded": n, "failed": 0, "errored": 0,
                      "timeout": 0, "2xx": n, "3xx": 0, "4xx": 0, "5xx": 0, "data": n * (5 + len(payload))}
    assert len(lean.requests) == n and set(lean.requests) == {payload}  # every message intact, once
    assert _server_problems(caplog, lean) == []


@pytest.mark.timeout(60)
def test_h2load_large_messages_through_small_client_windows(lean: Hosted, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent_under_test")
    payload = bytes(range(256)) * 1024  # 256 KiB each way, against 64 KiB stream and connection windows
    n = 64
    counts = _h2load(lean.port, _grpc_body(tmp_path, payload), "-n", str(n), "-c", "2", "-m", "4",
                     "-w", "16", "-W", "16")
    assert counts == {"total": n, "started": n, "done": n, "succeeded": n, "failed": 0, "errored": 0,
                      "timeout": 0, "2xx": n, "3xx": 0, "4xx": 0, "5xx": 0, "data": n * (5 + len(payload))}
    assert len(lean.requests) == n and all(r == payload for r in lean.requests)
    assert _server_problems(caplog, lean) == []
