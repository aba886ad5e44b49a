"""Triton kernel of `silu_shrink.silu_and_mul_shrink`: SiLU-and-mul that also computes the down projection's
LoRA shrink of the row block it writes (split-K partials for the SGMV expand).

Program (row m, column block j of BLOCK columns):

    out[m, j·BLOCK:(j+1)·BLOCK] = fused_kernels' SiLU-and-mul of the block (gate and up plus their delta)
    part[j, 0, m, r] = Σ_{c in block j} out[m, c] · A[s, r, c]   for r < rank = min(ranks[s], R), s = row_slot[m] ≥ 0

(fp32 products of the rounded output and A, summed in fp32; nothing written for rows with s = -1 or r ≥ rank).
The block's A columns (BLOCK × rank values) are the shrink's own bytes spread over SiLU's grid, so the
shrink's launch, which ran alone before the down GEMM could start (it took every SM), goes away.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernels import COMPILED, _add_delta, _pow2, _silu_mul, _takes_delta
from ..launch import Launcher
from ..pdl import pdl_start

BLOCK = 512     # columns per program: the shrink's K split is I / BLOCK (22 at Llama-2-7B's 11,008)
BLOCK_R = 16    # rank columns per step
WARPS = 4


@triton.jit
def _silu_and_mul_shrink_kernel(gu_ptr, d_ptr, rows_ptr, out_ptr, slot_ptr, a_ptr, rank_ptr, part_ptr, I, R,
                                stride_gu, stride_d, stride_out, stride_a_slot, stride_a_r, stride_p_split, stride_pm,
                                HAS_DELTA: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr,
                                BLOCK_R: tl.constexpr, COMPILED: tl.constexpr):
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    DT = out_ptr.dtype.element_ty
    # The first rank tile of A is loaded before SiLU's own loads, so that both are in flight together (a
    # branch on the slot would serialise them); rows without an adapter load nothing (all masked).
    slot = tl.load(slot_ptr + row)
    safe = tl.maximum(slot, 0)
    rank = tl.where(slot >= 0, tl.minimum(tl.load(rank_ptr + safe), R), 0)
    a_rows = a_ptr + safe.to(tl.int64) * stride_a_slot
    offs_r = tl.arange(0, BLOCK_R)
    a = tl.load(a_rows + offs_r[:, None] * stride_a_r + offs[None, :],
                mask=(offs_r < rank)[:, None] & mask[None, :], other=0.0)
    gu_row = gu_ptr + row * stride_gu
    d_row = d_ptr + row * stride_d
    take = _takes_delta(rows_ptr, row, HAS_ROWS)
    g = _add_delta(tl.load(gu_row + offs, mask=mask, other=0.0).to(tl.float32), d_row, offs, mask, take, DT,
                   HAS_DELTA, COMPILED)
    u = _add_delta(tl.load(gu_row + I + offs, mask=mask, other=0.0).to(tl.float32), d_row + I, offs, mask, take,
                   DT, HAS_DELTA, COMPILED)
    o = _silu_mul(g, u, DT, COMPILED).to(DT)
    tl.store(out_ptr + row * stride_out + offs, o, mask=mask)
    of = tl.where(mask, o.to(tl.float32), 0.0)
    p_row = part_ptr + block.to(tl.int64) * stride_p_split + row * stride_pm
    tl.store(p_row + offs_r, tl.sum(a.to(tl.float32) * of[None, :], axis=1), mask=offs_r < rank)
    for r0 in range(BLOCK_R, rank, BLOCK_R):   # ranks past the first tile
        offs_rr = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_rr < rank
        a = tl.load(a_rows + offs_rr[:, None] * stride_a_r + offs[None, :], mask=r_mask[:, None] & mask[None, :],
                    other=0.0)
        tl.store(p_row + offs_rr, tl.sum(a.to(tl.float32) * of[None, :], axis=1), mask=r_mask)


_LAUNCH = Launcher(_silu_and_mul_shrink_kernel)


def num_splits(I: int) -> int:
    """The K splits of the partials: one per column block."""
    return -(-I // min(BLOCK, _pow2(I)))


def silu_and_mul_shrink(gate_up: torch.Tensor, out: torch.Tensor, row_slot: torch.Tensor, lora_a: torch.Tensor,
                        ranks: torch.Tensor, part: torch.Tensor, delta: torch.Tensor | None = None,
                        delta_rows: torch.Tensor | None = None) -> None:
    """Launch it (arguments checked by silu_shrink.py); `part` is `[num_splits(I), 1, T, R]` fp32."""
    T, I = out.shape
    if T == 0:
        return
    block = min(BLOCK, _pow2(I))
    d = delta if delta is not None else gate_up
    rows = delta_rows if delta_rows is not None else row_slot
    args = (gate_up, d, rows, out, row_slot, lora_a, ranks, part, I, lora_a.shape[1], gate_up.stride(0), d.stride(0),
            out.stride(0), lora_a.stride(0), lora_a.stride(1), part.stride(0), part.stride(2))
    _LAUNCH((T, -(-I // block)), args, dict(HAS_DELTA=delta is not None, HAS_ROWS=delta_rows is not None,
                                            BLOCK=block, BLOCK_R=BLOCK_R, COMPILED=COMPILED), WARPS, 1)
