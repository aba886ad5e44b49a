"""Synthetic adapters (adapters/synthetic.py): random weights with no files, for benchmarks and demos."""
from __future__ import annotations

import pytest
import torch

from loraplex.adapters.synthetic import read_synthetic, synthetic_spec
from loraplex.models.config import ModelConfig

CONFIG = ModelConfig(model_type="llama", hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=100)


def weights(seed: int, dtype: torch.dtype, rank: int = 8):
    adapter = read_synthetic(synthetic_spec("syn", CONFIG, rank, seed=seed), dtype, False)
    return {key: (m.a, m.b, m.scaling) for key, m in adapter.modules.items()}


def test_seeded_weights_have_the_documented_scale_and_shapes():
    w = weights(3, torch.float32)
    assert len(w) == 2 * 7
    for (layer, proj), (a, b, scaling) in w.items():
        in_f, out_f = CONFIG.projection_shape(proj)
        assert a.shape == (8, in_f) and b.shape == (out_f, 8) and scaling == 2.0
        assert a.dtype == b.dtype == torch.float32
        # A ~ N(0, 1/in), B ~ N(0, 1/rank): the sample std within 15% of the documented one
        assert abs(a.std().item() * in_f ** 0.5 - 1) < 0.15, (layer, proj)
        assert abs(b.std().item() * 8 ** 0.5 - 1) < 0.15, (layer, proj)
    again, other = weights(3, torch.float32), weights(4, torch.float32)
    assert all(torch.equal(w[k][0], again[k][0]) and torch.equal(w[k][1], again[k][1]) for k in w)
    assert not any(torch.equal(w[k][0], other[k][0]) for k in w)
    # modules of one adapter are different windows, not one block repeated
    assert not torch.equal(w[(0, "q_proj")][0], w[(1, "q_proj")][0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_hold_the_float32_weights_rounded_once(dtype):
    """The served dtype is drawn from a pre-scaled array of that dtype: the same values as scaling the
    float32 weights and casting them."""
    exact, served = weights(5, torch.float32), weights(5, dtype)
    for key in exact:
        for mine, truth in zip(served[key][:2], exact[key][:2]):
            assert mine.dtype == dtype and torch.equal(mine, truth.to(dtype)), key


def test_windows_larger_than_the_shared_array_are_drawn():
    big = ModelConfig(model_type="llama", hidden_size=128, intermediate_size=1 << 16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, vocab_size=10)
    spec = synthetic_spec("big", big, 128, projections=("down_proj",), seed=1)   # 128 × 65,536 > 4M values
    a = read_synthetic(spec, torch.bfloat16, False).modules[(0, "down_proj")].a
    assert a.shape == (128, 1 << 16) and a.dtype == torch.bfloat16
    assert abs(a.float().std().item() * (1 << 16) ** 0.5 - 1) < 0.05
