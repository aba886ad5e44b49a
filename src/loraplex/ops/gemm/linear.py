"""The projections' GEMM, for a weight of either kind: a dense tensor (ops/gemm/skinny.py: the Triton GEMM for
decode rows on GPUs, else cuBLAS) or an `Fp8Matrix` (ops/gemm/fp8.py). The one place that branches on it."""
from __future__ import annotations

import torch

from . import fp8, skinny
from .fp8 import Fp8Matrix, QuantizedRows

GemmWeight = torch.Tensor | Fp8Matrix


def linear(x: torch.Tensor, weight: GemmWeight, bias: torch.Tensor | None = None,
           x_e4m3: QuantizedRows | None = None) -> torch.Tensor:
    """x @ wᵀ (+ bias); `x_e4m3`: x quantized a row, for an FP8 weight's GEMM (fp8.linear's)."""
    if type(weight) is Fp8Matrix:
        return fp8.linear(x, weight, bias, x_e4m3)
    if x_e4m3 is not None:
        raise ValueError("linear: x_e4m3 is for FP8 weights; this weight is a dense tensor")
    return skinny.linear(x, weight, bias)


def takes_input(x: torch.Tensor, weight: GemmWeight) -> bool:
    """Does `linear(x, weight)` run one of the package's Triton GEMMs (which release a kernel launched after them
    only after their own PDL wait: ops/lora/overlap.py's "after" order relies on it)?"""
    if type(weight) is Fp8Matrix:
        return fp8.takes_input(x, weight)
    return skinny.takes_input(x, weight)
