"""Triton consumers of a `LoraProduct` (ops/lora/product.py): RMSNorm, SiLU-and-mul and RoPE that expand a
projection's LoRA product for each row as they load the row, then run the op of kernels.py on the sum,
rounded as there.

For a row with slot s ≥ 0, slice i, column n of the slice (product.py's loop, in fp32):

    delta = scalings_i[s] * Σ_{r < rank} (Σ_split part[split, i, row, r]) * B_i[s, n, r]
    x     = round(x + delta)                  # to x's dtype, as the in-place expand would round

and x untouched for rows with s = -1; a composed product's members after a row's first add theirs to the same
delta (product.py), so the row is rounded once. Each program sums the splits and reads the B columns it needs:
the expand's bytes spread over the consumer's grid, so RoPE and SiLU-and-mul run one program per
(token, head block) and (token, column block); RMSNorm, which needs the whole row's sum of squares, cuts
each row into chunks over two launches (rms_split.py). RoPE's consumer is in rope_lora.py; the helpers here that
read a row's product are shared by all three.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels import COMPILED, _round, _silu_mul
from ..launch import Launcher, pow2
from ..lora.expand_kernels import _load_rank_block
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
def _member(extra_ptr, lane, T, row, extra_lanes, rank_ptr, scale_ptr, R):
    """(slot, rank, scale) of row's member lane + 1: -1, 0 and 0 past its members (nothing is read there)."""
    slot = tl.load(extra_ptr + lane * T + row, mask=lane < extra_lanes, other=-1)
    has = slot >= 0
    safe = tl.maximum(slot, 0)
    return slot, tl.minimum(tl.load(rank_ptr + safe, mask=has, other=0), R), tl.load(scale_ptr + safe, mask=has,
                                                                                     other=0.0)


@triton.jit
def _lanes(extra_ptr, T, row, extra_lanes, rank_ptr, scale_ptr, R):
    """The row's members after its first, as (count, slot, rank and scale of lanes 1-3): the three lanes' loads
    side by side, so that a member costs one chain of dependent loads (its partials and B) in the loop that adds
    it, and the lanes past the row's members none (members fill the lanes in order)."""
    s1, r1, c1 = _member(extra_ptr, 0, T, row, extra_lanes, rank_ptr, scale_ptr, R)
    s2, r2, c2 = _member(extra_ptr, 1, T, row, extra_lanes, rank_ptr, scale_ptr, R)
    s3, r3, c3 = _member(extra_ptr, 2, T, row, extra_lanes, rank_ptr, scale_ptr, R)
    count = (s1 >= 0).to(tl.int32) + (s2 >= 0).to(tl.int32) + (s3 >= 0).to(tl.int32)
    return count, s1, r1, c1, s2, r2, c2, s3, r3, c3


@triton.jit
def _lane(lane, s1, r1, c1, s2, r2, c2, s3, r3, c3, T, part_row, stride_pm, b_ptr, slot_elems):
    """(rank, scale, partials row, B block) of member lane + 1 (< the row's count), from `_lanes`."""
    slot = tl.where(lane == 0, s1, tl.where(lane == 1, s2, s3))
    rank = tl.where(lane == 0, r1, tl.where(lane == 1, r2, r3))
    scale = tl.where(lane == 0, c1, tl.where(lane == 1, c2, c3))
    p = part_row + ((lane + 1) * T).to(tl.int64) * stride_pm
    return rank, scale, p, b_ptr + slot.to(tl.int64) * slot_elems


@triton.jit
def _extra_products(acc, part_row, extra_ptr, row, T, extra_lanes, stride_pm, b_ptr, slot_elems, rank_ptr, scale_ptr,
                    cols, mask, R, stride_p_split, ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, EXTRAS: tl.constexpr):
    """acc plus the products of the row's members after its first (product.py's loop; `part_row`: the first
    member's partials, this slice; B blocks `slot_elems` apart). EXTRAS (a composed product) or nothing: plain
    products compile without the loop."""
    if EXTRAS:
        count, s1, r1, c1, s2, r2, c2, s3, r3, c3 = _lanes(extra_ptr, T, row, extra_lanes, rank_ptr, scale_ptr, R)
        for lane in range(0, count):
            rank, scale, p, b_slot = _lane(lane, s1, r1, c1, s2, r2, c2, s3, r3, c3, T, part_row, stride_pm, b_ptr,
                                           slot_elems)
            v, offs_r, r_mask = _v(p, 0, rank, stride_p_split, SPLIT_K, BLOCK_R)
            acc += _product(p, b_slot, rank, scale, cols, mask, R, stride_p_split, v, offs_r, r_mask, ONE_R_TILE,
                            SPLIT_K, BLOCK_R, BLOCK)
    return acc


@triton.jit(do_not_specialize=["T", "extra_lanes"])   # one variant whatever the lanes
def _silu_and_mul_lora_kernel(gu_ptr, out_ptr, part_ptr, row_slot_ptr, b0, b1, rk0, rk1, sc0, sc1, R,
                              stride_p_split, stride_p_slice, stride_pm, extra_ptr, T, extra_lanes, I, stride_gu,
                              stride_out,
                              ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK: tl.constexpr, COMPILED: tl.constexpr, EARLY: tl.constexpr,
                              EXTRAS: tl.constexpr):
    """Program (row, column block): gate and up take their slice's product, then out = silu(gate) · up.
    EARLY (one rank tile): the row's slot, ranks, scalings and both B blocks are read before the PDL wait
    (ops/pdl.py's early reads), gate/up and the partials after it; the same sums."""
    pdl_start(EARLY)   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first (EARLY: below)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    DT = out_ptr.dtype.element_ty
    gu_row = gu_ptr + row * stride_gu
    if EARLY:
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
            dg = tl.sum(bg.to(tl.float32) * vg[None, :], axis=1) * scale_g
            du = tl.sum(bu.to(tl.float32) * vu[None, :], axis=1) * scale_u
            dg = _extra_products(dg, part_g, extra_ptr, row, T, extra_lanes, stride_pm, b0, I * R, rk0, sc0, offs,
                                 mask, R, stride_p_split, ONE_R_TILE, SPLIT_K, BLOCK_R, BLOCK, EXTRAS)
            du = _extra_products(du, part_g + stride_p_slice, extra_ptr, row, T, extra_lanes, stride_pm, b1, I * R,
                                 rk1, sc1, offs, mask, R, stride_p_split, ONE_R_TILE, SPLIT_K, BLOCK_R, BLOCK, EXTRAS)
            g = _round(g + dg, DT, COMPILED)
            u = _round(u + du, DT, COMPILED)
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
            dg = _extra_products(dg, part_g, extra_ptr, row, T, extra_lanes, stride_pm, b0, I * R, rk0, sc0, offs,
                                 mask, R, stride_p_split, ONE_R_TILE, SPLIT_K, BLOCK_R, BLOCK, EXTRAS)
            du = _extra_products(du, part_u, extra_ptr, row, T, extra_lanes, stride_pm, b1, I * R, rk1, sc1, offs,
                                 mask, R, stride_p_split, ONE_R_TILE, SPLIT_K, BLOCK_R, BLOCK, EXTRAS)
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
    block_r = _block_r(R)
    return dict(ONE_R_TILE=R <= block_r, BLOCK_R=block_r)


def _early(R: int, lora) -> bool:
    """The consumers' early reads (ops/pdl.py), where they apply: one rank tile, and a product whose row slots
    were not made inside the forward (LoraProduct.early_reads). With PDL their loads run while the GEMM before them
    is finishing: a batch-32 Llama-2-7B decode forward with distinct adapters took 0.988-0.990× the time (H200)."""
    return R <= _block_r(R) and lora.early_reads


def rms_norm(x, weight, eps: float, residual, out, s_out, lora, block: int | None = None) -> None:
    """`fused_kernels.rms_norm` on x plus the LoraProduct `lora` (one slice), s always written; each row over
    programs of `block` columns (None: RMS_SPLIT), rms_split.py's two launches."""
    if x.shape[0] == 0:
        return
    from . import rms_split   # imports this module's jit helpers
    R = lora.part.shape[3]
    rms_split.rms_norm(x, weight, eps, residual, out, s_out, lora, block or RMS_SPLIT, _tiles(R), _early(R, lora))


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
