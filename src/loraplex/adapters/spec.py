"""What an adapter is once validated: per (layer, projection) rank and scale, and its host weights."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.config import PROJECTIONS, ModelConfig
from .priority import HOST_PRIORITY

ModuleKey = tuple[int, str]  # (layer index, projection name)


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file, field or key at fault."""


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


def check_adapter_name(name) -> None:
    """Names appear in the OpenAI API's `model` field and in metrics: printable, no spaces."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise AdapterError(f"adapter name {name!r} is not allowed: 1-128 characters, letters, digits and "
                           f"._:/@+- , starting with a letter or digit")


def check_finite(adapter: "LoraAdapter", where: str) -> None:
    """NaN or inf in an adapter's host copy (in the serving dtype, so overflow of the cast counts)."""
    if not all(torch.isfinite(b).all() for b in adapter.buffers):
        raise AdapterError(f"{where}: holds NaN or infinite values once cast to "
                           f"{str(adapter.buffers[0].dtype).replace('torch.', '')}, the serving dtype")


@dataclass(frozen=True)
class ModuleSpec:
    """One projection of one layer that the adapter changes: `delta = scaling * B[:, :rank] @ A[:rank]`."""

    rank: int
    scaling: float


@dataclass
class AdapterSpec:
    """A validated adapter, before its weights are read: enough to plan memory and to refuse early."""

    name: str
    source: str  # where its weights live, for messages
    modules: dict[ModuleKey, ModuleSpec]
    base_model_name_or_path: str | None = None
    warnings: list[str] = field(default_factory=list)
    locator: Any = None  # where each module's weights are inside the source (its reader's business)
    weights_dtype: torch.dtype | None = None  # as stored (float32 when the tensors disagree)

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def projections(self) -> list[str]:
        present = {proj for _, proj in self.modules}
        return [p for p in PROJECTIONS if p in present]

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.modules})

    def num_parameters(self, model: ModelConfig) -> int:
        return sum(m.rank * sum(model.projection_shape(proj)) for (_, proj), m in self.modules.items())

    def describe(self) -> str:
        ranks = sorted({m.rank for m in self.modules.values()})
        return (f"{self.name}: rank {'/'.join(map(str, ranks))} on {','.join(self.projections)} "
                f"of {len(self.layers)} layers ({self.source})")


@dataclass
class LoraModule:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float


@dataclass
class LoraAdapter:
    """An adapter's weights on the host, cast to the serving dtype, in PEFT's orientation."""

    spec: AdapterSpec
    modules: dict[ModuleKey, LoraModule]
    buffers: list[torch.Tensor] = field(default_factory=list)  # the allocations the modules are views of

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def nbytes(self) -> int:
        """Bytes of weights (what a GPU load moves)."""
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory held."""
        return sum(b.numel() * b.element_size() for b in self.buffers)


# Pinned memory comes from PyTorch's caching host allocator, which rounds every allocation up to a
# power of two: one 80 MB buffer would hold 128 MB. Chunks of exactly 2^k bytes waste only the
# tail of the last one and the gaps where a tensor did not fit.
PINNED_CHUNK_BYTES = 8 << 20


def _layout(sizes: list[int], chunk: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Place tensors of `sizes` elements into chunks of `chunk` elements: (chunk, offset) each, chunk sizes."""
    places, chunks = [], []
    for n in sizes:
        if not chunks or chunks[-1] + n > chunk:
            chunks.append(0)
        places.append((len(chunks) - 1, chunks[-1]))
        chunks[-1] += n
    return places, chunks


def _chunk_elements(sizes: list[int], dtype: torch.dtype, pin: bool) -> int:
    item = torch.tensor([], dtype=dtype).element_size()
    return max(PINNED_CHUNK_BYTES // item, max(sizes, default=0)) if pin else max(sum(sizes), 1)


def host_chunk_sizes(sizes: list[int], dtype: torch.dtype, pin: bool) -> list[int]:
    """The host buffers (elements each) pack_host_adapter allocates for tensors of `sizes` elements, in order."""
    return _layout(sizes, _chunk_elements(sizes, dtype, pin))[1]


def pack_host_adapter(spec: AdapterSpec, tensors: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]],
                      dtype: torch.dtype, pin: bool) -> LoraAdapter:
    """Copy (and cast) every module's A and B into few contiguous host buffers, pinned when asked.

    Pinned (page-locked) memory lets the later host→device copies run asynchronously. Unpinned,
    the whole adapter is one buffer.
    """
    keys = sorted(tensors)
    flat = [t for key in keys for t in tensors[key]]
    sizes = [t.numel() for t in flat]
    places, chunk_sizes = _layout(sizes, _chunk_elements(sizes, dtype, pin))
    buffers = [torch.empty(n, dtype=dtype, pin_memory=pin) for n in chunk_sizes]
    views = []
    for i, (t, (c, offset)) in enumerate(zip(flat, places)):
        if i % 2 == 0:
            HOST_PRIORITY.checkpoint()
        view = buffers[c][offset: offset + t.numel()].view(t.shape)
        view.copy_(t)
        views.append(view)
    modules = {key: LoraModule(views[2 * i], views[2 * i + 1], spec.modules[key].scaling)
               for i, key in enumerate(keys)}
    return LoraAdapter(spec, modules, buffers)
