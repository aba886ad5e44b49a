"""PyTorch reference of every LoRA op: the CPU path and the oracle the Triton kernels are tested against.

Semantics, the same for every backend (one slice shown; slice i writes columns
`y_offset + N_0 + … + N_{i-1}` onward):

    for s in range(S):
        slot = slot_ids[s]
        if slot < 0: continue
        r = ranks[slot]; rows = seg_indptr[s]:seg_indptr[s+1]
        y[rows, y_offset:y_offset+N] += scalings[slot] * (x[rows] @ lora_a[slot, :r].T) @ lora_b[slot, :, :r].T

The intermediate `x @ Aᵀ` is computed and kept in fp32, and y is rounded once, at the end.
Here the loop runs per slot group (rows of all segments with that slot), which is the same
sum because segments are disjoint. Reading `ranks` costs a device sync on CUDA tensors, so
this path is for the CPU and for tests, not for graph capture.
"""
from __future__ import annotations

import torch

from .batch import LoraBatch


def _groups(batch: LoraBatch):
    rows_all = batch.sorted_rows.long()
    for g, slot in enumerate(batch.group_slots):
        yield slot, rows_all[batch.group_bounds[g]:batch.group_bounds[g + 1]]


def shrink_impl(x: torch.Tensor, lora_a: list[torch.Tensor], ranks: list[torch.Tensor],
                batch: LoraBatch) -> list[torch.Tensor]:
    """v_i[rows, :r] = x[rows] @ lora_a_i[slot, :r]ᵀ in fp32; zero elsewhere."""
    outs = [torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device) for a in lora_a]
    ranks_host = [r.tolist() for r in ranks]
    for slot, rows in _groups(batch):
        xs = x[rows].float()
        for a, v, rk in zip(lora_a, outs, ranks_host):
            r = rk[slot]
            if r > 0:
                v[rows, :r] = xs @ a[slot, :r].float().T
    return outs


def expand_impl(y: torch.Tensor, v: list[torch.Tensor], lora_b: list[torch.Tensor], ranks: list[torch.Tensor],
                scalings: list[torch.Tensor], batch: LoraBatch, y_offset: int) -> torch.Tensor:
    """y[rows, cols_i] += scalings_i[slot] * v_i[rows, :r] @ lora_b_i[slot, :, :r]ᵀ, rounded once."""
    ranks_host = [r.tolist() for r in ranks]
    scal_host = [s.tolist() for s in scalings]
    for slot, rows in _groups(batch):
        col = y_offset
        for vi, b, rk, sc in zip(v, lora_b, ranks_host, scal_host):
            n, r = b.shape[1], rk[slot]
            if r > 0:
                delta = (vi[rows, :r] @ b[slot, :, :r].float().T) * sc[slot]
                y[rows, col:col + n] = (y[rows, col:col + n].float() + delta).to(y.dtype)
            col += n
    return y


def add_lora(y, x, lora_a, lora_b, batch, ranks, scalings, *, y_offset: int = 0):
    """Reference `add_lora` (same signature and checks as `loraplex.ops.add_lora`)."""
    from . import api
    return api.add_lora(y, x, lora_a, lora_b, batch, ranks, scalings, y_offset=y_offset, backend="reference")


def lora_shrink(x, lora_a, batch, ranks, *, out=None):
    """Reference `lora_shrink`."""
    from . import api
    return api.lora_shrink(x, lora_a, batch, ranks, out=out, backend="reference")


def lora_expand(y, v, lora_b, batch, ranks, scalings, *, y_offset: int = 0):
    """Reference `lora_expand`."""
    from . import api
    return api.lora_expand(y, v, lora_b, batch, ranks, scalings, y_offset=y_offset, backend="reference")
