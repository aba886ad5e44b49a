"""Triton kernels that prepare the FP8 GEMMs' activations a row at a time, and their launchers.

`quantize_rows_fused`, for the prompt GEMM (ops/gemm/fp8.py's `w8a8_linear`): for every row m < M of x [M, K]
(fp32 arithmetic, IEEE-rounded divisions), bit for bit fp8.quantize_rows, the torch code it replaces on the GPU:

    s[m] = amax_k |x[m, k]| / 448            (1 where the row is all zeros)
    xq[m, k] = e4m3(clamp(x[m, k] / s[m], -448, 448))      (rounded to nearest, ties to even)

`rows_to_f16`, for the decode GEMM's fp16 route (fp8_kernels.py's X_F16): each row scaled by a power of two into
fp16's range, so that its bf16 values convert exactly (down to 2^-31 of the row's largest):

    e[m] = clamp(floor(log2(amax_k |x[m, k]|)) - 14, -100, 113)     (0 where the row is all zeros)
    x16[m, k] = fp16(x[m, k] · 2^-e[m])       (its largest value in [2^14, 2^15))
    r[m] = 2^e[m]

One program a row holds the whole row in registers: x is read once and the result written once (torch's
element-wise and reduction kernels moved the row in fp32 several times).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..e4m3 import f16_range_scales, round_to_e4m3
from ..launch import Launcher, pow2
from ..pdl import pdl_start

MAX_K = 65536   # a row in one program's registers: 64 fp32 values a thread at 32 warps


@triton.jit
def _load_row(x_ptr, K, stride_x, BLOCK: tl.constexpr):
    """(row, offs, mask, x in fp32) of program program_id(0)'s row: both kernels' first load."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    return row, offs, mask, tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    row, offs, mask, x = _load_row(x_ptr, K, stride_x, BLOCK)
    amax = tl.max(tl.abs(x), axis=0)
    s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = round_to_e4m3(tl.math.div_rn(x, s))   # exact in e4m3: the cast below does not round
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, s)


@triton.jit
def _rows_to_f16_kernel(x_ptr, y_ptr, r_ptr, K, stride_x, stride_y, BLOCK: tl.constexpr):
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    row, offs, mask, x = _load_row(x_ptr, K, stride_x, BLOCK)
    down, up = f16_range_scales(tl.max(tl.abs(x), axis=0))   # 2^-e and 2^e
    tl.store(y_ptr + row * stride_y + offs, (x * down).to(tl.float16), mask=mask)
    tl.store(r_ptr + row, up)


_QUANTIZE = Launcher(_quantize_rows_kernel)
_TO_F16 = Launcher(_rows_to_f16_kernel)


def _check_rows(name: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...], what: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in dtypes:
        raise ValueError(f"{name} takes a 2-D {what} tensor with unit stride along K, not {x.dtype} "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    if x.shape[1] > MAX_K:
        raise ValueError(f"{name}: rows of {x.shape[1]} values, more than {MAX_K}")


def _launch_rows(launcher: Launcher, x: torch.Tensor, outs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A program a row of x into outs (the row-wise output, the per-row scalars)."""
    M, K = x.shape
    if M and K:
        block = pow2(K)
        launcher((M,), (x, *outs, K, x.stride(0), outs[0].stride(0)), dict(BLOCK=block),
                 min(32, max(4, block // 512)), 1)


def quantize_rows_fused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq e4m3 [M, K], s fp32 [M, 1]) of x [M, K] (fp32, fp16 or bf16, unit stride along K), in one launch."""
    _check_rows("quantize_rows_fused", x, (torch.float32, torch.float16, torch.bfloat16), "float")
    xq = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    _launch_rows(_QUANTIZE, x, (xq, s))
    return xq, s


def rows_to_f16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x16 fp16 [M, K], r fp32 [M]) of x [M, K] (bf16 or fp16, unit stride along K), x = x16 · r a row (module
    docstring), in one launch."""
    _check_rows("rows_to_f16", x, (torch.float16, torch.bfloat16), "bf16 or fp16")
    y = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    r = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _launch_rows(_TO_F16, x, (y, r))
    return y, r
