"""One-launch multi-LoRA for decode-like batches: shrink and expand in the same program.

The two-launch path (sgmv.py) writes the rank-r intermediate `v = x @ Aᵀ` to fp32 partials in one
kernel and reads them back in a second. For decode tiles (16 rows, usually one real row each)
both kernels are short and latency-bound, so a decode step's 128 LoRA calls pay 256 launches.
Here each program takes one work tile, one output slice and one chunk of its columns: it computes
`v` over the whole K in registers, then streams its chunk of B:

    for each program (tile: slot and rows; slice i; columns [n0, n1) of slice i):
        r = min(ranks_i[slot], R)
        v = x[rows] @ A_i[slot, :r]ᵀ                                  # fp32, never leaves registers
        y[rows, c_i + n0:c_i + n1] += scalings_i[slot] * v @ B_i[slot, n0:n1, :r]ᵀ

— the same semantics as ops.add_lora. When a tile's columns are cut into several chunks, each chunk
recomputes `v` (A and x are re-read, from L2 after the first); `fused_programs_per_sm` sets how
many chunks. Only for ranks that fit one rank tile (R ≤ 64); sgmv.add_lora picks this path when
the config asks for it (`KernelConfig.fused`, or LORAPLEX_FUSED_DECODE=1 for decode tiles).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .launch import Launcher
from .sgmv import MAX_SLICES, KernelConfig, _block_r, _dot_v_b, _load_b, choose_n_chunks, one_rank_tile


@triton.jit
def _fused_tile(y_ptr, x_ptr, a_ptr, b_ptr, rank_ptr, scale_ptr, sorted_rows_ptr, slot, start, end, n_chunk,
                N, col0, n_per_prog, K, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_ym, stride_yn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                S_PRECISION: tl.constexpr, E_PRECISION: tl.constexpr):
    rank = tl.minimum(tl.load(rank_ptr + slot), R)  # a rank past R (the stacks' width) is R
    n_begin = n_chunk * n_per_prog
    if (rank > 0) & (n_begin < N):
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < end
        rows = tl.load(sorted_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        # shrink over the whole K: columns past the rank load as zeros, so they stay zero in v
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
        a_ptrs = a_ptr + slot.to(tl.int64) * stride_a_slot + offs_r[:, None] * stride_a_r + offs_k[None, :]
        v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_mask = (k + offs_k) < K
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            v = tl.dot(xt, tl.trans(at), v, input_precision=S_PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            a_ptrs += BLOCK_K
        # expand this program's columns, B streaming through
        n_end = tl.minimum(n_begin + n_per_prog, N)
        scale = tl.load(scale_ptr + slot)
        b_base = b_ptr + slot.to(tl.int64) * N * R
        y_rows = y_ptr + rows[:, None] * stride_ym
        for n0 in range(n_begin, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_end
            y_ptrs = y_rows + (col0 + offs_n)[None, :] * stride_yn
            y_mask = m_mask[:, None] & n_mask[None, :]
            y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = _dot_v_b(v, _load_b(b_base, offs_n, n_mask, offs_r, r_mask, R), acc, E_PRECISION)
            tl.store(y_ptrs, (y_old.to(tl.float32) + acc * scale).to(y_old.dtype), mask=y_mask)


@triton.jit
def _sgmv_fused_kernel(
        y_ptr, x_ptr, sorted_rows_ptr, work_slot_ptr, work_start_ptr, work_end_ptr,
        a0, a1, a2, a3, b0, b1, b2, b3, rk0, rk1, rk2, rk3, sc0, sc1, sc2, sc3, n0, n1, n2, n3, c0, c1, c2, c3,
        n_chunks, n_per_prog, K, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_ym, stride_yn,
        NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_K: tl.constexpr, S_PRECISION: tl.constexpr, E_PRECISION: tl.constexpr):
    """y[rows, c_i + n] += sc_i[slot] * (x[rows] @ A_i[slot, :rank]ᵀ) @ B_i[slot, n, :rank]ᵀ, one chunk of n."""
    pid = tl.program_id(0)
    work = pid // (NUM_SLICES * n_chunks)
    inner = pid % (NUM_SLICES * n_chunks)
    sl = inner // n_chunks
    n_chunk = inner % n_chunks
    slot = tl.load(work_slot_ptr + work)
    if slot >= 0:
        start = tl.load(work_start_ptr + work)
        end = tl.load(work_end_ptr + work)
        if sl == 0:
            _fused_tile(y_ptr, x_ptr, a0, b0, rk0, sc0, sorted_rows_ptr, slot, start, end, n_chunk, n0, c0,
                        n_per_prog, K, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_ym, stride_yn,
                        BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_K, S_PRECISION, E_PRECISION)
        if NUM_SLICES > 1:
            if sl == 1:
                _fused_tile(y_ptr, x_ptr, a1, b1, rk1, sc1, sorted_rows_ptr, slot, start, end, n_chunk, n1, c1,
                            n_per_prog, K, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_ym,
                            stride_yn, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_K, S_PRECISION, E_PRECISION)
        if NUM_SLICES > 2:
            if sl == 2:
                _fused_tile(y_ptr, x_ptr, a2, b2, rk2, sc2, sorted_rows_ptr, slot, start, end, n_chunk, n2, c2,
                            n_per_prog, K, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_ym,
                            stride_yn, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_K, S_PRECISION, E_PRECISION)
        if NUM_SLICES > 3:
            if sl == 3:
                _fused_tile(y_ptr, x_ptr, a3, b3, rk3, sc3, sorted_rows_ptr, slot, start, end, n_chunk, n3, c3,
                            n_per_prog, K, R, stride_xm, stride_xk, stride_a_slot, stride_a_r, stride_ym,
                            stride_yn, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_K, S_PRECISION, E_PRECISION)


_FUSED = Launcher(_sgmv_fused_kernel)


def choose_chunks(num_programs: int, N: int, device: torch.device, cfg: KernelConfig) -> tuple[int, int]:
    """(chunks, columns per program): the expand's rule, at `fused_programs_per_sm` programs per SM."""
    return choose_n_chunks(num_programs, N, device,
                           dataclasses.replace(cfg, expand_programs_per_sm=cfg.fused_programs_per_sm))


def add_lora(y, x, lora_a, lora_b, batch, ranks, scalings, y_offset: int, cfg: KernelConfig) -> torch.Tensor:
    """One launch: every (tile, slice, column chunk) program shrinks its rows and expands its chunk."""
    num_slices = len(lora_a)
    _, R, K = lora_a[0].shape
    if not one_rank_tile(R):
        raise ValueError(f"the fused LoRA kernel takes ranks up to 64 (one rank tile), got a stack width of {R}")
    ns = [b.shape[1] for b in lora_b]
    cols = [y_offset + sum(ns[:i]) for i in range(num_slices)]
    n_chunks, n_per_prog = choose_chunks(batch.num_work * num_slices, max(ns), y.device, cfg)
    grid = (batch.num_work * num_slices * n_chunks,)
    if grid[0] == 0:
        return y
    pad = MAX_SLICES - num_slices
    s_precision = "tf32x3" if x.dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs
    e_precision = cfg.expand_precision or ("split" if y.dtype == torch.bfloat16 else "tf32x3")
    args = (y, x, batch.sorted_rows, batch.work_slot, batch.work_start, batch.work_end,
            *lora_a, *[lora_a[0]] * pad, *lora_b, *[lora_b[0]] * pad, *ranks, *[ranks[0]] * pad,
            *scalings, *[scalings[0]] * pad, *ns, *[0] * pad, *cols, *[0] * pad,
            n_chunks, n_per_prog, K, R, x.stride(0), x.stride(1), lora_a[0].stride(0), lora_a[0].stride(1),
            y.stride(0), y.stride(1))
    _FUSED(grid, args, dict(NUM_SLICES=num_slices, BLOCK_M=batch.block_m, BLOCK_N=cfg.expand_block_n,
                            BLOCK_R=_block_r(R), BLOCK_K=cfg.shrink_block_k, S_PRECISION=s_precision,
                            E_PRECISION=e_precision),
           cfg.expand_warps, cfg.expand_stages)
    return y
