"""Triton kernel of a decode projection with its LoRA in one launch: y = x @ wᵀ (+ bias) + each row's LoRA product.

For every row m < M with slot s = row_slot[m] ≥ 0, slice i (columns c_i … c_i + N_i of y, c_0 = 0), and
column n < N_i of that slice, with r_i = min(ranks_i[s], R) (fp32 sums, one rounding to y's dtype):

    v[m, i, r]      = Σ_k x[m, k] · A_i[s, r, k]                            for r < r_i
    y[m, c_i + n]   = round(Σ_k x[m, k] · w[c_i + n, k] + bias[c_i + n]
                            + Σ_{r < r_i} (scalings_i[s] · v[m, i, r]) · B_i[s, n, r])

Rows without an adapter get the base sum alone. The shrink and the expand run inside the GEMM's launch, on the
SMs its tiles leave: programs 0 … lora_programs-1 ("LoRA programs") (1) compute v for the batch's work tiles
(rows sharing a slot) × slices into an fp32 workspace, (2) wait until every LoRA program has, (3) compute every
row's product for the columns (BLOCK_N of them, CHUNK rows a step) into an fp32 `delta` [M, N], and count
themselves done. Meanwhile the GEMM's programs stream their [BLOCK_N, K] block of w as ops/skinny_gemm_kernels.py
does, then wait for the LoRA programs and add their block of delta (from L2) before storing y. A decode
projection is bound by reading w, and the adapters' A and B are ~10% more bytes: read beside it, by programs of
long pipelined loops, they should cost about their bytes. Measured, they do not (H200, 2026-12-02,
results/skinny_lora_v3.json): this expand took 8-95 µs a projection beside the GEMM, and an expand inside the
GEMM's programs after their loop (8 short steps a tile) 15-25 µs (results/skinny_lora_v2.json); the shrink
alone beside the GEMM costs 3-5 µs. Off by default (ops/skinny_lora.py).

The waits spin on global counters, so every LoRA program must be running while others wait: a program's role
is its arrival order (a ticket from a counter, not its program id), so the LoRA programs are the first to
start, and there are no more of them than the GPU's SMs (each holds at least one program of any kernel that
launches). The last GEMM program to finish resets the counters for the next launch (and graph replay).
Launches sharing a workspace must not run concurrently on two streams.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import pdl_start


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
def _row_meta(row_slot_ptr, rk, sc, M, R, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Every row's slot (0 where it has none), whether it has one, and its rank and scale in one slice, as
    [BLOCK_M // CHUNK, CHUNK] (chunk c's rows in row c), loaded once so that the expand's steps depend on no load."""
    row2 = tl.arange(0, BLOCK_M // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    slot2 = tl.load(row_slot_ptr + row2, mask=row2 < M, other=-1)
    used2 = slot2 >= 0
    slot2 = tl.where(used2, slot2, 0)
    rank2 = tl.minimum(tl.load(rk + slot2, mask=used2, other=0), R)
    scale2 = tl.load(sc + slot2, mask=used2, other=0.0)
    return slot2, used2, rank2, scale2


@triton.jit
def _chunk(values, c, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Row c of a [BLOCK_M // CHUNK, CHUNK] tensor (in registers: a masked sum)."""
    pick = tl.arange(0, BLOCK_M // CHUNK)[:, None] == c
    return tl.sum(tl.where(pick, values, tl.zeros_like(values)), axis=0)


@triton.jit
def _expand_step(delta_ptr, b_ptr, part_ptr, slot2, used2, rank2, scale2, c, col, first, width, M, N, R, stride_pm,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr):
    """delta[rows of chunk c, col + n] = Σ_r (scale · part[row, r]) · B[slot, col - first + n, r] in fp32 (CUDA
    cores: [BLOCK_N, CHUNK, BLOCK_R] products summed over the rank), for one slice's columns col … col + BLOCK_N.
    B is loaded with masks constant along the rank (16-byte loads, which Triton pipelines); the columns past each
    row's rank are zeroed in registers (what the pool holds there is not this adapter's)."""
    jj = tl.arange(0, CHUNK)
    rr = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    slot = _chunk(slot2, c, BLOCK_M, CHUNK).to(tl.int64)
    used = _chunk(used2.to(tl.int32), c, BLOCK_M, CHUNK) > 0
    rank = _chunk(rank2, c, BLOCK_M, CHUNK)
    scale = _chunk(scale2, c, BLOCK_M, CHUNK)
    row = c * CHUNK + jj
    live = rr[None, :] < rank[:, None]                                            # [CHUNK, BLOCK_R]
    v = tl.load(part_ptr + row[:, None] * stride_pm + rr[None, :], mask=used[:, None], other=0.0,
                cache_modifier=".cg")
    v = tl.where(live, v, 0.0) * scale[:, None]
    n_ok = (col - first + offs_n) < width
    b = tl.load(b_ptr + slot[None, :, None] * width * R + (col - first + offs_n)[:, None, None] * R + rr[None, None, :],
                mask=n_ok[:, None, None] & used[None, :, None] & (rr < R)[None, None, :], other=0.0)
    b = tl.where(live[None, :, :], b.to(tl.float32), 0.0)
    prod = tl.sum(b * v[None, :, :], axis=2)                                          # [BLOCK_N, CHUNK]
    tl.store(delta_ptr + row[None, :].to(tl.int64) * N + (col + offs_n)[:, None], prod,
             mask=(row < M)[None, :] & n_ok[:, None])


@triton.jit
def _wait_for(count_ptr, target):
    """Spin until *count_ptr ≥ target on plain (volatile) loads, then one acquire, which makes the stores released
    before each count visible (they are read past L1)."""
    while tl.load(count_ptr, volatile=True) < target:
        pass
    tl.atomic_add(count_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit(do_not_specialize=["num_units", "lora_programs", "tiles", "M"])   # one compile for every batch
def _skinny_lora_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, delta_ptr, count_ptr, row_slot_ptr,
                        sorted_rows_ptr, work_slot_ptr, work_start_ptr, work_end_ptr, a0, a1, a2, b0, b1, b2,
                        rk0, rk1, rk2, sc0, sc1, sc2, n0, n1, n2, num_units, lora_programs, tiles, M, N, K, R,
                        stride_xm, stride_wn, stride_ym, stride_ps, stride_pm,
                        NUM_SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
                        EVEN_K: tl.constexpr, SHRINK_EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_M: tl.constexpr,
                        BLOCK_R: tl.constexpr, SHRINK_BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
                        PARTS: tl.constexpr = 7):
    """PARTS (for timing the parts apart; 7 computes the op): 1 the shrink, 2 the waits, 4 the expand."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    # roles by arrival, not by program id: the first lora_programs programs to start are the LoRA programs, so
    # each one another waits for is already running, whatever order the GPU places programs in
    pid = tl.atomic_add(count_ptr + 3, 1)
    if pid < lora_programs:
        # 1. the shrink: units (work tile, slice), this program's every lora_programs-th
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
        # 2. every LoRA program's v stored (they all run at once: the lowest program ids, within the GPU's room)
        if PARTS & 2:
            _wait_for(count_ptr, lora_programs)
        # 3. the expand into delta: steps (column tile, chunk of rows), this program's every lora_programs-th
        if PARTS & 4:
            slot2, used2, rank2, scale2 = _row_meta(row_slot_ptr, rk0, sc0, M, R, BLOCK_M, CHUNK)
            if NUM_SLICES > 1:
                rank2_1 = tl.minimum(tl.load(rk1 + slot2, mask=used2, other=0), R)
                scale2_1 = tl.load(sc1 + slot2, mask=used2, other=0.0)
            if NUM_SLICES > 2:
                rank2_2 = tl.minimum(tl.load(rk2 + slot2, mask=used2, other=0), R)
                scale2_2 = tl.load(sc2 + slot2, mask=used2, other=0.0)
            chunks = tl.cdiv(M, CHUNK)
            # no branch in the loop (Triton pipelines loads only outside conditionals): each step picks its
            # slice's B, v, ranks and scales by selects
            for it in tl.range(pid, tiles * chunks, lora_programs, num_stages=3):
                col = (it // chunks) * BLOCK_N
                c = it % chunks
                b = b0
                part = part_ptr
                rank = rank2
                scale = scale2
                first = 0
                width = n0
                if NUM_SLICES > 1:
                    second = col >= n0
                    b = tl.where(second, b1, b)
                    part = tl.where(second, part_ptr + stride_ps, part)
                    rank = tl.where(second, rank2_1, rank)
                    scale = tl.where(second, scale2_1, scale)
                    first = tl.where(second, n0, first)
                    width = tl.where(second, n1, width)
                if NUM_SLICES > 2:
                    third = col >= n0 + n1
                    b = tl.where(third, b2, b)
                    part = tl.where(third, part_ptr + 2 * stride_ps, part)
                    rank = tl.where(third, rank2_2, rank)
                    scale = tl.where(third, scale2_2, scale)
                    first = tl.where(third, n0 + n1, first)
                    width = tl.where(third, n2, width)
                _expand_step(delta_ptr, b, part, slot2, used2, rank, scale, c, col, first, width, M, N, R, stride_pm,
                             BLOCK_N, BLOCK_M, BLOCK_R, CHUNK)
        tl.debug_barrier()
        tl.atomic_add(count_ptr + 1, 1, sem="release")
    else:
        pid_n = pid - lora_programs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
        if PARTS & 2:   # every LoRA program's products stored
            _wait_for(count_ptr + 1, lora_programs)
        out_mask = n_mask[:, None] & m_mask[None, :]
        if PARTS & 4:
            acc += tl.load(delta_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None], mask=out_mask, other=0.0,
                           cache_modifier=".cg")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)
        passed = tl.atomic_add(count_ptr + 2, 1)
        if passed == tiles - 1:   # the last: every program has read the counters; ready for the next launch
            tl.atomic_xchg(count_ptr, 0)
            tl.atomic_xchg(count_ptr + 1, 0)
            tl.atomic_xchg(count_ptr + 2, 0)
            tl.atomic_xchg(count_ptr + 3, 0)
