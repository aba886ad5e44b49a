"""Triton kernel of a projection for few rows (decode steps): y = x @ wᵀ (+ bias), x [M, K] with M ≤ 64.

For every row m < M and column n < N (fp32 sums, rounded once to y's dtype):

    y[m, n] = round(Σ_{s < SPLIT_K} (Σ_{k in split s} x[m, k] · w[n, k]) + bias[n])

where split s covers k in [s · k_per_split, min((s + 1) · k_per_split, K)), the splits summed in s order (within
a split, `tl.dot`'s fp32 accumulation order is the MMA's). At decode the
projection is bound by reading w (a 7B layer's four weights are 404 MB against 2 MB of x and y), and cuBLAS's
kernels for 32 rows read it at 0.70-0.91 of the copy bandwidth on an H200 (o's and down's with a split-K
reduce launch after them). Here program (n tile, k split) streams a
[BLOCK_N, K / SPLIT_K] block of w through a pipelined `tl.dot` with xᵀ (w's rows on the MMA's long side, so
32 rows of x fill a Hopper wgmma's N = 32), and with SPLIT_K > 1 the split that finishes last for its n tile
(a counter per tile, reset by that program, so graphs replay) sums the fp32 partials in split order and stores
y: one launch, and the same bits whichever split finishes last.

With PDL (ops/pdl.py) a program first asks L2 for the first PREFETCH elements of each of its weight rows
(`prefetch_rows`, skinny.PREFETCH_BYTES), then waits for the kernel before it: the weight starts streaming while
that kernel finishes (docs/design-notes.md has the measurements).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import pdl_deferred_start, pdl_start


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_per_split, stride_xm,
                        stride_wn, stride_ym, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_N: tl.constexpr,
                        EVEN_K: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pdl_start(PREFETCH > 0)   # ops/pdl.py: with PDL, wait for the grids before this one (after PREFETCH)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PREFETCH > 0:
        prefetch_rows(w_ptr, offs_n, N, stride_wn, k_lo, k_hi, PREFETCH,
                      1024 // w_ptr.dtype.element_ty.primitive_bitwidth)   # (LINE: the elements of 128 bytes)
    pdl_deferred_start(PREFETCH > 0)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_N and EVEN_K:   # N and K multiples of the tiles (Llama's widths): no masks on w
            w = tl.load(w_rows + offs_k[None, :])
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < k_hi)[None, :], other=0.0)
        x = tl.load(x_cols + offs_k[:, None], mask=m_mask[None, :] & (offs_k < k_hi)[:, None], other=0.0)
        if IEEE:   # fp32 weights: full fp32 products, not TF32
            acc = tl.dot(w, x, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x, acc)
    out_mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        last, total = _split_sum(acc, part_ptr, count_ptr, pid_n, pid_k, offs_m, offs_n, out_mask, N, SPLIT_K,
                                 BLOCK_M)
        if last:
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_sum(acc, part_ptr, count_ptr, pid_n, pid_k, offs_m, offs_n, out_mask, N, SPLIT_K: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """(last, total) of split pid_k's fp32 sums `acc` ([BLOCK_N, BLOCK_M]) for n tile pid_n: true and the splits'
    sum in split order for the split that finishes last, which also resets the tile's counter (for the next launch
    and graph replays); false for the others. Also the FP8 kernel's (fp8_kernels.py)."""
    # part: [SPLIT_K, BLOCK_M, N] fp32, this split's sums; the counter's acq_rel atomic orders them before the
    # last split's loads, which bypass L1 (.cg: other SMs wrote them)
    tile = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
    tl.store(part_ptr + pid_k.to(tl.int64) * BLOCK_M * N + tile, acc, mask=out_mask)
    tl.debug_barrier()   # every thread's partials stored before the (one-thread) release below
    done = tl.atomic_add(count_ptr + pid_n, 1)
    last = done == SPLIT_K - 1
    total = acc
    if last:
        total = tl.load(part_ptr + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(part_ptr + s * BLOCK_M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + pid_n, 0)   # ready for the next launch (and graph replay)
    return last, total


@triton.jit
def prefetch_rows(w_ptr, offs_n, N, stride_wn, k_lo, k_hi, SPAN: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the first SPAN elements from k_lo (up to k_hi) of the weight rows offs_n, one `prefetch` a
    128-byte line of LINE elements (SPAN a power-of-two multiple of LINE: skinny.prefetch_elements); rows past N
    read row N - 1's and columns past k_hi column k_hi - 1's, so that every address is the weight's. The GEMMs'
    early reads (ops/pdl.py): before the PDL wait, so that a program's weight starts streaming while the kernel
    before it finishes."""
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    cols = tl.minimum(k_lo + tl.arange(0, SPAN // LINE) * LINE, k_hi - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [w_ptr + rows[:, None] * stride_wn + cols[None, :]], dtype=tl.int32, is_pure=False,
                              pack=1)
