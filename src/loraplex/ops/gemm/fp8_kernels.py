"""Triton kernel of a projection with FP8 weights for few rows (decode steps): y = x @ wᵀ (+ bias), weight-only
(x [M, K] in the model's dtype) or W8A8 (X_E4M3 below), w given as e4m3 `q [N, K]` and fp32 scales over blocks (ops/gemm/fp8.py's
`Fp8Matrix`: w[n, k] = q[n, k] · scale[n // scale_bn, k // scale_bk]).

For every row m < M and column n < N (fp32 sums, rounded once to y's dtype):

    y[m, n] = round(Σ_j scale[n // scale_bn, j] · (Σ_{k in K block j} x[m, k] · q[n, k]) + bias[n])

with one K block (scale_bk ≥ K: a scale per output column) the scale multiplies the whole sum once, in the
epilogue; with several (128-wide blocks) each block's partial sum is scaled as it is accumulated, so BLOCK_K divides
scale_bk and a K step never straddles two scales. With SPLIT_K > 1, as in the dense kernel, split s sums
k in [s · k_per_split, (s + 1) · k_per_split) (whole K steps) and the split that finishes last for its n tile adds
the fp32 partials in split order before the column scale and the bias (kernels.py's `_split_sum`). q's values are
exact in x's dtype (e4m3's 3-bit mantissa and range fit fp16 and bf16), so the products are those of dequantizing
first, up to the scale's rounding.

For bf16 x on the GPU (FAST_BF16) q's bytes become bf16 by integer operations, four at a time (ops/e4m3.py):
Triton's own conversion bound the kernel below the memory's rate. With X_E4M3 (W8A8) x arrives quantized a row,
x ≈ xq · sx[m] (quantize_kernel.py's `quantize_rows_fused`), q goes into the FP8 tensor cores as it is, no
conversion, and the epilogue multiplies row m by sx[m]:

    y[m, n] = round(sx[m] · Σ_j scale[n // scale_bn, j] · (Σ_{k in K block j} xq[m, k] · q[n, k]) + bias[n])

Hopper's e4m3 MMAs add into their accumulator with fewer bits than fp32's (Triton lets them by default), so each K
step's sum joins the fp32 sum by an fp32 add, as block-scaled FP8 GEMMs do.

As ops/gemm/kernels.py's dense kernel (whose layout this follows: w's rows on the MMA's long side, 32 rows of x
filling a Hopper wgmma's N), decode is bound by reading the weight, here half the bytes: program (n tile, split)
streams a [BLOCK_N, K / SPLIT_K] block of q beside x's [BLOCK_M, K / SPLIT_K] (16 bits, 8 with X_E4M3). With
32-column tiles 16-bit x's bytes are twice q's; a K split lets wider tiles keep enough programs. An e4m3 wgmma has
64 rows at least (Triton lowers narrower e4m3 dots to fp16 `mma.sync`), so W8A8 tiles of w are 64 rows or more, and
o's and down's 4,096 columns make 64 programs, half an H100's SMs; SWAP_AB puts x's rows (padded to 64: masked, never
read) on the long side and w's BLOCK_N rows on the short one, where 16 or 32 make more programs, each reading all
of x's K block beside its own.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..e4m3 import e4m3_to_bf16
from ..pdl import pdl_deferred_start, pdl_start
from .kernels import _split_sum, prefetch_rows


@triton.jit
def _fp8_skinny_kernel(x_ptr, q_ptr, s_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, r_ptr, M, N, K, k_per_split,
                       stride_xm, stride_qn, stride_sn, stride_ym, scale_bn, scale_bk, HAS_BIAS: tl.constexpr,
                       PER_STEP_SCALE: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                       FAST_BF16: tl.constexpr, X_E4M3: tl.constexpr, PREFETCH: tl.constexpr, SPLIT_K: tl.constexpr,
                       SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pdl_start(PREFETCH > 0)   # ops/pdl.py: with PDL, wait for the grids before this one (after PREFETCH)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH > 0:   # q's first bytes into L2 while the kernel before finishes (kernels.py's prefetch_rows)
        prefetch_rows(q_ptr, offs_n, N, stride_qn, k_lo, k_hi, PREFETCH, 128)
    pdl_deferred_start(PREFETCH > 0)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    q_rows = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    x_at = x_ptr + offs_m.to(tl.int64) * stride_xm
    s_rows = s_ptr + (offs_n // scale_bn).to(tl.int64) * stride_sn
    if SWAP_AB:   # acc is yᵀ's tile until the loop ends
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_N and EVEN_K:   # N and K multiples of the tiles (published widths): no masks on q
            q = tl.load(q_rows + offs_k[None, :])
        else:
            q = tl.load(q_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < k_hi)[None, :], other=0.0)
        if X_E4M3:
            w = q
        elif FAST_BF16:
            w = e4m3_to_bf16(q)
        else:
            w = q.to(x_ptr.dtype.element_ty)
        k_mask = offs_k < k_hi
        if SWAP_AB:   # x [BLOCK_M, BLOCK_K] on the MMA's long side, wᵀ (K-major, as an e4m3 wgmma's B must be)
            x = tl.load(x_at[:, None] + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = _dot_step(acc, x, tl.trans(w), s_rows, k, scale_bk, n_mask, 1, PER_STEP_SCALE, IEEE, X_E4M3,
                            BLOCK_K)
        else:
            x = tl.load(x_at[None, :] + offs_k[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0)
            acc = _dot_step(acc, w, x, s_rows, k, scale_bk, n_mask, 0, PER_STEP_SCALE, IEEE, X_E4M3, BLOCK_K)
    if SWAP_AB:
        acc = tl.trans(acc)
    out_mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    r_rows = r_ptr + offs_m
    if SPLIT_K == 1:
        _store_y(acc, s_rows, r_rows, bias_ptr, y_ptrs, offs_n, n_mask, m_mask, out_mask, HAS_BIAS, PER_STEP_SCALE,
                 X_E4M3)
    else:
        last, total = _split_sum(acc, part_ptr, count_ptr, pid_n, pid_k, offs_m, offs_n, out_mask, N, SPLIT_K,
                                 BLOCK_M)
        if last:
            _store_y(total, s_rows, r_rows, bias_ptr, y_ptrs, offs_n, n_mask, m_mask, out_mask, HAS_BIAS,
                     PER_STEP_SCALE, X_E4M3)


@triton.jit
def _dot_step(acc, a, b, s_rows, k, scale_bk, n_mask, N_AXIS: tl.constexpr, PER_STEP_SCALE: tl.constexpr,
              IEEE: tl.constexpr, X_E4M3: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a @ b for one K step, w's rows along acc's axis N_AXIS: scaled by this step's K block's scale of each
    row of q (PER_STEP_SCALE), in full fp32 products for fp32 x (IEEE), each e4m3 step's sum added in fp32 (X_E4M3)."""
    if PER_STEP_SCALE:
        s = tl.load(s_rows + k // scale_bk, mask=n_mask, other=0.0)
        s = s[:, None] if N_AXIS == 0 else s[None, :]
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee") * s
        else:
            acc += tl.dot(a, b) * s
    elif IEEE:   # fp32 activations: full fp32 products, not TF32
        acc = tl.dot(a, b, acc, input_precision="ieee")
    elif X_E4M3:   # each K step's e4m3 products summed apart, then added in fp32 (the docstring)
        acc += tl.dot(a, b, max_num_imprecise_acc=BLOCK_K)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _store_y(acc, s_rows, r_rows, bias_ptr, y_ptrs, offs_n, n_mask, m_mask, out_mask, HAS_BIAS: tl.constexpr,
             PER_STEP_SCALE: tl.constexpr, X_E4M3: tl.constexpr):
    """y = round(acc · the column's scale (one K block) · the row's sx (X_E4M3) + bias)."""
    if not PER_STEP_SCALE:
        acc *= tl.load(s_rows, mask=n_mask, other=0.0)[:, None]
    if X_E4M3:
        acc *= tl.load(r_rows, mask=m_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=out_mask)
