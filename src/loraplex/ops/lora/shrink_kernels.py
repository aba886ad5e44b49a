"""The SGMV shrink as a Triton kernel (`_sgmv_shrink_kernel`) and the per-tile functions it branches to; ops/lora/sgmv.py
picks its settings and launches it (the semantics are in its docstring). The expand is in expand_kernels.py.

Triton's interpreter runs a kernel as Python and looks its callees up in the module that defines them, so tests
that count which per-tile path ran patch them here (and in expand_kernels.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import pdl_release, pdl_start, pdl_wait_last

# The row-wise kernels (`_shrink_tile_rows`, `_expand_tile_rows`) take tiles of at most this many rows; larger
# ones keep the tile product, where the rows run side by side rather than one after another.
ROWWISE_MAX_ROWS = tl.constexpr(4)


@triton.jit
def _program_work(NUM_SLICES: tl.constexpr, per_slice):
    """(work item, slice, index within the slice) of this program along axis 0: slices and then the
    `per_slice` programs of each (rank tiles, N chunks) vary fastest, so programs of one tile run side by side."""
    pid = tl.program_id(0)
    inner = pid % (NUM_SLICES * per_slice)
    return pid // (NUM_SLICES * per_slice), inner // per_slice, inner % per_slice


@triton.jit
def _shrink_tile(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, entries_ptr, weights_ptr, slot, start, end, r_tile,
                 k_begin, k_end, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 COMPOSED: tl.constexpr):
    """COMPOSED: the items are entries (batch.py): x is read at each entry's row, the product scaled by its
    member's weight and stored at the entry; else rows, stored at the row."""
    rank = tl.minimum(tl.load(rank_ptr + slot), R)  # a rank past R (the stacks' width) is R
    r_first = r_tile * BLOCK_R
    if r_first < rank:
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        rows = tl.load(sorted_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = r_first + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_begin + offs_k)[None, :] * stride_xk
        a_ptrs = a_ptr + slot.to(tl.int64) * stride_a_slot + offs_r[:, None] * stride_a_r + (k_begin + offs_k)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(k_begin, k_end, BLOCK_K):
            k_mask = (k + offs_k) < k_end
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K
        if COMPOSED:
            ents = tl.load(entries_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
            acc = acc * tl.load(weights_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
        else:
            ents = rows
        p_ptrs = part_ptr + ents[:, None] * stride_pm + offs_r[None, :]
        tl.store(p_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _shrink_tile_rows(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, entries_ptr, weights_ptr, slot, start, end,
                      r_tile, k_begin, k_end, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, COMPOSED: tl.constexpr):
    """`_shrink_tile` for tiles of a few rows (decode), row by row: a [rank tile, BLOCK_K] block of A times
    the row's x, summed over K in fp32 on the CUDA cores (no tile padded to 16 rows for the tensor cores).
    A is read once per row; the tile's few rows find it in L2."""
    rank = tl.minimum(tl.load(rank_ptr + slot), R)  # a rank past R (the stacks' width) is R
    r_first = r_tile * BLOCK_R
    if r_first < rank:
        offs_r = r_first + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + offs_r[:, None] * stride_a_r
        for m in range(start, end):
            row = tl.load(sorted_rows_ptr + m).to(tl.int64)
            x_row = x_ptr + row * stride_xm
            acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for k in range(k_begin, k_end, BLOCK_K):
                k_mask = (k + offs_k) < k_end
                xk_now = tl.load(x_row + (k + offs_k) * stride_xk, mask=k_mask, other=0.0)
                at_now = tl.load(a_rows + (k + offs_k)[None, :], mask=r_mask[:, None] & k_mask[None, :],
                                 other=0.0)
                acc += tl.sum(at_now.to(tl.float32) * xk_now.to(tl.float32)[None, :], axis=1)
            if COMPOSED:
                acc = acc * tl.load(weights_ptr + m)
                row = tl.load(entries_ptr + m).to(tl.int64)
            tl.store(part_ptr + row * stride_pm + offs_r, acc, mask=r_mask)


@triton.jit
def _shrink_slice(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, entries_ptr, weights_ptr, slot, start, end,
                  r_tile, k_begin, k_end, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                  ROWWISE: tl.constexpr, COMPOSED: tl.constexpr):
    # ROWWISE: row by row for tiles of at most ROWWISE_MAX_ROWS rows (as in _expand_slice); a static branch
    if ROWWISE:
        if end - start <= ROWWISE_MAX_ROWS:
            _shrink_tile_rows(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, entries_ptr, weights_ptr, slot, start,
                              end, r_tile, k_begin, k_end, R, stride_xm, stride_xk, stride_a_slot, stride_a_r,
                              stride_pm, BLOCK_R, BLOCK_K, COMPOSED)
        else:
            _shrink_tile(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, entries_ptr, weights_ptr, slot, start, end,
                         r_tile, k_begin, k_end, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                         BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, COMPOSED)
    else:
        _shrink_tile(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, entries_ptr, weights_ptr, slot, start, end,
                     r_tile, k_begin, k_end, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                     BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, COMPOSED)


@triton.jit
def _sgmv_shrink_kernel(
        x_ptr, part_ptr, sorted_rows_ptr, entries_ptr, weights_ptr, work_slot_ptr, work_start_ptr, work_end_ptr,
        a0, a1, a2, a3, rk0, rk1, rk2, rk3,
        K, k_per_split, r_tiles, R,
        stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_p_split, stride_p_slice, stride_pm,
        NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, ROWWISE: tl.constexpr, AFTER_GEMM: tl.constexpr, COMPOSED: tl.constexpr):
    """part[split, i, rows, :rank_i] = x[rows, split's K range] @ A_i[slot, :rank_i, same range]ᵀ; COMPOSED:
    part[split, i, entries, :rank_i] = weights · x[rows of the entries, ...] @ ... (batch.py's entries).
    AFTER_GEMM (launched right after ops/gemm/skinny.py's kernel over the same x: overlap.py's "after" order):
    with PDL, release the next kernel first and wait for the grids before this one last, so that the programs run
    beside the GEMM's (x was complete before the GEMM, after its own wait, released this grid) and the next kernel,
    whose wait is for this grid, also finds the GEMM complete (ops/pdl.py)."""
    # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first; AFTER_GEMM: release the next first
    # and wait last
    pdl_start(AFTER_GEMM)
    pdl_release(AFTER_GEMM)
    split = tl.program_id(1)
    work, sl, r_tile = _program_work(NUM_SLICES, r_tiles)   # programs that share x rows run side by side
    slot = tl.load(work_slot_ptr + work)
    if slot >= 0:
        start = tl.load(work_start_ptr + work)
        end = tl.load(work_end_ptr + work)
        k_begin = split * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        part = part_ptr + split.to(tl.int64) * stride_p_split + sl.to(tl.int64) * stride_p_slice
        if sl == 0:
            _shrink_slice(x_ptr, a0, rk0, part, sorted_rows_ptr, entries_ptr, weights_ptr, slot, start, end,
                          r_tile, k_begin, k_end, R,
                          stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                          BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, ROWWISE, COMPOSED)
        if NUM_SLICES > 1:
            if sl == 1:
                _shrink_slice(x_ptr, a1, rk1, part, sorted_rows_ptr, entries_ptr, weights_ptr, slot, start, end,
                              r_tile, k_begin, k_end, R,
                              stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                              BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, ROWWISE, COMPOSED)
        if NUM_SLICES > 2:
            if sl == 2:
                _shrink_slice(x_ptr, a2, rk2, part, sorted_rows_ptr, entries_ptr, weights_ptr, slot, start, end,
                              r_tile, k_begin, k_end, R,
                              stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                              BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, ROWWISE, COMPOSED)
        if NUM_SLICES > 3:
            if sl == 3:
                _shrink_slice(x_ptr, a3, rk3, part, sorted_rows_ptr, entries_ptr, weights_ptr, slot, start, end,
                              r_tile, k_begin, k_end, R,
                              stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                              BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, ROWWISE, COMPOSED)
    # Program (0, 0) alone waits: the grid then completes after the GEMM, and every other program leaves as soon
    # as its work is stored, its room on the SM free for the programs after it (a composed graph's grid, sized
    # for 4 members a row, is mostly programs without work).
    if tl.program_id(0) + tl.program_id(1) == 0:
        pdl_wait_last(AFTER_GEMM)
