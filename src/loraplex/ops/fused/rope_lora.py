"""The RoPE consumer of a `LoraProduct` (lora_kernels.py's semantics): q and k rotated after each row's q/k
products are added, v's product added, in place, one program per (token, q/k/v, head block).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels import COMPILED, _cos_sin, _rotate, _round
from .lora_kernels import _early, _tiles, _v
from ..launch import Launcher, pow2
from ..lora.b_blocks import _load_rank_block_exact, _pair_b, _pair_scalars, _pair_slots, _pair_sum, _pair_v, \
    _pairs_after_first
from ..pdl import pdl_deferred_start, pdl_start


@triton.jit
def _product_2d(part_row, b_slot, rank, scale, cols, mask, R, stride_p_split, v, offs_r, r_mask,
                ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """`_product` over a [BLOCK_H, BLOCK_D] tile of columns (heads × half a head), B read at the rank itself
    (`_load_rank_block_exact`)."""
    if ONE_R_TILE:
        b = _load_rank_block_exact(b_slot + cols[:, :, None] * R + offs_r[None, None, :], mask[:, :, None],
                                offs_r[None, None, :], r_mask[None, None, :], rank, R)
        acc = tl.sum(b.to(tl.float32) * v[None, None, :], axis=2)
    else:
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            v_r, offs_rr, r_mask_r = _v(part_row, r0, rank, stride_p_split, SPLIT_K, BLOCK_R)
            b = _load_rank_block_exact(b_slot + cols[:, :, None] * R + offs_rr[None, None, :], mask[:, :, None],
                                    offs_rr[None, None, :], r_mask_r[None, None, :], rank, R)
            acc += tl.sum(b.to(tl.float32) * v_r[None, None, :], axis=2)
    return acc * scale


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
def _load_halves(q_ptr, k_ptr, v_ptr, is_q, is_k, stride_qh, stride_kh, stride_vh, offs_h, offs_d, mask, HALF):
    """(first halves' pointers, both halves in fp32) of q's, k's or v's heads `offs_h` of the token."""
    base = tl.where(is_q, q_ptr, tl.where(is_k, k_ptr, v_ptr))
    stride_h = tl.where(is_q, stride_qh, tl.where(is_k, stride_kh, stride_vh))
    p1 = base + offs_h[:, None] * stride_h + offs_d[None, :]
    return p1, tl.load(p1, mask=mask, other=0.0).to(tl.float32), tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rope_early(q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, part_row, slot, has, b0, b1, b2, rk0, rk1, rk2, sc0, sc1,
                sc2, R, stride_p_split, stride_p_slice, HQ, HKV, HALF, stride_qh, stride_kh, stride_vh, which, h0,
                SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                COMPILED: tl.constexpr):
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
    b1_ = _load_rank_block_exact(b_slot + cols[:, :, None] * R + offs_r[None, None, :], mask[:, :, None],
                              offs_r[None, None, :], r_mask[None, None, :], rank, R)
    b2_ = _load_rank_block_exact(b_slot + (cols + HALF)[:, :, None] * R + offs_r[None, None, :], mask[:, :, None],
                              offs_r[None, None, :], r_mask[None, None, :], rank, R)
    pdl_deferred_start(True)
    DT = q_ptr.dtype.element_ty
    p1, x1, x2 = _load_halves(q_ptr, k_ptr, v_ptr, is_q, is_k, stride_qh, stride_kh, stride_vh, offs_h, offs_d, mask,
                              HALF)
    if has:
        part_slice = part_row + which * stride_p_slice
        lv, _, _ = _v(part_slice, 0, rank, stride_p_split, SPLIT_K, BLOCK_R)
        x1 = _round(x1 + tl.sum(b1_.to(tl.float32) * lv[None, None, :], axis=2) * scale, DT, COMPILED)
        x2 = _round(x2 + tl.sum(b2_.to(tl.float32) * lv[None, None, :], axis=2) * scale, DT, COMPILED)
    c, s = _cos_sin(pos_ptr, inv_freq_ptr, offs_d, d_mask, DT, COMPILED)
    _store_heads(p1, HALF, x1, x2, c, s, mask, which < 2, has, COMPILED)


@triton.jit
def _rope_composed(q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, part_row, row_slot_ptr, extra_ptr, t, T, extra_lanes,
                   stride_pm, b0, b1, b2, rk0, rk1, rk2, sc0, sc1, sc2, R, stride_p_split, stride_p_slice, HQ, HKV,
                   HALF, stride_qh, stride_kh, stride_vh, which, h0, SPLIT_K: tl.constexpr, MEMBER_R: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, COMPILED: tl.constexpr, EARLY: tl.constexpr):
    """`_rope_early` for a composed product: the row's members two at a time (ops/lora/b_blocks.py), members
    0 and 1's slots, ranks, scalings and first B blocks (both halves) read before the deferred PDL wait where EARLY.
    `q_ptr`, `k_ptr`, `v_ptr`: the token's rows."""
    is_q = which == 0
    is_k = which == 1
    num_heads = tl.where(is_q, HQ, HKV)
    b_ptr = tl.where(is_q, b0, tl.where(is_k, b1, b2))
    rank_ptr = tl.where(is_q, rk0, tl.where(is_k, rk1, rk2))
    scale_ptr = tl.where(is_q, sc0, tl.where(is_k, sc1, sc2))
    first = tl.load(row_slot_ptr + t)
    slots = _pair_slots(first, extra_ptr, t, T, extra_lanes, 0)
    ranks, scales = _pair_scalars(slots, rank_ptr, scale_ptr, R)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]   # k and v: none past their heads (GQA)
    cols = offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    slot_elems = num_heads * 2 * HALF * R
    b1_ = _pair_b(b_ptr, slot_elems, slots, ranks, cols, mask, 0, R, MEMBER_R, True)
    b2_ = _pair_b(b_ptr, slot_elems, slots, ranks, cols + HALF, mask, 0, R, MEMBER_R, True)
    pdl_deferred_start(EARLY)
    DT = q_ptr.dtype.element_ty
    p1, x1, x2 = _load_halves(q_ptr, k_ptr, v_ptr, is_q, is_k, stride_qh, stride_kh, stride_vh, offs_h, offs_d, mask,
                              HALF)
    has = (first >= 0) & (h0 < num_heads)   # (a k/v program past their heads: nothing to add)
    if has:
        part_slice = part_row + which * stride_p_slice
        v = _pair_v(part_slice, 0, T, stride_pm, 0, ranks, stride_p_split, SPLIT_K, MEMBER_R)
        d1 = _pairs_after_first(_pair_sum(b1_, v, scales), part_slice, first, extra_ptr, t, T, extra_lanes,
                                stride_pm, b_ptr, slot_elems, rank_ptr, scale_ptr, slots, ranks, scales, cols, mask, R,
                                stride_p_split, SPLIT_K, MEMBER_R, True)
        d2 = _pairs_after_first(_pair_sum(b2_, v, scales), part_slice, first, extra_ptr, t, T, extra_lanes,
                                stride_pm, b_ptr, slot_elems, rank_ptr, scale_ptr, slots, ranks, scales, cols + HALF,
                                mask, R, stride_p_split, SPLIT_K, MEMBER_R, True)
        x1 = _round(x1 + d1, DT, COMPILED)
        x2 = _round(x2 + d2, DT, COMPILED)
    c, s = _cos_sin(pos_ptr, inv_freq_ptr, offs_d, d_mask, DT, COMPILED)
    _store_heads(p1, HALF, x1, x2, c, s, mask, which < 2, has, COMPILED)


@triton.jit
def _token_slot(row_slot_ptr, part_ptr, t, stride_pm):
    """(has, slot, its partials' row) of token t: slot 0 where it has no adapter (nothing is read)."""
    slot = tl.load(row_slot_ptr + t)
    has = slot >= 0
    slot = tl.maximum(slot, 0)
    part_row = part_ptr + t * stride_pm
    return has, slot, part_row


@triton.jit(do_not_specialize=["T", "extra_lanes"])   # one variant whatever the lanes
def _rope_lora_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, part_ptr, row_slot_ptr, b0, b1, b2, rk0, rk1, rk2,
                      sc0, sc1, sc2, R, stride_p_split, stride_p_slice, stride_pm, extra_ptr, T, extra_lanes, HQ, HKV,
                      HALF, stride_qt,
                      stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pos, ONE_R_TILE: tl.constexpr,
                      SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                      COMPILED: tl.constexpr, EARLY: tl.constexpr, EXTRAS: tl.constexpr, MEMBER_R: tl.constexpr):
    """Program (token, q|k|v, head block): q/k/v heads take their slice's product; q and k rotate.
    EARLY (one rank tile): the row's slot, the slice's rank and scaling and its B blocks are read before the PDL
    wait (ops/pdl.py's early reads; `_rope_early`). EXTRAS: a composed product (`_rope_composed`)."""
    pdl_start(EARLY)   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first (EARLY: below)
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    h0 = tl.program_id(2) * BLOCK_H
    # k and v have fewer head blocks with GQA; a program past them loads and stores nothing of q/k/v
    if EXTRAS:
        _rope_composed(q_ptr + t * stride_qt, k_ptr + t * stride_kt, v_ptr + t * stride_vt, pos_ptr + t * stride_pos,
                       inv_freq_ptr, part_ptr + t * stride_pm, row_slot_ptr, extra_ptr, t, T, extra_lanes, stride_pm,
                       b0, b1, b2, rk0, rk1, rk2, sc0, sc1, sc2, R, stride_p_split, stride_p_slice, HQ, HKV, HALF,
                       stride_qh, stride_kh, stride_vh, which, h0, SPLIT_K, MEMBER_R, BLOCK_H, BLOCK_D, COMPILED,
                       EARLY)
    elif EARLY:
        has, slot, part_row = _token_slot(row_slot_ptr, part_ptr, t, stride_pm)
        _rope_early(q_ptr + t * stride_qt, k_ptr + t * stride_kt, v_ptr + t * stride_vt, pos_ptr + t * stride_pos,
                    inv_freq_ptr, part_row, slot, has, b0, b1, b2, rk0, rk1, rk2, sc0, sc1, sc2, R, stride_p_split,
                    stride_p_slice, HQ, HKV, HALF, stride_qh, stride_kh, stride_vh, which, h0, SPLIT_K, BLOCK_R,
                    BLOCK_H, BLOCK_D, COMPILED)
    elif h0 < tl.where(which == 0, HQ, HKV):
        DT = q_ptr.dtype.element_ty
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HALF
        c, s = _cos_sin(pos_ptr + t * stride_pos, inv_freq_ptr, offs_d, d_mask, DT, COMPILED)
        has, slot, part_row = _token_slot(row_slot_ptr, part_ptr, t, stride_pm)
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
# Launchers. Arguments arrive validated (api.py); T = 0 launches nothing.


ROPE_HEADS = 4   # heads per program (a sweep on an H200: 2 and 1 measured no faster)
_ROPE = Launcher(_rope_lora_kernel)


def apply_rope(q, k, v, positions, inv_freq, lora, heads: int | None = None) -> None:
    """`fused_kernels.apply_rope` on q/k/v plus the LoraProduct `lora` (three slices); v takes its product."""
    T, Hq, D = q.shape
    if T == 0:
        return
    Hkv, half = k.shape[1], D // 2
    block_h = min(pow2(max(Hq, Hkv)), heads or ROPE_HEADS)
    block_d = pow2(half)
    p, row_slot, b0, b1, b2, rk0, rk1, rk2, sc0, sc1, sc2, R, sp, ss, sm, extra, lanes_t, extra_lanes = \
        lora.kernel_args()
    args = (q, k, v, positions, inv_freq, p, row_slot, b0, b1, b2, rk0, rk1, rk2, sc0, sc1, sc2, R, sp, ss, sm,
            extra, lanes_t, extra_lanes, Hq, Hkv, half, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), positions.stride(0))
    grid = (T, 3, -(-max(Hq, Hkv) // block_h))
    composed = lora.lanes > 1
    # a composed product holds two members' B blocks of both halves: twice the warps (at Llama's 4 heads of 64
    # columns and a rank-32 pool, sm_90 code spilled 482 bytes a thread at 2 warps and none at 4)
    warps = max(1, min(4, block_h * block_d // 128)) * (2 if composed else 1)
    _ROPE(grid, args, dict(**_tiles(R), SPLIT_K=p.shape[0], BLOCK_H=block_h, BLOCK_D=block_d, COMPILED=COMPILED,
                           EARLY=_early(R, lora), EXTRAS=composed), warps, 1)
