"""Strategy model: a small transformer encoder with sparse sliding-window attention (PyTorch).

Attention between tokens i (query) and j (key), with dt = |t_i - t_j| seconds:

    weight_ij  ~  exp(q_i . k_j / sqrt(d))  *  exp(-dt / tau)  *  w_j     for |i - j| <= window // 2
               =  0                                                      otherwise (and for padding)

so far-apart ticks count less and keys on levels with outlier spreads (w_j < 1) are down-weighted.
Both factors enter as an additive bias on the scores before a softmax that always runs in fp32;
layer norms also run in fp32 (under CUDA autocast the matmuls run in fp16/bf16).

Imported only by the server process: the traffic generator and the launcher never import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from agent_under_test.degrade import FULL, LIGHT
from agent_under_test.features import N_FEATURES
from wire.registry import Registry

N_OUTPUTS = 5  # logits for HOLD, BUY, SELL; price offset; size fraction


@dataclass(frozen=True)
class TierSpec:
    d_model: int
    heads: int
    layers: int
    d_ff: int


TIERS: Registry[str, TierSpec] = Registry("model tier", {
    FULL: TierSpec(d_model=64, heads=4, layers=5, d_ff=256),
    LIGHT: TierSpec(d_model=32, heads=2, layers=1, d_ff=64),
}, error=ValueError)
DEFAULT_WINDOW = 5
DEFAULT_TAU_S = 0.25


def attention_bias(t: torch.Tensor, key_weight: torch.Tensor, valid: torch.Tensor,
                   window: int = DEFAULT_WINDOW, tau: float = DEFAULT_TAU_S) -> torch.Tensor:
    """Additive score bias [B, L, L]: -dt/tau + log(w_j) inside the window, -inf outside.

    A query always sees itself, so padded rows stay finite (their output is masked later).
    """
    length = t.shape[1]
    idx = torch.arange(length, device=t.device)
    band = (idx[:, None] - idx[None, :]).abs() <= window // 2
    allowed = band[None] & valid[:, None, :]
    allowed = allowed | torch.eye(length, dtype=torch.bool, device=t.device)[None]
    dt = (t[:, :, None] - t[:, None, :]).abs().float()
    bias = -dt / tau + torch.log(key_weight.float())[:, None, :]
    return bias.masked_fill(~allowed, float("-inf"))


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 whatever autocast says (kept-fp32 op, checked by gpu_check)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(),
                                self.bias.float(), self.eps)


class SparseWindowAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads, self.d_head = heads, d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.softmax_dtype: torch.dtype | None = None  # observed by gpu_check

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, length, d = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, self.d_head).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(self.d_head) + bias[:, None]
        weights = torch.softmax(scores, dim=-1)  # fp32: fp16 softmax over -inf biases loses mass
        self.softmax_dtype = weights.dtype
        ctx = (weights.to(v.dtype) @ v).transpose(1, 2).reshape(b, length, d)
        return self.out(ctx)


class EncoderLayer(nn.Module):
    def __init__(self, spec: TierSpec) -> None:
        super().__init__()
        self.norm1, self.norm2 = FP32LayerNorm(spec.d_model), FP32LayerNorm(spec.d_model)
        self.attn = SparseWindowAttention(spec.d_model, spec.heads)
        self.ff = nn.Sequential(nn.Linear(spec.d_model, spec.d_ff), nn.GELU(), nn.Linear(spec.d_ff, spec.d_model))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), bias)
        return x + self.ff(self.norm2(x))


class StrategyModel(nn.Module):
    """Encoder over level tokens -> [B, 5]: side logits, price offset, size fraction (raw)."""

    def __init__(self, spec: TierSpec, window: int = DEFAULT_WINDOW, tau: float = DEFAULT_TAU_S) -> None:
        super().__init__()
        self.window, self.tau = window, tau
        self.embed = nn.Linear(N_FEATURES, spec.d_model)
        self.layers = nn.ModuleList(EncoderLayer(spec) for _ in range(spec.layers))
        self.norm = FP32LayerNorm(spec.d_model)
        self.head = nn.Linear(2 * spec.d_model, N_OUTPUTS)

    def forward(self, x: torch.Tensor, t: torch.Tensor, w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        bias = attention_bias(t, w, valid, self.window, self.tau)
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, bias)
        h = self.norm(h)
        mask = valid[..., None].to(h.dtype)
        pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.head(torch.cat([h[:, 0], pooled], dim=-1)).float()


def build_model(tier: str, seed: int = 0) -> StrategyModel:
    """A deterministic model for `tier`: the same seed gives the same weights on every host."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1009 + (0 if tier == "full" else 1))
        model = StrategyModel(TIERS[tier])
    return model.eval()


def save_weights(path: str, seed: int = 0) -> None:
    """Write both tiers' seeded weights to `path` (a file `--weights` can load)."""
    torch.save({tier: build_model(tier, seed).state_dict() for tier in TIERS}, path)


def load_weights(path: str) -> dict[str, StrategyModel]:
    """Models for every tier in a file written by `save_weights` (weights only, no pickled code)."""
    states = torch.load(path, map_location="cpu", weights_only=True)
    models = {}
    for tier, spec in TIERS.items():
        model = StrategyModel(spec)
        model.load_state_dict(states[tier])
        models[tier] = model.eval()
    return models
