"""Shared test set-up: capability-based skips for the `root`, `ebpf` and `gpu` markers, the Go
toolchain fixtures (`host_goarch`, `go_version`, `build`) of the tests that build Go peers, and the
fixtures several test files share:

    state_dir    SHADOWTEST_STATE_DIR in the test's own tmp dir (a module uses it with
                 `pytest.mark.usefixtures("state_dir")`): no test reads or leaves another's fault state
    echo         faults.testing.EchoServer on 127.0.0.1:0
    tp           the embedded Toxiproxy-compatible proxy, seeded by the module's TP_SEED (default 5)
    light_agent  the agent (light tier) in a process of its own, one per module

A marked test skips only with a reason that names the missing capability and how to get it.

Every JSON document a command writes during the tests (in this process or a child) is checked against
its schema, harness/schemas/KIND.json (SHADOWTEST_CHECK_OUTPUTS, harness/outputs.py).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.outputs import CHECK_ENV
from tests.golang import DEBIAN_GOPATH, ELF_ARCH, go_cmd

os.environ[CHECK_ENV] = "1"   # inherited by every command a test starts


@functools.cache
def _ebpf_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root for eBPF (run as root)"
    from harness import doctor

    check = doctor._tracepoint()
    return None if check.ok else f"eBPF unavailable: {check.detail} ({check.fix})"


@functools.cache
def _gpu_problem() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs torch (pip install 'shadowtest[agent]')"
    return None if torch.cuda.is_available() else "needs a CUDA device (none on this machine)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "root" in item.keywords and os.geteuid() != 0:
            item.add_marker(pytest.mark.skip(reason="needs root (run the tests as root)"))
        if "ebpf" in item.keywords and (why := _ebpf_problem()):
            item.add_marker(pytest.mark.skip(reason=why))
        if "gpu" in item.keywords and (why := _gpu_problem()):
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def host_goarch() -> str:
    arch = go_cmd("env", "GOARCH").strip()
    if arch not in ELF_ARCH:
        pytest.skip(f"the Go tests build for the host and goelf traces amd64/arm64 only (host GOARCH {arch})")
    return arch


@pytest.fixture(scope="session")
def go_version() -> str:
    # "go version go1.19.8 linux/amd64"
    return go_cmd("version").split()[2]


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory, host_goarch: str) -> Callable[..., Path]:
    """build(name, source, *go build flags, goarch=host) -> the binary; each built once per session.
    CGO_ENABLED=0 (static, no C compiler), GOPATH mode (no module proxy; Debian's Go packages, such as
    golang-google-grpc-dev, are on the GOPATH), GOCACHE under pytest's tmp."""
    root = tmp_path_factory.mktemp("gobuild")
    env = {**os.environ, "GOCACHE": str(root / "gocache"), "GOPATH": f"{root / 'gopath'}:{DEBIAN_GOPATH}",
           "GO111MODULE": "off", "GOFLAGS": "", "CGO_ENABLED": "0", "GOOS": "linux"}
    built: dict[str, Path] = {}

    def _build(name: str, source: Path, *flags: str, goarch: str | None = None) -> Path:
        if name not in built:
            out = root / name
            go_cmd("build", *flags, "-o", str(out), str(source), env={**env, "GOARCH": goarch or host_goarch},
                   cwd=root)
            built[name] = out
        return built[name]

    return _build


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "state"
    monkeypatch.setenv("SHADOWTEST_STATE_DIR", str(d))
    return d


@pytest.fixture
def echo() -> Iterator[Any]:
    from faults.testing import EchoServer

    with EchoServer() as e:
        yield e


@pytest.fixture
def tp(request: pytest.FixtureRequest) -> Iterator[Any]:
    from faults.proxy import EmbeddedToxiproxy

    with EmbeddedToxiproxy(seed=getattr(request.module, "TP_SEED", 5)) as server:
        yield server


@pytest.fixture(scope="module")
def light_agent() -> Iterator[Any]:
    from agent_under_test.launch import AgentProcess

    with AgentProcess(tier="light") as agent:
        yield agent
