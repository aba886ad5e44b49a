"""Argument checks of the paged-attention ops (paged.py): each raises ValueError naming the argument.

Shapes, dtypes and devices are read from metadata, for both backends. Values that live on the device
(lengths, block ids, scales held in tensors) are checked by the reference path only: the Triton path
cannot read them without a host sync.
"""
from __future__ import annotations

import math

import torch

from ..gemm.fp8 import E4M3_MAX, FP8 as KV_FP8   # (one definition of the format, beside its GEMMs)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# An FP8 cache stores e4m3 (float8_e4m3fn: no infinities, largest finite value 448) beside activations of
# any float dtype; each layer's keys and values then carry a dequantization scale (paged.py's semantics).
CACHE_DTYPES = FLOAT_DTYPES + (KV_FP8,)
# Head sizes the Triton kernels are built for (tl.arange needs a power of two; tl.dot at least 16).
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)


def desc(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)}, {str(t.dtype).replace('torch.', '')} on {t.device}"


def check_tensor(t, name: str, ndim: int, device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got {desc(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def check_rows(t: torch.Tensor, name: str) -> None:
    """Float rows with a unit stride along the last dimension (other strides may be anything)."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {desc(t)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}'s last dimension must have stride 1, got {desc(t)} with strides {t.stride()}")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but the attention ops are not differentiable: call them under "
                         f"torch.no_grad() or torch.inference_mode()")


def check_caches(k_cache, v_cache, device: torch.device | None) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(c, name, 4, device)
        if c.dtype not in CACHE_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float8_e4m3fn, got {desc(c)}")
        if (c.shape[3] > 1 and c.stride(3) != 1) or torch._debug_has_internal_overlap(c) == 1:
            raise ValueError(f"{name} [num_blocks, block_size, Hkv, D] must have D innermost (stride 1) and the "
                             f"other dimensions apart (contiguous, or head-major: KVCache's), got {desc(c)} with "
                             f"strides {c.stride()}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must match k_cache: {desc(v_cache)} vs {desc(k_cache)}")
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache's strides {v_cache.stride()} differ from k_cache's {k_cache.stride()}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device} but k_cache is on {k_cache.device}")


def check_cache_dtype(cache_dtype: torch.dtype, dtype: torch.dtype, name: str) -> None:
    """The caches hold `name`'s dtype, or e4m3 beside any float dtype."""
    if cache_dtype not in (dtype, KV_FP8):
        raise ValueError(f"k_cache is {cache_dtype} but {name} is {dtype}: a cache holds its inputs' dtype or "
                         f"float8_e4m3fn")


def check_scales(k_scale, v_scale, cache_dtype: torch.dtype, device: torch.device) -> None:
    """`k_scale`/`v_scale`: None, a positive finite float, or a float32 tensor of one element on the device; only
    an e4m3 cache takes them (a 16- or 32-bit cache holds the values themselves)."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            continue
        if cache_dtype != KV_FP8:
            raise ValueError(f"{name} scales a float8_e4m3fn cache, but the cache is {cache_dtype}: pass None")
        if isinstance(s, torch.Tensor):
            if s.dtype != torch.float32 or s.numel() != 1 or s.device != device:
                raise ValueError(f"{name} must be a float32 tensor of one element on {device}, got {desc(s)}")
        elif isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"{name} must be a positive finite float or a float32 tensor of one element, got {s!r}")


def scale_value(s, name: str) -> float:
    """The reference's host read of a checked scale (None: 1.0), refused unless positive and finite."""
    value = 1.0 if s is None else float(s)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return value


def check_int(value, name: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_head_dim_for_triton(head_dim: int) -> None:
    if head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"the Triton attention kernels need head_dim in {TRITON_HEAD_DIMS}, got {head_dim}; "
                         f"use backend='reference' for other sizes")


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, query_start: torch.Tensor, *, max_query_len: int, max_seq_len: int,
                         scale: float, sliding_window: int, out: torch.Tensor | None, k_scale=None,
                         v_scale=None) -> torch.Tensor:
    """`paged_attention`'s argument checks; returns `out`, allocated if None."""
    check_tensor(q, "q", 3, None)
    check_rows(q, "q")
    device = q.device
    T, Hq, D = q.shape
    check_caches(k_cache, v_cache, device)
    Hkv = k_cache.shape[2]
    check_cache_dtype(k_cache.dtype, q.dtype, "q")
    check_scales(k_scale, v_scale, k_cache.dtype, device)
    if k_cache.shape[3] != D:
        raise ValueError(f"k_cache has head_dim {k_cache.shape[3]} but q has {D} ({desc(k_cache)} vs {desc(q)})")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q's {Hq} heads are not a multiple of the cache's {Hkv} kv heads")
    check_tensor(block_tables, "block_tables", 2, device)
    if block_tables.dtype != torch.int32 or (block_tables.shape[1] > 1 and block_tables.stride(1) != 1):
        raise ValueError(f"block_tables must be int32 [S, max_blocks] with stride 1 along the last dimension, "
                         f"got {desc(block_tables)} with strides {block_tables.stride()}")
    S = block_tables.shape[0]
    for name, t, n in (("seq_lens", seq_lens, S), ("query_start", query_start, S + 1)):
        check_tensor(t, name, 1, device)
        if t.dtype != torch.int32 or t.shape[0] != n or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32 [{n}] (block_tables has S={S} rows), got {desc(t)}")
    check_int(max_query_len, "max_query_len", 0)
    check_int(max_seq_len, "max_seq_len", 0)
    check_int(sliding_window, "sliding_window", 0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=device)
    else:
        check_tensor(out, "out", 3, device)
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be {list(q.shape)} {q.dtype} like q, got {desc(out)}")
        if D > 1 and out.stride(-1) != 1:
            raise ValueError(f"out's last dimension must have stride 1, got strides {out.stride()}")
        if torch._debug_has_internal_overlap(out) == 1:
            raise ValueError(f"out has elements that share memory ({desc(out)}, strides {out.stride()})")
    return out


def check_query_start(starts: list[int], T: int) -> None:
    for s in range(len(starts) - 1):
        begin, end = starts[s], starts[s + 1]
        if begin < 0 or end < begin or end > T:
            raise ValueError(f"query_start[{s}:{s + 2}] = [{begin}, {end}] must be non-decreasing within q's {T} rows")


def check_lengths(s: int, q_len: int, seq_len: int, max_query_len: int, max_seq_len: int) -> None:
    if q_len > max_query_len:
        raise ValueError(f"sequence {s} has {q_len} query rows but max_query_len={max_query_len}")
    if seq_len < q_len:
        raise ValueError(f"seq_lens[{s}]={seq_len} is below the sequence's {q_len} query rows: seq_lens counts "
                         f"this step's tokens too")
    if seq_len > max_seq_len:
        raise ValueError(f"seq_lens[{s}]={seq_len} exceeds max_seq_len={max_seq_len}")
