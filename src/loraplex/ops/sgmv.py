"""Triton kernels for batched multi-LoRA: SGMV shrink (`v = x @ Aᵀ`) and expand (`y += s · v @ Bᵀ`).

Both kernels walk the work tiles of a `LoraBatch`: a tile is up to `block_m` rows that share
one adapter slot, gathered through `sorted_rows`. A tile reads its adapter's weights once,
whatever the number of segments behind it, so decode with hundreds of distinct adapters
reads each adapter once and prefill becomes tiled matrix work.

Shrink splits K across `split_k` programs when the batch alone would leave SMs idle. Each
split writes its own fp32 partial `part[split, slice, row, :]` (no atomics, no zero fill,
deterministic); expand sums the partials as it loads them. Each expand program covers a
chunk of N, BLOCK_N columns at a time, so B streams through a pipelined loop. Ranks are
honoured exactly: rank tiles past a slot's rank are skipped, and weight columns past it are
never loaded.

Up to `MAX_SLICES` output slices (fused q/k/v, gate/up) share one launch per direction;
each slice's tensors come in as their own kernel arguments so the compiler keeps their
alignment, and the program picks its slice with a branch.

For tiles of a few rows (decode rows with their own adapters) both kernels have a row-wise path
(`_shrink_tile_rows`, `_expand_tile_rows`: fp32 multiply-and-sum on the CUDA cores, no row padded to
16 for the tensor cores), for every tile or for tiles of a few rows (chosen at run time), per config
(`KernelConfig`; LORAPLEX_LORA_ROWWISE for the decode config, mode 1 by default, see CONFIGS).

A one-launch variant (each program shrinking over the whole K, then expanding its columns) was
measured on an H200 and lost 1.1–3.3× to these two launches at every decode batch: without
split-K each program's K loop is one long latency chain (benchmarks/NOTES.md).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Launcher

MAX_SLICES = 4
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
def _shrink_tile(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, slot, start, end, r_tile, k_begin, k_end, R,
                 stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
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
        p_ptrs = part_ptr + rows[:, None] * stride_pm + offs_r[None, :]
        tl.store(p_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _shrink_tile_rows(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, slot, start, end, r_tile, k_begin, k_end, R,
                      stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """`_shrink_tile` for tiles of a few rows (decode), row by row: a [rank tile, BLOCK_K] block of A times
    the row's x, summed over K in fp32 on the CUDA cores (no tile padded to 16 rows for the tensor cores).
    A is read once per row; the tile's few rows find it in L2. PREFETCH: each step loads the next step's
    x and A before it reduces its own (Triton pipelines only loads that feed a tl.dot; without it each step
    waits for its loads in turn)."""
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
            if PREFETCH:
                k_mask = (k_begin + offs_k) < k_end
                xk = tl.load(x_row + (k_begin + offs_k) * stride_xk, mask=k_mask, other=0.0)
                at = tl.load(a_rows + (k_begin + offs_k)[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            for k in range(k_begin, k_end, BLOCK_K):
                if PREFETCH:
                    xk_now, at_now = xk, at
                    k_next = k + BLOCK_K + offs_k
                    k_mask = k_next < k_end
                    xk = tl.load(x_row + k_next * stride_xk, mask=k_mask, other=0.0)
                    at = tl.load(a_rows + k_next[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                else:
                    k_mask = (k + offs_k) < k_end
                    xk_now = tl.load(x_row + (k + offs_k) * stride_xk, mask=k_mask, other=0.0)
                    at_now = tl.load(a_rows + (k + offs_k)[None, :], mask=r_mask[:, None] & k_mask[None, :],
                                     other=0.0)
                acc += tl.sum(at_now.to(tl.float32) * xk_now.to(tl.float32)[None, :], axis=1)
            tl.store(part_ptr + row * stride_pm + offs_r, acc, mask=r_mask)


@triton.jit
def _shrink_slice(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, slot, start, end, r_tile, k_begin, k_end, R,
                  stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                  ROWWISE: tl.constexpr, ROWS_PREFETCH: tl.constexpr):
    # the modes as in _expand_slice; static branches, so that modes 0 and 2 compile one path only
    if ROWWISE == 2:
        _shrink_tile_rows(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, slot, start, end, r_tile, k_begin,
                          k_end, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm, BLOCK_R, BLOCK_K,
                          ROWS_PREFETCH)
    elif ROWWISE == 1:
        if end - start <= ROWWISE_MAX_ROWS:
            _shrink_tile_rows(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, slot, start, end, r_tile, k_begin,
                              k_end, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm, BLOCK_R, BLOCK_K,
                              ROWS_PREFETCH)
        else:
            _shrink_tile(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, slot, start, end, r_tile, k_begin, k_end,
                         R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm, BLOCK_M, BLOCK_R, BLOCK_K,
                         PRECISION)
    else:
        _shrink_tile(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, slot, start, end, r_tile, k_begin, k_end, R,
                     stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm, BLOCK_M, BLOCK_R, BLOCK_K, PRECISION)


@triton.jit
def _sgmv_shrink_kernel(
        x_ptr, part_ptr, sorted_rows_ptr, work_slot_ptr, work_start_ptr, work_end_ptr,
        a0, a1, a2, a3, rk0, rk1, rk2, rk3,
        K, k_per_split, r_tiles, R,
        stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_p_split, stride_p_slice, stride_pm,
        NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, ROWWISE: tl.constexpr, ROWS_PREFETCH: tl.constexpr):
    """part[split, i, rows, :rank_i] = x[rows, split's K range] @ A_i[slot, :rank_i, same range]ᵀ."""
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
            _shrink_slice(x_ptr, a0, rk0, part, sorted_rows_ptr, slot, start, end, r_tile, k_begin, k_end, R,
                          stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                          BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, ROWWISE, ROWS_PREFETCH)
        if NUM_SLICES > 1:
            if sl == 1:
                _shrink_slice(x_ptr, a1, rk1, part, sorted_rows_ptr, slot, start, end, r_tile, k_begin, k_end, R,
                              stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                              BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, ROWWISE, ROWS_PREFETCH)
        if NUM_SLICES > 2:
            if sl == 2:
                _shrink_slice(x_ptr, a2, rk2, part, sorted_rows_ptr, slot, start, end, r_tile, k_begin, k_end, R,
                              stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                              BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, ROWWISE, ROWS_PREFETCH)
        if NUM_SLICES > 3:
            if sl == 3:
                _shrink_slice(x_ptr, a3, rk3, part, sorted_rows_ptr, slot, start, end, r_tile, k_begin, k_end, R,
                              stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_pm,
                              BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, ROWWISE, ROWS_PREFETCH)


@triton.jit
def _load_v(part_ptr, rows, m_mask, r0, rank, stride_p_split, stride_pm,
            SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Σ over the K splits of the fp32 partials for these rows and rank columns r0..r0+BLOCK_R (in fp32 also
    when the partials are a 16-bit GEMM's output: ops/lora_in_gemm.py)."""
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
    is not zero-filled, ops/overlap.py), always: a slice of rank 0 stores zeros (its loads are all masked)."""
    if ACCUMULATE:
        writes = rank > 0
    else:
        writes = rank >= 0
    return writes


@triton.jit
def _expand_tile(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk, N, col0,
                 n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                 SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr):
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
        # One program covers n_per_prog columns of y, BLOCK_N at a time; B streams through.
        for n0 in range(n_begin, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_end
            y_ptrs = y_rows + (col0 + offs_n)[None, :] * stride_yn
            y_mask = m_mask[:, None] & n_mask[None, :]
            if ACCUMULATE:  # loaded first, so that its latency hides behind the dot
                y_old = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
            else:  # y is an fp32 buffer of LoRA products that a later op adds (ops/overlap.py)
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
def _expand_tile_prefetch(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk, N,
                          col0, n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                          SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                          ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr):
    """`_expand_tile` with each step's y tile loaded a step ahead (KernelConfig.tile_prefetch): the expand of
    a prompt's rows streams y in and out (a read-modify-write of BLOCK_M × BLOCK_N values a step), and
    Triton pipelines only loads that feed a tl.dot, so without this each step waits for its y in turn."""
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
        if ACCUMULATE:
            y_next = tl.load(y_rows + (col0 + n_begin + cols)[None, :] * stride_yn,
                             mask=m_mask[:, None] & ((n_begin + cols) < n_end)[None, :], other=0.0)
        for n0 in range(n_begin, n_end, BLOCK_N):
            offs_n = n0 + cols
            n_mask = offs_n < n_end
            y_ptrs = y_rows + (col0 + offs_n)[None, :] * stride_yn
            y_mask = m_mask[:, None] & n_mask[None, :]
            if ACCUMULATE:
                y_old = y_next.to(tl.float32)
                later = offs_n + BLOCK_N   # the next step's columns (all masked off after the last step)
                y_next = tl.load(y_rows + (col0 + later)[None, :] * stride_yn,
                                 mask=m_mask[:, None] & (later < n_end)[None, :], other=0.0)
            else:
                y_old = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if ONE_R_TILE:
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
                      SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ACCUMULATE: tl.constexpr,
                      PREFETCH: tl.constexpr):
    """`_expand_tile` for tiles of a few rows (decode): row by row, a [BLOCK_N, rank] block of B times the
    row's fp32 v, summed over the rank in fp32 on the CUDA cores. No tensor-core product, so no tile is
    padded to 16 rows, no B tile is transposed through shared memory, and each program holds few
    registers (more of them in flight per SM). Needs rank ≤ BLOCK_R. PREFETCH: each step loads the next
    step's B block, and each row its y, before the reduce (Triton pipelines only loads that feed a tl.dot)."""
    rank = tl.minimum(tl.load(rank_ptr + slot), R)  # a rank past R (the stacks' width) is R
    n_begin = n_chunk * n_per_prog
    if _expands(rank, ACCUMULATE) & (n_begin < N):
        n_end = tl.minimum(n_begin + n_per_prog, N)
        scale = tl.load(scale_ptr + slot)
        b_base = b_ptr + slot.to(tl.int64) * N * R
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        if PREFETCH:
            offs_first = n_begin + tl.arange(0, BLOCK_N)
            b_next = _load_b(b_base, offs_first, offs_first < n_end, offs_r, r_mask, R)
        for n0 in range(n_begin, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_end
            if PREFETCH:
                b = b_next.to(tl.float32)
                b_next = _load_b(b_base, offs_n + BLOCK_N, offs_n + BLOCK_N < n_end, offs_r, r_mask, R)
            else:
                b = _load_b(b_base, offs_n, n_mask, offs_r, r_mask, R).to(tl.float32)
            for m in range(start, end):
                row = tl.load(sorted_rows_ptr + m).to(tl.int64)
                y_ptrs = y_ptr + row * stride_ym + (col0 + offs_n) * stride_yn
                if PREFETCH and ACCUMULATE:
                    y_old = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
                v_ptrs = part_ptr + row * stride_pm + offs_r
                v = tl.load(v_ptrs, mask=r_mask, other=0.0).to(tl.float32)
                for s in tl.static_range(1, SPLIT_K):
                    v += tl.load(v_ptrs + tl.full((), s, tl.int64) * stride_p_split, mask=r_mask, other=0.0)
                acc = tl.sum(b * v[None, :], axis=1) * scale
                if ACCUMULATE:
                    if PREFETCH:
                        acc += y_old
                    else:
                        acc += tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _expand_slice(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk, N, col0,
                  n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                  SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
                  ROWWISE: tl.constexpr, ROWS_BLOCK_N: tl.constexpr, ROWS_PREFETCH: tl.constexpr,
                  TILE_PREFETCH: tl.constexpr):
    # ROWWISE 1: row by row only for tiles of a few rows (decode rows with their own adapters): a tile's rows
    # run one after another, so 16 rows sharing an adapter took 9.5 ms per 32-row forward against 6.9 with
    # the tile product. But one kernel gets the registers of its larger branch (239 against 72 for the
    # row-wise expand alone, sm_90), so mode 2 (every tile row by row, one path compiled) is kept to measure
    # what that costs. The row-wise path needs the rank in one tile. (Static branches but the tile size.)
    rows = False
    if ONE_R_TILE:
        if ROWWISE == 2:
            rows = True
        elif ROWWISE == 1:
            rows = end - start <= ROWWISE_MAX_ROWS
    if rows:
        _expand_tile_rows(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk,
                          N, col0, n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                          SPLIT_K, ROWS_BLOCK_N, BLOCK_R, ACCUMULATE, ROWS_PREFETCH)
    elif TILE_PREFETCH:
        _expand_tile_prefetch(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk,
                              N, col0, n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                              SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE)
    else:
        _expand_tile(y_ptr, part_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk, N,
                     col0, n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R,
                     SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE)


@triton.jit
def _sgmv_expand_kernel(
        y_ptr, part_ptr, sorted_rows_ptr, work_slot_ptr, work_start_ptr, work_end_ptr,
        b0, b1, b2, b3, rk0, rk1, rk2, rk3, sc0, sc1, sc2, sc3, n0, n1, n2, n3, c0, c1, c2, c3,
        n_chunks, n_per_prog, R, stride_ym, stride_yn, stride_p_split, stride_p_slice, stride_pm,
        NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
        ROWWISE: tl.constexpr, ROWS_BLOCK_N: tl.constexpr, ROWS_PREFETCH: tl.constexpr, TILE_PREFETCH: tl.constexpr):
    """y[rows, c_i + n] += sc_i[slot] * (Σ_split part[split, i, rows, :rank]) @ B_i[slot, n, :rank]ᵀ
    (ACCUMULATE), or y[rows, c_i + n] = that product (y an fp32 delta buffer; 0 where rank is 0)."""
    work, sl, n_chunk = _program_work(NUM_SLICES, n_chunks)
    slot = tl.load(work_slot_ptr + work)
    if slot >= 0:
        start = tl.load(work_start_ptr + work)
        end = tl.load(work_end_ptr + work)
        part = part_ptr + sl.to(tl.int64) * stride_p_slice
        if sl == 0:
            _expand_slice(y_ptr, part, b0, rk0, sc0, sorted_rows_ptr, slot, start, end, n_chunk, n0, c0, n_per_prog,
                          stride_ym, stride_yn, stride_p_split, stride_pm, R, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R,
                          ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE, ROWS_BLOCK_N, ROWS_PREFETCH,
                          TILE_PREFETCH)
        if NUM_SLICES > 1:
            if sl == 1:
                _expand_slice(y_ptr, part, b1, rk1, sc1, sorted_rows_ptr, slot, start, end, n_chunk, n1, c1,
                              n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R, SPLIT_K, BLOCK_M,
                              BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE, ROWS_BLOCK_N,
                              ROWS_PREFETCH, TILE_PREFETCH)
        if NUM_SLICES > 2:
            if sl == 2:
                _expand_slice(y_ptr, part, b2, rk2, sc2, sorted_rows_ptr, slot, start, end, n_chunk, n2, c2,
                              n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R, SPLIT_K, BLOCK_M,
                              BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE, ROWS_BLOCK_N,
                              ROWS_PREFETCH, TILE_PREFETCH)
        if NUM_SLICES > 3:
            if sl == 3:
                _expand_slice(y_ptr, part, b3, rk3, sc3, sorted_rows_ptr, slot, start, end, n_chunk, n3, c3,
                              n_per_prog, stride_ym, stride_yn, stride_p_split, stride_pm, R, SPLIT_K, BLOCK_M,
                              BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, ACCUMULATE, ROWWISE, ROWS_BLOCK_N,
                              ROWS_PREFETCH, TILE_PREFETCH)


# ---------------------------------------------------------------------------------------------
# Launchers. Arguments arrive validated (see checks.py); these only pick tiles and launch.


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes and launch settings. `config_for` picks one per regime (tile height)."""

    shrink_block_k: int = 128
    shrink_warps: int = 4
    shrink_stages: int = 3
    shrink_programs_per_sm: float = 2.0  # split K until the shrink has about this many programs per SM
    expand_block_n: int = 128
    expand_warps: int = 4
    expand_stages: int = 2
    expand_programs_per_sm: float = 4.0  # cut N into chunks until the expand has about this many
    split_k: int | None = None  # fixed K splits (a power of two up to MAX_SPLIT_K) instead of the rule above
    n_chunks: int | None = None  # fixed N chunks per slice instead of the rule above
    expand_precision: str | None = None  # None: "split" for bf16 weights, "tf32x3" for fp16 and fp32
    # Row-wise paths (`_shrink_tile_rows`, `_expand_tile_rows`): 0 never, 1 for tiles of up to ROWWISE_MAX_ROWS
    # rows, 2 for every tile. The expand's needs the rank in one tile, the shrink's a rank tile of ≤ 32
    # (wider ones spill registers); elsewhere the tile product runs.
    shrink_rowwise: int = 0
    expand_rowwise: int = 0
    rows_block_n: int | None = None  # the row-wise expand's columns per step (None: `rows_block_n_for`)
    rows_prefetch: bool = False  # the row-wise paths load each step's weights a step ahead (_expand_tile_rows)
    tile_prefetch: bool = False  # the tile expand loads each step's y tile a step ahead (_expand_tile_prefetch)


MAX_SPLIT_K = 8
MAX_PARTIAL_BYTES = 64 << 20  # the partials span every row of x: a few adapter rows in a huge batch split less
_SHRINK = Launcher(_sgmv_shrink_kernel)
_EXPAND = Launcher(_sgmv_expand_kernel)
# Decode-like tiles (16 rows, few of them) are latency-bound: wide K tiles and many programs, so
# each program's serial loop is short (benchmarks/sweep_decode_lora.py: the 128 add_lora calls of
# a Llama-2-7B decode step in a CUDA graph, batches 1–256, distinct and shared adapters).
# Prefill-like tiles (64 rows) stream x and y. Chosen by benchmarks/sweep_lora_configs.py on an H200.
# LORAPLEX_LORA_ROWWISE: the decode config's row-wise mode for both kernels, "0", "1" (the default) or "2"
# (KernelConfig), or "auto": decode CUDA graphs captured twice, mode 0 and mode 2, and each step replays the
# one its adapters fit (`rows_fit`; engine/cuda_graphs.py). Mode 1 measured on the H200 (2026-12-01,
# benchmarks/results/model_forward_rowwise_*.json): Llama-2-7B decode forwards in CUDA graphs, distinct
# adapters 8.23 → 7.92 ms at 32 rows and 22.6 → 21.0 ms at 160, shared adapters unchanged (6.87 → 6.85 ms
# at 32 rows); mode 2 took the 32-row shared forward to 12.2 ms, as every tile then runs rows one by one.
def _rowwise_setting() -> int | str:
    raw = os.environ.get("LORAPLEX_LORA_ROWWISE", "1")
    value = raw.strip().lower() or "1"
    if value not in ("0", "1", "2", "auto"):
        raise ValueError(f"LORAPLEX_LORA_ROWWISE={raw!r}: expected 0 (off), 1 (tiles of up to "
                         f"{ROWWISE_MAX_ROWS.value} rows), 2 (every tile) or auto")
    return value if value == "auto" else int(value)


# LORAPLEX_LORA_ROWS: options of the decode config's row-wise paths, comma-separated: "prefetch" (loads a step
# ahead, KernelConfig.rows_prefetch) and "n<columns>" (the expand's columns a step, rows_block_n, a power of
# two from 16 to 1024, for every rank). Unset: no prefetch, and `rows_block_n_for`'s columns.
def _rows_options() -> dict:
    raw = os.environ.get("LORAPLEX_LORA_ROWS", "")
    options = {}
    for item in (part.strip().lower() for part in raw.split(",")):
        if item == "prefetch":
            options["rows_prefetch"] = True
        elif item[:1] == "n" and item[1:].isdecimal() and int(item[1:]) in (16, 32, 64, 128, 256, 512, 1024):
            options["rows_block_n"] = int(item[1:])
        elif item:
            raise ValueError(f"LORAPLEX_LORA_ROWS={raw!r}: {item!r} is not an option; expected prefetch and/or "
                             f"n<columns> (a power of two from 16 to 1024), comma-separated")
    return options


# LORAPLEX_LORA_PREFILL: changes to the large tiles' config (prompts), comma-separated: "n<columns>" (the
# expand's BLOCK_N, a power of two from 16 to 256), "epps<x>" (the expand's programs per SM), "ew<warps>" (its
# warps: 2, 4 or 8) and "prefetch" (KernelConfig.tile_prefetch). Unset: CONFIGS[64] as below.
def _prefill_options(raw: str | None = None) -> dict:
    """The KernelConfig changes a LORAPLEX_LORA_PREFILL value asks for (`raw`; None: the environment's)."""
    raw = os.environ.get("LORAPLEX_LORA_PREFILL", "") if raw is None else raw
    options: dict = {}
    for item in (part.strip().lower() for part in raw.split(",")):
        if item == "prefetch":
            options["tile_prefetch"] = True
        elif item.startswith("epps") and item[4:].replace(".", "", 1).isdecimal() and float(item[4:]) > 0:
            options["expand_programs_per_sm"] = float(item[4:])
        elif item.startswith("ew") and item[2:] in ("2", "4", "8"):
            options["expand_warps"] = int(item[2:])
        elif item[:1] == "n" and item[1:].isdecimal() and int(item[1:]) in (16, 32, 64, 128, 256):
            options["expand_block_n"] = int(item[1:])
        elif item:
            raise ValueError(f"LORAPLEX_LORA_PREFILL={raw!r}: {item!r} is not an option; expected n<columns> (16 to "
                             f"256, a power of two), epps<programs per SM>, ew<2|4|8> and/or prefetch, comma-separated")
    return options


_SETTING = _rowwise_setting()
# The large tiles' config without LORAPLEX_LORA_PREFILL (what probes and tests compare its options against).
PREFILL_DEFAULT = KernelConfig(shrink_block_k=128, expand_block_n=128, expand_programs_per_sm=2.0)
ROWWISE_AUTO = _SETTING == "auto"
_DECODE_ROWWISE = 0 if ROWWISE_AUTO else _SETTING
CONFIGS = {16: KernelConfig(shrink_block_k=256, expand_block_n=256, shrink_programs_per_sm=16.0,
                            expand_programs_per_sm=16.0, shrink_rowwise=_DECODE_ROWWISE,
                            expand_rowwise=_DECODE_ROWWISE, **_rows_options()),
           64: dataclasses.replace(PREFILL_DEFAULT, **_prefill_options())}


# A row-wise mode for the decode config while a forward runs (`decode_rowwise`): "auto" graphs capture with it.
_DECODE_MODE_NOW: contextvars.ContextVar[int | None] = contextvars.ContextVar("decode_rowwise", default=None)


def config_for(block_m: int) -> KernelConfig:
    return with_decode_mode(CONFIGS.get(block_m, CONFIGS[64]), block_m)


def with_decode_mode(cfg: KernelConfig, block_m: int) -> KernelConfig:
    """`cfg` (the settings for tiles of `block_m` rows) with the row-wise mode `decode_rowwise` set, if any
    is and the tiles are the decode config's."""
    mode = _DECODE_MODE_NOW.get() if block_m == 16 else None
    return cfg if mode is None else _with_mode(cfg, mode)


@functools.cache
def _with_mode(cfg: KernelConfig, mode: int) -> KernelConfig:
    return dataclasses.replace(cfg, shrink_rowwise=mode, expand_rowwise=mode)


@contextlib.contextmanager
def decode_rowwise(mode: int) -> Iterator[None]:
    """The decode config's row-wise mode (0, 1 or 2) for the kernels launched (or captured) inside."""
    if mode not in (0, 1, 2):
        raise ValueError(f"row-wise mode must be 0, 1 or 2, got {mode!r}")
    token = _DECODE_MODE_NOW.set(mode)
    try:
        yield
    finally:
        _DECODE_MODE_NOW.reset(token)


def rows_fit(slots: Iterable[int]) -> bool:
    """Do decode rows with these adapter slots (one row each; -1 none) make only tiles the row-wise path
    takes, i.e. no slot with more than ROWWISE_MAX_ROWS rows?"""
    counts = collections.Counter(s for s in slots if s >= 0)
    return not counts or max(counts.values()) <= ROWWISE_MAX_ROWS.value


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    # On the CPU (Triton's interpreter) pretend to a small GPU so that split-K and N chunks are exercised.
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv: that is a @jit function, and calling it from the host costs µs.
    return -(-a // b)


def _block_r(R: int) -> int:
    return min(max(16, 1 << (max(R, 1) - 1).bit_length()), 64)


# 512 columns a step for ranks up to 16, measured on the H200 (2026-12-01, benchmarks/results/
# model_forward_rows_*.json, Llama-2-7B decode forwards in CUDA graphs, rank 16): distinct adapters 7.96 →
# 7.89 ms at 32 rows and 21.34 → 20.92 ms at 160 against 256 columns, shared unchanged ("prefetch" was
# slower: 21.79 ms at 160). Wider ranks keep expand_block_n: a 512-column tile of rank 32 or 64 would hold
# 2-4× the weights a step in registers (not measured).
ROWS_WIDE_BLOCK_N = 512


def rows_block_n_for(cfg: KernelConfig, block_r: int) -> int:
    """The row-wise expand's columns a step: `cfg.rows_block_n` if set, else ROWS_WIDE_BLOCK_N for rank
    tiles of 16 and `cfg.expand_block_n` for wider ones."""
    if cfg.rows_block_n is not None:
        return cfg.rows_block_n
    return ROWS_WIDE_BLOCK_N if block_r <= 16 and cfg.expand_rowwise else cfg.expand_block_n


def choose_split_k(num_programs: int, K: int, device: torch.device, cfg: KernelConfig,
                   partial_bytes: int = 0) -> int:
    """The power of two (≤ MAX_SPLIT_K, ≥ 1 K-tile per split, partials ≤ MAX_PARTIAL_BYTES) that brings
    the shrink near its program target. `partial_bytes`: the size of one split's fp32 partials."""
    if cfg.split_k is not None:
        return cfg.split_k
    wanted = math.ceil(cfg.shrink_programs_per_sm * _num_sms(device) / max(num_programs, 1))
    limit = min(wanted, MAX_SPLIT_K, max(1, K // cfg.shrink_block_k),
                max(1, MAX_PARTIAL_BYTES // max(partial_bytes, 1)))
    return 1 << (limit.bit_length() - 1)


def choose_n_chunks(num_programs: int, N: int, device: torch.device, cfg: KernelConfig) -> tuple[int, int]:
    """(chunks, columns per program): N cut so that the expand has about its program target."""
    tiles = _cdiv(N, cfg.expand_block_n)
    chunks = cfg.n_chunks or math.ceil(cfg.expand_programs_per_sm * _num_sms(device) / max(num_programs, 1))
    chunks = max(1, min(chunks, tiles))
    per_prog = _cdiv(tiles, chunks) * cfg.expand_block_n
    return _cdiv(N, per_prog), per_prog


def shrink_into(part: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], ranks: list[torch.Tensor],
                batch, cfg: KernelConfig) -> None:
    """Launch shrink writing `part[split, slice, row, :rank]` (fp32 `[split_k, slices, T, R]`)."""
    num_slices = len(lora_a)
    split_k = part.shape[0]
    _, R, K = lora_a[0].shape
    block_r = _block_r(R)
    r_tiles = _cdiv(R, block_r)
    k_per_split = _cdiv(_cdiv(K, split_k), cfg.shrink_block_k) * cfg.shrink_block_k
    grid = (batch.num_work * num_slices * r_tiles, split_k)
    if grid[0] == 0:
        return
    pad = MAX_SLICES - num_slices
    precision = "tf32x3" if x.dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs
    args = (x, part, batch.sorted_rows, batch.work_slot, batch.work_start, batch.work_end,
            *lora_a, *[lora_a[0]] * pad, *ranks, *[ranks[0]] * pad, K, k_per_split, r_tiles, R,
            x.stride(0), x.stride(1), lora_a[0].stride(0), lora_a[0].stride(1),
            part.stride(0), part.stride(1), part.stride(2))
    _SHRINK(grid, args, dict(NUM_SLICES=num_slices, BLOCK_M=batch.block_m, BLOCK_R=block_r,
                             BLOCK_K=cfg.shrink_block_k, PRECISION=precision,
                             ROWWISE=cfg.shrink_rowwise if block_r <= 32 else 0, ROWS_PREFETCH=cfg.rows_prefetch),
            cfg.shrink_warps, cfg.shrink_stages)


def expand_from(y: torch.Tensor, part: torch.Tensor, lora_b: list[torch.Tensor], ranks: list[torch.Tensor],
                scalings: list[torch.Tensor], batch, y_offset: int, cfg: KernelConfig, *,
                accumulate: bool = True) -> None:
    """Launch expand adding `scalings[slot] * Σ_split part @ B[slot]ᵀ` into y's slices; with
    `accumulate=False`, y is fp32 and that product is stored instead (zeros for slices of rank 0; rows
    without an adapter are left as they were)."""
    num_slices = len(lora_b)
    R = lora_b[0].shape[2]
    ns = [b.shape[1] for b in lora_b]
    cols = [y_offset + sum(ns[:i]) for i in range(num_slices)]
    n_chunks, n_per_prog = choose_n_chunks(batch.num_work * num_slices, max(ns), y.device, cfg)
    grid = (batch.num_work * num_slices * n_chunks,)
    if grid[0] == 0:
        return
    pad = MAX_SLICES - num_slices
    # bf16 keeps fp32's exponent range, so v splits into two bf16 halves without overflow; fp16 would
    # overflow past 65504, so fp16 (exactly representable in fp32) takes the fp32 product.
    dtype = y.dtype if accumulate else lora_b[0].dtype
    precision = cfg.expand_precision or ("split" if dtype == torch.bfloat16 else "tf32x3")
    block_r = _block_r(R)
    args = (y, part, batch.sorted_rows, batch.work_slot, batch.work_start, batch.work_end,
            *lora_b, *[lora_b[0]] * pad, *ranks, *[ranks[0]] * pad, *scalings, *[scalings[0]] * pad,
            *ns, *[0] * pad, *cols, *[0] * pad,
            n_chunks, n_per_prog, R, y.stride(0), y.stride(1), part.stride(0), part.stride(1), part.stride(2))
    _EXPAND(grid, args, dict(NUM_SLICES=num_slices, SPLIT_K=part.shape[0], BLOCK_M=batch.block_m,
                             BLOCK_N=cfg.expand_block_n, BLOCK_R=block_r, ONE_R_TILE=R <= block_r,
                             PRECISION=precision, ACCUMULATE=accumulate,
                             ROWWISE=cfg.expand_rowwise, ROWS_BLOCK_N=rows_block_n_for(cfg, block_r),
                             ROWS_PREFETCH=cfg.rows_prefetch, TILE_PREFETCH=cfg.tile_prefetch),
            cfg.expand_warps, cfg.expand_stages)


def new_partials(x: torch.Tensor, lora_a: list[torch.Tensor], batch, cfg: KernelConfig) -> torch.Tensor:
    """The shrink's fp32 output `[split_k, slices, T, R]`, split K ways by the rule above."""
    num_slices, R = len(lora_a), lora_a[0].shape[1]
    split_k = choose_split_k(batch.num_work * num_slices * _cdiv(R, _block_r(R)), x.shape[1], x.device, cfg,
                             num_slices * x.shape[0] * R * 4)
    return torch.empty((split_k, num_slices, x.shape[0], R), dtype=torch.float32, device=x.device)


def add_lora(y, x, lora_a, lora_b, batch, ranks, scalings, y_offset: int, cfg: KernelConfig | None = None, *,
             accumulate: bool = True):
    """Shrink into a per-call fp32 partial buffer, then expand into y (two launches); `accumulate` as
    for `expand_from`."""
    cfg = cfg or config_for(batch.block_m)
    part = new_partials(x, lora_a, batch, cfg)
    shrink_into(part, x, lora_a, ranks, batch, cfg)
    expand_from(y, part, lora_b, ranks, scalings, batch, y_offset, cfg, accumulate=accumulate)
    return y
