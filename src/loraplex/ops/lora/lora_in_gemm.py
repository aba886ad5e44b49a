"""LoRA with its shrink inside the projection's GEMM: the expand that reads each row's shrink from the GEMM's output.

If the A rows of the adapters a batch uses sit below a projection's weight, in an "active area" of C
adapters, one GEMM returns the base output and every active adapter's shrink at once:

    W_ext = [W; A rows of active adapter 0, slice 0; …, slice S-1; active adapter 1, …]   # [N + C·S·R, K]
    y_ext = x @ W_extᵀ                                  # y_ext[:, :N] the base, the rest every shrink

(adapter-major, so the first c adapters' rows are a prefix of W_ext: a batch that uses fewer reads only
those). On an H200, with q/k/v's expand left to RoPE, this cost ~0.5 ms less per Llama-2-7B decode step than
today's separate shrink kernels at 32 rows and ~1.9 ms less at 128, and about the same at 16
(benchmarks/probe_lora_in_gemm.py, results/probe_lora_in_gemm.md). `expand_in_gemm` then adds each row's
product into the base columns, in place:

    for row m with slot s = row_slot[m] ≥ 0, a = slot_active[s], and each slice i (columns c_i, width N_i):
        v[r]  = y_ext[m, N + (a·S + i)·R + r]                   for r < rank_i = min(ranks[i][s], R)
        y_ext[m, c_i + n] += scalings[i][s] · Σ_{r < rank_i} v[r] · lora_b[i][s, n, r]

with B, ranks and scalings the pool's (indexed by slot). Rows without an adapter keep their bits; shrink
columns at or past a slot's rank are never read. The kernel walks the `LoraBatch`'s work tiles (rows that
share a slot share its active index) and reuses sgmv's expand tile. Not wired into the model yet: the active
area's upkeep (copies of A as adapters enter the batch, compact indices) is the next step (benchmarks/NOTES.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import sgmv
from .sgmv_kernels import _expand_tile, _program_work
from .batch import LoraBatch
from .checks import _desc
from ..launch import Launcher
from ..pdl import pdl_start

MAX_SLICES = 3


@triton.jit
def _expand_in_gemm_kernel(
        y_ptr, sorted_rows_ptr, work_slot_ptr, work_start_ptr, work_end_ptr, slot_active_ptr,
        b0, b1, b2, rk0, rk1, rk2, sc0, sc1, sc2, n0, n1, n2, c0, c1, c2,
        n_chunks, n_per_prog, R, N_BASE, stride_ym, stride_yn,
        NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr):
    """y[rows, c_i + n] += sc_i[slot] * y[rows, N_BASE + (active·S + i)·R + :rank] @ B_i[slot, n, :rank]ᵀ."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    work, sl, n_chunk = _program_work(NUM_SLICES, n_chunks)
    slot = tl.load(work_slot_ptr + work)
    if slot >= 0:
        start = tl.load(work_start_ptr + work)
        end = tl.load(work_end_ptr + work)
        active = tl.load(slot_active_ptr + slot).to(tl.int64)
        part = y_ptr + (N_BASE + (active * NUM_SLICES + sl) * R) * stride_yn
        if sl == 0:
            _expand_tile(y_ptr, part, b0, rk0, sc0, sorted_rows_ptr, slot, start, end, n_chunk, n0, c0,
                         n_per_prog, stride_ym, stride_yn, 0, stride_ym, R, 1, BLOCK_M, BLOCK_N, BLOCK_R,
                         ONE_R_TILE, PRECISION, True, False)
        if NUM_SLICES > 1:
            if sl == 1:
                _expand_tile(y_ptr, part, b1, rk1, sc1, sorted_rows_ptr, slot, start, end, n_chunk, n1, c1,
                             n_per_prog, stride_ym, stride_yn, 0, stride_ym, R, 1, BLOCK_M, BLOCK_N, BLOCK_R,
                             ONE_R_TILE, PRECISION, True, False)
        if NUM_SLICES > 2:
            if sl == 2:
                _expand_tile(y_ptr, part, b2, rk2, sc2, sorted_rows_ptr, slot, start, end, n_chunk, n2, c2,
                             n_per_prog, stride_ym, stride_yn, 0, stride_ym, R, 1, BLOCK_M, BLOCK_N, BLOCK_R,
                             ONE_R_TILE, PRECISION, True, False)


_EXPAND = Launcher(_expand_in_gemm_kernel)


def shrink_columns(n_base: int, num_slices: int, rank: int, capacity: int) -> int:
    """The width of y_ext (and the rows of W_ext) for `capacity` active adapters."""
    return n_base + capacity * num_slices * rank


def _check(y_ext: torch.Tensor, n_base: int, lora_b, ranks, scalings, batch: LoraBatch,
           slot_active: torch.Tensor) -> tuple[int, int]:
    """(slices, R), or ValueError naming the argument at fault."""
    if not isinstance(lora_b, (list, tuple)) or not 1 <= len(lora_b) <= MAX_SLICES:
        raise ValueError(f"lora_b must be a list of 1 to {MAX_SLICES} B stacks (one per slice), got {lora_b!r}")
    if not len(lora_b) == len(ranks) == len(scalings):
        raise ValueError(f"{len(lora_b)} B stacks, {len(ranks)} rank and {len(scalings)} scaling tensors: "
                         "one of each per slice")
    S, R = len(lora_b), lora_b[0].shape[2] if lora_b[0].dim() == 3 else -1
    widths = [b.shape[1] if b.dim() == 3 else -1 for b in lora_b]
    if y_ext.dim() != 2 or y_ext.stride(1) != 1 or y_ext.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"y_ext must be a 2-D fp16/bf16/fp32 tensor with contiguous columns, got {_desc(y_ext)}")
    if n_base != sum(widths):
        raise ValueError(f"n_base ({n_base}) must be the slices' widths summed ({widths})")
    extra = y_ext.shape[1] - n_base
    if R < 1 or extra < 0 or extra % (S * R):
        raise ValueError(f"y_ext ({_desc(y_ext)}) must hold {n_base} base columns and then C·{S}·R shrink columns "
                         f"(R = {R}, the B stacks' last dimension)")
    slots = lora_b[0].shape[0]
    for i, (b, rk, sc) in enumerate(zip(lora_b, ranks, scalings)):
        if b.dim() != 3 or b.shape[0] != slots or b.shape[2] != R or not b.is_contiguous() \
                or b.dtype != y_ext.dtype or b.device != y_ext.device:
            raise ValueError(f"lora_b[{i}] must be a contiguous {y_ext.dtype} [slots={slots}, N_i, R={R}] tensor "
                             f"on {y_ext.device} (y_ext's dtype and device), got {_desc(b)}")
        if rk.dtype != torch.int32 or sc.dtype != torch.float32 or rk.shape != (slots,) or sc.shape != (slots,) \
                or rk.device != y_ext.device or sc.device != y_ext.device \
                or (slots > 1 and (rk.stride(0) != 1 or sc.stride(0) != 1)):
            raise ValueError(f"ranks[{i}] / scalings[{i}] must be contiguous int32 / float32 [slots={slots}] on "
                             f"{y_ext.device}, got {_desc(rk)} and {_desc(sc)}")
    if slot_active.dtype != torch.int32 or slot_active.shape != (slots,) or slot_active.device != y_ext.device \
            or (slots > 1 and slot_active.stride(0) != 1):
        raise ValueError(f"slot_active must be a contiguous int32 [slots={slots}] tensor on {y_ext.device}, "
                         f"got {_desc(slot_active)}")
    if batch.num_rows != y_ext.shape[0] or batch.device != y_ext.device:
        raise ValueError(f"the batch has {batch.num_rows} rows on {batch.device}; y_ext is {_desc(y_ext)}")
    if batch.max_slot >= slots:
        raise ValueError(f"the batch uses slot {batch.max_slot}; the B stacks hold {slots} slots")
    if extra // (S * R) < len(batch.group_slots):
        raise ValueError(f"the batch uses {len(batch.group_slots)} adapters; y_ext holds the shrink columns of "
                         f"{extra // (S * R)} active adapters")
    return S, R


def expand_in_gemm(y_ext: torch.Tensor, n_base: int, lora_b: list[torch.Tensor], ranks: list[torch.Tensor],
                   scalings: list[torch.Tensor], batch: LoraBatch, slot_active: torch.Tensor, *,
                   backend: str = "triton") -> torch.Tensor:
    """Add each row's LoRA product into `y_ext[:, :n_base]`, in place, reading its shrink from y_ext's own
    columns (the module docstring's loop); returns y_ext. `slot_active[s]`: the active index of pool slot s,
    read only for the slots the batch uses. Its values live on the device and are not checked (that would
    cost a sync per call): each must be in [0, C), C the active adapters whose shrink columns y_ext holds,
    or the kernel reads outside them. `backend`: "triton" (CUDA, or Triton's interpreter) or "reference"
    (torch, any device)."""
    S, R = _check(y_ext, n_base, lora_b, ranks, scalings, batch, slot_active)
    if backend == "reference":
        return _reference(y_ext, n_base, lora_b, ranks, scalings, batch, slot_active, S, R)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
    cfg = sgmv.config_for(batch.block_m)
    ns = [b.shape[1] for b in lora_b]
    cols = [sum(ns[:i]) for i in range(S)]
    n_chunks, n_per_prog = sgmv.choose_n_chunks(batch.num_work * S, max(ns), y_ext.device, cfg)
    grid = (batch.num_work * S * n_chunks,)
    if grid[0] == 0:
        return y_ext
    pad = MAX_SLICES - S
    block_r = sgmv._block_r(R)
    # v is the GEMM's output: a 16-bit v (and B) is exact in tf32, so one tf32 product is exact; fp32 takes three
    precision = "tf32x3" if y_ext.dtype == torch.float32 else "tf32"
    args = (y_ext, batch.sorted_rows, batch.work_slot, batch.work_start, batch.work_end, slot_active,
            *lora_b, *[lora_b[0]] * pad, *ranks, *[ranks[0]] * pad, *scalings, *[scalings[0]] * pad,
            *ns, *[0] * pad, *cols, *[0] * pad, n_chunks, n_per_prog, R, n_base, y_ext.stride(0), y_ext.stride(1))
    _EXPAND(grid, args, dict(NUM_SLICES=S, BLOCK_M=batch.block_m, BLOCK_N=cfg.expand_block_n, BLOCK_R=block_r,
                             ONE_R_TILE=R <= block_r, PRECISION=precision),
            cfg.expand_warps, cfg.expand_stages)
    return y_ext


def _reference(y_ext, n_base, lora_b, ranks, scalings, batch, slot_active, S, R) -> torch.Tensor:
    """The loop in torch, per group of rows that share a slot (fp32 products, one rounding into y)."""
    rows = batch.sorted_rows.long().cpu()
    col = 0
    for i, (b, rk, sc) in enumerate(zip(lora_b, ranks, scalings)):
        for slot, lo, hi in zip(batch.group_slots, batch.group_bounds[:-1], batch.group_bounds[1:]):
            r = min(int(rk[slot]), R)
            if r <= 0:
                continue
            m = rows[lo:hi].to(y_ext.device)
            start = n_base + (int(slot_active[slot]) * S + i) * R
            v = y_ext[m, start:start + r].float()
            delta = float(sc[slot]) * (v @ b[slot, :, :r].float().t())
            y_ext[m, col:col + b.shape[1]] = (y_ext[m, col:col + b.shape[1]].float() + delta).to(y_ext.dtype)
        col += b.shape[1]
    return y_ext
