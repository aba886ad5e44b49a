"""SiLU-and-mul that also computes the next projection's LoRA shrink (down_proj's, in the Llama MLP).

`silu_and_mul_shrink(gate_up, lora_a, ranks, row_slot, delta=...)` returns `(out, part)`: `out` is exactly
`fused.silu_and_mul(gate_up, delta=delta)`, and `part` the fp32 split-K partials of the shrink
`v = out @ A[slot]ᵀ` that `sgmv.expand_from` (or a LoraProduct consumer) sums:

    for every row m with s = row_slot[m] ≥ 0 and r < rank = min(ranks[s], R):
        Σ_split part[split, 0, m, r] = Σ_k out[m, k] · A[s, r, k]       (fp32 products of out's rounded values)

Nothing else of `part` is written (rows without an adapter, columns past a rank: the expand never reads
them). At decode the shrink launched beside the down GEMM took every SM before the GEMM could start (a
latency-bound kernel of a few MB, alone for ~7 µs of each Llama-2-7B layer at batch 32 on an H200,
benchmarks/results/decode_graph_trace.json); here SiLU's own programs read A's columns of their block.
Triton (silu_shrink_kernels.py) for CUDA tensors, the reference (PyTorch, one split) otherwise, as
`fused.silu_and_mul`. Bad arguments raise ValueError naming the argument.
"""
from __future__ import annotations

import torch

from ..lora.api import _bump_version, _on, resolve_backend
from ..lora.checks import _desc, check_shrink_inputs
from .api import _delta, _float_rows, _kernel_delta, silu_and_mul
from ..lora.delta import LoraDelta


def silu_and_mul_shrink(gate_up: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, row_slot: torch.Tensor, *,
                        delta: torch.Tensor | LoraDelta | None = None,
                        backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out [T, I], part [splits, 1, T, R])`, see the module docstring. `lora_a [slots, R, I]` (gate_up's
    dtype, I contiguous), `ranks` int32 `[slots]`, `row_slot` int32 `[T]` (-1: no adapter), `delta` as for
    `fused.silu_and_mul` (an fp32 tensor or a LoraDelta; not a LoraProduct)."""
    _float_rows(gate_up, "gate_up", "[T, 2*I]", 2)
    T, width = gate_up.shape
    if width == 0 or width % 2:
        raise ValueError(f"gate_up must be [T, 2*I] with I ≥ 1 (gate then up), got {_desc(gate_up)}")
    I = width // 2
    dev = gate_up.device
    check_shrink_inputs(lora_a, ranks, row_slot, T, I, "I", gate_up.dtype, dev)
    R = lora_a.shape[1]
    if delta is not None:
        if not isinstance(delta, (torch.Tensor, LoraDelta)):
            raise ValueError(f"delta must be an fp32 tensor or a LoraDelta, got {type(delta).__name__}")
        _delta(delta, "delta", T, (I, I), gate_up, "gate_up")
    if resolve_backend(backend, dev) == "reference":
        out = silu_and_mul(gate_up, delta=delta, backend="reference")
        part = torch.zeros((1, 1, T, R), dtype=torch.float32, device=dev)
        has = row_slot >= 0
        if bool(has.any()):
            a = lora_a[row_slot[has].long()].float()                  # [rows, R, I]
            v = torch.einsum("mri,mi->mr", a, out[has].float())
            rank = ranks[row_slot[has].long()].clamp(max=R)
            v = torch.where(torch.arange(R, device=dev)[None, :] < rank[:, None], v, 0.0)
            part[0, 0, has] = v
        return out, part
    from . import silu_shrink_kernels as k
    out = torch.empty((T, I), dtype=gate_up.dtype, device=dev)
    part = torch.empty((k.num_splits(I), 1, T, R), dtype=torch.float32, device=dev)
    with _on(dev):
        kd = _kernel_delta(delta)
        k.silu_and_mul_shrink(gate_up, out, row_slot, lora_a, ranks, part, kd["delta"], kd.get("delta_rows"))
    _bump_version(out)
    return out, part
