"""The persistent decode kernel (ops/attention/persistent_kernel.py): the same bits as the grid of a program an item
(`_decode_kernel` unsplit) and the float64 loop's values, on make_case's poisoned layouts (NaN past each context,
garbage table entries, rows no sequence owns), in Triton's interpreter; on the GPU at Llama shapes over bf16 and
e4m3 caches, batches whose items outnumber the programs.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from loraplex.ops.attention import launchers as ak

from test_attention import DECODE, MIXED, TOL, _case, interpreted, make_case, max_err, stable_seed
from test_fp8_kv_cache import K_SCALE, V_SCALE, _fp8_case, quantize

GRID = ak.DecodeConfig(block_n=16, num_warps=4, num_stages=1)   # small steps: several tiles an item


def _decode(case, cfg: ak.DecodeConfig, dtype=None, **kw) -> torch.Tensor:
    out = torch.full(case.q.shape, float("nan"), dtype=dtype or case.q.dtype, device=case.q.device)
    ak.decode(*case.args(), out, max_seq_len=case.max_seq_len, scale=case.scale, window=case.window, num_splits=1,
              cfg=cfg, **kw)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(nan=7.0), b.nan_to_num(nan=7.0)) and torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("num_items, programs, expected", [
    (1024, 396, (396, 4)), (256, 396, (256, 2)), (3, 8, (3, 2)), (1, 8, (1, 2)),
    (10_000, 8, (157, 64)),   # past MAX_PERSISTENT_ITEMS an item a program: more programs
])
def test_persistent_grid(num_items, programs, expected):
    got = ak.persistent_grid(num_items, programs)
    assert got == expected
    assert got[0] * got[1] >= num_items and got[1] <= ak.MAX_PERSISTENT_ITEMS


@interpreted
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("layout", ["mha-d64-bs16", "gqa3-d32-bs16", "mqa16-d16-bs8"])
@pytest.mark.parametrize("window", [0, 21])
@pytest.mark.parametrize("per_sm", [1, 2])
def test_same_bits_as_a_program_an_item_and_the_float64_loop(seqs, layout, window, per_sm):
    """The interpreter's 4 pretend SMs: 4 or 8 programs over 8-112 items (up to 16 an item list), items of
    several 16-key tiles, prompt sequences among them (no steps), rows past every sequence (left as NaN)."""
    rng = np.random.default_rng(stable_seed("persistent", len(seqs), layout, window, per_sm))
    case = _case(rng, seqs, layout, torch.float32, window=window)
    grid = _decode(case, GRID)
    persistent = _decode(case, replace(GRID, persistent_per_sm=per_sm))
    assert _same_bits(persistent, grid)
    decode_rows = case.owned_rows() & ~torch.isnan(grid[:, 0, 0])
    assert decode_rows.sum() == sum(n == 1 for _, n in seqs)
    assert max_err(persistent, case.oracle(), decode_rows) <= TOL[torch.float32]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 40])
def test_e4m3_cache_same_bits_as_a_program_an_item(dtype, window):
    """Over an e4m3 cache with k and v scales: the same bits as the grid, within the loop's tolerance of the
    dequantized values."""
    case, oracle = _fp8_case(stable_seed("persistent-fp8", str(dtype), window), DECODE, dtype, window=window)
    scales = dict(k_scale=torch.tensor([K_SCALE]), v_scale=torch.tensor([V_SCALE]))
    grid = _decode(case, GRID, **scales)
    persistent = _decode(case, replace(GRID, persistent_per_sm=1), **scales)
    assert _same_bits(persistent, grid)
    assert max_err(persistent, oracle, case.owned_rows()) <= TOL[dtype]


@interpreted
def test_a_batch_without_one_row_sequences_writes_nothing():
    rng = np.random.default_rng(5)
    case = _case(rng, [(0, 5), (10, 0), (3, 2)], "mha-d64-bs16", torch.float32)
    out = _decode(case, replace(GRID, persistent_per_sm=2))
    assert torch.isnan(out).all()


def _engine_like(seed: int, batch: int, Hkv: int, dtype, fp8: bool):
    """A decode batch as the engine's benchmark has it: contexts 128-640 tokens, Llama heads (32 query heads,
    head_dim 128), 16-token pages."""
    rng = np.random.default_rng(seed)
    seqs = [(int(c), 1) for c in rng.integers(128, 640, batch)]
    case = make_case(rng, seqs, Hq=32, Hkv=Hkv, D=128, bs=16, dtype=dtype, device="cuda")
    kw = {}
    if fp8:
        case.k_cache, case.v_cache = quantize(case.k_cache, K_SCALE), quantize(case.v_cache, V_SCALE)
        kw = dict(k_scale=torch.tensor([K_SCALE], device="cuda"), v_scale=torch.tensor([V_SCALE], device="cuda"))
    return case, kw


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32, 128])
@pytest.mark.parametrize("Hkv", [32, 8], ids=["llama2", "llama3"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "e4m3-cache"])
@pytest.mark.parametrize("per_sm", [1, 2, 3])
def test_gpu_same_bits_as_a_program_an_item(batch, Hkv, fp8, per_sm):
    """bf16 q at Llama shapes: up to 4,096 items over 132 × per_sm programs (2 stages at 3 an SM), the same bits as
    the grid kernel's (which test_attention_gpu.py and test_fp8_kv_cache.py hold to fp32 references)."""
    case, kw = _engine_like(stable_seed("persistent-gpu", batch, Hkv, fp8), batch, Hkv, torch.bfloat16, fp8)
    cfg = ak.decode_config(128, torch.bfloat16, fp8)
    grid = _decode(case, replace(cfg, persistent_per_sm=0), **kw)
    persistent = _decode(case, replace(cfg, persistent_per_sm=per_sm, num_stages=2 if per_sm == 3 else cfg.num_stages),
                         **kw)
    assert not grid.isnan().any() or not grid[case.owned_rows()].isnan().any()
    assert _same_bits(persistent, grid)
