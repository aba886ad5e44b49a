"""Random adapters with no files: what benchmarks and demos serve when only shapes matter.

The weights have the scale of trained LoRA factors (A ~ N(0, 1/in), B ~ N(0, 1/rank)), so the
deltas stay small next to the base model's activations but are not zero.
"""
from __future__ import annotations

import torch

from ..models.config import PROJECTIONS, ModelConfig
from .spec import AdapterSpec, LoraAdapter, ModuleSpec, check_adapter_name, pack_host_adapter


def synthetic_spec(name: str, model: ModelConfig, rank: int, *, alpha: float | None = None,
                   projections: tuple[str, ...] = tuple(PROJECTIONS), seed: int = 0) -> AdapterSpec:
    """A rank-`rank` adapter on `projections` of every layer; its weights are drawn from `seed` when read."""
    check_adapter_name(name)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"synthetic adapter {name!r}: rank must be a positive integer, got {rank!r}")
    unknown = [p for p in projections if p not in PROJECTIONS]
    if unknown or not projections:
        raise ValueError(f"synthetic adapter {name!r}: projections must be a non-empty subset of {PROJECTIONS}, "
                         f"got {projections!r}")
    scaling = (alpha if alpha is not None else 2 * rank) / rank
    modules = {(layer, proj): ModuleSpec(rank, scaling)
               for layer in range(model.num_hidden_layers) for proj in projections}
    return AdapterSpec(name, f"synthetic(seed={seed})", modules, locator=(model, seed),
                       weights_dtype=torch.float32)


def read_synthetic(spec: AdapterSpec, dtype: torch.dtype, pin: bool) -> LoraAdapter:
    """The adapter's host weights (the reader the cache calls on a loader thread)."""
    model, seed = spec.locator
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer, proj), module in sorted(spec.modules.items()):
        in_f, out_f = model.projection_shape(proj)
        a = torch.randn(module.rank, in_f, generator=gen) * in_f ** -0.5
        b = torch.randn(out_f, module.rank, generator=gen) * module.rank ** -0.5
        tensors[(layer, proj)] = (a, b)
    return pack_host_adapter(spec, tensors, dtype, pin)
