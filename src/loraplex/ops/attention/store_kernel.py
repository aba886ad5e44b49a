"""The Triton kernel that writes a step's keys and values into the paged cache, and its launcher
(semantics: `store_kv` in paged.py).

One program per new token (and group of kv heads) copies its k and v rows into their cache slot; slot < 0
(a padding row) is skipped. One launch for both tensors. Into an e4m3 cache each value is divided by its
scale in fp32 (IEEE-rounded, as torch divides), clamped to ±448 and rounded to the nearest e4m3 value,
ties to even: the reference's `(k.float() / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)`, bit for bit.
The caches are addressed through their strides (block, token, head; D innermost), so KVCache's head-major
layout works too. Offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..e4m3 import to_e4m3
from ..launch import Launcher, cdiv, num_sms, pow2
from ..pdl import pdl_start
from .checks import KV_FP8

STORE_WARPS = 4
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, num_kv_heads, page,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    """k_cache[slot] = k[t], v_cache[slot] = v[t] for heads of this program's group, unless slot < 0; with FP8,
    the e4m3 of k[t] / k_scale and v[t] / v_scale."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        if FP8:
            k = to_e4m3(tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)))
            v = to_e4m3(tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)))
        # Slot s is token s % page of block s // page; the caches' strides say where that is.
        dst = (slot // page) * stride_cb + (slot % page) * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


_STORE = Launcher(_store_kv_kernel)
WIDE = 4096   # elements of k (and of v) a program
# Into an e4m3 cache each value is divided in IEEE: where wide programs of NARROW_FROM elements or more would leave
# SMs idle (a decode step's 32 tokens of Llama-2-7B: 32 programs, 64 divisions a thread), programs of NARROW elements
# make several times as many. Steps of more tokens keep the wide ones, whose grid already fills the GPU (narrow ones
# there only multiply the programs), and so do tokens of fewer elements (benchmarks/results/fp8_h100/swap_ab.md).
NARROW = 512
NARROW_FROM = 2048


def store_kv_constexprs(Hkv: int, D: int, fp8: bool = False, narrow: bool = False) -> dict:
    """The store kernel's compile-time parameters: whole heads, up to WIDE (`narrow`: NARROW) elements of k (and of v)
    a program."""
    return dict(HEAD_DIM=D, BLOCK_H=_heads_a_program(Hkv, D, NARROW if narrow else WIDE), BLOCK_D=pow2(D), FP8=fp8)


def _heads_a_program(Hkv: int, D: int, elements: int) -> int:
    return min(pow2(Hkv), max(1, elements // pow2(D)))


def narrow_programs(T: int, Hkv: int, D: int, fp8: bool, sms: int) -> bool:
    """Does a store of T tokens into an e4m3 (`fp8`) cache take NARROW programs: would the WIDE ones hold
    NARROW_FROM elements or more and be fewer than the GPU's `sms`?"""
    wide_heads = _heads_a_program(Hkv, D, WIDE)
    if not fp8 or min(Hkv, wide_heads) * D < NARROW_FROM:
        return False
    return T * cdiv(Hkv, wide_heads) < sms


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """One launch, grid (T, head groups). `k_scale`, `v_scale`: fp32 tensors of one element, for an e4m3 cache."""
    T, Hkv, D = k.shape
    fp8 = k_cache.dtype == KV_FP8
    consts = store_kv_constexprs(Hkv, D, fp8, narrow_programs(T, Hkv, D, fp8, num_sms(k.device)))
    grid = (T, cdiv(Hkv, consts["BLOCK_H"]))
    # without FP8 the scale pointers are never read: any tensor will do
    args = (k, v, k_cache, v_cache, slot_mapping, k_scale if fp8 else k, v_scale if fp8 else k, Hkv,
            k_cache.shape[1], k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2))
    _STORE(grid, args, consts, STORE_WARPS, 1)
