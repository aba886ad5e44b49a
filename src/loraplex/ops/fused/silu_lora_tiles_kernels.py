"""The Triton kernel of ops/silu_lora_tiles.py (see there)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .kernels import COMPILED, _round, _silu_mul
from ..launch import Launcher
from ..pdl import pdl_start
from ..lora.sgmv_kernels import _dot_v_b, _load_b, _load_v


def _config(raw: str) -> tuple[int, int]:
    """LORAPLEX_LORA_SILU_TILES_CONFIG, "<columns a program>x<warps>" (default 64x4)."""
    try:
        block_n, warps = (int(v) for v in raw.lower().split("x"))
    except ValueError:
        block_n = warps = 0
    if block_n not in (16, 32, 64, 128, 256) or warps not in (1, 2, 4, 8):
        raise ValueError(f"LORAPLEX_LORA_SILU_TILES_CONFIG={raw!r}: expected <columns>x<warps>, columns 16 to 256 "
                         f"and warps 1 to 8, powers of two (e.g. 64x4)")
    return block_n, warps


BLOCK_N, NUM_WARPS = _config(os.environ.get("LORAPLEX_LORA_SILU_TILES_CONFIG", "64x4"))   # benchmarks set them
PROGRAMS_PER_SM = 4.0   # the grid's target (read at call time, as the two above)
PREFETCH = True


@triton.jit
def _slice_setup(part, b_ptr, rank_ptr, scale_ptr, slot, rows, m_mask, I, R, stride_p_split, stride_pm,
                 SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """A slice's rank, scaling, B stack of the tile's slot, and v (its first rank tile) for the tile's rows."""
    rank = tl.where(slot >= 0, tl.minimum(tl.load(rank_ptr + tl.maximum(slot, 0)), R), 0)
    scale = tl.load(scale_ptr + tl.maximum(slot, 0))
    b_base = b_ptr + tl.maximum(slot, 0).to(tl.int64) * I * R
    v, offs_r, r_mask = _load_v(part, rows, m_mask, 0, rank, stride_p_split, stride_pm, SPLIT_K, BLOCK_R)
    return rank, scale, b_base, v, offs_r, r_mask


@triton.jit
def _summed(x, part, b_base, rank, scale, v, offs_r, r_mask, rows, m_mask, offs_n, n_mask, R, stride_p_split,
            stride_pm, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
            ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr, DT: tl.constexpr, COMPILED: tl.constexpr):
    """x (fp32 [BLOCK_M, BLOCK_N]) plus the slice's product on these columns, rounded to DT as the expand's
    `(y_old + acc * scale).to(dtype)`, the product the tile expand's (its bits)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ONE_R_TILE:   # v stays in registers over the column loop
        acc = _dot_v_b(v, _load_b(b_base, offs_n, n_mask, offs_r, r_mask, R), acc, PRECISION)
    else:
        for r0 in range(0, rank, BLOCK_R):
            v_r, offs_rr, r_mask_r = _load_v(part, rows, m_mask, r0, rank, stride_p_split, stride_pm, SPLIT_K,
                                             BLOCK_R)
            acc = _dot_v_b(v_r, _load_b(b_base, offs_n, n_mask, offs_rr, r_mask_r, R), acc, PRECISION)
    return _round(x + acc * scale, DT, COMPILED)


@triton.jit(do_not_specialize=["T", "num_work"])
def _silu_and_mul_lora_tiles_kernel(gu_ptr, out_ptr, part_ptr, sorted_rows_ptr, work_slot_ptr, work_start_ptr,
                                    work_end_ptr, row_slot_ptr, b0, b1, rk0, rk1, sc0, sc1, R, stride_p_split,
                                    stride_p_slice, stride_pm, T, I, num_work, n_per_prog, stride_gu, stride_out,
                                    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_R: tl.constexpr, ONE_R_TILE: tl.constexpr, PRECISION: tl.constexpr,
                                    PREFETCH: tl.constexpr, COMPILED: tl.constexpr):
    """See ops/silu_lora_tiles.py. Program (w, chunk) covers columns [chunk · n_per_prog, + n_per_prog) of I,
    BLOCK_N at a time; PREFETCH: each step's gate and up blocks are loaded a step ahead (Triton pipelines a
    loop's loads only where they feed a dot)."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    w = tl.program_id(0)
    n_begin = tl.program_id(1) * n_per_prog
    n_end = tl.minimum(n_begin + n_per_prog, I)
    cols = tl.arange(0, BLOCK_N)
    DT = out_ptr.dtype.element_ty
    if w < num_work:
        slot = tl.load(work_slot_ptr + w)
        offs_m = tl.load(work_start_ptr + w) + tl.arange(0, BLOCK_M)
        m_mask = offs_m < tl.where(slot >= 0, tl.load(work_end_ptr + w), 0)   # a capacity batch's unused tiles
        rows = tl.load(sorted_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        gu_rows = gu_ptr + rows[:, None] * stride_gu
        out_rows = out_ptr + rows[:, None] * stride_out
        part_u = part_ptr + stride_p_slice
        rank_g, scale_g, b_g, v_g, offs_r, rm_g = _slice_setup(part_ptr, b0, rk0, sc0, slot, rows, m_mask, I, R,
                                                               stride_p_split, stride_pm, SPLIT_K, BLOCK_R)
        rank_u, scale_u, b_u, v_u, _, rm_u = _slice_setup(part_u, b1, rk1, sc1, slot, rows, m_mask, I, R,
                                                          stride_p_split, stride_pm, SPLIT_K, BLOCK_R)
        if PREFETCH:
            first = m_mask[:, None] & ((n_begin + cols) < n_end)[None, :]
            g_next = tl.load(gu_rows + (n_begin + cols)[None, :], mask=first, other=0.0)
            u_next = tl.load(gu_rows + (I + n_begin + cols)[None, :], mask=first, other=0.0)
        for n0 in range(n_begin, n_end, BLOCK_N):
            offs_n = n0 + cols
            n_mask = offs_n < n_end
            mask = m_mask[:, None] & n_mask[None, :]
            if PREFETCH:
                g = g_next.to(tl.float32)
                u = u_next.to(tl.float32)
                later = offs_n + BLOCK_N   # the next step's columns (all masked off after the last step)
                ahead = m_mask[:, None] & (later < n_end)[None, :]
                g_next = tl.load(gu_rows + later[None, :], mask=ahead, other=0.0)
                u_next = tl.load(gu_rows + (I + later)[None, :], mask=ahead, other=0.0)
            else:
                g = tl.load(gu_rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
                u = tl.load(gu_rows + (I + offs_n)[None, :], mask=mask, other=0.0).to(tl.float32)
            g = _summed(g, part_ptr, b_g, rank_g, scale_g, v_g, offs_r, rm_g, rows, m_mask, offs_n, n_mask, R,
                        stride_p_split, stride_pm, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, DT,
                        COMPILED)
            u = _summed(u, part_u, b_u, rank_u, scale_u, v_u, offs_r, rm_u, rows, m_mask, offs_n, n_mask, R,
                        stride_p_split, stride_pm, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, ONE_R_TILE, PRECISION, DT,
                        COMPILED)
            tl.store(out_rows + offs_n[None, :], _silu_mul(g, u, DT, COMPILED).to(DT), mask=mask)
    else:
        rows = ((w - num_work) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_mask = rows < T
        m_mask &= tl.load(row_slot_ptr + rows, mask=m_mask, other=0) < 0
        if tl.max(m_mask.to(tl.int32), axis=0) > 0:   # a block of rows that all have adapters: nothing to do
            gu_rows = gu_ptr + rows[:, None] * stride_gu
            out_rows = out_ptr + rows[:, None] * stride_out
            for n0 in range(n_begin, n_end, BLOCK_N):
                offs_n = n0 + cols
                mask = m_mask[:, None] & (offs_n < n_end)[None, :]
                g = tl.load(gu_rows + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
                u = tl.load(gu_rows + (I + offs_n)[None, :], mask=mask, other=0.0).to(tl.float32)
                tl.store(out_rows + offs_n[None, :], _silu_mul(g, u, DT, COMPILED).to(DT), mask=mask)


_TILES = Launcher(_silu_and_mul_lora_tiles_kernel)


def silu_and_mul(gate_up, out, lora, block_n: int | None = None) -> None:
    """`out = silu(gate + delta_0) · (up + delta_1)` over `lora.tiles`' work tiles (ops/silu_lora_tiles.py); `lora`
    a two-slice LoraProduct whose `part` the shrink wrote over the same batch (arguments checked by the caller)."""
    from ..lora.sgmv import _block_r, _num_sms, config_for
    batch = lora.tiles
    T, I = out.shape
    if T == 0:
        return
    block_n = block_n or BLOCK_N
    R = lora.part.shape[3]
    block_r = _block_r(R)
    free = 0 if batch.all_rows_have_adapters else -(-T // batch.block_m)
    p = lora.part
    # the expand's precision (sgmv.expand_from, adding into gate_up)
    precision = config_for(batch.block_m).expand_precision or \
        ("split" if gate_up.dtype == torch.bfloat16 else "tf32x3")
    # I cut into chunks so that the grid has about PROGRAMS_PER_SM programs an SM (as sgmv.choose_n_chunks)
    tiles = -(-I // block_n)
    chunks = max(1, min(tiles, -(-int(PROGRAMS_PER_SM * _num_sms(gate_up.device)) // max(batch.num_work + free, 1))))
    n_per_prog = -(-tiles // chunks) * block_n
    args = (gate_up, out, p, batch.sorted_rows, batch.work_slot, batch.work_start, batch.work_end, lora.row_slot,
            *lora.lora_b, *lora.ranks, *lora.scalings, R, p.stride(0), p.stride(1), p.stride(2), T, I,
            batch.num_work, n_per_prog, gate_up.stride(0), out.stride(0))
    consts = dict(SPLIT_K=p.shape[0], BLOCK_M=batch.block_m, BLOCK_N=block_n, BLOCK_R=block_r,
                  ONE_R_TILE=R <= block_r, PRECISION=precision, PREFETCH=PREFETCH, COMPILED=COMPILED)
    _TILES((batch.num_work + free, -(-I // n_per_prog)), args, consts, NUM_WARPS, 1)
