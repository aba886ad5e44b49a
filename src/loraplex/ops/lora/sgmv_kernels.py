"""The SGMV shrink and expand as Triton kernels (`_sgmv_shrink_kernel`, `_sgmv_expand_kernel`) and the per-tile
functions they branch to; ops/lora/sgmv.py picks their settings and launches them (the semantics are in its docstring).

Triton's interpreter runs a kernel as Python and looks its callees up in this module, so tests that count which
per-tile path ran patch them here.
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
    pdl_wait_last(AFTER_GEMM)   # every program, work or none: the grid completes after the GEMM


@triton.jit
def _load_v(part_ptr, rows, m_mask, r0, rank, stride_p_split, stride_pm,
            SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Σ over the K splits of the fp32 partials for these rows and rank columns r0..r0+BLOCK_R."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    v_mask = m_mask[:, None] & r_mask[None, :]
    v_ptrs = part_ptr + rows[:, None] * stride_pm + offs_r[None, :]
    v = tl.load(v_ptrs, mask=v_mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT_K):
        v += tl.load(v_ptrs + tl.full((), s, tl.int64) * stride_p_split, mask=v_mask, other=0.0)
    return v, offs_r, r_mask


@triton.jit
def _load_b(b_base, offs_n, n_mask, offs_r, r_mask, R):
    """B[slot][offs_n, offs_r] as [BLOCK_N, BLOCK_R], in memory order (transposed in registers for the dot)."""
    return tl.load(b_base + offs_n[:, None] * R + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)


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
def _load_b_rows(b_base, offs_n, n_mask, offs_r, r_mask, rank, R):
    """`_load_b` for the row-wise expand, through `_load_rank_block`."""
    return _load_rank_block(b_base + offs_n[:, None] * R + offs_r[None, :], n_mask[:, None], offs_r[None, :],
                            r_mask[None, :], rank, R)


@triton.jit
def _dot_v_b(v, b, acc, PRECISION: tl.constexpr):
    """acc += v @ bᵀ with v fp32. "split": v as hi + lo halves in b's 16-bit dtype, two tensor-core
    products that keep ~16 mantissa bits of v; otherwise one fp32 product at that precision."""
    bt = tl.trans(b)
    if PRECISION == "split":
        v_hi = v.to(bt.dtype)
        acc = tl.dot(v_hi, bt, acc)
        acc = tl.dot((v - v_hi.to(tl.float32)).to(bt.dtype), bt, acc)
    else:
        acc = tl.dot(v, bt.to(tl.float32), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _expands(rank, ACCUMULATE: tl.constexpr):
    """Does a tile of this slice's rank write y? Adding, only with a rank; storing (an fp32 delta buffer that
    is not zero-filled, a LoraDelta), always: a slice of rank 0 stores zeros (its loads are all masked)."""
    if ACCUMULATE:
        writes = rank > 0
    else:
        writes = rank >= 0
    return writes


@triton.jit
def _expand_tile(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk, N, col0,
                 n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                 SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
                 PREFETCH: tl.constexpr):
    """PREFETCH (KernelConfig.tile_prefetch): each step's y tile is loaded a step ahead. A prompt's expand streams
    y in and out (a read-modify-write of BLOCK_M × BLOCK_N values a step), and Triton pipelines a plain loop's
    loads only where they feed a tl.dot, so without it each step waits for its y in turn. The same values."""
    rank = tl.minimum(tl.load(rank_ptr + slot), R)  # a rank past R (the stacks' width) is R
    n_begin = n_chunk * n_per_prog
    if _expands(rank, ACCUMULATE) & (n_begin < N):
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        rows = tl.load(sorted_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        n_end = tl.minimum(n_begin + n_per_prog, N)
        scale = tl.load(scale_ptr + slot)
        b_base = b_ptr + slot.to(tl.int64) * N * R
        y_rows = y_ptr + rows[:, None] * stride_ym
        if ONE_R_TILE:
            v, offs_r, r_mask = _load_v(part_ptr, rows, m_mask, 0, rank, stride_p_split, stride_pm, SPLIT_K, BLOCK_R)
        cols = tl.arange(0, BLOCK_N)
        if PREFETCH and ACCUMULATE:
            y_next = tl.load(y_rows + (col0 + n_begin + cols)[None, :] * stride_yn,
                             mask=m_mask[:, None] & ((n_begin + cols) < n_end)[None, :], other=0.0)
        # One program covers n_per_prog columns of y, BLOCK_N at a time; B streams through.
        for n0 in tl.range(n_begin, n_end, BLOCK_N):
            offs_n = n0 + cols
            n_mask = offs_n < n_end
            y_ptrs = y_rows + (col0 + offs_n)[None, :] * stride_yn
            y_mask = m_mask[:, None] & n_mask[None, :]
            if ACCUMULATE:
                if PREFETCH:
                    y_old = y_next.to(tl.float32)
                    later = offs_n + BLOCK_N   # the next step's columns (all masked off after the last step)
                    y_next = tl.load(y_rows + (col0 + later)[None, :] * stride_yn,
                                     mask=m_mask[:, None] & (later < n_end)[None, :], other=0.0)
                else:  # loaded first, so that its latency hides behind the dot
                    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
            else:  # y is an fp32 buffer of LoRA products that a later op adds (a LoraDelta)
                y_old = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if ONE_R_TILE:
                # The whole rank fits one tile: v (loaded once, above) stays in registers.
                acc = _dot_v_b(v, _load_b(b_base, offs_n, n_mask, offs_r, r_mask, R), acc, PRECISION)
            else:
                for r0 in range(0, rank, BLOCK_R):
                    v_r, offs_rr, r_mask_r = _load_v(part_ptr, rows, m_mask, r0, rank, stride_p_split, stride_pm,
                                                     SPLIT_K, BLOCK_R)
                    acc = _dot_v_b(v_r, _load_b(b_base, offs_n, n_mask, offs_rr, r_mask_r, R), acc, PRECISION)
            tl.store(y_ptrs, (y_old + acc * scale).to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _expand_tile_rows(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk, N,
                      col0, n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                      SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ACCUMULATE: tl.constexpr):
    """`_expand_tile` for tiles of a few rows (decode): row by row, a [BLOCK_N, rank] block of B times the
    row's fp32 v, summed over the rank in fp32 on the CUDA cores. No tensor-core product, so no tile is
    padded to 16 rows, no B tile is transposed through shared memory, and each program holds few
    registers (more of them in flight per SM). Needs rank ≤ BLOCK_R."""
    rank = tl.minimum(tl.load(rank_ptr + slot), R)  # a rank past R (the stacks' width) is R
    n_begin = n_chunk * n_per_prog
    if _expands(rank, ACCUMULATE) & (n_begin < N):
        n_end = tl.minimum(n_begin + n_per_prog, N)
        scale = tl.load(scale_ptr + slot)
        b_base = b_ptr + slot.to(tl.int64) * N * R
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        for n0 in range(n_begin, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_end
            b = _load_b_rows(b_base, offs_n, n_mask, offs_r, r_mask, rank, R).to(tl.float32)
            for m in range(start, end):
                row = tl.load(sorted_rows_ptr + m).to(tl.int64)
                y_ptrs = y_ptr + row * stride_ym + (col0 + offs_n) * stride_yn
                v_ptrs = part_ptr + row * stride_pm + offs_r
                v = tl.load(v_ptrs, mask=r_mask, other=0.0).to(tl.float32)
                for s in tl.static_range(1, SPLIT_K):
                    v += tl.load(v_ptrs + tl.full((), s, tl.int64) * stride_p_split, mask=r_mask, other=0.0)
                acc = tl.sum(b * v[None, :], axis=1) * scale
                if ACCUMULATE:
                    acc += tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _expand_slice(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk, N, col0,
                  n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                  SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
                  ROWWISE: tl.constexpr, ROWS_BLOCK_N: tl.constexpr, TILE_PREFETCH: tl.constexpr):
    # ROWWISE: row by row only for tiles of at most ROWWISE_MAX_ROWS rows (decode rows with their own adapters): a
    # tile's rows run one after another, so 16 rows sharing an adapter took 9.5 ms per 32-row forward against 6.9
    # with the tile product. The row-wise path needs the rank in one tile. (Static branches but the tile size.)
    rows = False
    if ONE_R_TILE:
        if ROWWISE:
            rows = end - start <= ROWWISE_MAX_ROWS
    if rows:
        _expand_tile_rows(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk,
                          N, col0, n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                          SPLIT_K, ROWS_BLOCK_N, BLOCK_R, ACCUMULATE)
    else:
        _expand_tile(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk, N,
                     col0, n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                     SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, TILE_PREFETCH)


@triton.jit
def _sgmv_expand_kernel(
        y_ptr, part_ptr, sorted_rows_ptr, work_slot_ptr, work_start_ptr, work_end_ptr,
        b0, b1, b2, b3, rk0, rk1, rk2, rk3, sc0, sc1, sc2, sc3, n0, n1, n2, n3, c0, c1, c2, c3,
        n_chunks, n_per_prog, R, stride_ym, stride_yn, stride_p_split, stride_p_slice, stride_pm,
        NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
        ROWWISE: tl.constexpr, ROWS_BLOCK_N: tl.constexpr, TILE_PREFETCH: tl.constexpr):
    """y[rows, c_i + n] += sc_i[slot] * (Σ_split part[split, i, rows, :rank]) @ B_i[slot, n, :rank]ᵀ
    (ACCUMULATE), or y[rows, c_i + n] = that product (y an fp32 delta buffer; 0 where rank is 0)."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    work, sl, n_chunk = _program_work(NUM_SLICES, n_chunks)
    slot = tl.load(work_slot_ptr + work)
    if slot >= 0:
        start = tl.load(work_start_ptr + work)
        end = tl.load(work_end_ptr + work)
        part = part_ptr + sl.to(tl.int64) * stride_p_slice
        if sl == 0:
            _expand_slice(y_ptr, part, b0, rk0, sc0, sorted_rows_ptr, slot, start, end, n_chunk, n0, c0, n_per_prog,
                          stride_ym, stride_yn, stride_p_split, stride_pm, R, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R,
                          ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE, ROWS_BLOCK_N, TILE_PREFETCH)
        if NUM_SLICES > 1:
            if sl == 1:
                _expand_slice(y_ptr, part, b1, rk1, sc1, sorted_rows_ptr, slot, start, end, n_chunk, n1, c1,
                              n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R, SPLIT_K, BLOCK_M,
                              BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE, ROWS_BLOCK_N,
                              TILE_PREFETCH)
        if NUM_SLICES > 2:
            if sl == 2:
                _expand_slice(y_ptr, part, b2, rk2, sc2, sorted_rows_ptr, slot, start, end, n_chunk, n2, c2,
                              n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R, SPLIT_K, BLOCK_M,
                              BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE, ROWS_BLOCK_N,
                              TILE_PREFETCH)
        if NUM_SLICES > 3:
            if sl == 3:
                _expand_slice(y_ptr, part, b3, rk3, sc3, sorted_rows_ptr, slot, start, end, n_chunk, n3, c3,
                              n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R, SPLIT_K, BLOCK_M,
                              BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE, ROWS_BLOCK_N,
                              TILE_PREFETCH)
