"""`Fp8Weight`: a projection's base weight in float8 e4m3 with fp32 scales over a grid of blocks.

One representation serves every source (quantized at load, compressed-tensors, transformers `fp8`):

    w[n, k] = float(qweight[n, k]) * scale[n // block_n, k // block_k]

- per-row scales (quantized at load; compressed-tensors per-channel, and per-tensor scales spread over
  the rows of each fused part): block = (1, in_features), scale `[out, 1]`;
- 128×128 block scales (transformers `fp8`) where every fused part starts on a block row: block =
  (128, 128), scale `[ceil(out/128), ceil(in/128)]`, the parts' grids stacked;
- otherwise (a part of a fused weight starting inside a block row) each row takes its part's block
  row: block = (1, 128), scale `[out, ceil(in/128)]`.

A GPU kernel reads `scale[n // block_n, k // block_k]` for its tile; `block_n == 1` means one scale per
output column, applied in the epilogue when `block_k == in_features`.
"""
from __future__ import annotations

import torch
from torch import nn

from ...ops.gemm.fp8 import E4M3_MAX, FP8, Fp8Matrix, quantize_rows  # noqa: F401 (E4M3_MAX, quantize_rows: re-exported)


class Fp8Weight(nn.Module):
    """`qweight` (e4m3 `[out, in]`), `scale` (fp32 grid, see the module docstring) and, where the checkpoint
    stores static activation scales, `input_scale` (fp32, one per fused part; the weight-only path ignores it)."""

    def __init__(self, out_features: int, in_features: int, block: tuple[int, int], parts: int = 1,
                 input_scale: bool = False) -> None:
        super().__init__()
        block_n, block_k = block
        if block_n < 1 or block_k < 1:
            raise ValueError(f"FP8 scale blocks must be positive, got {block}")
        self.block = (block_n, min(block_k, in_features))
        self.qweight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        grid = (-(-out_features // self.block[0]), -(-in_features // self.block[1]))
        self.register_buffer("scale", torch.empty(grid, dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty(parts, dtype=torch.float32) if input_scale else None)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def _apply(self, fn, recurse: bool = True):
        # Module moves (to, to_empty) move the weight and its scales; casts (model.to(dtype)) leave their dtypes.
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(out.device)
        return super()._apply(keep_dtype, recurse)

    @property
    def matrix(self) -> Fp8Matrix:
        """The GEMMs' view of this weight (ops/gemm/fp8.py)."""
        return Fp8Matrix(self.qweight, self.scale, self.block, self.input_scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """`w` of the module docstring in `dtype`: each product rounded once from fp32 (exact in fp32 for fp32)."""
        return self.matrix.dequantize(dtype)

    def extra_repr(self) -> str:
        return f"out={self.shape[0]}, in={self.shape[1]}, block={self.block}, " \
               f"static_input_scale={self.input_scale is not None}"


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 `qweight * scale` over `block`-sized tiles (the module docstring's formula)."""
    return Fp8Matrix(qweight, scale, block).dequantize(torch.float32)
