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
        tl.store(part_ptr + kvh * stride_p_split + row * stride_pm + offs_r, acc, mask=r_mask)
