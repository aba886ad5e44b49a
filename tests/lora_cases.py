"""Random LoRA problems for the op tests: fresh inputs, weights past each rank poisoned with NaN."""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from loraplex import ops
from loraplex.ops import LoraBatch
from loraplex.workloads import popularity_slots

from oracle import add_lora_f64


@dataclass
class Case:
    x: torch.Tensor
    y0: torch.Tensor
    lora_a: list[torch.Tensor]
    lora_b: list[torch.Tensor]
    ranks: list[torch.Tensor]
    scalings: list[torch.Tensor]
    seg_lens: list[int]
    slot_ids: list[int]
    y_offset: int

    def batch(self, **kw) -> LoraBatch:
        return LoraBatch.from_lengths(self.seg_lens, self.slot_ids, self.x.device, **kw)

    def args(self, single: bool):
        """(lora_a, lora_b, ranks, scalings): tensors of slice 0 if single, else lists."""
        if single:
            return self.lora_a[0], self.lora_b[0], self.ranks[0], self.scalings[0]
        return self.lora_a, self.lora_b, self.ranks, self.scalings

    def run(self, y=None, batch=None, single=False, **kw) -> torch.Tensor:
        """ops.add_lora on a fresh copy of y0 (or on y); returns the output."""
        y = self.y0.clone() if y is None else y
        a, b, rk, sc = self.args(single)
        return ops.add_lora(y, self.x, a, b, batch or self.batch(), rk, sc, y_offset=self.y_offset, **kw)

    def oracle(self, single=False) -> torch.Tensor:
        return add_lora_f64(self.y0, self.x, *self.args(single), self.seg_lens, self.slot_ids, self.y_offset)

    def untouched(self) -> torch.Tensor:
        """Mask of y's elements no adapter may change: rows without one, columns outside the slices."""
        mask = torch.ones_like(self.y0, dtype=torch.bool)
        cols = slice(self.y_offset, self.y_offset + sum(b.shape[1] for b in self.lora_b))
        start = 0
        for length, slot in zip(self.seg_lens, self.slot_ids):
            if slot >= 0:
                mask[start:start + length, cols] = False
            start += length
        return mask


def make_case(rng: np.random.Generator, *, seg_lens, popularity="distinct", K=64, Ns=(64,), R=16,
              ranks="full", dtype=torch.float32, device="cpu", none_frac=0.0, y_offset=0, extra_cols=0,
              num_slots=None) -> Case:
    """`ranks`: "full" (all R), an int, or "mixed" (random 0..R per slot and slice)."""
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**31)))
    slots = popularity_slots(popularity, len(seg_lens), rng)
    slots = [-1 if rng.random() < none_frac else s for s in slots]
    num_slots = num_slots or max(max(slots) + 1, 1) + int(rng.integers(0, 3))
    T = int(sum(seg_lens))

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x = randn(T, K)
    A, B, RK, SC = [], [], [], []
    for n in Ns:
        if ranks == "full":
            rk = torch.full((num_slots,), R)
        elif ranks == "mixed":
            rk = torch.randint(0, R + 1, (num_slots,), generator=gen, device=device).cpu()
        else:
            rk = torch.full((num_slots,), int(ranks))
        a = randn(num_slots, R, K, scale=K ** -0.5)
        # Scale B by each slot's own rank so every delta is about as large as y: the test then
        # measures the op's error, not y's own rounding next to a tiny delta.
        b = randn(num_slots, n, R) * (rk.clamp_min(1).double() ** -0.5).to(dtype).to(device)[:, None, None]
        for s in range(num_slots):  # nothing past a slot's rank may be read
            a[s, int(rk[s]):] = float("nan")
            b[s, :, int(rk[s]):] = float("nan")
        A.append(a), B.append(b)
        RK.append(rk.to(torch.int32).to(device))
        SC.append(torch.rand(num_slots, generator=gen, device=device) * 2 + 0.25)
    y0 = randn(T, y_offset + sum(Ns) + extra_cols)
    return Case(x, y0, A, B, RK, SC, list(map(int, seg_lens)), slots, y_offset)


def rel_err(out: torch.Tensor, ref: torch.Tensor, base: torch.Tensor) -> float:
    """The op's error beyond the one rounding of y it cannot avoid, relative to the LoRA delta.

    ‖out − ref‖ minus ‖round(ref) − ref‖ (ref rounded once to out's dtype: the best any
    implementation can return), over ‖ref − base‖. Stricter than ‖out − ref‖ / ‖ref‖, which y's
    own size would dilute, and unlike a plain delta-relative error it does not blame the op for
    rounding y when a small delta (a rank-1 adapter on a few rows) sits on a large y.
    """
    out64, ref64, base64 = out.double(), ref.to(out.device).double(), base.to(out.device).double()
    if torch.isnan(out64).any():
        return float("inf")
    unavoidable = (ref64.to(out.dtype).double() - ref64).norm().item()
    excess = max(0.0, (out64 - ref64).norm().item() - unavoidable)
    return excess / max((ref64 - base64).norm().item(), 1e-30)


def stable_seed(*parts) -> int:
    """A seed from the test's parameters, the same in every process (unlike hash() of a str)."""
    return zlib.crc32(repr(parts).encode())
