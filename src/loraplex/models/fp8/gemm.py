"""The base GEMM of a projection, for a weight of either kind (dense or `Fp8Weight`).

`gemm_operand` hands the ops the weight as they read it: the tensor itself, or an FP8 weight's `Fp8Matrix`
(ops/gemm/fp8.py picks its GEMM: the Triton weight-only kernel for decode rows on GPUs of sm_89 on, the FP8
tensor cores for prompts where the scales allow, else the weight dequantized for this call). Weight-only or not,
the LoRA kernels read the same x as with a dense weight.
"""
from __future__ import annotations

import torch

from ...ops.gemm import linear as gemm
from .weight import Fp8Weight

BaseWeight = torch.Tensor | Fp8Weight


def gemm_operand(weight: BaseWeight) -> gemm.GemmWeight:
    """What ops/gemm/linear.py's GEMMs (and ops/lora/overlap.py's, beside the LoRA kernels) take for `weight`."""
    return weight.matrix if isinstance(weight, Fp8Weight) else weight


def base_linear(x: torch.Tensor, weight: BaseWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ wᵀ + bias` for a weight of either kind."""
    return gemm.linear(x, gemm_operand(weight), bias)
