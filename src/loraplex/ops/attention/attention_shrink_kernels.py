"""Triton epilogue of the decode attention kernel (`attention_kernels._decode_kernel` with LORA_SHRINK): the
o projection's LoRA shrink over the columns of the heads the program computed (ops/attention_shrink.py).

Program (sequence row m, kv head h; the G query heads h·G … h·G + G - 1, columns (h·G + g)·D + d):

    s = row_slot[m]; if s ≥ 0, for r < min(ranks[s], R):
        part[h, 0, m, r] = Σ_{g < G, d < D} out[m, h·G + g, d] · A[s, r, (h·G + g)·D + d]

(fp32 products of out's rounded values, as the o GEMM and a shrink kernel read them; summed in fp32.)
The kv heads are the shrink's K splits: the expand sums the Hkv partials.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def o_shrink_epilogue(o, offs_m, offs_d, row, kvh, a_ptr, rank_ptr, slot_ptr, part_ptr, R, stride_a_slot, stride_a_r,
                      stride_p_split, stride_pm, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """`o` [M, HEAD_DIM] fp32: the rounded output of the program's heads (rows ≥ G are padding)."""
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        rank = tl.minimum(tl.load(rank_ptr + slot), R)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        a_head = a_ptr + slot.to(tl.int64) * stride_a_slot + kvh * (G * HEAD_DIM)
        acc = tl.zeros([BLOCK_R], tl.float32)
        for g in tl.static_range(G):
            o_g = tl.sum(tl.where(offs_m[:, None] == g, o, 0.0), axis=0)   # head g's row of the tile
            a = tl.load(a_head + offs_r[:, None] * stride_a_r + g * HEAD_DIM + offs_d[None, :], mask=r_mask[:, None],
                        other=0.0)
            acc += tl.sum(a.to(tl.float32) * o_g[None, :], axis=1)
        tl.store(part_ptr + kvh.to(tl.int64) * stride_p_split + row * stride_pm + offs_r, acc, mask=r_mask)


@triton.jit
def o_shrink_prefetch(offs_d, row, kvh, a_ptr, rank_ptr, slot_ptr, R, stride_a_slot, stride_a_r,
                      HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """One head per program (G = 1): its A tile [BLOCK_R, HEAD_DIM], loaded before the attention so that the
    load's latency hides behind the key walk (zeros past the rank and for rows without an adapter)."""
    slot = tl.load(slot_ptr + row)
    safe = tl.maximum(slot, 0)
    rank = tl.minimum(tl.load(rank_ptr + safe, mask=slot >= 0, other=0), R)   # 0 for rows without an adapter
    offs_r = tl.arange(0, BLOCK_R)
    return tl.load(a_ptr + safe.to(tl.int64) * stride_a_slot + kvh * HEAD_DIM + offs_r[:, None] * stride_a_r
                   + offs_d[None, :], mask=(offs_r < rank)[:, None], other=0.0)


@triton.jit
def o_shrink_finish(o, a, offs_m, row, kvh, rank_ptr, slot_ptr, part_ptr, R, stride_p_split, stride_pm,
                    BLOCK_R: tl.constexpr):
    """`o_shrink_epilogue` for G = 1 with the A tile `o_shrink_prefetch` loaded."""
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        rank = tl.minimum(tl.load(rank_ptr + slot), R)
        offs_r = tl.arange(0, BLOCK_R)
        o_0 = tl.sum(tl.where(offs_m[:, None] == 0, o, 0.0), axis=0)
        acc = tl.sum(a.to(tl.float32) * o_0[None, :], axis=1)
        tl.store(part_ptr + kvh.to(tl.int64) * stride_p_split + row * stride_pm + offs_r, acc, mask=offs_r < rank)
