"""Shared test set-up: capability-based skips for the `root`, `ebpf` and `gpu` markers.

A marked test skips only with a reason that names the missing capability and how to get it.
"""

from __future__ import annotations

import functools
import os

import pytest


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
