"""`QuantizedRows`: activations quantized a row to e4m3 for the W8A8 GEMMs (ops/gemm/fp8.py), by the GEMM itself or
by the op that makes them (ops/fused's RMSNorm)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class QuantizedRows:
    """x [M, K] quantized a row as `quantize_rows` does: `q` e4m3 [M, K], `scale` fp32 [M, 1] (x ≈ q · scale)."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def empty(cls, like: torch.Tensor) -> "QuantizedRows":
        """Uninitialised buffers for the rows of a 2-D tensor shaped as `like`, on its device."""
        return cls(torch.empty(like.shape, dtype=FP8, device=like.device),
                   torch.empty(like.shape[0], 1, dtype=torch.float32, device=like.device))

    def check(self, x: torch.Tensor, name: str) -> None:
        """ValueError naming `name` unless these are buffers for x's rows (contiguous, on x's device)."""
        q, s = self.q, self.scale
        if (q.dtype != FP8 or q.shape != x.shape or not q.is_contiguous() or s.dtype != torch.float32
                or tuple(s.shape) != (x.shape[0], 1) or not s.is_contiguous() or q.device != x.device
                or s.device != x.device):
            raise ValueError(f"{name} must be contiguous {FP8} {tuple(x.shape)} and float32 ({x.shape[0]}, 1) on "
                             f"{x.device}, got {q.dtype} {tuple(q.shape)} and {s.dtype} {tuple(s.shape)} on "
                             f"{q.device}")
