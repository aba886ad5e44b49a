"""Launchers of the paged-attention kernels (kernels.py, which describes them): tile tables per head size, the
split of a decode launch, and the launches. Arguments arrive validated (paged.py); these only pick tiles and
launch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..launch import Launcher, cdiv, num_sms, pow2
from .checks import KV_FP8
from .kernels import _decode_kernel, _decode_reduce_kernel, _prefill_kernel

LOG2E = 1.4426950408889634   # the kernels' softmax runs in exp2: the scale carries log2(e)
UNSPLIT_CHUNK = 1 << 30  # "tokens per split" with one split: the whole context, whatever max_seq_len says
SCAN = 128  # sequences per vector load when a prefill program looks for its sequence


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int     # tile rows: query rows × padded query heads of one kv head (raised to G_PAD if smaller)
    block_n: int     # keys per step
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int     # keys per step
    num_warps: int
    num_stages: int
    programs_per_sm: float = 2.0  # split the context until S × Hkv × splits reaches this many programs per SM
    # (two resident programs per SM, 2 × 2 tiles in flight, already cover HBM latency: ~64 KB per SM)
    min_split_tokens: int = 256   # ...but give each split at least this many tokens (more splits cost a reduce)
    max_splits: int = 64
    # 0: a split covers a share of the longest context the launch may see (max_seq_len: under CUDA graphs the
    # model's length, so shorter contexts fill the first splits only); else each sequence's own context is shared
    # evenly (kernels.py's split_span), in splits of at least this many tokens (at most that share of the longest)
    even_split_tokens: int = 0

    def __post_init__(self) -> None:
        if self.even_split_tokens < 0:
            raise ValueError(f"even_split_tokens must be at least 0, got {self.even_split_tokens}")


# Fixed tables keyed on head_dim, for sm_90 (no autotuning here; revisit with a sweep on the GPU).
# Prefill is compute bound: 128-row tiles (two warpgroups of wgmma for D=128, one for D ≤ 64) and
# 64-key steps. Decode is memory bound: 16 KB K and V tiles (BLOCK_N · D = 8192 elements; 256 keys
# for D < 64), 4 warps.
# num_stages 3 keeps two K/V tiles in flight per program. Compiled for sm_90 (bf16, ptxas -v),
# no spills: prefill D=128 190 registers × 8 warps, 128 KB shared (one program per SM); D=64 241 ×
# 4 warps, 64 KB; D=256 (64 × 32 tiles, 2 stages) 255 × 4 warps, 96 KB. Decode D=128 96 registers,
# 70 KB (three programs per SM); D=64 126, 70 KB.
PREFILL_CONFIGS = {16: PrefillConfig(128, 64, 4, 3), 32: PrefillConfig(128, 64, 4, 3),
                   64: PrefillConfig(128, 64, 4, 3), 128: PrefillConfig(128, 64, 8, 3),
                   256: PrefillConfig(64, 32, 4, 2)}
DECODE_CONFIGS = {16: DecodeConfig(256, 4, 3), 32: DecodeConfig(256, 4, 3), 64: DecodeConfig(128, 4, 3),
                  128: DecodeConfig(64, 4, 3), 256: DecodeConfig(32, 4, 3)}
# e4m3 caches: the 16-bit tiles' keys at 2 warps, and splits of at least 512 tokens. Against the former tiles (twice
# the keys at 4 warps, V converted in the dot's layout): 0.3-7% less time at Llama-2-7B's and Llama-3-8B's heads,
# batch 32-128, contexts 512-4096 (bench_fp8_attention.py), and a batch-32 decode step of 5.03 against 5.24 ms
# (bench_engine.py, Llama-2-7B; H100, results/fp8_h100/v_in_place.md). Each sequence's context shared evenly in
# splits of 256+ tokens: Llama-3-8B's batch 32 over 512-token contexts, splits planned for 1,024 or 4,096 (as CUDA
# graphs plan them), 24.3-24.7 against 27.4-27.6 µs a launch; the other cases within 0.2% (results/fp8_h100/
# even_splits.md). Measured at head size 128; the other sizes follow the same rule.
FP8_DECODE_CONFIGS = {d: replace(c, num_warps=2, min_split_tokens=512, even_split_tokens=256)
                      for d, c in DECODE_CONFIGS.items()}
# fp32 caches (tests, CPU-sized models) take twice the bytes per tile: the 16-bit tiles would need up
# to 320 KB of shared memory, these small ones ≤ 136 KB (prefill) and ≤ 100 KB (decode) at D=256.
FP32_PREFILL_CONFIG = PrefillConfig(32, 32, 4, 2)
FP32_DECODE_CONFIG = DecodeConfig(32, 4, 2)


def prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    return FP32_PREFILL_CONFIG if dtype == torch.float32 else PREFILL_CONFIGS[head_dim]


def decode_config(head_dim: int, dtype: torch.dtype, fp8_kv: bool = False) -> DecodeConfig:
    """The decode tiles for queries of `dtype` over a cache of that dtype or, `fp8_kv`, of e4m3."""
    if dtype == torch.float32:
        return FP32_DECODE_CONFIG
    return (FP8_DECODE_CONFIGS if fp8_kv else DECODE_CONFIGS)[head_dim]

REDUCE_WARPS = 4
_PREFILL = Launcher(_prefill_kernel)
_DECODE = Launcher(_decode_kernel)
_REDUCE = Launcher(_decode_reduce_kernel)


def _scales(fp8: bool, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
            q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale pointers a launch passes: unread without FP8_KV, so any tensor stands in."""
    return (k_scale, v_scale) if fp8 else (q, q)


def _e4m3_ptx(fp8_kv: bool, dtype: torch.dtype) -> bool:
    """E4M3_PTX: an e4m3 cache's tiles converted to bf16 by ops/e4m3.py (compiled kernels only, not the interpreter)."""
    return fp8_kv and dtype == torch.bfloat16 and _PREFILL.compiles


def _precision(dtype: torch.dtype) -> str:
    # fp32 caches (tests, CPU models) get ~fp32 products; the setting is ignored for 16-bit inputs.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def prefill_constexprs(G: int, D: int, page: int, window: int, dtype: torch.dtype, cfg: PrefillConfig,
                       fp8_kv: bool = False) -> dict:
    """The prefill kernel's compile-time parameters (also used by the ahead-of-time compile test)."""
    g_pad = pow2(G)
    return dict(G=G, G_PAD=g_pad, BLOCK_Q=max(cfg.block_m, g_pad) // g_pad, BLOCK_N=cfg.block_n, HEAD_DIM=D,
                PAGE=page, SCAN_SEQS=SCAN, WINDOW=window > 0, PRECISION=_precision(dtype), FP8_KV=fp8_kv,
                E4M3_PTX=_e4m3_ptx(fp8_kv, dtype))


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, query_start: torch.Tensor, out: torch.Tensor, *, scale: float, window: int,
            cfg: PrefillConfig | None = None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> None:
    """Attention rows of every sequence with ≥ 2 query rows (one-row sequences are `decode`'s). `k_scale`,
    `v_scale`: fp32 tensors of one element, for an e4m3 cache."""
    T, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    S = block_tables.shape[0]
    cfg = cfg or prefill_config(D, q.dtype)
    fp8 = k_cache.dtype == KV_FP8
    consts = prefill_constexprs(Hq // Hkv, D, page, window, q.dtype, cfg, fp8)
    grid = (T // consts["BLOCK_Q"] + S, Hkv)
    args = (q, k_cache, v_cache, out, block_tables, seq_lens, query_start, *_scales(fp8, k_scale, v_scale, q), S,
            scale * LOG2E, window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), block_tables.stride(0))
    _PREFILL(grid, args, consts, cfg.num_warps, cfg.num_stages)


def plan_decode(num_seqs: int, num_kv_heads: int, max_seq_len: int, window: int, device: torch.device,
                cfg: DecodeConfig, num_splits: int | None = None) -> tuple[int, int]:
    """(splits, tokens per split) for a decode launch, from host ints only.

    Without splits the grid is S × Hkv programs; when that is under `programs_per_sm` per SM (a
    small batch), the context is cut into up to `max_splits` contiguous ranges of at least
    `min_split_tokens` tokens so long contexts still fill the GPU. Ranges are whole BLOCK_N
    steps. `num_splits` forces the count (tests; it may come out lower after rounding). The chunk is
    the kernel's least split: with `even_split_tokens` that many tokens (whole steps), each sequence's
    context then shared evenly by the kernel.
    """
    longest = max(1, min(max_seq_len, window) if window > 0 else max_seq_len)  # keys one query reads, at most
    if num_splits is None:
        wanted = math.ceil(cfg.programs_per_sm * num_sms(device) / max(1, num_seqs * num_kv_heads))
        num_splits = min(wanted, cfg.max_splits, longest // cfg.min_split_tokens)
    if num_splits <= 1:
        return 1, UNSPLIT_CHUNK
    chunk = cdiv(cdiv(longest, num_splits), cfg.block_n) * cfg.block_n
    splits = cdiv(longest, chunk)
    if splits <= 1:
        return 1, UNSPLIT_CHUNK
    if cfg.even_split_tokens > 0:
        chunk = min(chunk, cdiv(cfg.even_split_tokens, cfg.block_n) * cfg.block_n)
    return splits, chunk


def decode_constexprs(G: int, D: int, page: int, split: bool, dtype: torch.dtype, cfg: DecodeConfig,
                      fp8_kv: bool = False) -> dict:
    """The decode kernel's compile-time parameters (also used by the ahead-of-time compile test). bf16 q over an
    e4m3 cache takes the fp16 dots (kernels.py's F16_DOTS: 6% less kernel time than ops/e4m3.py's bf16 conversion
    in a batch-32 decode step, H100)."""
    return dict(G=G, M=max(16, pow2(G)), BLOCK_N=cfg.block_n, HEAD_DIM=D, PAGE=page, SPLIT=split,
                PRECISION=_precision(dtype), FP8_KV=fp8_kv, F16_DOTS=fp8_kv and dtype == torch.bfloat16)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, query_start: torch.Tensor, out: torch.Tensor, *, max_seq_len: int, scale: float,
           window: int, num_splits: int | None = None, cfg: DecodeConfig | None = None,
           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Attention rows of every one-row sequence (others are `prefill`'s): split as `plan_decode` says. `k_scale`,
    `v_scale`: fp32 tensors of one element, for an e4m3 cache."""
    T, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    S = block_tables.shape[0]
    G = Hq // Hkv
    fp8 = k_cache.dtype == KV_FP8
    cfg = cfg or decode_config(D, q.dtype, fp8)
    splits, chunk = plan_decode(S, Hkv, max_seq_len, window, q.device, cfg, num_splits)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
               k_cache.stride(2), block_tables.stride(0))
    scales = _scales(fp8, k_scale, v_scale, q)
    consts = decode_constexprs(G, D, page, splits > 1, q.dtype, cfg, fp8)
    if splits == 1:  # no partials: the program writes out itself (the partial pointers are unused)
        args = (q, k_cache, v_cache, out, out, out, block_tables, seq_lens, query_start, *scales, scale * LOG2E,
                window, chunk, Hq, 1, 0, *strides)
        _DECODE((S, Hkv, 1), args, consts, cfg.num_warps, cfg.num_stages)
        return
    n_part = S * Hq * splits
    buf = torch.empty(n_part * (D + 2), dtype=torch.float32, device=q.device)  # one allocation: acc, then max, sum
    part_o, part_ml = buf[:n_part * D], buf[n_part * D:]
    args = (q, k_cache, v_cache, out, part_o, part_ml, block_tables, seq_lens, query_start, *scales, scale * LOG2E,
            window, chunk, Hq, splits, n_part, *strides)
    _DECODE((S, Hkv, splits), args, consts, cfg.num_warps, cfg.num_stages)
    args = (part_o, part_ml, out, seq_lens, query_start, window, chunk, Hq, splits, n_part, out.stride(0),
            out.stride(1))
    _REDUCE((S, Hq), args, dict(HEAD_DIM=D, SPLITS_PAD=pow2(splits), BLOCK_N=cfg.block_n), REDUCE_WARPS, 1)
