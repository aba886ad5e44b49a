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

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0   # the largest finite e4m3fn value


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

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """`w` of the module docstring in `dtype`: each product rounded once from fp32 (exact in fp32 for fp32)."""
        return dequantize(self.qweight, self.scale, self.block).to(dtype)

    def extra_repr(self) -> str:
        return f"out={self.shape[0]}, in={self.shape[1]}, block={self.block}, " \
               f"static_input_scale={self.input_scale is not None}"


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 `qweight * scale` over `block`-sized tiles (the module docstring's formula)."""
    out, cols = qweight.shape
    rows_n, cols_n = scale.shape
    full = scale[:, None, :, None].expand(rows_n, block[0], cols_n, block[1])
    full = full.reshape(rows_n * block[0], cols_n * block[1])[:out, :cols]
    return qweight.to(torch.float32) * full


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[out, in]`, fp32 scales `[out, 1]`): each row scaled so that its largest |w| maps to E4M3_MAX and
    rounded to nearest (ties to even). An all-zero row takes scale 1 (its values stay 0)."""
    w32 = w.to(torch.float32)
    amax = w32.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # the division can round a row's largest value a hair past E4M3_MAX; the clamp keeps it finite
    q = (w32 / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale
