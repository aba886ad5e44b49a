"""The base GEMM of a projection, for a weight of either kind (dense or `Fp8Weight`).

`gemm_operand` hands the ops the weight as they read it: the tensor itself, or an FP8 weight's `Fp8Matrix`
(ops/gemm/fp8.py picks its GEMM: the Triton weight-only kernel for decode rows on GPUs of sm_89 on, the FP8
tensor cores for prompts where the scales allow, else the weight dequantized for this call). Weight-only or not,
the LoRA kernels read the same x as with a dense weight.
"""
from __future__ import annotations

import torch

from ...ops.gemm import fp8
from ...ops.gemm import linear as gemm
from ...ops.gemm.fp8 import QuantizedRows
from .weight import Fp8Weight

BaseWeight = torch.Tensor | Fp8Weight


def gemm_operand(weight: BaseWeight) -> gemm.GemmWeight:
    """What ops/gemm/linear.py's GEMMs (and ops/lora/overlap.py's, beside the LoRA kernels) take for `weight`."""
    return weight.matrix if isinstance(weight, Fp8Weight) else weight


def base_linear(x: torch.Tensor, weight: BaseWeight, bias: torch.Tensor | None = None,
                x_e4m3: QuantizedRows | None = None) -> torch.Tensor:
    """`x @ wᵀ + bias` for a weight of either kind; `x_e4m3`: x quantized a row (`e4m3_input`'s buffers, filled)."""
    return gemm.linear(x, gemm_operand(weight), bias, x_e4m3)


def e4m3_input(weight: BaseWeight, x_like: torch.Tensor) -> QuantizedRows | None:
    """Empty buffers for the projection's input quantized a row, where its GEMM quantizes that input (an FP8 weight
    under W8A8: ops/gemm/fp8.py's `quantizes_x`), for the op that makes the input to fill as it writes it (ops/fused's
    RMSNorm); None elsewhere. `x_like`: a tensor of the input's shape, dtype and device."""
    if not isinstance(weight, Fp8Weight) or not fp8.quantizes_x(x_like, weight.matrix):
        return None
    return QuantizedRows.empty(x_like)
