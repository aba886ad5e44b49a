"""PyTorch reference of every LoRA op: the CPU path and the oracle the Triton kernels are tested against.

Semantics, the same for every backend (one slice shown; slice i writes columns
`y_offset + N_0 + … + N_{i-1}` onward):

    for s in range(S):
        for slot, w in members[s]:            # (slot, weight): one at weight 1.0, or a composition
            r = ranks[slot]; rows = seg_indptr[s]:seg_indptr[s+1]
            y[rows, y_offset:y_offset+N] += w * scalings[slot] * (x[rows] @ lora_a[slot, :r].T) @ lora_b[slot, :, :r].T

The intermediate `w · x @ Aᵀ` is computed and kept in fp32 (one row per (row, member) entry: batch.py), and y is
rounded once, at the end (as on the Triton path). Here the loop runs per slot group (the entries of all segments
with that slot), which is the same sum. Reading `ranks` costs a device sync on CUDA tensors, so this path is for the CPU and for tests, not
for graph capture.
"""
from __future__ import annotations

import torch

from .batch import LoraBatch


def _groups(batch: LoraBatch):
    """(slot, rows, entries, weights or None) of each of the shrink's slot groups."""
    rows_all, ents_all = batch.shrink_rows.long(), batch.shrink_entries.long()
    bounds = batch.shrink_group_bounds
    for g, slot in enumerate(batch.shrink_group_slots):
        sel = slice(bounds[g], bounds[g + 1])
        weights = batch.shrink_weights[sel].float() if batch.composed else None
        yield slot, rows_all[sel], ents_all[sel], weights


def shrink_impl(x: torch.Tensor, lora_a: list[torch.Tensor], ranks: list[torch.Tensor],
                batch: LoraBatch) -> list[torch.Tensor]:
    """v_i[entry, :r] = weight · x[row] @ lora_a_i[slot, :r]ᵀ in fp32 (`[num_entries, R]`); zero elsewhere."""
    outs = [torch.zeros((batch.num_entries, a.shape[1]), dtype=torch.float32, device=x.device) for a in lora_a]
    ranks_host = [r.tolist() for r in ranks]
    for slot, rows, ents, weights in _groups(batch):
        xs = x[rows].float()
        for a, v, rk in zip(lora_a, outs, ranks_host):
            r = rk[slot]
            if r > 0:
                prod = xs @ a[slot, :r].float().T
                v[ents, :r] = prod if weights is None else prod * weights[:, None]
    return outs


def expand_impl(y: torch.Tensor, v: list[torch.Tensor], lora_b: list[torch.Tensor], ranks: list[torch.Tensor],
                scalings: list[torch.Tensor], batch: LoraBatch, y_offset: int) -> torch.Tensor:
    """y[row, cols_i] += Σ_entries of the row scalings_i[slot] * v_i[entry, :r] @ lora_b_i[slot, :, :r]ᵀ, rounded
    once; rows without an adapter untouched."""
    ranks_host = [r.tolist() for r in ranks]
    scal_host = [s.tolist() for s in scalings]
    col = y_offset
    for vi, b, rk, sc in zip(v, lora_b, ranks_host, scal_host):
        n = b.shape[1]
        delta = torch.zeros((y.shape[0], n), dtype=torch.float32, device=y.device)
        touched = torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
        for slot, rows, ents, _ in _groups(batch):
            r = rk[slot]
            if r > 0:   # a slot's rows are distinct within its group, so this adds each once
                delta[rows] += (vi[ents, :r] @ b[slot, :, :r].float().T) * sc[slot]
                touched[rows] = True
        rows = touched.nonzero().squeeze(1)
        y[rows, col:col + n] = (y[rows, col:col + n].float() + delta[rows]).to(y.dtype)
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
