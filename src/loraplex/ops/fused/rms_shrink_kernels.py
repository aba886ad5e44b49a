"""Triton kernel of `rms_shrink.rms_norm_shrink`'s second launch: the split RMSNorm's scaling step
(fused_lora_rms_split.py, launch 2) that also computes the next projection's LoRA shrink over its chunk.

Program (row m, chunk j of BLOCK columns), after launch 1 wrote s and the chunks' sums of squares:

    out[m, chunk] = weight · normalize(s[m, chunk])            (fused_lora_rms_split's launch 2, same bits)
    part[j, i, m, r] = Σ_{c in chunk j} out[m, c] · A_i[s, r, c]   for each slice i and r < min(ranks_i[s], R),
                                                                  s = row_slot[m] ≥ 0

(fp32 products of out's rounded values, summed in fp32; nothing written for rows with s = -1 or r past a
rank). The shrink's A columns are spread over the norm's grid: the next projection's GEMM starts with no
shrink launch before it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels import COMPILED, _inv, _pow2, _round
from .rms_split import _scale_step
from ..launch import Launcher
from ..pdl import pdl_start

MAX_SLICES = 3   # q/k/v


@triton.jit
def _slice_partial(o, a_rows, rank, offs, mask, p_row, stride_a_r, BLOCK_R: tl.constexpr):
    """part_row[r] = Σ_c o[c] · A[r, c] for r < rank (rank tiles of BLOCK_R)."""
    o2 = o[None, :]   # outside the loop: Triton 3.6's layout pass failed on the broadcast inside it (aligned A)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        a = tl.load(a_rows + offs_r[:, None] * stride_a_r + offs[None, :], mask=r_mask[:, None] & mask[None, :],
                    other=0.0)
        tl.store(p_row + offs_r, tl.sum(a.to(tl.float32) * o2, axis=1), mask=r_mask)


@triton.jit
def _rms_scale_shrink_kernel(s_ptr, w_ptr, out_ptr, sumsq_ptr, slot_ptr, a0, a1, a2, rk0, rk1, rk2, part_ptr,
                             H, inv_h, eps, stride_s, stride_out, CHUNKS, R, stride_a_slot, stride_a_r,
                             stride_p_split, stride_p_slice, stride_pm, NUM_SLICES: tl.constexpr,
                             BLOCK_C: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                             COMPILED: tl.constexpr):
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    row, rstd, v, offs, mask = _scale_step(s_ptr, sumsq_ptr, H, inv_h, eps, stride_s, CHUNKS, BLOCK_C, BLOCK,
                                           COMPILED)
    chunk = tl.program_id(1)
    DT = out_ptr.dtype.element_ty
    n = _round(v * rstd, DT, COMPILED)                 # fused_kernels._norm_output's roundings, kept in registers
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    o = _round(w * n, DT, COMPILED)
    tl.store(out_ptr + row * stride_out + offs, o.to(DT), mask=mask)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        of = tl.where(mask, o.to(DT).to(tl.float32), 0.0)
        base = slot.to(tl.int64) * stride_a_slot
        p_row = part_ptr + chunk.to(tl.int64) * stride_p_split + row * stride_pm
        _slice_partial(of, a0 + base, tl.minimum(tl.load(rk0 + slot), R), offs, mask, p_row, stride_a_r, BLOCK_R)
        if NUM_SLICES > 1:
            _slice_partial(of, a1 + base, tl.minimum(tl.load(rk1 + slot), R), offs, mask, p_row + stride_p_slice,
                           stride_a_r, BLOCK_R)
        if NUM_SLICES > 2:
            _slice_partial(of, a2 + base, tl.minimum(tl.load(rk2 + slot), R), offs, mask,
                           p_row + 2 * stride_p_slice, stride_a_r, BLOCK_R)


_LAUNCH = Launcher(_rms_scale_shrink_kernel)
BLOCK_R = 16


def scale_shrink(s, weight, out, sumsq, eps: float, block: int, row_slot, lora_a: list, ranks: list, part) -> None:
    """Launch it: `block` the columns per program launch 1 used (`fused_lora_rms_split.chunking`), `part`
    fp32 `[chunks, slices, T, R]`."""
    T, H = s.shape
    chunks = sumsq.shape[1]
    pad = MAX_SLICES - len(lora_a)
    a = list(lora_a) + [lora_a[0]] * pad
    rk = list(ranks) + [ranks[0]] * pad
    args = (s, weight, out, sumsq, row_slot, *a, *rk, part, H, _inv(H), float(eps), s.stride(0), out.stride(0), chunks,
            lora_a[0].shape[1], lora_a[0].stride(0), lora_a[0].stride(1), part.stride(0), part.stride(1),
            part.stride(2))
    # more warps than the plain scaling step: each program also holds a BLOCK_R × BLOCK tile of A (≤ 64 values a
    # thread; at 4 warps a 2,048-column chunk would spill). The norm's bits do not depend on the warp count.
    _LAUNCH((T, chunks), args, dict(NUM_SLICES=len(lora_a), BLOCK_C=_pow2(chunks), BLOCK=block, BLOCK_R=BLOCK_R,
                                    COMPILED=COMPILED), warps(block), 1)


def warps(block: int) -> int:
    return min(16, max(4, block // 64))
