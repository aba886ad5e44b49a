"""Readers of a LoRA B stack (`[slots, N, R]`, each slot's block `[N, R]` row-major) for the products summed on the CUDA
cores: the row-wise expand (expand_kernels.py) and the consumers of ops/fused. One adapter's block, or two members
of a composed row side by side.

A composed row's members (ops/lora/batch.py: member 0 is the row's slot, member l ≥ 1 `extra_slot[(l-1)·T + row]`,
its partials at entry l·T + row) are read two at a time: members 2p and 2p + 1 in one [columns, 2, MEMBER_R] block,
MEMBER_R rank columns a step. For columns n and members l of a row, in fp32:

    delta[n] = Σ_l scale[slot_l] · Σ_{r < rank_l} (Σ_split part[split, l·T + row, r]) · B[slot_l, n, r]

Two members of rank ≤ MEMBER_R cost what one adapter of twice the rank costs: its registers, its loads and one
round trip, which a consumer's early reads (ops/pdl.py) start before its PDL wait. (The consumers used to read one
member at a time: each further member's loads waited for the one before's, and at a rank-32 pool their sm_90 code
spilled up to 30.9 KB a thread.)
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..launch import pow2
from .batch_plan import MAX_MEMBERS

if MAX_MEMBERS > 4:   # `_pairs_after_first` reads two pairs of members
    raise RuntimeError(f"b_blocks.py reads at most 4 members a row, MAX_MEMBERS is {MAX_MEMBERS}")


def member_r(R: int) -> int:
    """MEMBER_R for stacks R wide: a member's rank columns a step, two members side by side (16: two rank-16 members
    take a rank-32 adapter's registers)."""
    return min(pow2(R), 16)


# The CUDA-core readers of B (the row-wise expand and the consumers of ops/fused/lora_kernels.py) load it through
# `_load_rank_block`; the tile expand keeps `_load_b`, whose loads feed the tensor cores through shared memory
# (16-byte loads there took twice the shared memory a program).
@triton.jit
def _load_rank_block(ptrs, col_mask, offs_r, r_mask, rank, R):
    """A block of B (columns × rank, `offs_r`/`r_mask` broadcast along the last axis), zero past the rank. It
    reads the rank rounded up to 16 (and below R): a mask constant over 16 columns lets Triton load 16 bytes at
    a time where R is a multiple of 16 (it specializes such ints), where a mask at the rank itself compiled
    to 2-byte loads (sm_90 PTX: tests/test_fused_compile.py counts them). The columns past the rank are zeroed
    in registers: what the pool holds there is not this adapter's. 16 columns of a 16-bit B row are one
    32-byte sector, so no more bytes move."""
    b = tl.load(ptrs, mask=col_mask & (offs_r < tl.minimum((rank + 15) // 16 * 16, R)), other=0.0)
    return tl.where(r_mask, b, tl.zeros_like(b))


@triton.jit
def _load_rank_block_exact(ptrs, col_mask, offs_r, r_mask, rank, R):
    """The same block read at the rank itself (2-byte loads), for RoPE's [heads, half head, rank] tiles: with
    16-byte loads there RoPE's kernels took 289 µs of a batch-32 Llama-2-7B decode forward against 274-276 (H200)."""
    return tl.load(ptrs, mask=col_mask & r_mask, other=0.0)


@triton.jit
def _pair_slots(first, extra_ptr, row, T, extra_lanes, pair):
    """int32 [2]: the slots of the row's members 2·pair and 2·pair + 1 (-1 past its members); `first`: member 0's."""
    lane = 2 * pair + tl.arange(0, 2)
    extra = tl.load(extra_ptr + tl.maximum(lane - 1, 0).to(tl.int64) * T + row,
                    mask=(lane >= 1) & (lane <= extra_lanes), other=-1)
    return tl.where(lane == 0, first, extra)


@triton.jit
def _pair_scalars(slots, rank_ptr, scale_ptr, R):
    """(rank, scaling) [2] of the members' slots: rank 0 where there is no member (nothing of it is read)."""
    has = slots >= 0
    safe = tl.maximum(slots, 0)
    return tl.minimum(tl.load(rank_ptr + safe, mask=has, other=0), R), tl.load(scale_ptr + safe, mask=has, other=0.0)


@triton.jit
def _pair_b(b_ptr, slot_elems, slots, ranks, cols, col_mask, r0, R, MEMBER_R: tl.constexpr, EXACT: tl.constexpr):
    """B of the two members over columns `cols` (any shape C, `col_mask` alike) and rank columns r0..r0+MEMBER_R:
    [*C, 2, MEMBER_R], zero past each member's rank. EXACT: read at the rank itself (RoPE's, see
    `_load_rank_block_exact`)."""
    offs_r = r0 + tl.arange(0, MEMBER_R)[None, :]                                        # [1, MEMBER_R]
    rank = ranks[:, None]                                                                # [2, 1]
    ptrs = b_ptr + tl.maximum(slots, 0).to(tl.int64)[:, None] * slot_elems + offs_r \
        + tl.expand_dims(cols * R, (-2, -1))
    col_mask = tl.expand_dims(col_mask, (-2, -1))
    if EXACT:
        return _load_rank_block_exact(ptrs, col_mask, offs_r, offs_r < rank, rank, R)
    return _load_rank_block(ptrs, col_mask, offs_r, offs_r < rank, rank, R)


@triton.jit
def _pair_v(part_row, pair, T, stride_pm, r0, ranks, stride_p_split, SPLIT_K: tl.constexpr,
            MEMBER_R: tl.constexpr):
    """fp32 [2, MEMBER_R]: Σ over the K splits of members 2·pair and 2·pair + 1's partials (entries lane·T + row:
    `part_row` is the row's first, this slice), rank columns r0..r0+MEMBER_R, zero past each member's rank."""
    lane = 2 * pair + tl.arange(0, 2)
    offs_r = r0 + tl.arange(0, MEMBER_R)
    mask = offs_r[None, :] < ranks[:, None]
    ptrs = part_row + (lane.to(tl.int64) * T * stride_pm)[:, None] + offs_r[None, :]
    v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT_K):
        v += tl.load(ptrs + tl.full((), s, tl.int64) * stride_p_split, mask=mask, other=0.0)
    return v


@triton.jit
def _pair_sum(b, v, scales):
    """fp32 [*C]: Σ_lane scales[lane] · Σ_r b[..., lane, r] · v[lane, r] (the members' products over `_pair_b`'s
    columns)."""
    return tl.sum(tl.sum(b.to(tl.float32) * v, axis=-1) * scales, axis=-1)


@triton.jit
def _pair_step(part_row, pair, T, stride_pm, b_ptr, slot_elems, slots, ranks, scales, cols, col_mask, r0, R,
               stride_p_split, SPLIT_K: tl.constexpr, MEMBER_R: tl.constexpr, EXACT: tl.constexpr):
    """The products of members 2·pair and 2·pair + 1 over rank columns r0..r0+MEMBER_R (`_pair_sum`)."""
    v = _pair_v(part_row, pair, T, stride_pm, r0, ranks, stride_p_split, SPLIT_K, MEMBER_R)
    b = _pair_b(b_ptr, slot_elems, slots, ranks, cols, col_mask, r0, R, MEMBER_R, EXACT)
    return _pair_sum(b, v, scales)


@triton.jit
def _pairs_after_first(acc, part_row, first, extra_ptr, row, T, extra_lanes, stride_pm, b_ptr, slot_elems,
                       rank_ptr, scale_ptr, slots, ranks, scales, cols, col_mask, R, stride_p_split,
                       SPLIT_K: tl.constexpr, MEMBER_R: tl.constexpr, EXACT: tl.constexpr):
    """acc (members 0 and 1 over rank columns 0..MEMBER_R: `slots`, `ranks`, `scales`) plus the rest of a composed
    row's products: members 0 and 1's further rank columns, then members 2 and 3 (MAX_MEMBERS is 4: two pairs)."""
    for r0 in range(MEMBER_R, tl.max(ranks, axis=0), MEMBER_R):
        acc += _pair_step(part_row, 0, T, stride_pm, b_ptr, slot_elems, slots, ranks, scales, cols, col_mask, r0, R,
                          stride_p_split, SPLIT_K, MEMBER_R, EXACT)
    if extra_lanes > 1:
        slots1 = _pair_slots(first, extra_ptr, row, T, extra_lanes, 1)
        ranks1, scales1 = _pair_scalars(slots1, rank_ptr, scale_ptr, R)
        for r0 in range(0, tl.max(ranks1, axis=0), MEMBER_R):
            acc += _pair_step(part_row, 1, T, stride_pm, b_ptr, slot_elems, slots1, ranks1, scales1, cols, col_mask,
                              r0, R, stride_p_split, SPLIT_K, MEMBER_R, EXACT)
    return acc
