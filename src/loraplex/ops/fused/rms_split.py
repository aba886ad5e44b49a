"""RMSNorm of a projection plus its LoraProduct, each row spread over several programs (two launches).

The norm needs the whole row's sum of squares; one program per row would stream its adapter's whole B block
(4,096 × rank values for o and down) in a serial walk at decode (10.6 µs on an H200 at 32 rows, against 2.5 µs
for the plain RMSNorm). Here the row is cut into chunks of BLOCK columns:

    1. program (row, chunk): s = round(x + delta) (+ residual, rounded), stored; sumsq[row, chunk] = Σ s²
    2. program (row, chunk): rstd from Σ_chunk sumsq[row, :] (a fixed order: deterministic);
       out = weight · normalize(s) over the chunk (with `e4m3`, one program a row that also quantizes it: the
       row's amax needs all of it, and launch 2 reads no adapter)

with delta each row's expanded product (lora_kernels.py's loop), the sums and roundings of fused/kernels.py's
RMSNorm but the order of the sum of squares (chunk by chunk), and every run gives the same bits. 512 columns
(lora_kernels.RMS_SPLIT) took a Llama-2-7B decode forward at batch 32 to 0.985× the time of 1,024 columns' 0.988×
and 2,048's 1.021× (H200; a sweep of the consumers (docs/design-notes.md)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import kernels as fused_kernels
from .kernels import COMPILED, _inv, _norm_output, _round, _rstd
from .lora_kernels import _product, _slot_of, _v
from ..gemm.fp8 import QuantizedRows
from ..gemm.quantize_kernel import quantize_rows_fused, store_quantized_row
from ..lora.b_blocks import _load_rank_block, _pair_b, _pair_scalars, _pair_slots, _pair_sum, _pair_v, \
    _pairs_after_first
from ..launch import Launcher, pow2
from ..pdl import pdl_deferred_start, pdl_start


@triton.jit
def _composed_chunk(x_row, part_row, row_slot_ptr, extra_ptr, row, T, extra_lanes, stride_pm, b_ptr, rank_ptr,
                    scale_ptr, R, H, offs, mask, stride_p_split, SPLIT_K: tl.constexpr, MEMBER_R: tl.constexpr,
                    COMPILED: tl.constexpr, EARLY: tl.constexpr):
    """The chunk of x plus a composed product's row, fp32 and rounded: the row's members two at a time
    (ops/lora/b_blocks.py), members 0 and 1's first B block read before the deferred PDL wait where EARLY."""
    first = tl.load(row_slot_ptr + row)
    slots = _pair_slots(first, extra_ptr, row, T, extra_lanes, 0)
    ranks, scales = _pair_scalars(slots, rank_ptr, scale_ptr, R)
    b = _pair_b(b_ptr, H * R, slots, ranks, offs, mask, 0, R, MEMBER_R, False)
    pdl_deferred_start(EARLY)
    v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if first >= 0:
        d = _pair_sum(b, _pair_v(part_row, 0, T, stride_pm, 0, ranks, stride_p_split, SPLIT_K, MEMBER_R), scales)
        d = _pairs_after_first(d, part_row, first, extra_ptr, row, T, extra_lanes, stride_pm, b_ptr, H * R,
                               rank_ptr, scale_ptr, slots, ranks, scales, offs, mask, R, stride_p_split, SPLIT_K,
                               MEMBER_R, False)
        v = _round(v + d, x_row.dtype.element_ty, COMPILED)
    return v


@triton.jit
def _chunk_sums(x_ptr, r_ptr, s_ptr, sumsq_ptr, part_ptr, row_slot_ptr, b_ptr, rank_ptr, scale_ptr, R, stride_p_split,
                stride_pm, extra_ptr, T, extra_lanes, H, stride_x, stride_r, stride_s, CHUNKS,
                HAS_RESIDUAL: tl.constexpr, ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK: tl.constexpr, COMPILED: tl.constexpr, EARLY: tl.constexpr, EXTRAS: tl.constexpr,
                MEMBER_R: tl.constexpr):
    """Launch 1's program (row, chunk): the chunk of s, stored, and its sum of squares. EARLY (one rank tile):
    the row's slot, rank, scaling and B block are read before the deferred PDL wait (ops/pdl.py's early reads;
    the kernel's first statement was `pdl_start(EARLY)`); the same sums. EXTRAS: a composed product
    (`_composed_chunk`)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    DT = x_ptr.dtype.element_ty
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    if EXTRAS:
        v = _composed_chunk(x_ptr + row * stride_x, part_ptr + row * stride_pm, row_slot_ptr, extra_ptr, row, T,
                            extra_lanes, stride_pm, b_ptr, rank_ptr, scale_ptr, R, H, offs, mask, stride_p_split,
                            SPLIT_K, MEMBER_R, COMPILED, EARLY)
    elif EARLY:
        has, slot, rank, scale = _slot_of(row_slot_ptr, row, rank_ptr, scale_ptr, R)
        offs_r = tl.arange(0, BLOCK_R)
        b = _load_rank_block(b_ptr + slot.to(tl.int64) * H * R + offs[:, None] * R + offs_r[None, :], mask[:, None],
                             offs_r[None, :], (offs_r < rank)[None, :], rank, R)   # rank 0: nothing read
        pdl_deferred_start(EARLY)
        v = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if has:
            lv, _, _ = _v(part_ptr + row * stride_pm, 0, rank, stride_p_split, SPLIT_K, BLOCK_R)
            v = _round(v + tl.sum(b.to(tl.float32) * lv[None, :], axis=1) * scale, DT, COMPILED)
    else:
        v = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        has, slot, rank, scale = _slot_of(row_slot_ptr, row, rank_ptr, scale_ptr, R)
        if has:
            part_row = part_ptr + row * stride_pm
            lv, offs_r, r_mask = _v(part_row, 0, rank, stride_p_split, SPLIT_K, BLOCK_R)
            d = _product(part_row, b_ptr + slot.to(tl.int64) * H * R, rank, scale, offs, mask, R, stride_p_split,
                         lv, offs_r, r_mask, ONE_R_TILE, SPLIT_K, BLOCK_R, BLOCK)
            v = _round(v + d, DT, COMPILED)
    if HAS_RESIDUAL:
        v = _round(tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32) + v, DT, COMPILED)
    tl.store(s_ptr + row * stride_s + offs, v.to(DT), mask=mask)
    tl.store(sumsq_ptr + row * CHUNKS + chunk, tl.sum(v * v, axis=0))


@triton.jit(do_not_specialize=["T", "extra_lanes"])   # one variant whatever the lanes
def _rms_lora_sums_kernel(x_ptr, r_ptr, s_ptr, sumsq_ptr, part_ptr, row_slot_ptr, b_ptr, rank_ptr, scale_ptr, R,
                          stride_p_split, stride_pm, extra_ptr, T, extra_lanes, H, stride_x, stride_r, stride_s, CHUNKS,
                          HAS_RESIDUAL: tl.constexpr, ONE_R_TILE: tl.constexpr, SPLIT_K: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, COMPILED: tl.constexpr, EARLY: tl.constexpr,
                          EXTRAS: tl.constexpr, MEMBER_R: tl.constexpr):
    """Launch 1: program (row, chunk) stores the chunk of s and its sum of squares (`_chunk_sums`)."""
    pdl_start(EARLY)   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first (EARLY: later)
    _chunk_sums(x_ptr, r_ptr, s_ptr, sumsq_ptr, part_ptr, row_slot_ptr, b_ptr, rank_ptr, scale_ptr, R, stride_p_split,
                stride_pm, extra_ptr, T, extra_lanes, H, stride_x, stride_r, stride_s, CHUNKS, HAS_RESIDUAL, ONE_R_TILE,
                SPLIT_K, BLOCK_R, BLOCK, COMPILED, EARLY, EXTRAS, MEMBER_R)


@triton.jit
def _scale_step(s_ptr, sumsq_ptr, H, inv_h, eps, stride_s, CHUNKS, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
                COMPILED: tl.constexpr):
    """(row, rstd, the chunk's s values in fp32, columns, mask) of program (row, chunk) of launch 2: rstd from
    the row's chunks' sums of squares, in a fixed order."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    sums = tl.load(sumsq_ptr + row * CHUNKS + offs_c, mask=offs_c < CHUNKS, other=0.0)
    rstd = _rstd(tl.sum(sums, axis=0), inv_h, eps, COMPILED)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    v = tl.load(s_ptr + row * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    return row, rstd, v, offs, mask


@triton.jit
def _rms_scale_kernel(s_ptr, w_ptr, out_ptr, sumsq_ptr, q_ptr, qs_ptr, H, inv_h, eps, stride_s, stride_out,
                      stride_q, CHUNKS, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr, QUANTIZE: tl.constexpr,
                      COMPILED: tl.constexpr):
    """Program (row, chunk): rstd of the row from its chunks' sums of squares, then the chunk normalised;
    QUANTIZE (one chunk: the whole row): the row quantized to e4m3 too (ops/gemm/quantize_kernel.py's bits)."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    row, rstd, v, offs, mask = _scale_step(s_ptr, sumsq_ptr, H, inv_h, eps, stride_s, CHUNKS, BLOCK_C, BLOCK,
                                           COMPILED)
    y = _norm_output(v, rstd, w_ptr, out_ptr + row * stride_out, offs, mask, COMPILED)
    if QUANTIZE:
        store_quantized_row(y, offs, mask, q_ptr + row * stride_q, qs_ptr + row)


_SUMS = Launcher(_rms_lora_sums_kernel)
_SCALE = Launcher(_rms_scale_kernel)


def chunking(H: int, block: int) -> tuple[int, int]:
    """(columns per program, chunks per row) for rows of H columns cut `block` wide."""
    block = min(pow2(H), block)
    return block, -(-H // block)


def sums(x, residual, s_out, lora, block: int, tiles: dict, early: bool = False) -> torch.Tensor:
    """Launch 1 (see above): s written, and the fp32 `[T, chunks]` sums of squares returned."""
    T, H = x.shape
    block, chunks = chunking(H, block)
    p, row_slot, b, _, _, rk, _, _, sc, _, _, R, sp, _, sm, extra, lanes_t, extra_lanes = lora.kernel_args()
    r = residual if residual is not None else x
    sumsq = torch.empty((T, chunks), dtype=torch.float32, device=x.device)
    consts = dict(HAS_RESIDUAL=residual is not None, **tiles, SPLIT_K=p.shape[0], BLOCK=block, COMPILED=COMPILED,
                  EARLY=early and tiles["ONE_R_TILE"], EXTRAS=lora.lanes > 1)
    _SUMS((T, chunks), (x, r, s_out, sumsq, p, row_slot, b, rk, sc, R, sp, sm, extra, lanes_t, extra_lanes, H,
                        x.stride(0), r.stride(0), s_out.stride(0), chunks), consts, max(1, min(4, block // 128)), 1)
    return sumsq


def rms_norm(x, weight, eps: float, residual, out, s_out, lora, block: int, tiles: dict, early: bool = False,
             e4m3: QuantizedRows | None = None) -> None:
    """lora_kernels.rms_norm's op with each row cut into chunks of `block` columns (see above);
    `tiles`: the rank-tile constexprs (lora_kernels.py's `_tiles`); `early`: launch 1's early reads (one rank tile);
    `e4m3` (ops/gemm/fp8.py's QuantizedRows): out quantized a row into it, by launch 2 with one program a row (rows
    up to fused/kernels.py's RMS_MAX_BLOCK; wider ones by a launch of their own)."""
    T, H = x.shape
    sumsq = sums(x, residual, s_out, lora, block, tiles, early)
    block, chunks = chunking(H, block)
    quantize = e4m3 is not None and pow2(H) <= fused_kernels.RMS_MAX_BLOCK
    q, qs = (e4m3.q, e4m3.scale) if quantize else (out, out)
    width = pow2(H) if quantize else block
    _SCALE((T, 1 if quantize else chunks),
           (s_out, weight, out, sumsq, q, qs, H, _inv(H), float(eps), s_out.stride(0), out.stride(0), q.stride(0),
            chunks), dict(BLOCK_C=pow2(chunks), BLOCK=width, QUANTIZE=quantize, COMPILED=COMPILED),
           max(1, min(16, width // 512)) if quantize else max(1, min(4, block // 128)), 1)
    if e4m3 is not None and not quantize:
        quantize_rows_fused(out, e4m3.q, e4m3.scale)
