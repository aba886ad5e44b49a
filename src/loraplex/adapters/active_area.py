"""The active area: the A rows of the adapters a batch uses, kept below each projection's weight, so that one
GEMM returns the base output and every active adapter's shrink (ops/lora_in_gemm.py has the layout and the
expand that reads it).

For each layer and fused projection (q/k/v, o, gate/up, down) the weight is moved into a tensor with room for
`capacity` adapters below it, `W_ext [N + capacity·S·R, K]`, and the model's parameter becomes a view of its
first N rows (same values, same strides: the model's own GEMMs do not change). Active adapter a, slice i,
occupies rows `N + (a·S + i)·R …+R`: adapter-major, so the first c adapters are a prefix of W_ext.

`update(slots)` makes the active set exactly those pool slots, in indices 0 … len-1 (compact: a slot that
leaves hands its index to the last one), copying A from the pool for slots that enter, and for slots whose
pool contents changed since (`AdapterPool.versions`). B, ranks and scalings stay in the pool. Copies run on
the current stream, before whatever reads the area next. Host-side state; call it from the engine's thread.

Build it once the model is placed and before any CUDA graph is captured: a later `model.to(...)` of device or
dtype gives the model new weights and leaves the area behind, and graphs keep the addresses they captured.
Build and update it under the same `torch.inference_mode` setting (tensors made in inference mode cannot be
written outside it). The model's forwards use it once attached (`LlamaForCausalLM.active_area`), inside
`model.lora_in_gemm(count)`; the engine keeps one when `EngineConfig.lora_in_gemm` is set.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .pool import AdapterPool

# name of the group, its weight and bias attributes on a DecoderLayer, the pool projections of its slices
GROUPS = (("qkv", "qkv_proj", "qkv_bias", ("q_proj", "k_proj", "v_proj")),
          ("o", "o_proj", "o_bias", ("o_proj",)),
          ("gate_up", "gate_up_proj", "gate_up_bias", ("gate_proj", "up_proj")),
          ("down", "down_proj", "down_bias", ("down_proj",)))


@dataclass
class _Group:
    weight: torch.Tensor            # [N + capacity·S·R, K]
    bias: torch.Tensor | None       # [N + capacity·S·R] (zeros below N), or None
    n_base: int
    projs: tuple[str, ...]


class ActiveArea:
    def __init__(self, model, pool: AdapterPool, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        if model.device != pool.ranks.device or model.dtype != pool.dtype:   # (pool.device may lack an index)
            raise ValueError(f"the model ({model.dtype} on {model.device}) and the adapter pool ({pool.dtype} on "
                             f"{pool.ranks.device}) must share dtype and device")
        self.pool, self.capacity, self.rank = pool, capacity, pool.max_rank
        self.groups: list[dict[str, _Group]] = []
        for layer in model.layers:
            groups = {}
            for name, weight_attr, bias_attr, projs in GROUPS:
                w = getattr(layer, weight_attr)
                n, k = w.shape
                rows = n + capacity * len(projs) * self.rank
                ext = torch.zeros(rows, k, dtype=w.dtype, device=w.device)
                ext[:n].copy_(w.data)
                w.data = ext[:n]   # the parameter is now the head of the extended weight
                b = getattr(layer, bias_attr)
                bias_ext = None
                if b is not None:
                    bias_ext = torch.zeros(rows, dtype=b.dtype, device=b.device)
                    bias_ext[:n].copy_(b.data)
                    b.data = bias_ext[:n]
                groups[name] = _Group(ext, bias_ext, n, projs)
            self.groups.append(groups)
        self._order: list[int] = []              # active index → pool slot
        self._copied: dict[int, int] = {}        # pool slot → the pool version its rows were copied from
        self._host = [-1] * pool.num_slots
        self.slot_active = torch.full((pool.num_slots,), -1, dtype=torch.int32, device=pool.ranks.device)

    @property
    def nbytes(self) -> int:
        """The memory the area adds (the rows below the weights)."""
        return sum((g.weight.shape[0] - g.n_base) * g.weight.shape[1] * g.weight.element_size()
                   for layer in self.groups for g in layer.values())

    @property
    def count(self) -> int:
        """Active adapters now (indices 0 … count-1)."""
        return len(self._order)

    def holds(self, slots: Iterable[int], below: int | None = None) -> bool:
        """Whether every one of these pool slots is active now (at an index below `below`, if given)."""
        limit = self.capacity if below is None else below
        return all(0 <= s < self.pool.num_slots and 0 <= self._host[s] < limit for s in slots)

    def weight(self, layer: int, group: str, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W_ext, bias_ext) of the first `count` active adapters (default: all active now): a prefix view."""
        g = self.groups[layer][group]
        count = self.count if count is None else count
        if not 0 <= count <= self.capacity:
            raise ValueError(f"count must be in [0, {self.capacity}], got {count}")
        rows = g.n_base + count * len(g.projs) * self.rank
        return g.weight[:rows], None if g.bias is None else g.bias[:rows]

    def update(self, slots: Iterable[int]) -> int:
        """Make the active set exactly these pool slots (-1 entries ignored); returns the active count. Each
        slot's rows are copied at most once: slots that stay keep their index unless it is past the new count
        (then they move once, into a freed index), and a slot the pool rewrote is copied again in place."""
        wanted = list(dict.fromkeys(s for s in slots if s >= 0))
        if len(wanted) > self.capacity:
            raise ValueError(f"{len(wanted)} adapters in the batch; the active area holds {self.capacity}")
        bad = [s for s in wanted if not (isinstance(s, int) and s < self.pool.num_slots)]
        if bad:
            raise ValueError(f"slot {bad[0]!r} is not one of the pool's {self.pool.num_slots}")
        keep = set(wanted)
        staying = [s for s in self._order if s in keep]
        for slot in self._order:
            if slot not in keep:
                self._host[slot] = -1
                del self._copied[slot]
        entering = [s for s in wanted if self._host[s] < 0]
        count = len(staying) + len(entering)
        order: list[int | None] = [None] * count
        movers = []
        for slot in staying:
            if self._host[slot] < count:
                order[self._host[slot]] = slot
            else:
                movers.append(slot)
        changed = len(order) != len(self._order) or bool(movers or entering)
        for slot, index in zip(movers + entering, [i for i, s in enumerate(order) if s is None]):
            order[index] = slot
            self._place(slot, index)
        for index, slot in enumerate(order):   # rewritten in the pool since its rows were copied: again
            if self._copied[slot] != self.pool.versions[slot]:
                self._place(slot, index)
        self._order = order
        if changed:
            self.slot_active.copy_(torch.tensor(self._host, dtype=torch.int32), non_blocking=True)
        return self.count

    def _place(self, slot: int, index: int) -> None:
        """Copy the slot's A rows (every layer, group and slice) into active index `index`."""
        R, version = self.rank, self.pool.versions[slot]   # read first: a write that overlaps shows next time
        for layer, groups in enumerate(self.groups):
            dst, src = [], []
            for g in groups.values():
                S = len(g.projs)
                for i, proj in enumerate(g.projs):
                    row = g.n_base + (index * S + i) * R
                    dst.append(g.weight[row:row + R])
                    src.append(self.pool.lora_a[layer][proj][slot])
            torch._foreach_copy_(dst, src)
        self._host[slot] = index
        self._copied[slot] = version
