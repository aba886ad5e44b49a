"""The FMA decode kernel (ops/attention/fma_decode_kernel.py, DecodeConfig.fma) against the float64 loop of
test_attention, in Triton's interpreter: e4m3 caches with scales (as the FP8 KV cache runs it) and 16/32-bit ones,
one or several query heads a kv head, splits with the shared reduce, sliding windows,
head-major caches, tiles that straddle pages and contexts that end mid-tile; poisoned layouts (NaN past each
context, garbage block ids) as test_attention builds them. On GPUs (`-m gpu`) it runs in bf16 against the reference.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex import ops
from loraplex.ops.attention import launchers as ak
from test_attention import TOL, attention_f64, interpreted, make_case, max_err, stable_seed
from test_fp8_kv_cache import DECODE, K_SCALE, V_SCALE, quantize

FMA = ak.DecodeConfig(block_n=16, num_warps=1, num_stages=1, fma=True)


def _case(seed, *, Hq, Hkv, D=32, bs=8, window=0, head_major=False, dtype=torch.float32, fp8=True, seqs=DECODE,
          device="cpu"):
    case = make_case(np.random.default_rng(seed), seqs, Hq=Hq, Hkv=Hkv, D=D, bs=bs, dtype=dtype, window=window,
                     head_major=head_major, device=device)
    k_scale = v_scale = None
    if fp8:
        case.k_cache, case.v_cache = quantize(case.k_cache, K_SCALE), quantize(case.v_cache, V_SCALE)
        k_scale, v_scale = (torch.tensor([s], device=device) for s in (K_SCALE, V_SCALE))
    kd, vd = (c.double() * (s if fp8 else 1.0) for c, s in ((case.k_cache, K_SCALE), (case.v_cache, V_SCALE)))
    oracle = attention_f64(case.q, kd, vd, case.block_tables, case.seq_lens, case.query_start, case.scale, window)
    return case, oracle, k_scale, v_scale


def _decode(case, cfg, num_splits=None, k_scale=None, v_scale=None) -> torch.Tensor:
    out = torch.full(case.q.shape, float("nan"), dtype=case.q.dtype, device=case.q.device)
    ak.decode(*case.args(), out, max_seq_len=case.max_seq_len, scale=case.scale, window=case.window,
              num_splits=num_splits, cfg=cfg, k_scale=k_scale, v_scale=v_scale)
    assert torch.isnan(out[~case.owned_rows()]).all(), "rows no sequence owns were written"
    return out


@interpreted
@pytest.mark.parametrize("Hq, Hkv, num_splits, window", [(4, 4, 1, 0), (4, 4, 3, 40), (6, 2, 3, 0), (8, 1, 1, 40)],
                         ids=["mha", "mha-split-window", "gqa3-split", "mqa8-window"])
def test_over_e4m3_caches_matches_the_float64_loop(Hq, Hkv, num_splits, window):
    """Keys and values in e4m3 scaled by K_SCALE and V_SCALE, fp32 queries: fp32 FMAs on exactly dequantized
    values, the fp32 tolerance."""
    case, oracle, ks, vs = _case(stable_seed("fma", Hq, Hkv, num_splits, window), Hq=Hq, Hkv=Hkv, window=window,
                                 head_major=num_splits == 3)
    out = _decode(case, FMA, num_splits, ks, vs)
    assert max_err(out, oracle, case.owned_rows()) <= TOL[torch.float32]


@interpreted
@pytest.mark.parametrize("D, bs, cfg", [(128, 16, ak.DecodeConfig(64, 2, 1, fma=True)),
                                        (64, 32, ak.DecodeConfig(32, 1, 1, fma=True))], ids=["d128-r8", "d64-r8"])
def test_llama_head_sizes_with_several_keys_a_lane_stream(D, bs, cfg):
    """Head sizes where a tile holds several keys a stream (C > 1: 64 keys over R = 8 streams at D = 128 with two
    warps; 32 over 8 at D = 64), over pages of 16 and 32 tokens, split and with a window."""
    assert cfg.block_n // ak.fma_key_streams(D, 1, cfg) > 1
    case, oracle, ks, vs = _case(stable_seed("fma-heads", D), Hq=4, Hkv=2, D=D, bs=bs, window=70)
    out = _decode(case, cfg, 2, ks, vs)
    assert max_err(out, oracle, case.owned_rows()) <= TOL[torch.float32]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cfg", [FMA, ak.DecodeConfig(block_n=32, num_warps=2, num_stages=1, fma=True)],
                         ids=["16keys", "32keys-straddling-16-token-pages"])
def test_over_16_and_32_bit_caches_matches_the_float64_loop(dtype, cfg):
    """The kernel reads a cache of the queries' dtype as well (no scales); 32-key tiles over 16-token pages."""
    case, oracle, _, _ = _case(stable_seed("fma-dense", str(dtype), cfg.block_n), Hq=6, Hkv=2, bs=16, dtype=dtype,
                               fp8=False)
    out = _decode(case, cfg, num_splits=2)
    assert max_err(out, oracle, case.owned_rows()) <= TOL[dtype]


@interpreted
def test_splits_planned_over_query_heads(monkeypatch):
    """Left to plan its splits, a launch counts the FMA kernel's programs a query head each (the interpreter's 4
    "SMs" × 2 programs over 2 sequences × 4 query heads: 1 split; over 1 sequence × 2 heads: 4), and the split
    launch matches the loop."""
    grids = []
    real = ak._FMA_DECODE
    monkeypatch.setattr(ak, "_FMA_DECODE", lambda grid, *a: (grids.append(grid), real(grid, *a)))
    cfg = ak.DecodeConfig(16, 1, 1, fma=True, min_split_tokens=32)
    for seqs, Hq, Hkv in (([(150, 1), (90, 1)], 4, 2), ([(150, 1)], 2, 1)):
        case, oracle, ks, vs = _case(stable_seed("fma-plan", Hq), Hq=Hq, Hkv=Hkv, seqs=seqs)
        out = _decode(case, cfg, None, ks, vs)
        assert max_err(out, oracle, case.owned_rows()) <= TOL[torch.float32]
    assert grids == [(2, 4, 1), (1, 2, 4)]


def test_fma_tiles_take_their_own_kernel_and_constexprs(monkeypatch):
    """`fma` picks fma_decode_kernel.py's kernel, a program per query head, without the dots' settings; other tiles
    keep the dot kernel, a program per kv head."""
    consts = ak.decode_constexprs(3, 128, 16, True, torch.bfloat16, FMA, True)
    assert consts == dict(G=3, BLOCK_N=16, R=4, HEAD_DIM=128, PAGE=16, SPLIT=True, FP8_KV=True)
    # R: 8 lanes read a 128-byte e4m3 key, so a warp holds 4 keys side by side (16-bit keys: 2; 4 warps: 4 times more)
    for D, nbytes, cfg, r in ((128, 1, FMA, 4), (128, 2, FMA, 2), (128, 4, FMA, 1), (32, 1, FMA, 16),
                              (128, 1, ak.DecodeConfig(64, 4, 1, fma=True), 16), (32, 1, ak.DecodeConfig(8, 1, 1), 8)):
        assert ak.fma_key_streams(D, nbytes, cfg) == r, (D, nbytes, cfg)
    assert "F16_DOTS" in ak.decode_constexprs(3, 128, 16, True, torch.bfloat16, ak.DecodeConfig(64, 4, 3), True)
    launched = []
    monkeypatch.setattr(ak, "_DECODE", lambda grid, *a: launched.append(("dots", grid)))
    monkeypatch.setattr(ak, "_FMA_DECODE", lambda grid, *a: launched.append(("fma", grid)))
    case, _, ks, vs = _case(stable_seed("fma-pick"), Hq=4, Hkv=2)
    for cfg in (FMA, ak.DecodeConfig(16, 4, 2)):
        ak.decode(*case.args(), torch.empty_like(case.q), max_seq_len=case.max_seq_len, scale=case.scale, window=0,
                  num_splits=1, cfg=cfg, k_scale=ks, v_scale=vs)
    S = len(DECODE)
    assert launched == [("fma", (S, 4, 1)), ("dots", (S, 2, 1))]
    with pytest.raises(ValueError, match="block_n: 24 keys"):   # a step that would leave keys out of its streams
        ak.decode_constexprs(1, 128, 16, False, torch.bfloat16, ak.DecodeConfig(24, 1, 1, fma=True), True)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq, Hkv", [(32, 32), (32, 8)], ids=["llama2", "llama3"])
@pytest.mark.parametrize("block_n, warps", [(8, 1), (16, 1), (16, 2), (32, 4)])
def test_gpu_bf16_queries_over_an_e4m3_cache_match_the_reference(Hq, Hkv, block_n, warps):
    """Llama heads (head_dim 128), bf16 queries over e4m3 caches, split and not: within bf16's output rounding of
    the reference (fp32 on the same cache)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seqs = [(0, 1), (900, 1), (2500, 1), (63, 1), (511, 1)]
    case, _, ks, vs = _case(stable_seed("fma-gpu", Hq, block_n), Hq=Hq, Hkv=Hkv, D=128, bs=16, seqs=seqs,
                            dtype=torch.bfloat16, device="cuda")
    reference = ops.paged_attention(case.q.float(), *case.args()[1:], **case.kwargs(), k_scale=ks, v_scale=vs,
                                    backend="reference")
    cfg = ak.DecodeConfig(block_n=block_n, num_warps=warps, num_stages=1, fma=True)
    for splits in (1, 4):
        out = _decode(case, cfg, splits, ks, vs)
        assert max_err(out, reference.double(), case.owned_rows()) <= 2.5e-2, splits
