"""The expand of a composed batch's members after the first (batch.py), row by row.

The shrink of a composed batch writes one fp32 product per (row, member) entry, already scaled by the member's
weight; the tile expand (or the one beside the GEMM into a `LoraDelta`) adds each row's first member. This kernel
adds the others (a `LoraProduct`'s consumer adds them itself, with the first: ops/lora/product.py), for every
row m with members l = 1 .. lanes-1 (slot s = extra_slot[(l-1)·T + m] ≥ 0, entry e = l·T + m), slice i, column
n of the slice, in fp32:

    y[m, c_i + n] = round(y[m, c_i + n] + Σ_l scalings_i[s] · Σ_{r < rank_i(s)} (Σ_split part[split, i, e, r]) · B_i[s, n, r])

once per row, after the first member's expand (so no two programs write one row: the tile expand's programs
each own a slot's rows, and here each program owns a row). Rows without a second member are left alone. A
member's rows rarely share its B with other rows in one tile (a composition is per request), so reading B row by
row costs what a tile would.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..launch import Launcher
from ..pdl import pdl_start

MAX_SLICES = 4
# The decode tiles' tuned settings (tuned_h200.json's 16-row config: many short programs, each a short chain of
# loads). On an H100 they took a composed batch's op from 1.29× to 1.16× the time of the same entries as plain rows
# (4 programs an SM over 128-column steps before; benchmarks/results/compose_ops_h100.md).
BLOCK_N = 256
PROGRAMS_PER_SM = 16


@triton.jit
def _extras_slice(y_ptr, part_ptr, extra_slot_ptr, b_ptr, rank_ptr, scale_ptr, row, T, extra_lanes, n_chunk, N,
                  col0, n_per_prog, R, stride_ym, stride_yn, stride_p_split, stride_pm,
                  SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    n_begin = n_chunk * n_per_prog
    if n_begin < N:
        n_end = tl.minimum(n_begin + n_per_prog, N)
        for n0 in range(n_begin, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_end
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for lane in range(0, extra_lanes):
                slot = tl.load(extra_slot_ptr + lane * T + row)
                if slot >= 0:
                    rank = tl.minimum(tl.load(rank_ptr + slot), R)
                    scale = tl.load(scale_ptr + slot)
                    v_row = part_ptr + ((lane + 1) * T + row).to(tl.int64) * stride_pm
                    b_slot = b_ptr + slot.to(tl.int64) * N * R
                    for r0 in range(0, rank, BLOCK_R):
                        offs_r = r0 + tl.arange(0, BLOCK_R)
                        r_mask = offs_r < rank
                        v = tl.load(v_row + offs_r, mask=r_mask, other=0.0)
                        for s in tl.static_range(1, SPLIT_K):
                            v += tl.load(v_row + tl.full((), s, tl.int64) * stride_p_split + offs_r, mask=r_mask,
                                         other=0.0)
                        b = tl.load(b_slot + offs_n[:, None] * R + offs_r[None, :],
                                    mask=n_mask[:, None] & r_mask[None, :], other=0.0)
                        acc += tl.sum(b.to(tl.float32) * v[None, :], axis=1) * scale
            y_ptrs = y_ptr + row * stride_ym + (col0 + offs_n) * stride_yn
            y_old = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, (y_old + acc).to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _expand_extras_kernel(y_ptr, part_ptr, extra_slot_ptr, b0, b1, b2, b3, rk0, rk1, rk2, rk3, sc0, sc1, sc2, sc3,
                          n0, n1, n2, n3, c0, c1, c2, c3, T, extra_lanes, n_chunks, n_per_prog, R,
                          stride_ym, stride_yn, stride_p_split, stride_p_slice, stride_pm,
                          NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_R: tl.constexpr):
    """Program (row, slice, column chunk): the module docstring's sum for that row and those columns."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    pid = tl.program_id(0)
    per_row = NUM_SLICES * n_chunks
    row = (pid // per_row).to(tl.int64)
    sl = (pid % per_row) // n_chunks
    n_chunk = pid % n_chunks
    if tl.load(extra_slot_ptr + row) >= 0:   # members fill lanes in order: a row with none has lane 1 empty
        part = part_ptr + sl.to(tl.int64) * stride_p_slice
        if sl == 0:
            _extras_slice(y_ptr, part, extra_slot_ptr, b0, rk0, sc0, row, T, extra_lanes, n_chunk, n0, c0, n_per_prog,
                          R, stride_ym, stride_yn, stride_p_split, stride_pm, SPLIT_K, BLOCK_N, BLOCK_R)
        if NUM_SLICES > 1:
            if sl == 1:
                _extras_slice(y_ptr, part, extra_slot_ptr, b1, rk1, sc1, row, T, extra_lanes, n_chunk, n1, c1,
                              n_per_prog, R, stride_ym, stride_yn, stride_p_split, stride_pm, SPLIT_K, BLOCK_N,
                              BLOCK_R)
        if NUM_SLICES > 2:
            if sl == 2:
                _extras_slice(y_ptr, part, extra_slot_ptr, b2, rk2, sc2, row, T, extra_lanes, n_chunk, n2, c2,
                              n_per_prog, R, stride_ym, stride_yn, stride_p_split, stride_pm, SPLIT_K, BLOCK_N,
                              BLOCK_R)
        if NUM_SLICES > 3:
            if sl == 3:
                _extras_slice(y_ptr, part, extra_slot_ptr, b3, rk3, sc3, row, T, extra_lanes, n_chunk, n3, c3,
                              n_per_prog, R, stride_ym, stride_yn, stride_p_split, stride_pm, SPLIT_K, BLOCK_N,
                              BLOCK_R)


_EXTRAS = Launcher(_expand_extras_kernel)


def expand_extras(y: torch.Tensor, part: torch.Tensor, lora_b: list[torch.Tensor], ranks: list[torch.Tensor],
                  scalings: list[torch.Tensor], batch, y_offset: int) -> None:
    """Add the members after the first of a composed batch's rows into y's slices (in place: y is the projection's
    output, or an fp32 LoraDelta whose rows the first member's expand stored). Nothing for other batches."""
    if not batch.composed or batch.lanes < 2:
        return
    from .sgmv import _block_r, _num_sms   # (sgmv imports this module: its helpers are looked up here)
    T, num_slices, R = batch.num_rows, len(lora_b), lora_b[0].shape[2]
    ns = [b.shape[1] for b in lora_b]
    cols = [y_offset + sum(ns[:i]) for i in range(num_slices)]
    tiles = -(-max(ns) // BLOCK_N)
    chunks = max(1, min(tiles, math.ceil(PROGRAMS_PER_SM * _num_sms(y.device) / max(T * num_slices, 1))))
    n_per_prog = -(-tiles // chunks) * BLOCK_N
    chunks = -(-max(ns) // n_per_prog)
    pad = MAX_SLICES - num_slices
    block_r = _block_r(R)
    args = (y, part, batch.extra_slot, *lora_b, *[lora_b[0]] * pad, *ranks, *[ranks[0]] * pad,
            *scalings, *[scalings[0]] * pad, *ns, *[0] * pad, *cols, *[0] * pad,
            T, batch.lanes - 1, chunks, n_per_prog, R, y.stride(0), y.stride(1),
            part.stride(0), part.stride(1), part.stride(2))
    _EXTRAS((T * num_slices * chunks,), args,
            dict(NUM_SLICES=num_slices, SPLIT_K=part.shape[0], BLOCK_N=BLOCK_N, BLOCK_R=block_r), 4, 1)
