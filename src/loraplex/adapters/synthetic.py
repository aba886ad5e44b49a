"""Random adapters with no files: what benchmarks and demos serve when only shapes matter.

The weights have the scale of trained LoRA factors (A ~ N(0, 1/in), B ~ N(0, 1/rank)), so the
deltas stay small next to the base model's activations but are not zero.
"""
from __future__ import annotations

import threading

import torch

from ..models.config import PROJECTIONS, ModelConfig
from .priority import HOST_PRIORITY
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


_NOISE_SIZE = 1 << 22
_noise: torch.Tensor | None = None
_scaled: dict[tuple[torch.dtype, float], torch.Tensor] = {}
_lock = threading.Lock()


def _scaled_noise(dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The shared standard-normal array times `scale`, in `dtype` (made once per pair: an adapter has
    three scales, 1/sqrt of each input width and of its rank)."""
    global _noise
    with _lock:
        if _noise is None:
            _noise = torch.randn(_NOISE_SIZE, generator=torch.Generator().manual_seed(0))
        key = (dtype, scale)
        if key not in _scaled:
            _scaled[key] = (_noise * scale).to(dtype)
        return _scaled[key]


def _window(gen: torch.Generator, shape: tuple[int, int], scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Normal values of standard deviation `scale` and `shape` in `dtype`: a seeded window (a view) of one
    shared pre-scaled array. Drawing 40M fresh values per 7B-sized adapter took most of a second, and
    scaling and casting a window per module most of a read (0.068 against 0.024 s per 7B adapter on a
    2-core machine); a view costs nothing and packing copies it once. The values are those of the
    fp32 window scaled, then cast (one rounding either way)."""
    n = shape[0] * shape[1]
    if n > _NOISE_SIZE:  # larger than the shared array: draw it (rare: rank × width above 4M)
        return (torch.randn(shape, generator=gen) * scale).to(dtype)
    start = int(torch.randint(0, _NOISE_SIZE - n + 1, (1,), generator=gen))
    return _scaled_noise(dtype, scale)[start:start + n].view(shape)


def read_synthetic(spec: AdapterSpec, dtype: torch.dtype, pin: bool) -> LoraAdapter:
    """The adapter's host weights (the reader the cache calls on a loader thread)."""
    model, seed = spec.locator
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer, proj), module in sorted(spec.modules.items()):
        HOST_PRIORITY.checkpoint()
        in_f, out_f = model.projection_shape(proj)
        tensors[(layer, proj)] = (_window(gen, (module.rank, in_f), in_f ** -0.5, dtype),
                                  _window(gen, (out_f, module.rank), module.rank ** -0.5, dtype))
    return pack_host_adapter(spec, tensors, dtype, pin)
