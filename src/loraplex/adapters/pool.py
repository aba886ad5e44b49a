"""The GPU slot pool: for every layer and projection, all resident adapters stacked, as `ops.add_lora` takes them.

Allocated once at start. Slot `s` of layer `l`, projection `p` holds `lora_a[l][p][s, :r]`
(`[r, in]`) and `lora_b[l][p][s, :, :r]` (`[out, r]`) with `r = ranks[l, p, s]` and the scale in
`scalings[l, p, s]`. A projection the slot's adapter does not touch has rank 0: the kernels skip
it and never read the previous tenant's weights, so nothing is zeroed on reuse.

The pool only moves bytes; who may write which slot, and when, is the cache's business.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.config import PROJECTIONS, ModelConfig
from .priority import HOST_PRIORITY
from .spec import AdapterError, LoraAdapter

_PROJ_INDEX = {p: i for i, p in enumerate(PROJECTIONS)}


@dataclass
class LoraStack:
    """One projection of one layer: the four tensors `ops.add_lora` takes."""

    lora_a: torch.Tensor    # [slots, R, in]
    lora_b: torch.Tensor    # [slots, out, R]
    ranks: torch.Tensor     # int32 [slots]
    scalings: torch.Tensor  # float32 [slots]


class AdapterPool:
    def __init__(self, model: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        for name, value in (("max_gpu_adapters", num_slots), ("max_lora_rank", max_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"pool dtype must be float16, bfloat16 or float32, got {dtype}")
        self.model, self.num_slots, self.max_rank, self.dtype = model, num_slots, max_rank, dtype
        self.device = torch.device(device)
        L, S, R = model.num_hidden_layers, num_slots, max_rank
        self.lora_a: list[dict[str, torch.Tensor]] = []
        self.lora_b: list[dict[str, torch.Tensor]] = []
        for _ in range(L):
            a, b = {}, {}
            for proj in PROJECTIONS:
                in_f, out_f = model.projection_shape(proj)
                # torch.empty: a slot's weights are only read below its rank, which is written with them
                a[proj] = torch.empty(S, R, in_f, dtype=dtype, device=self.device)
                b[proj] = torch.empty(S, out_f, R, dtype=dtype, device=self.device)
            self.lora_a.append(a)
            self.lora_b.append(b)
        self._stacks: dict[tuple, tuple[list, list, list, list]] = {}
        self.ranks = torch.zeros(L, len(PROJECTIONS), S, dtype=torch.int32, device=self.device)
        self.scalings = torch.zeros(L, len(PROJECTIONS), S, dtype=torch.float32, device=self.device)

    @property
    def nbytes(self) -> int:
        weights = sum(t.numel() * t.element_size() for layer in self.lora_a + self.lora_b for t in layer.values())
        return weights + self.ranks.numel() * 4 + self.scalings.numel() * 4

    def describe(self) -> str:
        return (f"adapter pool: {self.num_slots} slots × rank ≤ {self.max_rank} × {self.model.num_hidden_layers} "
                f"layers × {len(PROJECTIONS)} projections, {str(self.dtype).replace('torch.', '')} on "
                f"{self.device}: {self.nbytes / 2**20:.1f} MiB")

    def stack(self, layer: int, proj: str) -> LoraStack:
        p = _PROJ_INDEX[proj]
        return LoraStack(self.lora_a[layer][proj], self.lora_b[layer][proj], self.ranks[layer, p],
                         self.scalings[layer, p])

    def stacks(self, layer: int, projs: tuple[str, ...] | list[str]) -> tuple[list, list, list, list]:
        """(lora_a, lora_b, ranks, scalings) lists for one multi-slice add_lora over fused projections.

        Built once per (layer, projections) and returned again after (the views never change:
        slots are rewritten in place); callers must not modify the lists."""
        key = (layer, tuple(projs))
        cached = self._stacks.get(key)
        if cached is None:
            parts = [self.stack(layer, p) for p in projs]
            cached = self._stacks[key] = ([s.lora_a for s in parts], [s.lora_b for s in parts],
                                          [s.ranks for s in parts], [s.scalings for s in parts])
        return cached

    def check_fits(self, adapter_max_rank: int, name: str) -> None:
        """Refuse an adapter whose rank is above the slots' size, naming the setting that raises it."""
        if adapter_max_rank > self.max_rank:
            raise AdapterError(f"adapter {name!r} has rank {adapter_max_rank}, above the pool's "
                               f"max_lora_rank={self.max_rank}: raise it to at least {adapter_max_rank} with "
                               f"--max-lora-rank (EngineConfig.max_lora_rank)")

    def write(self, slot: int, adapter: LoraAdapter, *, non_blocking: bool = False) -> None:
        """Copy an adapter into `slot` on the current stream; projections it lacks get rank 0.

        With `non_blocking` the host buffer must be pinned and stay alive until the copies finish.
        """
        self._check_slot(slot)
        self.check_fits(adapter.spec.max_rank, adapter.name)
        L, R = self.model.num_hidden_layers, self.max_rank
        ranks = [[0] * len(PROJECTIONS) for _ in range(L)]
        scalings = [[0.0] * len(PROJECTIONS) for _ in range(L)]
        by_layer: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for (layer, proj), module in adapter.modules.items():
            r, p = module.a.shape[0], _PROJ_INDEX[proj]
            if layer >= L:
                raise AdapterError(f"adapter {adapter.name!r} has layer {layer}; the model has {L}")
            a, b = self.lora_a[layer][proj][slot], self.lora_b[layer][proj][slot]
            dst, src = by_layer.setdefault(layer, ([], []))
            dst += [a if r == R else a[:r], b if r == R else b[:, :r]]
            src += [module.a, module.b]
            ranks[layer][p], scalings[layer][p] = r, module.scaling
        # One copy call per layer: a load runs beside the engine's thread, and each torch call takes the GIL
        # (a copy call per tensor and the tables filled by indexing: 2.1 ms of host time per write of a
        # Llama-2-7B-shaped adapter with tiny widths on a 2-core CPU; so: 0.95 ms). The checkpoint before
        # each lets an eager forward go first.
        for layer in sorted(by_layer):
            HOST_PRIORITY.checkpoint()
            torch._foreach_copy_(*by_layer[layer], non_blocking=non_blocking)
        ranks = torch.tensor(ranks, dtype=torch.int32)
        scalings = torch.tensor(scalings, dtype=torch.float32)
        # The rank table last: on one stream it lands after the weights it describes. (PyTorch keeps
        # a pinned source alive until its asynchronous copy is done, so these temporaries may go.)
        if non_blocking and self.device.type == "cuda":
            ranks, scalings = ranks.pin_memory(), scalings.pin_memory()
        self.ranks[:, :, slot].copy_(ranks, non_blocking=non_blocking)
        self.scalings[:, :, slot].copy_(scalings, non_blocking=non_blocking)

    def delta(self, slot: int, layer: int, proj: str) -> torch.Tensor:
        """The slot's weight change for one projection, `scaling * B[:, :r] @ A[:r]`, in float64 `[out, in]`."""
        p = _PROJ_INDEX[proj]
        r = int(self.ranks[layer, p, slot])
        a = self.lora_a[layer][proj][slot, :r].double()
        b = self.lora_b[layer][proj][slot, :, :r].double()
        return float(self.scalings[layer, p, slot]) * (b @ a)

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an int in [0, {self.num_slots}), got {slot!r}")
