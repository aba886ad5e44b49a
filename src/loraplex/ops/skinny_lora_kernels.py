"""Triton kernel of a decode projection with its LoRA in one launch: y = x @ wᵀ (+ bias) + each row's LoRA product.

For every row m < M with slot s = row_slot[m] ≥ 0, slice i (columns c_i … c_i + N_i of y, c_0 = 0), and
column n < N_i of that slice, with r_i = min(ranks_i[s], R) (fp32 sums):

    v[m, i, r]      = Σ_k x[m, k] · A_i[s, r, k]                            for r < r_i
    y[m, c_i + n]   = round(Σ_k x[m, k] · w[c_i + n, k] + bias[c_i + n]
                            + Σ_{r < r_i} q(scalings_i[s] · v[m, i, r]) · B_i[s, n, r])

where q rounds to the weights' dtype as `PRECISION` says ("split": the sum of two 16-bit halves, ~16 mantissa
bits; "ieee": fp32 as is). Rows without an adapter get the base sum alone. What no other op does: the shrink
and the expand run inside the GEMM's launch. Programs 0 … LORA_PROGRAMS-1 ("LoRA programs") compute v for the
batch's work tiles (rows sharing a slot) × slices and store it in an fp32 workspace; the GEMM's programs
stream their [BLOCK_N, K] block of w as ops/skinny_gemm_kernels.py does (on the SMs the LoRA programs leave),
then wait for a counter that each LoRA program bumps when its v is stored, and add their columns' products
before storing y. A decode projection is bound by reading w, and the adapters' A and B are ~10% more bytes:
read beside it in the same launch, they cost about their bytes, where separate shrink and expand kernels
each paid a launch, a wave of few programs and a wait.

The wait is a spin on a global counter, so every LoRA program must be able to run while the GEMM's
programs wait: they have the lowest program ids, which the GPU places first, and the launch's programs fit
the GPU at once for the grids `skinny_lora` picks. The last GEMM program to pass resets both counters for
the next launch (and graph replay). Launches sharing a workspace must not run concurrently on two streams.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .pdl import pdl_start


@triton.jit
def _shrink_unit(x_ptr, a_ptr, rank_ptr, part_ptr, sorted_rows_ptr, slot, start, end, K, R, stride_xm, stride_pm,
                 EVEN_K: tl.constexpr, IEEE: tl.constexpr, TILE_M: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """part[rows, :BLOCK_R] = x[rows] @ A[slot, :rank]ᵀ for one work tile's rows (zeros past the rank, which
    masks A's rows: what the pool holds there is not this adapter's)."""
    rank = tl.minimum(tl.load(rank_ptr + slot), R)
    offs_m = start + tl.arange(0, TILE_M)
    m_mask = offs_m < end
    rows = tl.load(sorted_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    a_ptrs = a_ptr + slot.to(tl.int64) * R * K + offs_r[:, None].to(tl.int64) * K + offs_k[None, :]
    acc = tl.zeros((TILE_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs + k, mask=m_mask[:, None], other=0.0)
            at = tl.load(a_ptrs + k, mask=(offs_r < rank)[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < K
            xt = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptrs + k, mask=(offs_r < rank)[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xt, tl.trans(at), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(at), acc)
    tl.store(part_ptr + rows[:, None] * stride_pm + offs_r[None, :], acc, mask=m_mask[:, None])


@triton.jit
def _expand_block(acc, b_ptr, part_ptr, slot2, used2, rank2, scale2, M, col, N_i, R, stride_pm,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
                  PRECISION: tl.constexpr):
    """acc[n, m] += Σ_r q(scale[s_m] · part[m, r]) · B[s_m, col + n, r] over the rows, CHUNK rows a step: one
    tensor-core product of the step's rows' B blocks side by side, [BLOCK_N, CHUNK · BLOCK_R], with their v laid
    out block-diagonally, [CHUNK · BLOCK_R, BLOCK_M] (each row's v in its own column, zeros elsewhere). The rows'
    slots, ranks and scales come in registers ([BLOCK_M // CHUNK, CHUNK], loaded before the GEMM's loop), so a
    step's loads depend on no other load and Triton pipelines them; B is loaded as [BLOCK_N, CHUNK, BLOCK_R] with
    masks constant along the rank (16-byte loads), the columns past each row's rank zeroed in registers (what the
    pool holds there is not this adapter's)."""
    jj = tl.arange(0, CHUNK)
    rr = tl.arange(0, BLOCK_R)
    chunk_of = tl.arange(0, BLOCK_M // CHUNK)[:, None]
    cols = col + tl.arange(0, BLOCK_N)
    n_ok = cols < N_i
    offs_m = tl.arange(0, BLOCK_M)
    for c in range(0, tl.cdiv(M, CHUNK)):
        pick = chunk_of == c
        slot = tl.sum(tl.where(pick, slot2, 0), axis=0).to(tl.int64)
        used = tl.sum(tl.where(pick, used2.to(tl.int32), 0), axis=0) > 0
        rank = tl.sum(tl.where(pick, rank2, 0), axis=0)
        scale = tl.sum(tl.where(pick, scale2, 0.0), axis=0)
        row = c * CHUNK + jj
        live = rr[None, :] < rank[:, None]                                        # [CHUNK, BLOCK_R]
        v = tl.load(part_ptr + row[:, None] * stride_pm + rr[None, :], mask=used[:, None], other=0.0,
                    cache_modifier=".cg")
        v = tl.where(live, v, 0.0) * scale[:, None]
        v = tl.where(row[:, None, None] == offs_m[None, None, :], v[:, :, None], 0.0)   # [CHUNK, BLOCK_R, BLOCK_M]
        v = tl.reshape(v, (CHUNK * BLOCK_R, BLOCK_M))
        b = tl.load(b_ptr + slot[None, :, None] * N_i * R + cols[:, None, None] * R + rr[None, None, :],
                    mask=n_ok[:, None, None] & used[None, :, None] & (rr < R)[None, None, :], other=0.0)
        b = tl.reshape(tl.where(live[None, :, :], b, 0.0), (BLOCK_N, CHUNK * BLOCK_R))
        if PRECISION == "split":
            v_hi = v.to(b.dtype)
            acc = tl.dot(b, v_hi, acc)
            acc = tl.dot(b, (v - v_hi.to(tl.float32)).to(b.dtype), acc)
        else:
            acc = tl.dot(b.to(tl.float32), v, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _skinny_lora_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, row_slot_ptr, sorted_rows_ptr,
                        work_slot_ptr, work_start_ptr, work_end_ptr, a0, a1, a2, b0, b1, b2, rk0, rk1, rk2,
                        sc0, sc1, sc2, n0, n1, n2, num_units, lora_programs, tiles, M, N, K, R, stride_xm, stride_wn,
                        stride_ym, stride_ps, stride_pm,
                        NUM_SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
                        EVEN_K: tl.constexpr, SHRINK_EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_M: tl.constexpr,
                        BLOCK_R: tl.constexpr, SHRINK_BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
                        PARTS: tl.constexpr = 7):
    """PARTS (for timing the parts apart; 7 computes the op): 1 the shrink, 2 the wait for it, 4 the expand."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    pid = tl.program_id(0)
    if pid < lora_programs:
        # the shrink: units (work tile, slice), this program's every lora_programs-th
        if PARTS & 1:
            for u in range(pid, num_units, lora_programs):
                work = u // NUM_SLICES
                sl = u % NUM_SLICES
                slot = tl.load(work_slot_ptr + work)
                if slot >= 0:
                    start = tl.load(work_start_ptr + work)
                    end = tl.load(work_end_ptr + work)
                    a = a0
                    rk = rk0
                    if NUM_SLICES > 1:
                        a = tl.where(sl == 1, a1, a)
                        rk = tl.where(sl == 1, rk1, rk)
                    if NUM_SLICES > 2:
                        a = tl.where(sl == 2, a2, a)
                        rk = tl.where(sl == 2, rk2, rk)
                    _shrink_unit(x_ptr, a, rk, part_ptr + sl * stride_ps, sorted_rows_ptr, slot, start, end, K, R,
                                 stride_xm, stride_pm, SHRINK_EVEN_K, IEEE, TILE_M, BLOCK_R, SHRINK_BLOCK_K)
        tl.debug_barrier()   # every thread's stores before the (one-thread) release below
        tl.atomic_add(count_ptr, 1, sem="release")
    else:
        pid_n = pid - lora_programs
        col = pid_n * BLOCK_N
        # the tile's slice (a tile lies in one, checked on the host): its B, ranks, scales, v and columns
        b = b0
        rk = rk0
        sc = sc0
        part = part_ptr
        first = 0
        width = n0
        if NUM_SLICES > 1:
            second = col >= n0
            b = tl.where(second, b1, b)
            rk = tl.where(second, rk1, rk)
            sc = tl.where(second, sc1, sc)
            part = tl.where(second, part_ptr + stride_ps, part)
            first = tl.where(second, n0, first)
            width = tl.where(second, n1, width)
        if NUM_SLICES > 2:
            third = col >= n0 + n1
            b = tl.where(third, b2, b)
            rk = tl.where(third, rk2, rk)
            sc = tl.where(third, sc2, sc)
            part = tl.where(third, part_ptr + 2 * stride_ps, part)
            first = tl.where(third, n0 + n1, first)
            width = tl.where(third, n2, width)
        # the rows' slots, ranks and scales: loaded now, their latency hidden by the GEMM's loop
        row2 = tl.arange(0, BLOCK_M // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        slot2 = tl.load(row_slot_ptr + row2, mask=row2 < M, other=-1)
        used2 = slot2 >= 0
        slot2 = tl.where(used2, slot2, 0)
        rank2 = tl.minimum(tl.load(rk + slot2, mask=used2, other=0), R)
        scale2 = tl.load(sc + slot2, mask=used2, other=0.0)
        offs_n = col + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_mask = offs_n < N
        m_mask = offs_m < M
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            if EVEN_N and EVEN_K:
                w = tl.load(w_rows + offs_k[None, :])
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
            x = tl.load(x_cols + offs_k[:, None], mask=m_mask[None, :] & (offs_k < K)[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(w, x, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, x, acc)
        if PARTS & 2:
            # every LoRA program's v stored: spin on plain (volatile) loads, then one acquire, which makes their
            # stores visible (read past L1 below)
            while tl.load(count_ptr, volatile=True) < lora_programs:
                pass
            tl.atomic_add(count_ptr, 0, sem="acquire")
            tl.debug_barrier()
        if PARTS & 4:
            acc = _expand_block(acc, b, part, slot2, used2, rank2, scale2, M, col - first, width, R, stride_pm,
                                BLOCK_N, BLOCK_M, BLOCK_R, CHUNK, PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])
        passed = tl.atomic_add(count_ptr + 1, 1)
        if passed == tiles - 1:   # the last: every program has read the counter; ready for the next launch
            tl.atomic_xchg(count_ptr, 0)
            tl.atomic_xchg(count_ptr + 1, 0)
