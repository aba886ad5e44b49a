"""`LoraDelta`: a projection's expanded LoRA product in an fp32 buffer of its own, for the op that consumes
the projection (ops/lora/overlap.py's `linear_with_lora_delta`).

The expand stores `values[m, c_i + n]` = scalings[i][s] · Σ_r v[r] · lora_b[i][s, n, r] for every row m with
a slot s = row_slot[m] ≥ 0 (zeros for slices of rank 0), and nothing for rows with s = -1: the buffer is not
zero-filled (a fill per projection cost ~90 µs of a 7.9 ms Llama-2-7B decode forward at batch 32 on an H200,
and, launched first on the side stream, let the GEMM take the SMs before the shrink). So the consumer (RMSNorm,
SiLU-and-mul, RoPE: ops/fused/api.py's `delta` arguments) adds

    x[m] = round(x[m] + values[m])   for rows with row_slot[m] ≥ 0
    x[m]                             untouched for the others (whatever `values[m]` holds is never read)

as a `LoraProduct` leaves rows without an adapter untouched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import _desc


@dataclass(frozen=True)
class LoraDelta:
    """fp32 `values [T, ΣN]` (contiguous) whose row m is written only where `row_slot[m]` (int32 `[T]`) ≥ 0."""

    values: torch.Tensor
    row_slot: torch.Tensor

    @property
    def rows(self) -> int:
        return self.values.shape[0]

    def select(self, rows: torch.Tensor) -> "LoraDelta":
        """The delta of these rows only (the final norm's logits rows)."""
        return LoraDelta(self.values.index_select(0, rows), self.row_slot.index_select(0, rows))

    def keep(self) -> torch.Tensor:
        """bool `[T]`: the rows that take nothing."""
        return self.row_slot < 0

    def dense(self) -> torch.Tensor:
        """The fp32 `[T, ΣN]` delta with 0 in rows without an adapter (the reference path's view)."""
        return torch.where(self.keep()[:, None], 0.0, self.values)

    def check(self, rows: int, width: int, like: torch.Tensor, like_name: str, name: str) -> None:
        """Raise ValueError unless it fits a consumer of `rows` rows and `width` delta columns."""
        v = self.values
        if not isinstance(v, torch.Tensor) or v.dtype != torch.float32 or v.dim() != 2 or \
                tuple(v.shape) != (rows, width) or not v.is_contiguous():
            raise ValueError(f"{name}.values must be a contiguous float32 [T={rows}, {width}] ({like_name} is "
                             f"{_desc(like)}), got {_desc(v) if isinstance(v, torch.Tensor) else type(v).__name__}")
        rs = self.row_slot
        if not isinstance(rs, torch.Tensor) or rs.dtype != torch.int32 or tuple(rs.shape) != (rows,) or \
                (rows > 1 and rs.stride(0) != 1):
            raise ValueError(f"{name}.row_slot must be a contiguous int32 [T={rows}], got "
                             f"{_desc(rs) if isinstance(rs, torch.Tensor) else type(rs).__name__}")
        for what, t in (("values", v), ("row_slot", rs)):
            if t.device != like.device:
                raise ValueError(f"{name}.{what} is on {t.device} but {like_name} is on {like.device}")
