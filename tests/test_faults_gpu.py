"""GPU fault: a competing CUDA workload; without CUDA it refuses with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.errors import GpuUnavailableError
from faults.gpu import gpu_contention, gpu_problem
from faults.state import FaultRegistry


def test_without_cuda_says_why(tmp_path: Path) -> None:
    if gpu_problem() is None:
        pytest.skip("this host has CUDA; covered by the gpu test")
    with pytest.raises(GpuUnavailableError, match="GPU contention unavailable: "):
        with gpu_contention(registry=FaultRegistry(tmp_path)):
            pass  # pragma: no cover
    assert not list(tmp_path.glob("holder-*.json"))


@pytest.mark.gpu
def test_gpu_burner_runs_and_is_gone_after(tmp_path: Path) -> None:
    import torch

    reg = FaultRegistry(tmp_path)
    with gpu_contention(device=0, duty_pct=50, size=1024, registry=reg) as load:
        assert Path(f"/proc/{load.pid}").exists() and reg.path.exists()
        # The burner holds a CUDA context on the device while it runs.
        free, total = torch.cuda.mem_get_info(0)
        assert free < total
    assert not reg.path.exists()
    assert not Path(f"/proc/{load.pid}").exists() or \
        Path(f"/proc/{load.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
