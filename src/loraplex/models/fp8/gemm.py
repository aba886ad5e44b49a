"""The base GEMM of a projection, chosen by the kind of its weight: the one place that branches on it.

A dense weight takes ops/gemm/skinny.py's `linear` (the Triton skinny GEMM for decode rows on GPUs, else
F.linear). An `Fp8Weight` is dequantized to the activations' dtype for each call and then takes the same
GEMM: weight-only (x stays in the model dtype, so the LoRA shrink reads the same x as with a dense weight).
On the CPU that is the reference path; on GPUs it is the fallback until the FP8 kernels exist, which slot in
here (and in `gemm_weight` for the LoRA plan's kinds that run the GEMM beside the LoRA kernels).
"""
from __future__ import annotations

import torch

from ...ops.gemm import skinny
from .weight import Fp8Weight

BaseWeight = torch.Tensor | Fp8Weight


def gemm_weight(weight: BaseWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense `[out, in]` tensor the dense GEMMs read: the weight itself, or an FP8 weight dequantized to
    `dtype` (a temporary of this call: the model keeps only the FP8 bytes)."""
    return weight.dequantize(dtype) if isinstance(weight, Fp8Weight) else weight


def base_linear(x: torch.Tensor, weight: BaseWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ wᵀ + bias` for a weight of either kind (w dequantized where FP8)."""
    return skinny.linear(x, gemm_weight(weight, x.dtype), bias)
