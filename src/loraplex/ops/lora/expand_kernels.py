"""The SGMV expand as a Triton kernel (`_sgmv_expand_kernel`) and the per-tile functions it branches to (B read on
the CUDA cores through b_blocks.py); ops/lora/sgmv.py launches it (semantics in its docstring).

A composed batch's tiles hold rows of one member list (ops/lora/batch_plan.py). Its kernels (COMPOSED) add every
member of a tile's rows in fp32 before they round y once: the first member's slot is the tile's, member l ≥ 1's is
`extra_slot[(l-1)·T + row]` and its weighted partials are at entry `l·T + row` (the row-wise path reads them two at
a time: b_blocks.py). Other batches compile without that loop.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import pdl_start
from .b_blocks import _load_rank_block, _pair_b, _pair_scalars, _pair_slots, _pair_sum, _pair_v, _pairs_after_first
from .shrink_kernels import ROWWISE_MAX_ROWS, _program_work


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
def _writes(rank, n_begin, N, ACCUMULATE: tl.constexpr, COMPOSED: tl.constexpr):
    """Does a program of this slice's (first member's) rank write y's columns from n_begin? Adding, only with a
    rank; storing (an fp32 delta buffer that is not zero-filled, a LoraDelta), always: a slice of rank 0 stores
    zeros (its loads are all masked); COMPOSED, always too: another member may have a rank where the first has
    none (a rank-0 member adds nothing, and y + 0 rounds back to y)."""
    if ACCUMULATE and not COMPOSED:
        writes = rank > 0
    else:
        writes = rank >= 0
    return writes & (n_begin < N)


@triton.jit
def _member_tile(part_ptr, ents, m_mask, b_ptr, rank_ptr, scale_ptr, slot, offs_n, n_mask, N, R, stride_p_split,
                 stride_pm, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """scale[slot] · (Σ_split part[ents, :rank]) @ B[slot][offs_n, :rank]ᵀ for a tile's member after the first."""
    rank = tl.minimum(tl.load(rank_ptr + slot), R)
    b_base = b_ptr + slot.to(tl.int64) * N * R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        v, offs_r, r_mask = _load_v(part_ptr, ents, m_mask, r0, rank, stride_p_split, stride_pm, SPLIT_K, BLOCK_R)
        acc = _dot_v_b(v, _load_b(b_base, offs_n, n_mask, offs_r, r_mask, R), acc, PRECISION)
    return acc * tl.load(scale_ptr + slot)


@triton.jit
def _expand_tile(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, extra_slot_ptr, slot, start, end,
                 n_chunk, N, col0, n_per_prog, T, extra_lanes, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                 SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
                 PREFETCH: tl.constexpr, COMPOSED: tl.constexpr):
    """PREFETCH (KernelConfig.tile_prefetch): each step's y tile is loaded a step ahead. A prompt's expand streams
    y in and out (a read-modify-write of BLOCK_M × BLOCK_N values a step), and Triton pipelines a plain loop's
    loads only where they feed a tl.dot, so without it each step waits for its y in turn. The same values.
    COMPOSED: the tile's other members (those of its first row: a tile's rows share their members) are added
    before y rounds."""
    rank = tl.minimum(tl.load(rank_ptr + slot), R)  # a rank past R (the stacks' width) is R
    n_begin = n_chunk * n_per_prog
    if _writes(rank, n_begin, N, ACCUMULATE, COMPOSED):
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        rows = tl.load(sorted_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        n_end = tl.minimum(n_begin + n_per_prog, N)
        scale = tl.load(scale_ptr + slot)
        b_base = b_ptr + slot.to(tl.int64) * N * R
        y_rows = y_ptr + rows[:, None] * stride_ym
        if ONE_R_TILE:
            v, offs_r, r_mask = _load_v(part_ptr, rows, m_mask, 0, rank, stride_p_split, stride_pm, SPLIT_K, BLOCK_R)
        if COMPOSED:
            first_row = tl.load(sorted_rows_ptr + start)
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
            acc = acc * scale
            if COMPOSED:
                for lane in range(0, extra_lanes):
                    other = tl.load(extra_slot_ptr + lane * T + first_row)
                    if other >= 0:
                        acc += _member_tile(part_ptr, rows + (lane + 1) * T, m_mask, b_ptr, rank_ptr, scale_ptr,
                                            other, offs_n, n_mask, N, R, stride_p_split, stride_pm, SPLIT_K, BLOCK_M,
                                            BLOCK_N, BLOCK_R, PRECISION)
            tl.store(y_ptrs, (y_old + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _expand_rows_composed(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, extra_slot_ptr, slot, start,
                          end, n_begin, n_end, N, col0, T, extra_lanes, stride_ym, stride_yn, stride_p_split, stride_pm,
                          R, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, MEMBER_R: tl.constexpr,
                          ACCUMULATE: tl.constexpr):
    """`_expand_tile_rows` for a composed batch's tile, whose rows share their member list (batch_plan.py): members 0
    and 1's B blocks side by side (b_blocks.py's pairs) are read once a column block for all its rows; members 2
    and 3, and rank columns past MEMBER_R, row by row (a few rows: in L1)."""
    first_row = tl.load(sorted_rows_ptr + start).to(tl.int64)
    slots = _pair_slots(slot, extra_slot_ptr, first_row, T, extra_lanes, 0)
    ranks, scales = _pair_scalars(slots, rank_ptr, scale_ptr, R)
    for n0 in range(n_begin, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_end
        b = _pair_b(b_ptr, N * R, slots, ranks, offs_n, n_mask, 0, R, MEMBER_R, False)
        for m in range(start, end):
            row = tl.load(sorted_rows_ptr + m).to(tl.int64)
            part_row = part_ptr + row * stride_pm
            acc = _pair_sum(b, _pair_v(part_row, 0, T, stride_pm, 0, ranks, stride_p_split, SPLIT_K, MEMBER_R),
                            scales)
            acc = _pairs_after_first(acc, part_row, slot, extra_slot_ptr, row, T, extra_lanes, stride_pm, b_ptr, N * R,
                                     rank_ptr, scale_ptr, slots, ranks, scales, offs_n, n_mask, R, stride_p_split,
                                     SPLIT_K, MEMBER_R, False)
            y_ptrs = y_ptr + row * stride_ym + (col0 + offs_n) * stride_yn
            if ACCUMULATE:
                acc += tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _expand_tile_rows(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, extra_slot_ptr, slot, start, end,
                      n_chunk, N, col0, n_per_prog, T, extra_lanes, stride_ym, stride_yn, stride_p_split, stride_pm,
                      R, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                      ACCUMULATE: tl.constexpr, COMPOSED: tl.constexpr, MEMBER_R: tl.constexpr):
    """`_expand_tile` for tiles of a few rows (decode): row by row, a [BLOCK_N, rank] block of B times the
    row's fp32 v, summed over the rank in fp32 on the CUDA cores. No tensor-core product, so no tile is
    padded to 16 rows, no B tile is transposed through shared memory, and each program holds few
    registers (more of them in flight per SM). Needs every rank ≤ BLOCK_R. COMPOSED: each row's members are added
    before y rounds (`_expand_rows_composed`)."""
    rank = tl.minimum(tl.load(rank_ptr + slot), R)  # a rank past R (the stacks' width) is R
    n_begin = n_chunk * n_per_prog
    if _writes(rank, n_begin, N, ACCUMULATE, COMPOSED):
        n_end = tl.minimum(n_begin + n_per_prog, N)
        if COMPOSED:
            _expand_rows_composed(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, extra_slot_ptr, slot,
                                  start, end, n_begin, n_end, N, col0, T, extra_lanes, stride_ym, stride_yn,
                                  stride_p_split, stride_pm, R, SPLIT_K, BLOCK_N, MEMBER_R, ACCUMULATE)
        else:
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
def _expand_slice(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, extra_slot_ptr, slot, start, end,
                  n_chunk, N, col0, n_per_prog, T, extra_lanes, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                  SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
                  ROWWISE: tl.constexpr, ROWS_BLOCK_N: tl.constexpr, TILE_PREFETCH: tl.constexpr,
                  COMPOSED: tl.constexpr, MEMBER_R: tl.constexpr):
    # ROWWISE: row by row only for tiles of at most ROWWISE_MAX_ROWS rows (decode rows with their own adapters): a
    # tile's rows run one after another, so 16 rows sharing an adapter took 9.5 ms per 32-row forward against 6.9
    # with the tile product. The row-wise path needs the rank in one tile. (Static branches but the tile size.)
    rows = False
    if ONE_R_TILE:
        if ROWWISE:
            rows = end - start <= ROWWISE_MAX_ROWS
    if rows:
        _expand_tile_rows(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, extra_slot_ptr, slot, start,
                          end, n_chunk, N, col0, n_per_prog, T, extra_lanes, stride_ym, stride_yn, stride_p_split,
                          stride_pm, R, SPLIT_K, ROWS_BLOCK_N, BLOCK_R, ACCUMULATE, COMPOSED, MEMBER_R)
    else:
        _expand_tile(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, extra_slot_ptr, slot, start, end,
                     n_chunk, N, col0, n_per_prog, T, extra_lanes, stride_ym, stride_yn, stride_p_split, stride_pm,
                     R, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, TILE_PREFETCH,
                     COMPOSED)


@triton.jit(do_not_specialize=["T", "extra_lanes"])   # one variant whatever the rows and lanes
def _sgmv_expand_kernel(
        y_ptr, part_ptr, sorted_rows_ptr, work_slot_ptr, work_start_ptr, work_end_ptr, extra_slot_ptr,
        b0, b1, b2, b3, rk0, rk1, rk2, rk3, sc0, sc1, sc2, sc3, n0, n1, n2, n3, c0, c1, c2, c3,
        n_chunks, n_per_prog, R, T, extra_lanes, stride_ym, stride_yn, stride_p_split, stride_p_slice, stride_pm,
        NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
        ROWWISE: tl.constexpr, ROWS_BLOCK_N: tl.constexpr, TILE_PREFETCH: tl.constexpr, COMPOSED: tl.constexpr,
        MEMBER_R: tl.constexpr):
    """y[rows, c_i + n] += Σ_members sc_i[slot] * (Σ_split part[split, i, entries, :rank]) @ B_i[slot, n, :rank]ᵀ
    (ACCUMULATE), or y[rows, c_i + n] = that sum (y an fp32 delta buffer; 0 where no member has a rank). One
    member, the tile's slot, at entries = rows, unless COMPOSED (the module docstring)."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    work, sl, n_chunk = _program_work(NUM_SLICES, n_chunks)
    slot = tl.load(work_slot_ptr + work)
    if slot >= 0:
        start = tl.load(work_start_ptr + work)
        end = tl.load(work_end_ptr + work)
        part = part_ptr + sl.to(tl.int64) * stride_p_slice
        if sl == 0:
            _expand_slice(y_ptr, part, b0, rk0, sc0, sorted_rows_ptr, extra_slot_ptr, slot, start, end, n_chunk, n0,
                          c0, n_per_prog, T, extra_lanes, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                          SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE,
                          ROWS_BLOCK_N, TILE_PREFETCH, COMPOSED, MEMBER_R)
        if NUM_SLICES > 1:
            if sl == 1:
                _expand_slice(y_ptr, part, b1, rk1, sc1, sorted_rows_ptr, extra_slot_ptr, slot, start, end, n_chunk,
                              n1, c1, n_per_prog, T, extra_lanes, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                              SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE,
                              ROWS_BLOCK_N, TILE_PREFETCH, COMPOSED, MEMBER_R)
        if NUM_SLICES > 2:
            if sl == 2:
                _expand_slice(y_ptr, part, b2, rk2, sc2, sorted_rows_ptr, extra_slot_ptr, slot, start, end, n_chunk,
                              n2, c2, n_per_prog, T, extra_lanes, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                              SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE,
                              ROWS_BLOCK_N, TILE_PREFETCH, COMPOSED, MEMBER_R)
        if NUM_SLICES > 3:
            if sl == 3:
                _expand_slice(y_ptr, part, b3, rk3, sc3, sorted_rows_ptr, extra_slot_ptr, slot, start, end, n_chunk,
                              n3, c3, n_per_prog, T, extra_lanes, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                              SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE,
                              ROWS_BLOCK_N, TILE_PREFETCH, COMPOSED, MEMBER_R)
