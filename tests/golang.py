"""The Go toolchain for tests that build Go peers (tests/interop/go/): `go_cmd`, and the constants the
`host_goarch`, `go_version` and `build` fixtures of tests/conftest.py use."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

GO = shutil.which("go")
GO_SRC = Path(__file__).parent / "interop" / "go"
ELF_ARCH = {"amd64": "x86_64", "arm64": "aarch64"}
NO_GO = "needs the Go toolchain (apt-get install golang-go; scripts/setup.sh does)"
DEBIAN_GOPATH = "/usr/share/gocode"      # where Debian's golang-*-dev packages put their sources
GRPC_GO = Path(DEBIAN_GOPATH) / "src" / "google.golang.org" / "grpc"
NO_GRPC_GO = "needs grpc-go (apt-get install golang-google-grpc-dev; scripts/setup.sh does)"


def go_cmd(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run `go ARGS`; its stdout (the test fails with go's output when it does)."""
    assert GO is not None, NO_GO
    proc = subprocess.run([GO, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert proc.returncode == 0, f"go {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout
