"""Triton consumers of a `LoraProduct` (ops/lora/product.py): RMSNorm, SiLU-and-mul and RoPE that expand a
projection's LoRA product for each row as they load the row, then run the op of kernels.py on the sum,
rounded as there.

For a row with slot s ≥ 0, slice i, column n of the slice (product.py's loop, in fp32):

    delta = scalings_i[s] * Σ_{r < rank} (Σ_split part[split, i, row, r]) * B_i[s, n, r]
    x     = round(x + delta)                  # to x's dtype, as the in-place expand would round

and x untouched for rows with s = -1; a composed product's members after a row's first add theirs to the same
delta (product.py), so the row is rounded once; they are read two at a time (ops/lora/b_blocks.py). Each program
sums the splits and reads the B columns it needs: the expand's bytes spread over the consumer's grid, so RoPE and
SiLU-and-mul run one program per (token, head block) and (token, column block); RMSNorm, which needs the whole row's
sum of squares, cuts each row into chunks over two launches (rms_split.py). RoPE's consumer is in rope_lora.py; the
helpers here that read a row's product are shared by all three.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels import COMPILED, _round, _silu_mul
from ..gemm.fp8 import QuantizedRows
from ..launch import Launcher, pow2
from ..lora.b_blocks import _load_rank_block, member_r, _pair_b, _pair_scalars, _pair_slots, _pair_sum, _pair_v, \
    _pairs_after_first
from ..pdl import pdl_deferred_start, pdl_start


@triton.jit
def _slot_of(row_slot_ptr, row, rank_ptr, scale_ptr, R):
    """(has, slot, rank, scale) of a row: rank 0 and slot 0 where it has no adapter (nothing is read)."""
    slot = tl.load(row_slot_ptr + row)
    has = slot >= 0
    safe = tl.maximum(slot, 0)
    rank = tl.where(has, tl.minimum(tl.load(rank_ptr + safe), R), 0)
    return has, safe, rank, tl.load(scale_ptr + safe)


@triton.jit
def _v(part_row, r0, rank, stride_p_split, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Σ over the K splits of the shrink's fp32 partials, rank columns r0..r0+BLOCK_R."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    v = tl.load(part_row + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT_K):
        v += tl.load(part_row + tl.full((), s, tl.int64) * stride_p_split + offs_r, mask=r_mask, other=0.0)
    return v, offs_r, r_mask


@triton.jit
def _product(part_row, b_slot, rank, scale, cols, mask, R, stride_p_split, v, offs_r, r_mask,
             ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    """fp32 [BLOCK]: scale · Σ_{r<rank} v[r] · B[cols, r] (B: this slot's [N, R] block). ONE_R_TILE (R ≤
    BLOCK_R): `v` (with `offs_r`, `r_mask`) is the row's, loaded once by the caller; else loaded here,
    BLOCK_R ranks at a time."""
    if ONE_R_TILE:   # B through `_load_rank_block` (16-byte loads), zero past the rank
        b = _load_rank_block(b_slot + cols[:, None] * R + offs_r[None, :], mask[:, None], offs_r[None, :],
                             r_mask[None, :], rank, R)
        acc = tl.sum(b.to(tl.float32) * v[None, :], axis=1)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            v_r, offs_rr, r_mask_r = _v(part_row, r0, rank, stride_p_split, SPLIT_K, BLOCK_R)
            b = _load_rank_block(b_slot + cols[:, None] * R + offs_rr[None, :], mask[:, None], offs_rr[None, :],
                                 r_mask_r[None, :], rank, R)
            acc += tl.sum(b.to(tl.float32) * v_r[None, :], axis=1)
    return acc * scale


@triton.jit
def _silu_composed(gu_row, part_row, row_slot_ptr, extra_ptr, row, T, extra_lanes, stride_pm, stride_p_slice, b0, b1,
                   rk0, rk1, sc0, sc1, R, I, offs, mask, stride_p_split, SPLIT_K: tl.constexpr,
                   MEMBER_R: tl.constexpr, COMPILED: tl.constexpr, EARLY: tl.constexpr):
    """(gate, up) of a composed product's row, in fp32 and rounded: its members' products added two at a time.
    Members 0 and 1's slots, ranks, scalings and first B blocks are read first, then the deferred PDL wait where
    EARLY (ops/pdl.py's early reads)."""
    first = tl.load(row_slot_ptr + row)
    slots = _pair_slots(first, extra_ptr, row, T, extra_lanes, 0)
    rank_g, scale_g = _pair_scalars(slots, rk0, sc0, R)
    rank_u, scale_u = _pair_scalars(slots, rk1, sc1, R)
    bg = _pair_b(b0, I * R, slots, rank_g, offs, mask, 0, R, MEMBER_R, False)
    bu = _pair_b(b1, I * R, slots, rank_u, offs, mask, 0, R, MEMBER_R, False)
    pdl_deferred_start(EARLY)
    g = tl.load(gu_row + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_row + I + offs, mask=mask, other=0.0).to(tl.float32)
    if first >= 0:
        part_u = part_row + stride_p_slice
        dg = _pair_sum(bg, _pair_v(part_row, 0, T, stride_pm, 0, rank_g, stride_p_split, SPLIT_K, MEMBER_R), scale_g)
        du = _pair_sum(bu, _pair_v(part_u, 0, T, stride_pm, 0, rank_u, stride_p_split, SPLIT_K, MEMBER_R), scale_u)
        dg = _pairs_after_first(dg, part_row, first, extra_ptr, row, T, extra_lanes, stride_pm, b0, I * R, rk0,
                                sc0, slots, rank_g, scale_g, offs, mask, R, stride_p_split, SPLIT_K, MEMBER_R, False)
        du = _pairs_after_first(du, part_u, first, extra_ptr, row, T, extra_lanes, stride_pm, b1, I * R, rk1,
                                sc1, slots, rank_u, scale_u, offs, mask, R, stride_p_split, SPLIT_K, MEMBER_R, False)
        DT = gu_row.dtype.element_ty
        g = _round(g + dg, DT, COMPILED)
        u = _round(u + du, DT, COMPILED)
    return g, u


@triton.jit(do_not_specialize=["T", "extra_lanes"])   # one variant whatever the lanes
def _silu_and_mul_lora_kernel(gu_ptr, out_ptr, part_ptr, row_slot_ptr, b0, b1, rk0, rk1, sc0, sc1, R,
                              stride_p_split, stride_p_slice, stride_pm, extra_ptr, T, extra_lanes, I, stride_gu,
                              stride_out,
                              ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK: tl.constexpr, COMPILED: tl.constexpr, EARLY: tl.constexpr,
                              EXTRAS: tl.constexpr, MEMBER_R: tl.constexpr):
    """Program (row, column block): gate and up take their slice's product, then out = silu(gate) · up.
    EARLY (one rank tile): the row's slot, ranks, scalings and both B blocks are read before the PDL wait
    (ops/pdl.py's early reads), gate/up and the partials after it; the same sums. EXTRAS (a composed product):
    the row's members two at a time (`_silu_composed`)."""
    pdl_start(EARLY)   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first (EARLY: below)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    DT = out_ptr.dtype.element_ty
    gu_row = gu_ptr + row * stride_gu
    if EXTRAS:
        g, u = _silu_composed(gu_row, part_ptr + row * stride_pm, row_slot_ptr, extra_ptr, row, T, extra_lanes,
                              stride_pm, stride_p_slice, b0, b1, rk0, rk1, sc0, sc1, R, I, offs, mask, stride_p_split,
                              SPLIT_K, MEMBER_R, COMPILED, EARLY)
    elif EARLY:
        has, slot, rank_g, scale_g = _slot_of(row_slot_ptr, row, rk0, sc0, R)
        rank_u = tl.where(has, tl.minimum(tl.load(rk1 + slot), R), 0)
        scale_u = tl.load(sc1 + slot)
        offs_r = tl.arange(0, BLOCK_R)
        bg = _load_rank_block(b0 + slot.to(tl.int64) * I * R + offs[:, None] * R + offs_r[None, :], mask[:, None],
                              offs_r[None, :], (offs_r < rank_g)[None, :], rank_g, R)   # rank 0: nothing read
        bu = _load_rank_block(b1 + slot.to(tl.int64) * I * R + offs[:, None] * R + offs_r[None, :], mask[:, None],
                              offs_r[None, :], (offs_r < rank_u)[None, :], rank_u, R)
        pdl_deferred_start(EARLY)
        g = tl.load(gu_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_row + I + offs, mask=mask, other=0.0).to(tl.float32)
        if has:
            part_g = part_ptr + row * stride_pm
            vg, _, _ = _v(part_g, 0, rank_g, stride_p_split, SPLIT_K, BLOCK_R)
            vu, _, _ = _v(part_g + stride_p_slice, 0, rank_u, stride_p_split, SPLIT_K, BLOCK_R)
            g = _round(g + tl.sum(bg.to(tl.float32) * vg[None, :], axis=1) * scale_g, DT, COMPILED)
            u = _round(u + tl.sum(bu.to(tl.float32) * vu[None, :], axis=1) * scale_u, DT, COMPILED)
    else:
        g = tl.load(gu_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_row + I + offs, mask=mask, other=0.0).to(tl.float32)
        has, slot, rank_g, scale_g = _slot_of(row_slot_ptr, row, rk0, sc0, R)
        if has:
            # Both slices' scalars and shrink outputs first, so that their loads overlap.
            rank_u = tl.minimum(tl.load(rk1 + slot), R)
            scale_u = tl.load(sc1 + slot)
            part_g = part_ptr + row * stride_pm
            part_u = part_g + stride_p_slice
            b_g = b0 + slot.to(tl.int64) * I * R
            b_u = b1 + slot.to(tl.int64) * I * R
            vg, offs_r, rm_g = _v(part_g, 0, rank_g, stride_p_split, SPLIT_K, BLOCK_R)
            vu, _, rm_u = _v(part_u, 0, rank_u, stride_p_split, SPLIT_K, BLOCK_R)
            dg = _product(part_g, b_g, rank_g, scale_g, offs, mask, R, stride_p_split, vg, offs_r, rm_g, ONE_R_TILE,
                          SPLIT_K, BLOCK_R, BLOCK)
            du = _product(part_u, b_u, rank_u, scale_u, offs, mask, R, stride_p_split, vu, offs_r, rm_u, ONE_R_TILE,
                          SPLIT_K, BLOCK_R, BLOCK)
            g = _round(g + dg, DT, COMPILED)
            u = _round(u + du, DT, COMPILED)
    tl.store(out_ptr + row * stride_out + offs, _silu_mul(g, u, DT, COMPILED).to(DT), mask=mask)


# Tile settings: a sweep of the consumers (docs/design-notes.md) on an H200 (SILU_BLOCK untuned). RMSNorm's consumer cuts each
# row into programs of RMS_SPLIT columns (two launches: rms_split.py); RoPE's are in rope_lora.py.
RMS_SPLIT = 512
SILU_BLOCK = 512
_SILU = Launcher(_silu_and_mul_lora_kernel)


def _block_r(R: int) -> int:
    return min(pow2(R), 32)


def _tiles(R: int) -> dict:
    """The rank-tile constexprs: BLOCK_R rank columns a step (ONE_R_TILE: all of them in one), and a composed
    product's MEMBER_R (ops/lora/b_blocks.py)."""
    block_r = _block_r(R)
    return dict(ONE_R_TILE=R <= block_r, BLOCK_R=block_r, MEMBER_R=member_r(R))


def _early(R: int, lora) -> bool:
    """The consumers' early reads (ops/pdl.py), where they apply: one rank tile, and a product whose row slots
    were not made inside the forward (LoraProduct.early_reads). With PDL their loads run while the GEMM before them
    is finishing: a batch-32 Llama-2-7B decode forward with distinct adapters took 0.988-0.990× the time (H200)."""
    return R <= _block_r(R) and lora.early_reads


def rms_norm(x, weight, eps: float, residual, out, s_out, lora, block: int | None = None,
             e4m3: QuantizedRows | None = None) -> None:
    """`fused_kernels.rms_norm` on x plus the LoraProduct `lora` (one slice), s always written; each row over
    programs of `block` columns (None: RMS_SPLIT), rms_split.py's two launches; `e4m3`: out quantized a row too."""
    if x.shape[0] == 0:
        return
    from . import rms_split   # imports this module's jit helpers
    R = lora.part.shape[3]
    rms_split.rms_norm(x, weight, eps, residual, out, s_out, lora, block or RMS_SPLIT, _tiles(R), _early(R, lora),
                       e4m3)


def silu_and_mul(gate_up, out, lora, block: int | None = None) -> None:
    """`fused_kernels.silu_and_mul` on gate/up plus the LoraProduct `lora` (two slices)."""
    T, I = out.shape
    if T == 0:
        return
    block = min(pow2(I), block or SILU_BLOCK)   # read at call time: benchmarks set SILU_BLOCK
    p, row_slot, b0, b1, _, rk0, rk1, _, sc0, sc1, _, R, sp, ss, sm, extra, lanes_t, extra_lanes = lora.kernel_args()
    args = (gate_up, out, p, row_slot, b0, b1, rk0, rk1, sc0, sc1, R, sp, ss, sm, extra, lanes_t, extra_lanes, I,
            gate_up.stride(0), out.stride(0))
    # a warp per 128 columns, at most 4 (148 registers a thread at 512 columns, sm_90)
    _SILU((T, -(-I // block)), args, dict(**_tiles(R), SPLIT_K=p.shape[0], BLOCK=block, COMPILED=COMPILED,
                                          EARLY=_early(R, lora), EXTRAS=lora.lanes > 1),
          max(1, min(4, block // 128)), 1)
