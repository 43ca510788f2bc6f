"""Inference engine: the models of both tiers on one device, run by worker threads.

On CUDA each worker thread owns one CUDA stream and runs under autocast (bf16 where supported, else
fp16); softmax and layer norm stay fp32 (see model.py). Warm-up runs every tier at the batch sizes the
batcher will use, before the server opens its port, so the first real call pays no JIT/allocator cost.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from agent_under_test.errors import ServeError
from agent_under_test.features import N_FEATURES, Features

if TYPE_CHECKING:   # torch loads inside the functions that use it
    import torch


@dataclass
class Collated:
    x: np.ndarray      # [B, L, F]
    t: np.ndarray      # [B, L]
    w: np.ndarray      # [B, L]
    valid: np.ndarray  # [B, L] bool


def collate(items: Sequence[Features]) -> Collated:
    """Pad a batch to its longest sequence."""
    b, length = len(items), max(len(f.x) for f in items)
    x = np.zeros((b, length, N_FEATURES), dtype=np.float32)
    t = np.zeros((b, length), dtype=np.float32)
    w = np.ones((b, length), dtype=np.float32)
    valid = np.zeros((b, length), dtype=bool)
    for i, f in enumerate(items):
        n = len(f.x)
        x[i, :n], t[i, :n], w[i, :n], valid[i, :n] = f.x, f.t, f.w, True
    return Collated(x, t, w, valid)


def resolve_device(requested: str) -> str:
    """'auto' -> 'cuda' when a CUDA device is visible, else 'cpu'.

    Raises:
        ServeError: 'cuda' was requested and none is visible.
    """
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ServeError(f"--device cuda: no CUDA device visible to torch {torch.__version__}; "
                         "use --device cpu (or auto)")
    return requested


@dataclass
class Engine:
    """Holds the models; `run()` is called from worker threads (one forward pass per call)."""

    device: str
    models: dict[str, torch.nn.Module] = field(default_factory=dict)   # tier -> model (traced on CPU)
    streams_used: set[int] = field(default_factory=set)               # CUDA stream handles
    autocast_dtype: torch.dtype | None = None
    _local: threading.local = field(default_factory=threading.local)

    def run(self, items: Sequence[Features], tier: str) -> np.ndarray:
        """Forward pass for a batch; returns raw outputs [B, 5] as float32 numpy."""
        import torch

        c = collate(items)
        model = self.models[tier]
        with torch.inference_mode():
            if self.device == "cpu":
                out = model(torch.from_numpy(c.x), torch.from_numpy(c.t), torch.from_numpy(c.w),
                            torch.from_numpy(c.valid))
                return out.numpy()
            return self._run_cuda(model, c)

    def _run_cuda(self, model: torch.nn.Module, c: Collated) -> np.ndarray:
        import torch

        stream = getattr(self._local, "stream", None)
        if stream is None:  # one stream per worker thread, created on its first batch
            stream = self._local.stream = torch.cuda.Stream()
        self.streams_used.add(stream.cuda_stream)
        with torch.cuda.stream(stream), torch.autocast("cuda", dtype=self.autocast_dtype):
            args = [torch.from_numpy(a).to(self.device, non_blocking=True) for a in (c.x, c.t, c.w, c.valid)]
            out = model(*args).float().cpu()
        stream.synchronize()
        return out.numpy()

    def warm_up(self, max_batch: int, levels: int = 10, rounds: int = 3) -> None:
        """Run every tier at batch sizes 1, 2, 4 .. `max_batch`, a few rounds each, so allocation,
        kernel selection and the TorchScript profiling runs happen now, not on the first calls."""
        rng = np.random.default_rng(0)
        feats = Features(rng.normal(size=(levels, N_FEATURES)).astype(np.float32),
                         np.linspace(0, 0.5, levels, dtype=np.float32), np.ones(levels, np.float32),
                         100.0, 99.99, 100.01)
        sizes = sorted({min(2 ** k, max_batch) for k in range(max_batch.bit_length() + 1)})
        for tier in self.models:
            for _ in range(rounds):
                for size in sizes:
                    self.run([feats] * size, tier)


def trace_model(model: torch.nn.Module, levels: int = 10) -> torch.jit.ScriptModule:
    """TorchScript-trace and freeze a model for CPU serving: same outputs, about half the per-op
    Python overhead (which dominates at these tensor sizes). Batch size and length stay dynamic."""
    import warnings

    import torch

    example = collate([Features(np.zeros((levels, N_FEATURES), np.float32), np.zeros(levels, np.float32),
                                np.ones(levels, np.float32), 1.0, 1.0, 1.0)] * 2)
    args = tuple(torch.from_numpy(a) for a in (example.x, example.t, example.w, example.valid))
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")  # tracer warnings about shape arithmetic: shapes stay symbolic here
        return torch.jit.freeze(torch.jit.trace(model, args, check_trace=False))


def load_engine(device: str, weights: str | None, seed: int, torch_threads: int, jit: bool = True) -> Engine:
    """Build the engine: resolve the device, load or seed the weights, move them there
    (and on CPU, with `jit`, trace them: see trace_model).

    Raises:
        ServeError: no CUDA device for --device cuda, or the weights file cannot be loaded.
    """
    import torch

    from agent_under_test import model as model_mod

    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    dev = resolve_device(device)
    try:
        models = model_mod.load_weights(weights) if weights else \
            {tier: model_mod.build_model(tier, seed) for tier in model_mod.TIERS}
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise ServeError(f"--weights {weights}: cannot load ({exc}); write one with "
                         "`python -m agent_under_test save-weights PATH`") from exc
    served: dict[str, torch.nn.Module] = {tier: m.to(dev) for tier, m in models.items()}
    if dev == "cpu" and jit:
        served = {tier: trace_model(m) for tier, m in served.items()}
    engine = Engine(dev, served)
    if dev == "cuda":
        engine.autocast_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return engine
