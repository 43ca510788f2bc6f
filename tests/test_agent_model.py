"""Sparse window attention, spread-outlier weights and model determinism: exact values on small inputs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install 'shadowtest[agent]')")

from agent_under_test.engine import collate, load_engine, trace_model  # noqa: E402
from agent_under_test.features import build_features, spread_outlier_weights, token_times  # noqa: E402
from agent_under_test.market import make_snapshot  # noqa: E402
from agent_under_test.model import attention_bias, build_model, load_weights, save_weights  # noqa: E402
from agent_under_test.snapshot import parse_snapshot  # noqa: E402

NEG = float("-inf")


def test_attention_bias_window_decay_and_outlier_exact() -> None:
    # 4 tokens at 0, 0.1, 0.3, 0.6 s; window 3 -> |i-j| <= 1; tau 0.5; key 2 is an outlier (w=0.1).
    t = torch.tensor([[0.0, 0.1, 0.3, 0.6]])
    w = torch.tensor([[1.0, 1.0, 0.1, 1.0]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    bias = attention_bias(t, w, valid, window=3, tau=0.5)[0]
    ln = math.log(0.1)
    expected = [
        [0.0, -0.2, NEG, NEG],
        [-0.2, 0.0, -0.4 + ln, NEG],
        [NEG, -0.4, ln, -0.6],
        [NEG, NEG, -0.6 + ln, 0.0],
    ]
    assert torch.allclose(bias, torch.tensor(expected), atol=1e-6)


def test_attention_bias_masks_padding_but_keeps_self() -> None:
    t = torch.zeros(1, 3)
    valid = torch.tensor([[True, True, False]])
    bias = attention_bias(t, torch.ones(1, 3), valid, window=5, tau=1.0)[0]
    assert bias[0, 2] == NEG and bias[1, 2] == NEG  # nobody attends to padding
    assert bias[2, 2] == 0.0                         # a padded query sees itself: no NaN rows
    weights = torch.softmax(bias, -1)
    assert torch.allclose(weights[0], torch.tensor([0.5, 0.5, 0.0]))


def test_softmax_weights_follow_exp_decay() -> None:
    # Equal scores: the weights are exactly proportional to exp(-dt/tau) * w_j.
    t = torch.tensor([[0.0, 0.25, 0.5]])
    bias = attention_bias(t, torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool), window=5, tau=0.25)
    row = torch.softmax(bias[0, 0], -1)
    raw = torch.tensor([1.0, math.exp(-1.0), math.exp(-2.0)])
    assert torch.allclose(row, raw / raw.sum(), atol=1e-6)


def test_spread_outlier_weights_leave_one_out() -> None:
    spreads = np.array([0.02, 0.021, 0.019, 0.02, 0.2, 0.02])
    assert spread_outlier_weights(spreads).tolist() == pytest.approx([1, 1, 1, 1, 0.1, 1])
    # All equal: the std floor keeps a 0.5% wider level from counting as an outlier.
    assert spread_outlier_weights(np.array([1.0, 1.0, 1.005, 1.0])).tolist() == [1, 1, 1, 1]
    assert spread_outlier_weights(np.array([1.0, 50.0])).tolist() == [1, 1]  # too few levels to judge


def test_token_times_align_newest_tick_with_best_level() -> None:
    ticks = np.array([[1.0e9, 1, 1], [1.2e9, 1, 1], [1.5e9, 1, 1]])  # oldest first
    assert token_times(ticks, 5).tolist() == pytest.approx([0.0, 0.3, 0.5, 0.5, 0.5])
    assert token_times(np.zeros((0, 3)), 2).tolist() == [0.0, 0.0]


def test_build_features_exact_values() -> None:
    from agent_under_test.snapshot import ParsedSnapshot

    book = np.array([[99.0, math.e - 1, 101.0, 0.0], [98.0, 0.0, 102.0, 0.0]])
    ticks = np.array([[1.0e9, 100.0, 0.0], [2.0e9, 101.0, math.e - 1]])  # oldest first
    f = build_features(ParsedSnapshot(1, "X", book, ticks, 0, 500.0))
    assert f.mid == 100.0 and f.best_bid == 99.0 and f.best_ask == 101.0
    expected = [[-1.0, 0.1, 1.0, 0.0, 2.0, 1.0, 0.1, math.tanh(0.5)],
                [-2.0, 0.0, 2.0, 0.0, 4.0, 0.0, 0.0, math.tanh(0.5)]]
    assert np.allclose(f.x, np.array(expected), atol=1e-6)
    assert f.t.tolist() == pytest.approx([0.0, 1.0])


def _features(n: int, seed: int = 1, levels: int = 10) -> list:
    rng = random.Random(seed)
    return [build_features(parse_snapshot(make_snapshot(rng, i, "AAPL", levels=levels, ts_ns=10**18)))
            for i in range(n)]


def _run(model, feats) -> torch.Tensor:
    c = collate(feats)
    with torch.inference_mode():
        return model(*(torch.from_numpy(a) for a in (c.x, c.t, c.w, c.valid)))


def test_weights_are_seeded_and_tiers_differ() -> None:
    feats = _features(3)
    a, b = _run(build_model("full", 0), feats), _run(build_model("full", 0), feats)
    assert torch.equal(a, b)
    assert not torch.equal(a, _run(build_model("full", 1), feats))
    light = build_model("light", 0)
    assert sum(p.numel() for p in light.parameters()) < sum(p.numel() for p in build_model("full").parameters()) / 4


def test_padding_does_not_change_a_shorter_snapshot() -> None:
    model = build_model("full")
    short, long_ = _features(1, levels=4), _features(1, seed=2, levels=12)
    alone = _run(model, short)
    padded = _run(model, short + long_)[:1]
    assert torch.allclose(alone, padded, atol=1e-5)


def test_traced_model_matches_eager_on_mixed_lengths() -> None:
    model = build_model("light")
    feats = _features(2, levels=6) + _features(3, seed=5, levels=10)
    assert torch.allclose(_run(model, feats), _run(trace_model(model), feats), atol=1e-5)


def test_saved_weights_reload_identically(tmp_path) -> None:
    path = tmp_path / "w.pt"
    save_weights(str(path), seed=7)
    feats = _features(2)
    loaded = load_weights(str(path))
    assert torch.equal(_run(loaded["full"], feats), _run(build_model("full", 7), feats))
    engine = load_engine("cpu", str(path), seed=0, torch_threads=1)
    assert engine.run(feats, "light").shape == (2, 5)
