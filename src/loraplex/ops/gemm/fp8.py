"""Projections with FP8 (e4m3) weights: `Fp8Matrix`, the GEMM's view of one, and `linear`, which picks its GEMM.

    w[n, k] = q[n, k] · scale[n // block_n, k // block_k]        (q e4m3 [N, K], scale fp32, block = (bn, bk))

`linear(x, m, bias)` = x @ wᵀ + bias by the first of:
- decode rows (1 to DECODE_MAX_ROWS) on GPUs with FP8 conversions (compute capability 8.9 on), where the
  dense Triton GEMM would run (LORAPLEX_SKINNY_GEMM): `fp8_skinny_linear` (fp8_kernels.py, half the bytes of a
  bf16 weight read), W8A8 where LORAPLEX_FP8_W8A8 takes it (`decode_w8a8`: each row of x quantized to e4m3 by its
  amax first, q read by the FP8 tensor cores as it is: a Llama-2-7B layer at 32 rows in 93 µs against 111 µs
  weight-only, H100), else weight-only (q's tiles converted to x's dtype in registers);
- other rows (prompts; decode rows too where the Triton kernel is off), a scale per output column, bf16 x, on
  Hopper GPUs (LORAPLEX_FP8_W8A8 "auto", read at import; "on": bf16 or fp16 anywhere torch._scaled_mm runs, the
  CPU included; "off" never): `w8a8_linear`, the FP8 tensor cores with each row of x quantized to e4m3 by its
  own amax (dynamic per-token scales) — the W8A8 path, approximate. "auto" keeps to what cuBLASLt's row-wise
  scaled GEMM takes on every torch this runs with (bf16 output, sm_90);
- else w dequantized to x's dtype for this call and cuBLAS (the CPU's reference path, and 128×128 block scales
  for prompts).
The LoRA kernels read x as it is: the activations are quantized for the base GEMM only. Where `quantizes_x` says
a GEMM quantizes x, the op that makes x may quantize it as it writes it (ops/fused's RMSNorm): `linear`'s `x_e4m3`,
the same bits as `quantize_rows(x)`, spares the GEMM its quantize launch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ... import envs
from . import skinny
from .fp8_tiles import default_config, fitted_config
from .quantized_rows import QuantizedRows

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
W8A8 = envs.fp8_w8a8()   # "auto", "on" or "off"
_KERNEL = []   # its Launcher, made on first use: Triton is imported only where the kernel runs
W8A8_MIN_K = 32   # the K step of Triton's e4m3 dots


@dataclass(frozen=True)
class Fp8Matrix:
    """An FP8 weight as the GEMMs read it (the module docstring's formula). `input_scale`: a checkpoint's static
    activation scales (one per fused part), not used by these GEMMs."""

    qweight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """w in `dtype`: each product rounded once from fp32."""
        out, cols = self.qweight.shape
        rows_n, cols_n = self.scale.shape
        bn, bk = self.block
        full = self.scale[:, None, :, None].expand(rows_n, bn, cols_n, bk).reshape(rows_n * bn, cols_n * bk)
        return (self.qweight.to(torch.float32) * full[:out, :cols]).to(dtype)


def linear(x: torch.Tensor, m: Fp8Matrix, bias: torch.Tensor | None = None,
           x_e4m3: QuantizedRows | None = None) -> torch.Tensor:
    """x @ wᵀ (+ bias) by the GEMM the module docstring picks (`route`); `x_e4m3`: x already quantized
    (`quantize_rows`'s bits), where the GEMM quantizes x (`quantizes_x`); elsewhere it is refused."""
    gemm = route(x, m)
    if gemm in (DECODE_W8A8, DECODE_WEIGHT_ONLY):   # (fp8_skinny_linear refuses x_e4m3 where it reads x weight-only)
        return fp8_skinny_linear(x, m, bias, quantize_x=gemm == DECODE_W8A8, x_e4m3=x_e4m3)
    if gemm == PROMPT_W8A8:
        return w8a8_linear(x, m, bias, x_e4m3)
    if x_e4m3 is not None:
        raise ValueError("fp8.linear: x_e4m3 is given but this GEMM dequantizes the weight and reads x as it is")
    return F.linear(x, m.dequantize(x.dtype), bias)


# The GEMMs `linear` picks among (`route`)
DECODE_W8A8, DECODE_WEIGHT_ONLY, PROMPT_W8A8, DEQUANTIZED = "decode-w8a8", "decode-weight-only", "w8a8", "dequantized"


def route(x: torch.Tensor, m: Fp8Matrix) -> str:
    """Which GEMM `linear(x, m)` runs, in the module docstring's order: the Triton decode kernel W8A8 or weight-only,
    `w8a8_linear`, or the weight dequantized. x may stand in for the input: its shape, dtype, device and strides
    decide."""
    if takes_input(x, m):
        return DECODE_W8A8 if decode_w8a8(x, m) else DECODE_WEIGHT_ONLY
    return PROMPT_W8A8 if w8a8_takes(x, m) else DEQUANTIZED


def quantizes_x(x: torch.Tensor, m: Fp8Matrix) -> bool:
    """Does `linear(x, m)` quantize x a row (the decode kernel's W8A8 or `w8a8_linear`), so that x quantized by
    the op that makes it (`x_e4m3`) spares it a launch?"""
    return route(x, m) in (DECODE_W8A8, PROMPT_W8A8)


def takes_input(x: torch.Tensor, m: Fp8Matrix) -> bool:
    """Does `linear(x, m)` run the Triton decode kernel (so that ops/lora/overlap.py may order a shrink after it,
    as after the dense Triton GEMM; with W8A8 the quantize launch before it changes nothing there: every launch
    waits for the one before)?"""
    if x.dim() != 2 or not 0 < x.shape[0] <= skinny.DECODE_MAX_ROWS or x.stride(1) != 1:
        return False
    if not _kernel_reads(m, x):
        return False
    if not skinny.takes(x.dtype, x.device):
        return False
    return not x.is_cuda or fp8_capable(x.device.index)


def decode_w8a8(x: torch.Tensor, m: Fp8Matrix) -> bool:
    """Does the decode kernel quantize x (W8A8) rather than convert q (weight-only)? LORAPLEX_FP8_W8A8 as for
    prompts: "auto" for bf16 on Hopper GPUs, "on" for bf16 and fp16 anywhere, "off" never; and scale blocks at
    least W8A8_MIN_K wide along K (an e4m3 dot's K step)."""
    return _w8a8_setting_takes(x) and not (m.scale.shape[1] > 1 and m.block[1] < W8A8_MIN_K)


def w8a8_takes(x: torch.Tensor, m: Fp8Matrix) -> bool:
    """Does `linear(x, m)` take `w8a8_linear` (see the module docstring)?"""
    if x.dim() != 2 or not _w8a8_setting_takes(x):
        return False
    if m.qweight.dtype != FP8 or tuple(m.scale.shape) != (m.shape[0], 1) or m.scale.dtype != torch.float32:
        return False   # a scale per output column only
    n, k = m.shape
    return not (n % 16 or k % 16)   # cuBLASLt's FP8 GEMMs' alignment


def _w8a8_setting_takes(x: torch.Tensor) -> bool:
    """LORAPLEX_FP8_W8A8 for x: "auto" bf16 on Hopper GPUs, "on" bf16 or fp16 anywhere, "off" never."""
    if W8A8 == "off" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return W8A8 == "on" or x.dtype == torch.bfloat16 and _on_hopper(x.device)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x / s, fp32 s [rows, 1]), s = amax(|x[row]|) / E4M3_MAX a row (1 for an all-zero row, whose values
    stay 0), rounded to nearest (ties to even): activations per token here, weights per output channel at load
    (models/fp8/checkpoint.py). The clamp keeps a row's largest value finite where the division rounds it a hair
    past E4M3_MAX."""
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=1, keepdim=True)
    # A tensor divisor: CUDA torch multiplies by a Python scalar's reciprocal, which can round s an ulp away from
    # the division (and the CPU's, and quantize_kernel.py's, result).
    s = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    return (x32 / s).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8), s


def _quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(x)`: on a GPU in one launch (quantize_kernel.py, the same bits)."""
    if x.is_cuda:
        from .quantize_kernel import quantize_rows_fused
        return quantize_rows_fused(x)
    return quantize_rows(x)


def w8a8_linear(x: torch.Tensor, m: Fp8Matrix, bias: torch.Tensor | None = None,
                x_e4m3: QuantizedRows | None = None) -> torch.Tensor:
    """x @ wᵀ (+ bias) on the FP8 tensor cores: y[i, n] = round(sx[i] · scale[n, 0] · Σ_k xq[i, k] · q[n, k] +
    bias[n]), (xq, sx) = `quantize_rows(x)` (on a GPU in one launch: quantize_kernel.py), or `x_e4m3` where given;
    w must have a scale per output column."""
    if x_e4m3 is not None:
        x_e4m3.check(x, "w8a8_linear: x_e4m3")
        xq, sx = x_e4m3.q, x_e4m3.scale
    else:
        xq, sx = _quantized(x)
    y = torch._scaled_mm(xq, m.qweight.t(), scale_a=sx, scale_b=m.scale.view(1, -1), out_dtype=x.dtype)
    return y if bias is None else y.add_(bias)


def fp8_skinny_linear(x: torch.Tensor, m: Fp8Matrix, bias: torch.Tensor | None = None,
                      config: skinny.SkinnyConfig | None = None, quantize_x: bool = False,
                      x_e4m3: QuantizedRows | None = None) -> torch.Tensor:
    """x [M, K] @ wᵀ (+ bias [N]) into a new [M, N] tensor of x's dtype, M ≤ skinny.MAX_ROWS, by fp8_kernels.py's
    kernel; x, bias of one float dtype on q's device, unit stride along K. `quantize_x`: W8A8, x (bf16 or fp16)
    quantized a row by `quantize_rows` first (on a GPU in one launch) or given so (`x_e4m3`), else weight-only."""
    M, K = _check(x, m, bias)
    if quantize_x and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_skinny_linear: quantize_x takes bf16 or fp16 x, not {x.dtype}")
    if x_e4m3 is not None:
        if not quantize_x:
            raise ValueError("fp8_skinny_linear: x_e4m3 is given but quantize_x is off (weight-only reads x)")
        x_e4m3.check(x, "fp8_skinny_linear: x_e4m3")
    N = m.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if config is None:
        config = default_config(N, K, x.device, w8a8=quantize_x)
    if config.swap_ab and not quantize_x:
        raise ValueError(f"fp8_skinny_linear: {config} has swap_ab, which takes W8A8 (quantize_x) only")
    if quantize_x and _k_step(m, K, config.block_k) < W8A8_MIN_K:
        raise ValueError(f"fp8_skinny_linear: quantize_x needs K steps of at least {W8A8_MIN_K}; scale blocks "
                         f"{m.block} and tiles {config} give {_k_step(m, K, config.block_k)}")
    if x_e4m3 is not None:
        x, r = x_e4m3.q, x_e4m3.scale
    else:
        x, r = _quantized(x) if quantize_x else (x, m.scale)   # (r unread weight-only)
    config = fitted_config(config, x)
    block_k = _k_step(m, K, config.block_k)
    per_step = m.scale.shape[1] > 1
    split, k_per_split = skinny.split_plan(K, block_k, config.split_k)   # (whole K steps: none straddles a scale)
    part, count = skinny.split_buffers(x.device, split, N) if split > 1 else (out, out)
    args = (x, m.qweight, m.scale, bias if bias is not None else out, out, part, count, r, M, N, K, k_per_split,
            x.stride(0), m.qweight.stride(0), m.scale.stride(0), out.stride(0), m.block[0], m.block[1])
    if not _KERNEL:
        from ..launch import Launcher
        from .fp8_kernels import _fp8_skinny_kernel
        _KERNEL.append(Launcher(_fp8_skinny_kernel))
    consts = dict(HAS_BIAS=bias is not None, PER_STEP_SCALE=per_step, EVEN_N=N % config.block_n == 0,
                  EVEN_K=K % block_k == 0, IEEE=x.dtype == torch.float32,
                  # bf16 x on the GPU: q converted by ops/e4m3.py's inline PTX (compiled kernels only)
                  FAST_BF16=x.dtype == torch.bfloat16 and x.is_cuda and _KERNEL[0].compiles, X_E4M3=quantize_x,
                  PREFETCH=skinny.prefetch_elements(m.qweight, _KERNEL[0].compiles), SPLIT_K=split,
                  SWAP_AB=config.swap_ab, BLOCK_M=skinny.tile_rows(config, M), BLOCK_N=config.block_n,
                  BLOCK_K=block_k)
    _KERNEL[0]((-(-N // config.block_n), split), args, consts, config.warps, config.stages)
    return out


def _k_step(m: Fp8Matrix, K: int, wanted: int = 128) -> int | None:
    """The kernel's K step: `wanted` where one scale spans all of K, else at most the scale block's width and
    dividing it (None where the block is not a power of two of at least 16: such weights are dequantized)."""
    if m.scale.shape[1] == 1:
        return wanted
    bk = m.block[1]
    if bk < 16 or bk & (bk - 1):
        return None
    return min(wanted, bk)


def _matrix_fault(m: Fp8Matrix, K: int) -> str | None:
    """Why the kernel cannot read m for inputs of K columns (None: it can). `linear` dequantizes such a matrix;
    `fp8_skinny_linear` refuses it with this reason."""
    if m.qweight.dim() != 2 or m.scale.dim() != 2:
        return f"qweight and scale must be 2-D, got {tuple(m.qweight.shape)} and {tuple(m.scale.shape)}"
    if m.shape[1] != K:
        return f"x has K = {K} columns but qweight {tuple(m.shape)} has {m.shape[1]}"
    if m.qweight.dtype != FP8 or m.scale.dtype != torch.float32:
        return f"qweight must be {FP8} and scale float32, got {m.qweight.dtype} and {m.scale.dtype}"
    if m.qweight.stride(1) != 1 or m.scale.stride(1) != 1:
        return "qweight and scale must have unit stride along their last dimension"
    grid = (-(-m.shape[0] // m.block[0]), -(-K // m.block[1]))
    if tuple(m.scale.shape) != grid:
        return f"scale has shape {tuple(m.scale.shape)}, expected {grid} for blocks {m.block}"
    if _k_step(m, K) is None:
        return f"scale blocks {m.block} span part of K but are not a power of two of at least 16 columns"
    return None


def _kernel_reads(m: Fp8Matrix, x: torch.Tensor) -> bool:
    """Does fp8_skinny_linear take m for x (else `linear` dequantizes it)?"""
    return _matrix_fault(m, x.shape[1]) is None


def _check(x: torch.Tensor, m: Fp8Matrix, bias: torch.Tensor | None) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"fp8_skinny_linear: x must be 2-D, got {tuple(x.shape)}")
    M, K = x.shape
    fault = _matrix_fault(m, K)
    if fault is not None:
        raise ValueError(f"fp8_skinny_linear: {fault}")
    if M > skinny.MAX_ROWS:
        raise ValueError(f"fp8_skinny_linear: x has {M} rows, more than MAX_ROWS = {skinny.MAX_ROWS}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_skinny_linear: x's dtype {x.dtype} is not float16, bfloat16 or float32")
    if bias is not None and (tuple(bias.shape) != (m.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"fp8_skinny_linear: bias is {bias.dtype} {tuple(bias.shape)}, expected {x.dtype} "
                         f"({m.shape[0]},)")
    for name, t in (("x", x), ("qweight", m.qweight), ("scale", m.scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"fp8_skinny_linear: {name} is on {t.device}, x on {x.device}")
    for name, t in (("x", x), ("bias", bias)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"fp8_skinny_linear: {name} must have unit stride along its last dimension")
    return M, K


def _on_hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.x (where "auto" takes W8A8)."""
    return device.type == "cuda" and _hopper(device.index)


@functools.lru_cache(maxsize=None)
def _hopper(cuda_index: int | None) -> bool:
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(cuda_index)[0] == 9


@functools.lru_cache(maxsize=None)
def fp8_capable(cuda_index: int | None) -> bool:
    """An NVIDIA GPU of compute capability 8.9 or more: FP8 conversions and tensor cores (Ada, Hopper on)."""
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(cuda_index) >= (8, 9)
