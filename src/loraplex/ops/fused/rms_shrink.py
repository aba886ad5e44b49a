"""RMSNorm after a projection whose LoRA product it expands, that also computes the next projection's LoRA
shrink: a fused layer boundary (o → gate/up, and down → the next layer's q/k/v, in the Llama decoder).

`rms_norm_shrink(x, weight, eps, residual=..., delta=product, lora_a=..., ranks=..., row_slot=...)` returns
`(out, s, part)`: `(out, s)` exactly as `fused.rms_norm(x, weight, eps, residual=residual, delta=product)` with
`fused_lora_kernels.RMS_SPLIT` columns per program gives them, and `part` the fp32 split-K partials of the next
projection's shrink of `out`, one K split per column chunk (`[chunks, slices, T, R]`), for the expand (an
in-place or delta expand, or a LoraProduct consumer) to sum:

    for each slice i, row m with s = row_slot[m] ≥ 0, r < min(ranks[i][s], R):
        Σ_split part[split, i, m, r] = Σ_k out[m, k] · lora_a[i][s, r, k]      (fp32 products of out's values)

and nothing else of `part` written. Triton: fused_lora_rms_split.py's first launch, then
rms_shrink_kernels.py's scaling step with the shrink; the reference (PyTorch, one split) elsewhere.
Why: every separate shrink launch ran alone for 4–8 µs before its GEMM could start (H200, Llama-2-7B decode
at batch 32, benchmarks/results/decode_graph_trace.md); here the norm's own programs read A's columns.
"""
from __future__ import annotations

import torch

from ..lora.api import _bump_version, _on, resolve_backend
from ..lora.checks import _desc, check_shrink_inputs
from .api import check_rms_args, rms_norm
from ..lora.product import LoraProduct


def _check_next(lora_a, ranks, row_slot, T: int, H: int, like: torch.Tensor) -> None:
    if not isinstance(lora_a, (list, tuple)) or not 1 <= len(lora_a) <= 3 or not isinstance(ranks, (list, tuple)) \
            or len(ranks) != len(lora_a):
        raise ValueError(f"lora_a and ranks must be lists of 1 to 3 slices, one rank tensor each; got "
                         f"{type(lora_a).__name__} and {type(ranks).__name__}")
    for i, (a, rk) in enumerate(zip(lora_a, ranks)):
        check_shrink_inputs(a, rk, row_slot, T, H, "H", like.dtype, like.device, index=f"[{i}]")
        if a.shape[:2] != lora_a[0].shape[:2] or a.stride()[:2] != lora_a[0].stride()[:2]:   # one kernel walks all
            raise ValueError(f"lora_a[{i}] must be shaped and strided as lora_a[0] "
                             f"({tuple(lora_a[0].shape)}, strides {lora_a[0].stride()}), got {_desc(a)}")


def rms_norm_shrink(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None,
                    delta: LoraProduct, lora_a: list[torch.Tensor], ranks: list[torch.Tensor], row_slot: torch.Tensor,
                    block: int, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(out, s, part)` (see the module docstring); `block`: columns per program (the K split's width)."""
    if not isinstance(delta, LoraProduct) or delta.slot_active is not None:
        raise ValueError(f"delta must be a LoraProduct (not in-gemm), got {type(delta).__name__}")
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two ≥ 16, got {block!r}")
    check_rms_args(x, weight, eps, residual, delta)
    T, H = x.shape
    _check_next(lora_a, ranks, row_slot, T, H, x)
    R = lora_a[0].shape[1]
    if resolve_backend(backend, x.device) == "reference":
        out, s = rms_norm(x, weight, eps, residual=residual, delta=delta, backend="reference")
        part = torch.zeros((1, len(lora_a), T, R), dtype=torch.float32, device=x.device)
        has = row_slot >= 0
        if bool(has.any()):
            slots = row_slot[has].long()
            for i, (a, rk) in enumerate(zip(lora_a, ranks)):
                v = torch.einsum("mrk,mk->mr", a[slots].float(), out[has].float())
                keep = torch.arange(R, device=x.device)[None, :] < rk[slots].clamp(max=R)[:, None]
                part[0, i, has] = torch.where(keep, v, 0.0)
        return out, s, part
    from . import lora_kernels as fused_lora_kernels
    from . import rms_split as fused_lora_rms_split
    from . import rms_shrink_kernels
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    s = torch.empty((T, H), dtype=x.dtype, device=x.device)
    block, chunks = fused_lora_rms_split.chunking(H, block)
    part = torch.empty((chunks, len(lora_a), T, R), dtype=torch.float32, device=x.device)
    if T:
        with _on(x.device):
            R = delta.part.shape[3]   # launch 1 as fused_lora_kernels.rms_norm runs it (early reads too): its bits
            sumsq = fused_lora_rms_split.sums(x, residual, s, delta, block, fused_lora_kernels._tiles(R),
                                              fused_lora_kernels._early(R, "rms", delta))
            rms_shrink_kernels.scale_shrink(s, weight, out, sumsq, eps, block, row_slot, lora_a, ranks, part)
    _bump_version(out)
    return out, s, part
