"""`LoraProduct`: a projection's LoRA product left unexpanded, for the op that consumes the projection.

At decode only the SGMV shrink runs beside the projection's GEMM (overlap.py's `linear_with_lora_product`); the
op that reads the projection's output next (RMSNorm for o and down, SiLU-and-mul for gate/up, RoPE for q/k/v: the
`delta` arguments of ops/fused/api.py) computes each row's expand itself as it loads that row. A
separate expand kernel, its fp32 product buffer and a dependent launch per projection go away, and
the expand's reads of B spread over the consumer's programs.

For row m with slot s = row_slot[m] ≥ 0 and slice i (q/k/v or gate/up: slices side by side, in order)
the product the consumer adds to column c_i + n of the projection is, in fp32:

    v[r]  = Σ_split part[split, i, m, r]                     # r < rank_i = min(ranks[i][s], R)
    delta = scalings[i][s] * Σ_{r < rank_i} v[r] * lora_b[i][s, n, r]

and no product at all (not even +0) for rows with s = -1. A composed batch's product (ops/lora/batch.py) also
holds each row's members after the first, which the consumer adds in the same sum: member l ≥ 1 of row m, slot
s_l = extra_slot[(l-1)·T + m] ≥ 0, its (weighted) partials at entry l·T + m:

    delta += scalings[i][s_l] * Σ_{r < rank_i(s_l)} (Σ_split part[split, i, l·T + m, r]) * lora_b[i][s_l, n, r]

The shrink (`sgmv.shrink_into`) writes
`part` only for rows with an adapter and only its first rank_i columns: the rest is never read.
The Triton consumers sum over r in another order than `dense()` (the reference, fp32 matmul), so
the two agree to fp32 rounding, not to the bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import _desc

MAX_SLICES = 3   # q/k/v is the widest consumer


@dataclass(frozen=True)
class LoraProduct:
    """The shrink's fp32 partials `part [split_k, slices, E, R]` with what expands them: per slice the B stack
    `[slots, N_i, R]`, its ranks (int32 `[slots]`) and scalings (float32 `[slots]`), each row's (first member's)
    slot (int32 `[T]`, -1: none), and for a composed batch the slots of the members after the first (int32
    `extra_slot [(lanes-1)·T]`; E ≥ lanes·T entries)."""

    part: torch.Tensor
    lora_b: tuple[torch.Tensor, ...]
    ranks: tuple[torch.Tensor, ...]
    scalings: tuple[torch.Tensor, ...]
    row_slot: torch.Tensor
    # False where row_slot was made inside the forward (select's index_select): the consumers must not read it
    # before their PDL wait (ops/pdl.py's early reads)
    early_reads: bool = True
    extra_slot: torch.Tensor | None = None
    lanes: int = 1

    @property
    def width(self) -> int:
        return sum(b.shape[1] for b in self.lora_b)

    @property
    def rows(self) -> int:
        return self.row_slot.shape[0]

    @property
    def device(self) -> torch.device:
        return self.part.device

    def select(self, rows: torch.Tensor) -> "LoraProduct":
        """The product of these rows only (the final norm's logits rows), each lane's entries with them."""
        T = self.rows
        entries = torch.cat([rows + lane * T for lane in range(self.lanes)]) if self.lanes > 1 else rows
        extra = None if self.extra_slot is None else \
            self.extra_slot.view(self.lanes - 1, T).index_select(1, rows).reshape(-1)
        return LoraProduct(self.part.index_select(2, entries), self.lora_b, self.ranks, self.scalings,
                           self.row_slot.index_select(0, rows), early_reads=False, extra_slot=extra, lanes=self.lanes)

    def check(self, rows: int, widths: tuple[int, ...], like: torch.Tensor, like_name: str, name: str) -> None:
        """Raise ValueError unless this product fits a consumer of `rows` rows and slices `widths` wide."""
        got = tuple(b.shape[1] for b in self.lora_b)
        if got != tuple(widths):
            raise ValueError(f"{name} expands to slices of widths {got}; {like_name} ({_desc(like)}) needs {widths}")
        if self.part.device != like.device:
            raise ValueError(f"{name} is on {self.part.device} but {like_name} is on {like.device}")
        S, slices, T, R = self.part.shape if self.part.dim() == 4 else (0, -1, -1, -1)
        if self.part.dtype != torch.float32 or slices != len(got) or T < rows or S < 1 \
                or self.part.stride(3) != 1:
            raise ValueError(f"{name}.part must be float32 [split_k, {len(got)}, T>={rows}, R] with R contiguous, "
                             f"got {_desc(self.part)}")
        if self.row_slot.dtype != torch.int32 or tuple(self.row_slot.shape) != (rows,) \
                or (rows > 1 and self.row_slot.stride(0) != 1):
            raise ValueError(f"{name}.row_slot must be a contiguous int32 [T={rows}], got {_desc(self.row_slot)}")
        if not len(self.lora_b) == len(self.ranks) == len(self.scalings):
            raise ValueError(f"{name} has {len(self.lora_b)} B stacks, {len(self.ranks)} rank and "
                             f"{len(self.scalings)} scaling tensors: one of each per slice")
        tensors = [("row_slot", self.row_slot)] + [(f"{k}[{i}]", t) for k in ("lora_b", "ranks", "scalings")
                                                    for i, t in enumerate(getattr(self, k))]
        for what, t in tensors:
            if t.device != like.device:
                raise ValueError(f"{name}.{what} is on {t.device} but {like_name} is on {like.device}")
        for i, (b, rk, sc) in enumerate(zip(self.lora_b, self.ranks, self.scalings)):
            if b.dim() != 3 or b.shape[2] != R or not b.is_contiguous() or b.dtype != like.dtype:
                raise ValueError(f"{name}.lora_b[{i}] must be a contiguous {like.dtype} [slots, N, R={R}], "
                                 f"got {_desc(b)}")
            if rk.dtype != torch.int32 or sc.dtype != torch.float32 or rk.shape != (b.shape[0],) \
                    or sc.shape != (b.shape[0],) or rk.stride(0) != 1 or sc.stride(0) != 1:
                raise ValueError(f"{name}.ranks[{i}] / scalings[{i}] must be contiguous int32 / float32 "
                                 f"[slots={b.shape[0]}], got {_desc(rk)} and {_desc(sc)}")
        if len(got) > MAX_SLICES:
            raise ValueError(f"{name} has {len(got)} slices; at most {MAX_SLICES}")
        if self.lanes > 1:
            e = self.extra_slot
            if e is None or e.dtype != torch.int32 or tuple(e.shape) != ((self.lanes - 1) * rows,) \
                    or e.device != like.device or e.stride(0) != 1:
                raise ValueError(f"{name}.extra_slot must be a contiguous int32 [(lanes-1)·T = "
                                 f"{(self.lanes - 1) * rows}] on {like.device} for {self.lanes} lanes, got "
                                 f"{_desc(e) if e is not None else None}")
            if T < self.lanes * rows:
                raise ValueError(f"{name}.part has {T} entries; {self.lanes} lanes of {rows} rows need "
                                 f"{self.lanes * rows}")
        elif self.extra_slot is not None:
            raise ValueError(f"{name}.extra_slot is given for lanes = {self.lanes}; it needs lanes > 1")

    def dense(self) -> torch.Tensor:
        """The fp32 `[T, ΣN]` product, by the loop of the module docstring (rows without an adapter: 0).
        The reference path of the consumers; it reads the slots back to the host."""
        R = self.part.shape[3]
        v = self.part.sum(0).float()               # [slices, E, R]
        T = self.rows
        out = torch.zeros((T, self.width), dtype=torch.float32, device=self.device)
        extra = [] if self.extra_slot is None else self.extra_slot.view(self.lanes - 1, T).tolist()
        for m, first in enumerate(self.row_slot.tolist()):
            members = [(first, m)] + [(lane[m], (i + 1) * T + m) for i, lane in enumerate(extra)]
            for s, e in members:
                if s < 0:
                    continue
                col = 0
                for i, (b, rk, sc) in enumerate(zip(self.lora_b, self.ranks, self.scalings)):
                    r = min(int(rk[s]), R)
                    out[m, col:col + b.shape[1]] += (b[s, :, :r].float() @ v[i, e, :r]) * sc[s]
                    col += b.shape[1]
        return out

    def kernel_args(self) -> tuple:
        """Pointers and strides for the consumer kernels (ops/fused/lora_kernels.py), slices padded to
        MAX_SLICES by repeating the first."""
        pad = MAX_SLICES - len(self.lora_b)
        p = self.part
        extra = self.extra_slot if self.extra_slot is not None else self.row_slot   # (not read with no lanes)
        return (p, self.row_slot, *self.lora_b, *[self.lora_b[0]] * pad, *self.ranks, *[self.ranks[0]] * pad,
                *self.scalings, *[self.scalings[0]] * pad, p.shape[3], p.stride(0), p.stride(1), p.stride(2),
                extra, self.rows, self.lanes - 1)

