"""Triton kernel that quantizes the W8A8 GEMMs' activations a row at a time, and its launcher.

`quantize_rows_fused`, for the prompt GEMM (ops/gemm/fp8.py's `w8a8_linear`) and the decode kernel's W8A8
(fp8_kernels.py's X_E4M3): for every row m < M of x [M, K] (fp32 arithmetic, IEEE-rounded divisions), bit for bit
fp8.quantize_rows, the torch code it replaces on the GPU:

    s[m] = amax_k |x[m, k]| / 448            (1 where the row is all zeros)
    xq[m, k] = e4m3(clamp(x[m, k] / s[m], -448, 448))      (rounded to nearest, ties to even)

One program a row holds the whole row in registers: x is read once and the result written once (torch's
element-wise and reduction kernels moved the row in fp32 several times).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..e4m3 import to_e4m3
from ..launch import Launcher, num_sms, pow2
from ..pdl import pdl_start

MAX_K = 65536   # a row in one program's registers: 64 fp32 values a thread at 32 warps
PROMPT_CAPPED_BLOCK = 16384   # the widest block measured at 16 warps (`quantize_warps`)


def quantize_warps(M: int, block: int, sms: int) -> int:
    """Warps a program for rows of `block` lanes: ~16 values a thread, at most 32 warps, and at most 16 for blocks
    of up to 16,384 lanes once there are more rows than SMs. There a row of 11,008 or 14,336 values in 32 warps
    held an SM alone, its loads, reduction and stores in turn: ~1.5× the time of 16 warps (H100, prompt rows;
    docs/design-notes.md). Wider rows (unmeasured) keep 32 warps, as a decode step's 32 rows do."""
    cap = 16 if M > sms and block <= PROMPT_CAPPED_BLOCK else 32
    return min(cap, max(4, block // 512))


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    store_quantized_row(x, offs, mask, q_ptr + row * stride_q, s_ptr + row)


@triton.jit
def store_quantized_row(x, offs, mask, q_row, s_at):
    """The docstring's row quantization of a whole row x (fp32, 0 where masked off), stored: q at q_row + offs,
    s at s_at. Also the RMSNorm kernels' (ops/fused), which quantize the row they write."""
    amax = tl.max(tl.abs(x), axis=0)
    s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    tl.store(q_row + offs, to_e4m3(tl.math.div_rn(x, s)), mask=mask)
    tl.store(s_at, s)


_QUANTIZE = Launcher(_quantize_rows_kernel)


def quantize_rows_fused(x: torch.Tensor, xq: torch.Tensor | None = None,
                        s: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq e4m3 [M, K], s fp32 [M, 1]) of x [M, K] (fp32, fp16 or bf16, unit stride along K), in one launch;
    into `xq` and `s` where given (contiguous, of those shapes and dtypes: the callers' own buffers)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"quantize_rows_fused takes a 2-D float tensor with unit stride along K, not {x.dtype} "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    M, K = x.shape
    if K > MAX_K:
        raise ValueError(f"quantize_rows_fused: rows of {K} values, more than {MAX_K}")
    xq = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device) if xq is None else xq
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device) if s is None else s
    if M and K:
        block = pow2(K)
        _QUANTIZE((M,), (x, xq, s, K, x.stride(0), xq.stride(0)), dict(BLOCK=block),
                  quantize_warps(M, block, num_sms(x.device)), 1)
    return xq, s
