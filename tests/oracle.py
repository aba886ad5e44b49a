"""The test oracle: the documented semantics of add_lora as a plain float64 loop over segments.

Written from the docstring, independently of loraplex's reference and kernels.
"""
from __future__ import annotations

import torch


def add_lora_f64(y, x, lora_a, lora_b, ranks, scalings, seg_lens, slot_ids, y_offset=0):
    """Return float64 y + Σ_segments scalings[slot] * (x[rows] @ A[slot,:r]ᵀ) @ B[slot,:,:r]ᵀ."""
    if isinstance(lora_a, torch.Tensor):
        lora_a, lora_b, ranks, scalings = [lora_a], [lora_b], [ranks], [scalings]
    out = y.detach().to(torch.float64).clone()  # on the inputs' device: fp64 is exact enough anywhere
    x64 = x.detach().to(torch.float64)
    col = y_offset
    for a, b, rk, sc in zip(lora_a, lora_b, ranks, scalings):
        a64, b64 = a.detach().double(), b.detach().double()
        rk, sc = rk.tolist(), sc.tolist()
        n = b.shape[1]
        start = 0
        for length, slot in zip(seg_lens, slot_ids):
            rows = slice(start, start + length)
            start += length
            if slot < 0:
                continue
            r = rk[slot]
            out[rows, col:col + n] += sc[slot] * (x64[rows] @ a64[slot, :r].T) @ b64[slot, :, :r].T
        col += n
    return out


def shrink_f64(x, lora_a, seg_lens, slot_ids, ranks):
    """v[rows, :r] = x[rows] @ A[slot, :r]ᵀ in float64, zero elsewhere."""
    v = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64, device=x.device)
    x64, a64, rk = x.detach().double(), lora_a.detach().double(), ranks.tolist()
    start = 0
    for length, slot in zip(seg_lens, slot_ids):
        rows = slice(start, start + length)
        start += length
        if slot >= 0:
            v[rows, :rk[slot]] = x64[rows] @ a64[slot, :rk[slot]].T
    return v
