"""Triton consumers of a `LoraProduct` (lora_product.py): RMSNorm, SiLU-and-mul and RoPE that expand a
projection's LoRA product for each row as they load the row, then run the op of fused_kernels.py on
the sum, rounded as there.

For a row with slot s ≥ 0, slice i, column n of the slice (lora_product.py's loop, in fp32):

    delta = scalings_i[s] * Σ_{r < rank} (Σ_split part[split, i, row, r]) * B_i[s, n, r]
    x     = round(x + delta)                  # to x's dtype, as the in-place expand would round

and x untouched for rows with s = -1. Each program sums the splits and reads the B columns it needs:
the expand's bytes spread over the consumer's grid, so RoPE and SiLU-and-mul run one program per
(token, head block) and (token, column block); RMSNorm keeps one program per row (it needs the whole
row's sum of squares) and walks the row in tiles.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...env_switch import env_switch
from .kernels import COMPILED, _cos_sin, _inv, _norm_output, _pow2, _rotate, _round, _rstd, _silu_mul
from ..launch import Launcher
from ..lora.sgmv_kernels import VECTOR_LOADS_SETTING, _load_rank_block, _rank_block_exact
from ..pdl import pdl_deferred_start, pdl_start

# RoPE's [heads, half head, rank] tiles: LORAPLEX_LORA_VECTOR_LOADS=no-rope keeps the exact mask there alone
_load_rank_block_2d = _rank_block_exact if VECTOR_LOADS_SETTING == "no-rope" else _load_rank_block


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
    v = tl.load(part_row + offs_r, mask=r_mask, other=0.0).to(tl.float32)   # (16-bit when in-gemm)
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
def _product_2d(part_row, b_slot, rank, scale, cols, mask, R, stride_p_split, v, offs_r, r_mask,
                ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """`_product` over a [BLOCK_H, BLOCK_D] tile of columns (heads × half a head)."""
    if ONE_R_TILE:
        b = _load_rank_block_2d(b_slot + cols[:, :, None] * R + offs_r[None, None, :], mask[:, :, None],
                                offs_r[None, None, :], r_mask[None, None, :], rank, R)
        acc = tl.sum(b.to(tl.float32) * v[None, None, :], axis=2)
    else:
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            v_r, offs_rr, r_mask_r = _v(part_row, r0, rank, stride_p_split, SPLIT_K, BLOCK_R)
            b = _load_rank_block_2d(b_slot + cols[:, :, None] * R + offs_rr[None, None, :], mask[:, :, None],
                                    offs_rr[None, None, :], r_mask_r[None, None, :], rank, R)
            acc += tl.sum(b.to(tl.float32) * v_r[None, None, :], axis=2)
    return acc * scale


# ---------------------------------------------------------------------------------------------
# RMSNorm (+ residual add) of o's and down's output


@triton.jit
def _rms_norm_lora_kernel(x_ptr, r_ptr, w_ptr, out_ptr, s_ptr, part_ptr, row_slot_ptr, b_ptr, rank_ptr, scale_ptr,
                          R, stride_p_split, stride_pm, H, inv_h, eps, stride_x, stride_r, stride_out, stride_s,
                          HAS_RESIDUAL: tl.constexpr, ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, COMPILED: tl.constexpr):
    """One program per row: s = round(x + delta) (+ residual, rounded), stored; out = weight · normalize(s)."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    row = tl.program_id(0).to(tl.int64)
    DT = x_ptr.dtype.element_ty
    has, slot, rank, scale = _slot_of(row_slot_ptr, row, rank_ptr, scale_ptr, R)
    b_slot = b_ptr + slot.to(tl.int64) * H * R
    part_row = part_ptr + row * stride_pm
    x_row, r_row = x_ptr + row * stride_x, r_ptr + row * stride_r
    s_row, out_row = s_ptr + row * stride_s, out_ptr + row * stride_out
    offs = tl.arange(0, BLOCK)
    # The row's shrink output, loaded once (one rank tile; rows without an adapter: rank 0, nothing read).
    lv, offs_r, r_mask = _v(part_row, 0, rank, stride_p_split, SPLIT_K, BLOCK_R)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, H, BLOCK):
        mask = c + offs < H
        v = tl.load(x_row + c + offs, mask=mask, other=0.0).to(tl.float32)
        if has:
            d = _product(part_row, b_slot, rank, scale, c + offs, mask, R, stride_p_split, lv, offs_r, r_mask,
                         ONE_R_TILE, SPLIT_K, BLOCK_R, BLOCK)
            v = _round(v + d, DT, COMPILED)
        if HAS_RESIDUAL:
            v = _round(tl.load(r_row + c + offs, mask=mask, other=0.0).to(tl.float32) + v, DT, COMPILED)
        tl.store(s_row + c + offs, v.to(DT), mask=mask)
        acc += v * v
    rstd = _rstd(tl.sum(acc, axis=0), inv_h, eps, COMPILED)
    tl.debug_barrier()   # s, stored above by this program's threads, is read back by others below
    for c in range(0, H, BLOCK):
        mask = c + offs < H
        v = tl.load(s_row + c + offs, mask=mask, other=0.0).to(tl.float32)
        _norm_output(v, rstd, w_ptr, out_row, c + offs, mask, COMPILED)


# ---------------------------------------------------------------------------------------------
# SiLU(gate) * up


@triton.jit
def _silu_and_mul_lora_kernel(gu_ptr, out_ptr, part_ptr, row_slot_ptr, b0, b1, rk0, rk1, sc0, sc1, R,
                              stride_p_split, stride_p_slice, stride_pm, I, stride_gu, stride_out,
                              ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK: tl.constexpr, COMPILED: tl.constexpr, LOADS_FIRST: tl.constexpr,
                              EARLY: tl.constexpr):
    """Program (row, column block): gate and up take their slice's product, then out = silu(gate) · up.
    LOADS_FIRST (one rank tile): both slices' B blocks are loaded before either product is summed (compiled
    in program order, the up block's loads otherwise wait for the gate's product: sm_90 PTX).
    EARLY (one rank tile): the row's slot, ranks, scalings and both B blocks are read before the PDL wait
    (ops/pdl.py's early reads), gate/up and the partials after it; the same sums as LOADS_FIRST's."""
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
            if LOADS_FIRST and ONE_R_TILE:   # the same sums as _product's, its loads issued first
                offs_r = tl.arange(0, BLOCK_R)
                bg = _load_rank_block(b_g + offs[:, None] * R + offs_r[None, :], mask[:, None], offs_r[None, :],
                                      (offs_r < rank_g)[None, :], rank_g, R)
                bu = _load_rank_block(b_u + offs[:, None] * R + offs_r[None, :], mask[:, None], offs_r[None, :],
                                      (offs_r < rank_u)[None, :], rank_u, R)
                vg, _, _ = _v(part_g, 0, rank_g, stride_p_split, SPLIT_K, BLOCK_R)
                vu, _, _ = _v(part_u, 0, rank_u, stride_p_split, SPLIT_K, BLOCK_R)
                dg = tl.sum(bg.to(tl.float32) * vg[None, :], axis=1) * scale_g
                du = tl.sum(bu.to(tl.float32) * vu[None, :], axis=1) * scale_u
            else:
                vg, offs_r, rm_g = _v(part_g, 0, rank_g, stride_p_split, SPLIT_K, BLOCK_R)
                vu, _, rm_u = _v(part_u, 0, rank_u, stride_p_split, SPLIT_K, BLOCK_R)
                dg = _product(part_g, b_g, rank_g, scale_g, offs, mask, R, stride_p_split, vg, offs_r, rm_g, ONE_R_TILE,
                              SPLIT_K, BLOCK_R, BLOCK)
                du = _product(part_u, b_u, rank_u, scale_u, offs, mask, R, stride_p_split, vu, offs_r, rm_u, ONE_R_TILE,
                              SPLIT_K, BLOCK_R, BLOCK)
            g = _round(g + dg, DT, COMPILED)
            u = _round(u + du, DT, COMPILED)
    tl.store(out_ptr + row * stride_out + offs, _silu_mul(g, u, DT, COMPILED).to(DT), mask=mask)


# ---------------------------------------------------------------------------------------------
# Rotary embedding of q and k, v's product added, in place


@triton.jit
def _heads(base, stride_h, num_heads, h0, part_row, b_ptr, rank_ptr, scale_ptr, slot, has, R, stride_p_split, HALF,
           c, s, offs_d, d_mask, ROTATE: tl.constexpr, ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr,
           BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, COMPILED: tl.constexpr):
    """Heads h0..h0+BLOCK_H of one token (none past `num_heads`: k and v have fewer with GQA): each half
    takes its product (rows with an adapter), then q and k rotate (ROTATE); v is only stored back when it
    changed."""
    DT = base.dtype.element_ty
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    p1 = base + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if has:
        rank = tl.minimum(tl.load(rank_ptr + slot), R)
        scale = tl.load(scale_ptr + slot)
        b_slot = b_ptr + slot.to(tl.int64) * num_heads * 2 * HALF * R
        cols = offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        lv, offs_r, r_mask = _v(part_row, 0, rank, stride_p_split, SPLIT_K, BLOCK_R)
        d1 = _product_2d(part_row, b_slot, rank, scale, cols, mask, R, stride_p_split, lv, offs_r, r_mask,
                         ONE_R_TILE, SPLIT_K, BLOCK_R, BLOCK_H, BLOCK_D)
        d2 = _product_2d(part_row, b_slot, rank, scale, cols + HALF, mask, R, stride_p_split, lv, offs_r, r_mask,
                         ONE_R_TILE, SPLIT_K, BLOCK_R, BLOCK_H, BLOCK_D)
        x1 = _round(x1 + d1, DT, COMPILED)
        x2 = _round(x2 + d2, DT, COMPILED)
    _store_heads(p1, HALF, x1, x2, c, s, mask, ROTATE, has, COMPILED)


@triton.jit
def _store_heads(p1, HALF, x1, x2, c, s, mask, rotate, has, COMPILED: tl.constexpr):
    """The heads' halves back in place: q and k (`rotate`) rotated; v only where it took a product (`has`)."""
    DT = p1.dtype.element_ty
    if rotate:
        o1, o2 = _rotate(x1, x2, c, s, DT, COMPILED)
        tl.store(p1, o1.to(DT), mask=mask)
        tl.store(p1 + HALF, o2.to(DT), mask=mask)
    elif has:
        tl.store(p1, x1.to(DT), mask=mask)
        tl.store(p1 + HALF, x2.to(DT), mask=mask)


@triton.jit
def _rope_early(q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, part_row, slot, has, b0, b1, b2, rk0, rk1, rk2, sc0, sc1,
                sc2, R, stride_p_split, stride_p_slice, HQ, HKV, HALF, stride_qh, stride_kh, stride_vh, which, h0,
                ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_D: tl.constexpr, COMPILED: tl.constexpr):
    """`_heads` for q, k or v (`which`) with the slice's rank, scaling and both halves' B blocks read first, then
    the kernel's deferred PDL wait (ops/pdl.py's early reads), then the rest: the same sums and roundings. `q_ptr`,
    `k_ptr`, `v_ptr`: the token's rows."""
    is_q = which == 0
    is_k = which == 1
    num_heads = tl.where(is_q, HQ, HKV)
    b_ptr = tl.where(is_q, b0, tl.where(is_k, b1, b2))
    rank = tl.where(has, tl.minimum(tl.load(tl.where(is_q, rk0, tl.where(is_k, rk1, rk2)) + slot), R), 0)
    scale = tl.load(tl.where(is_q, sc0, tl.where(is_k, sc1, sc2)) + slot)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    cols = offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    b_slot = b_ptr + slot.to(tl.int64) * num_heads * 2 * HALF * R
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank   # rank 0 (no adapter): nothing read
    b1_ = _load_rank_block_2d(b_slot + cols[:, :, None] * R + offs_r[None, None, :], mask[:, :, None],
                              offs_r[None, None, :], r_mask[None, None, :], rank, R)
    b2_ = _load_rank_block_2d(b_slot + (cols + HALF)[:, :, None] * R + offs_r[None, None, :], mask[:, :, None],
                              offs_r[None, None, :], r_mask[None, None, :], rank, R)
    pdl_deferred_start(True)
    DT = q_ptr.dtype.element_ty
    base = tl.where(is_q, q_ptr, tl.where(is_k, k_ptr, v_ptr))
    stride_h = tl.where(is_q, stride_qh, tl.where(is_k, stride_kh, stride_vh))
    p1 = base + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if has:
        lv, _, _ = _v(part_row + which * stride_p_slice, 0, rank, stride_p_split, SPLIT_K, BLOCK_R)
        x1 = _round(x1 + tl.sum(b1_.to(tl.float32) * lv[None, None, :], axis=2) * scale, DT, COMPILED)
        x2 = _round(x2 + tl.sum(b2_.to(tl.float32) * lv[None, None, :], axis=2) * scale, DT, COMPILED)
    c, s = _cos_sin(pos_ptr, inv_freq_ptr, offs_d, d_mask, DT, COMPILED)
    _store_heads(p1, HALF, x1, x2, c, s, mask, which < 2, has, COMPILED)


@triton.jit
def _token_slot(row_slot_ptr, part_ptr, slot_active_ptr, t, stride_pm, active_stride, IN_GEMM: tl.constexpr):
    """(has, slot, its partials' row) of token t: slot 0 where it has no adapter (nothing is read)."""
    slot = tl.load(row_slot_ptr + t)
    has = slot >= 0
    slot = tl.maximum(slot, 0)
    part_row = part_ptr + t * stride_pm
    if IN_GEMM:
        part_row += tl.maximum(tl.load(slot_active_ptr + slot), 0).to(tl.int64) * active_stride
    return has, slot, part_row


@triton.jit
def _rope_lora_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, part_ptr, row_slot_ptr, b0, b1, b2, rk0, rk1, rk2,
                      sc0, sc1, sc2, R, stride_p_split, stride_p_slice, stride_pm, HQ, HKV, HALF, stride_qt,
                      stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pos, slot_active_ptr,
                      active_stride, ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, COMPILED: tl.constexpr, IN_GEMM: tl.constexpr,
                      EARLY: tl.constexpr):
    """Program (token, q|k|v, head block): q/k/v heads take their slice's product; q and k rotate.
    IN_GEMM: the product's part is a GEMM's shrink columns, the row's adapter's `active_stride` × its
    active index along (lora_product.py). EARLY (one rank tile): the row's slot, the slice's rank and scaling
    and its B blocks are read before the PDL wait (ops/pdl.py's early reads; `_rope_early`)."""
    pdl_start(EARLY)   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first (EARLY: below)
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    h0 = tl.program_id(2) * BLOCK_H
    if EARLY:
        has, slot, part_row = _token_slot(row_slot_ptr, part_ptr, slot_active_ptr, t, stride_pm, active_stride,
                                          IN_GEMM)
        # k and v have fewer head blocks with GQA; a program past them loads and stores nothing of q/k/v
        _rope_early(q_ptr + t * stride_qt, k_ptr + t * stride_kt, v_ptr + t * stride_vt, pos_ptr + t * stride_pos,
                    inv_freq_ptr, part_row, slot, has, b0, b1, b2, rk0, rk1, rk2, sc0, sc1, sc2, R, stride_p_split,
                    stride_p_slice, HQ, HKV, HALF, stride_qh, stride_kh, stride_vh, which, h0, ONE_R_TILE, SPLIT_K,
                    BLOCK_R, BLOCK_H, BLOCK_D, COMPILED)
    elif h0 < tl.where(which == 0, HQ, HKV):   # k and v have fewer head blocks with GQA
        DT = q_ptr.dtype.element_ty
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HALF
        c, s = _cos_sin(pos_ptr + t * stride_pos, inv_freq_ptr, offs_d, d_mask, DT, COMPILED)
        has, slot, part_row = _token_slot(row_slot_ptr, part_ptr, slot_active_ptr, t, stride_pm, active_stride,
                                          IN_GEMM)
        if which == 0:
            _heads(q_ptr + t * stride_qt, stride_qh, HQ, h0, part_row, b0, rk0, sc0, slot, has, R, stride_p_split,
                   HALF, c, s, offs_d, d_mask, True, ONE_R_TILE, SPLIT_K, BLOCK_R, BLOCK_H, BLOCK_D, COMPILED)
        elif which == 1:
            _heads(k_ptr + t * stride_kt, stride_kh, HKV, h0, part_row + stride_p_slice, b1, rk1, sc1, slot, has, R,
                   stride_p_split, HALF, c, s, offs_d, d_mask, True, ONE_R_TILE, SPLIT_K, BLOCK_R, BLOCK_H, BLOCK_D,
                   COMPILED)
        else:
            _heads(v_ptr + t * stride_vt, stride_vh, HKV, h0, part_row + 2 * stride_p_slice, b2, rk2, sc2, slot, has,
                   R, stride_p_split, HALF, c, s, offs_d, d_mask, False, ONE_R_TILE, SPLIT_K, BLOCK_R, BLOCK_H,
                   BLOCK_D, COMPILED)


# ---------------------------------------------------------------------------------------------
# Launchers. Arguments arrive validated (fused.py); T = 0 launches nothing.

# Tile settings: benchmarks/sweep_fused_consumers.py on an H200 (results/fused_sweep.json, run on the first
# version of these kernels; its SILU_BLOCK values did not take effect, so SILU_BLOCK is untuned).
RMS_BLOCK = 2048    # columns per tile of the row walk (B tile: RMS_BLOCK × BLOCK_R)
RMS_STAGES = 2      # the row walk's loads pipelined this deep
RMS_SPLIT = 512     # > 0: each row over programs of this many columns, two launches (fused_lora_rms_split.py, which
                    # gives its measurements); 0: one program a row
SILU_BLOCK = 512
SILU_WARPS = 0      # > 0: warps per SiLU-and-mul program; 0: one per 128 columns, at most 4 (148 registers a thread
                    # at 512 columns, sm_90 ptxas; 76 in 8 warps)
SILU_LOADS_FIRST = False   # both B blocks loaded before either product (0.992x a batch-32 decode forward: inside the
                           # rounds' spread, H200, 2026-12-02, results/decode_graph_trace_skinny.json)
# LORAPLEX_LORA_EARLY_READS (on by default; off: the code before 2026-12-03): the three consumers (RMSNorm's split
# launch 1) read their rows' slots, ranks, scalings and B blocks before the PDL wait (ops/pdl.py's early reads), so
# that with PDL those loads run while the GEMM before them is finishing; only where one rank tile holds the rank
# (R <= 32). H200, 2026-12-03 (results/decode_graph_trace_early{,_c}.json, engine_early_*.md): a batch-32 Llama-2-7B
# decode forward with distinct adapters 0.988-0.990x in paired rounds (SiLU-and-mul's share 0.991x, RoPE's and the
# RMSNorm's 0.997-0.998x), issue 5's decode step 7.05-7.06 -> 6.96-6.98 ms on one lease, 6.95-6.98 -> 6.85-6.91
# on another.
EARLY_READS = env_switch("LORAPLEX_LORA_EARLY_READS", "on", on="on", off="off") == "on"
EARLY_KERNELS = frozenset({"rms", "silu", "rope"})   # the consumers it changes (benchmarks time them apart)
# heads per program; 2 and 1 measured 1.000× and 1.011× its decode forward time (H200, 2026-12-02, Llama-2-7B at
# batch 32 in CUDA graphs, paired rounds: results/decode_graph_trace_oattn.json)
ROPE_HEADS = 4
_RMS = Launcher(_rms_norm_lora_kernel)
_SILU = Launcher(_silu_and_mul_lora_kernel)
_ROPE = Launcher(_rope_lora_kernel)


def _block_r(R: int) -> int:
    return min(_pow2(R), 32)


def _tiles(R: int) -> dict:
    block_r = _block_r(R)
    return dict(ONE_R_TILE=R <= block_r, BLOCK_R=block_r)


def _early(R: int, kernel: str, lora) -> bool:
    """EARLY_READS for `kernel` where it applies (one rank tile, a product whose row slots were not made inside
    the forward: LoraProduct.early_reads); read at call time, as tests and benchmarks set it."""
    return EARLY_READS and kernel in EARLY_KERNELS and R <= _block_r(R) and lora.early_reads


def rms_norm(x, weight, eps: float, residual, out, s_out, lora, block: int | None = None) -> None:
    """`fused_kernels.rms_norm` on x plus the LoraProduct `lora` (one slice), s always written."""
    T, H = x.shape
    if T == 0:
        return
    if RMS_SPLIT:
        from . import rms_split as fused_lora_rms_split   # imports this module's jit helpers
        R = lora.part.shape[3]
        fused_lora_rms_split.rms_norm(x, weight, eps, residual, out, s_out, lora, RMS_SPLIT, _tiles(R),
                                      _early(R, "rms", lora))
        return
    block = min(_pow2(H), block or RMS_BLOCK)
    p, row_slot, b, _, _, rk, _, _, sc, _, _, R, sp, _, sm = lora.kernel_args()
    r = residual if residual is not None else x
    args = (x, r, weight, out, s_out, p, row_slot, b, rk, sc, R, sp, sm, H, _inv(H), float(eps), x.stride(0),
            r.stride(0), out.stride(0), s_out.stride(0))
    consts = dict(HAS_RESIDUAL=residual is not None, **_tiles(R), SPLIT_K=p.shape[0], BLOCK=block, COMPILED=COMPILED)
    _RMS((T,), args, consts, max(1, min(8, block // 128)), RMS_STAGES)


def silu_and_mul(gate_up, out, lora, block: int | None = None) -> None:
    """`fused_kernels.silu_and_mul` on gate/up plus the LoraProduct `lora` (two slices)."""
    if lora.tiles is not None:   # prompt rows: their product expanded tile by tile
        from . import silu_lora_tiles_kernels
        silu_lora_tiles_kernels.silu_and_mul(gate_up, out, lora)
        return
    T, I = out.shape
    if T == 0:
        return
    block = min(_pow2(I), block or SILU_BLOCK)   # read at call time: benchmarks set SILU_BLOCK
    p, row_slot, b0, b1, _, rk0, rk1, _, sc0, sc1, _, R, sp, ss, sm = lora.kernel_args()
    args = (gate_up, out, p, row_slot, b0, b1, rk0, rk1, sc0, sc1, R, sp, ss, sm, I, gate_up.stride(0), out.stride(0))
    _SILU((T, -(-I // block)), args, dict(**_tiles(R), SPLIT_K=p.shape[0], BLOCK=block, COMPILED=COMPILED,
                                          LOADS_FIRST=SILU_LOADS_FIRST, EARLY=_early(R, "silu", lora)),
          SILU_WARPS or max(1, min(4, block // 128)), 1)


def apply_rope(q, k, v, positions, inv_freq, lora, heads: int | None = None) -> None:
    """`fused_kernels.apply_rope` on q/k/v plus the LoraProduct `lora` (three slices); v takes its product."""
    T, Hq, D = q.shape
    if T == 0:
        return
    Hkv, half = k.shape[1], D // 2
    block_h = min(_pow2(max(Hq, Hkv)), heads or ROPE_HEADS)
    block_d = _pow2(half)
    p, row_slot, b0, b1, b2, rk0, rk1, rk2, sc0, sc1, sc2, R, sp, ss, sm = lora.kernel_args()
    in_gemm = lora.slot_active is not None
    args = (q, k, v, positions, inv_freq, p, row_slot, b0, b1, b2, rk0, rk1, rk2, sc0, sc1, sc2, R, sp, ss, sm,
            Hq, Hkv, half, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            positions.stride(0), lora.slot_active if in_gemm else row_slot, lora.active_stride if in_gemm else 0)
    grid = (T, 3, -(-max(Hq, Hkv) // block_h))
    _ROPE(grid, args, dict(**_tiles(R), SPLIT_K=p.shape[0], BLOCK_H=block_h, BLOCK_D=block_d, COMPILED=COMPILED,
                           IN_GEMM=in_gemm, EARLY=_early(R, "rope", lora)),
          max(1, min(4, block_h * block_d // 128)), 1)
