"""Triton kernels for the small fused elementwise ops of the Llama-family forward (see api.py).

Each kernel repeats, in fp32 registers, the op order of Hugging Face transformers and rounds
to the model dtype wherever transformers' separate PyTorch ops round (a 16-bit op computes
in fp32 and rounds once). Three details make that hold on a GPU:

- Transcendentals come from libdevice (`__nv_expf`, `__nv_cosf`, `__nv_sinf`, `__nv_rsqrtf`),
  the CUDA math library PyTorch's own kernels call, not Triton's `tl.exp`/`tl.cos`
  (`ex2.approx`/`sin.approx`-style fast paths, whose error grows with the argument; rotary
  angles reach ~1e5 radians). Divisions are IEEE (`div_rn`).
- A product that an addition consumes is written `mul_rn`: a plain fp32 multiply followed by
  an add may be contracted into one FMA (by LLVM or by ptxas), which rounds once where
  PyTorch's separate kernels round twice.
- Row offsets are int64: T × row stride passes 2³¹ in long prefills.

One difference remains by construction: Triton links libdevice in flush-to-zero mode, so a
product below fp32's smallest normal (~1.2e-38) becomes 0 where PyTorch keeps a subnormal.

Under Triton's CPU interpreter (TRITON_INTERPRET=1, the CPU tests) libdevice is not available
and the fp32→bf16 cast truncates, so `COMPILED=False` swaps in `tl.exp`/`tl.cos`/... (numpy)
and a round-to-nearest-even done on the bits. The op order is the same code either way.

No kernel reads a value back to the host: the launches can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..gemm.fp8 import QuantizedRows
from ..gemm.quantize_kernel import quantize_rows_fused, store_quantized_row
from ..launch import Launcher, cdiv, pow2
from ..pdl import pdl_start

# ---------------------------------------------------------------------------------------------
# Helpers


@triton.jit
def _round(x, DT: tl.constexpr, COMPILED: tl.constexpr):
    """fp32 `x` rounded to the dtype DT (to nearest, ties to even), returned as fp32."""
    if DT == tl.float32:
        y = x
    elif COMPILED or DT != tl.bfloat16:
        y = x.to(DT).to(tl.float32)
    else:
        # The interpreter's fp32→bf16 cast truncates; round on the bits instead (finite values).
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        y = u.to(tl.float32, bitcast=True)
    return y


@triton.jit
def _mul(a, b, COMPILED: tl.constexpr):
    """a * b in fp32, never fused into a following add (PyTorch rounds the product on its own)."""
    if COMPILED:
        p = libdevice.mul_rn(a, b)
    else:
        p = a * b
    return p


# ---------------------------------------------------------------------------------------------
# RMSNorm (+ residual add)


@triton.jit
def _takes_delta(rows_ptr, row, HAS_ROWS: tl.constexpr):
    """Does this row take its delta? With HAS_ROWS (a LoraDelta, ops/lora/delta.py) only a row with an
    adapter (`row_slot[row]` ≥ 0): the expand wrote no other; else every row."""
    if HAS_ROWS:
        take = tl.load(rows_ptr + row) >= 0
    else:
        take = row >= 0   # a program's row index: always
    return take


@triton.jit
def _add_delta(v, d_row, offs, mask, take, DT, HAS_DELTA: tl.constexpr, COMPILED: tl.constexpr):
    """v + an fp32 LoRA delta, rounded to DT, as the expand's in-place add rounds (ops/lora/overlap.py); v as it
    is where the row does not `take` its delta. The delta is loaded either way (whatever an unwritten row
    holds is discarded): a load masked by `take` would wait for the row's slot (~1 µs more per RMSNorm at
    decode on an H200)."""
    if HAS_DELTA:
        d = tl.load(d_row + offs, mask=mask, other=0.0)
        v = tl.where(take, _round(v + d, DT, COMPILED), v)
    return v


@triton.jit
def _norm_input(x_row, d_row, r_row, s_row, offs, mask, take, HAS_DELTA: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                STORE_S: tl.constexpr, COMPILED: tl.constexpr):
    """The row segment to normalise, fp32: s = x (+ delta) (+ residual), each sum rounded to x's
    dtype (stored to s if STORE_S)."""
    DT = x_row.dtype.element_ty
    v = _add_delta(tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32), d_row, offs, mask, take, DT,
                   HAS_DELTA, COMPILED)
    if HAS_RESIDUAL:
        r = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
        v = _round(r + v, DT, COMPILED)
    if STORE_S:
        tl.store(s_row + offs, v.to(DT), mask=mask)
    return v


@triton.jit
def _norm_output(v, rstd, w_row, out_row, offs, mask, COMPILED: tl.constexpr):
    """out = (weight * (v * rstd rounded to the dtype)) rounded to the dtype; returns out in fp32 (0 where masked)."""
    DT = out_row.dtype.element_ty
    n = _round(v * rstd, DT, COMPILED)
    w = tl.load(w_row + offs, mask=mask, other=0.0).to(tl.float32)
    y = _round(w * n, DT, COMPILED)
    tl.store(out_row + offs, y.to(DT), mask=mask)
    return y


@triton.jit
def _rstd(sum_sq, inv_h, eps, COMPILED: tl.constexpr):
    # PyTorch's CUDA mean is sum * fp32(1/H); then `+ eps`, then rsqrtf.
    var = _mul(sum_sq, inv_h, COMPILED) + eps
    if COMPILED:
        r = libdevice.rsqrt(var)
    else:
        r = tl.rsqrt(var)
    return r


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, rows_ptr, r_ptr, w_ptr, out_ptr, s_ptr, q_ptr, qs_ptr, H, inv_h, eps, stride_x,
                     stride_d, stride_r, stride_out, stride_s, stride_q, HAS_DELTA: tl.constexpr,
                     HAS_ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_S: tl.constexpr, BLOCK: tl.constexpr,
                     ONE_PASS: tl.constexpr, QUANTIZE: tl.constexpr, COMPILED: tl.constexpr):
    """One program per row: out[row] = weight * normalize(s[row]), s = x (+ delta) (+ residual); QUANTIZE (ONE_PASS
    only): out[row] quantized to e4m3 too, q[row] and its scale qs[row] (ops/gemm/quantize_kernel.py's bits)."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    tl.static_assert(ONE_PASS or not QUANTIZE, "QUANTIZE needs the row in one pass")
    row = tl.program_id(0).to(tl.int64)
    take = _takes_delta(rows_ptr, row, HAS_ROWS)
    x_row = x_ptr + row * stride_x
    d_row = d_ptr + row * stride_d
    r_row = r_ptr + row * stride_r
    s_row = s_ptr + row * stride_s
    out_row = out_ptr + row * stride_out
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        # The row fits one tile: read it once, keep it in registers.
        mask = offs < H
        v = _norm_input(x_row, d_row, r_row, s_row, offs, mask, take, HAS_DELTA, HAS_RESIDUAL, WRITE_S, COMPILED)
        rstd = _rstd(tl.sum(v * v, axis=0), inv_h, eps, COMPILED)
        y = _norm_output(v, rstd, w_ptr, out_row, offs, mask, COMPILED)
        if QUANTIZE:
            store_quantized_row(y, offs, mask, q_ptr + row * stride_q, qs_ptr + row)
    else:
        # Wide rows: sum the squares tile by tile, then re-read (and re-add: recomputing
        # x + delta + residual gives the same bits and needs no ordering against our own stores).
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for c in range(0, H, BLOCK):
            mask = c + offs < H
            v = _norm_input(x_row, d_row, r_row, s_row, c + offs, mask, take, HAS_DELTA, HAS_RESIDUAL, WRITE_S,
                            COMPILED)
            acc += v * v
        rstd = _rstd(tl.sum(acc, axis=0), inv_h, eps, COMPILED)
        for c in range(0, H, BLOCK):
            mask = c + offs < H
            v = _norm_input(x_row, d_row, r_row, s_row, c + offs, mask, take, HAS_DELTA, HAS_RESIDUAL, False,
                            COMPILED)
            _norm_output(v, rstd, w_ptr, out_row, c + offs, mask, COMPILED)


# ---------------------------------------------------------------------------------------------
# SiLU(gate) * up


@triton.jit
def _silu_mul(g, u, DT: tl.constexpr, COMPILED: tl.constexpr):
    """round(round(silu(g)) * u), silu(g) = g / (1 + exp(-g)) in fp32, as transformers rounds."""
    if COMPILED:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    # Left to contraction on purpose: the compiler fuses expf's final scaling with `1 +` into one FMA,
    # as nvcc (which also contracts by default) can in PyTorch's silu kernel; tests/test_fused_gpu.py
    # reports whether the bits agree.
    a = _round(tl.math.div_rn(g, 1.0 + e), DT, COMPILED)
    return _round(a * u, DT, COMPILED)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, d_ptr, rows_ptr, out_ptr, I, stride_gu, stride_d, stride_out,
                         HAS_DELTA: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, COMPILED: tl.constexpr):
    """Program (row, column block): out = round(round(silu(gate)) * up), silu(g) = g / (1 + exp(-g));
    gate and up first take their LoRA delta when HAS_DELTA (each sum rounded)."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    row = tl.program_id(0).to(tl.int64)
    take = _takes_delta(rows_ptr, row, HAS_ROWS)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    DT = out_ptr.dtype.element_ty
    gu_row = gu_ptr + row * stride_gu
    d_row = d_ptr + row * stride_d
    g = _add_delta(tl.load(gu_row + offs, mask=mask, other=0.0).to(tl.float32), d_row, offs, mask, take, DT,
                   HAS_DELTA, COMPILED)
    u = _add_delta(tl.load(gu_row + I + offs, mask=mask, other=0.0).to(tl.float32), d_row + I, offs, mask, take,
                   DT, HAS_DELTA, COMPILED)
    tl.store(out_ptr + row * stride_out + offs, _silu_mul(g, u, DT, COMPILED).to(DT), mask=mask)


# ---------------------------------------------------------------------------------------------
# Rotary embedding (rotate_half convention), in place


@triton.jit
def _cos_sin(pos_ptr, inv_freq_ptr, offs_d, d_mask, DT: tl.constexpr, COMPILED: tl.constexpr):
    """cos and sin of one token's angles `position · inv_freq` (fp32), each rounded to DT."""
    pos = tl.load(pos_ptr).to(tl.float32)
    freqs = pos * tl.load(inv_freq_ptr + offs_d, mask=d_mask, other=0.0)
    if COMPILED:
        c = libdevice.cos(freqs)
        s = libdevice.sin(freqs)
    else:
        c = tl.cos(freqs)
        s = tl.sin(freqs)
    return _round(c, DT, COMPILED), _round(s, DT, COMPILED)


@triton.jit
def _rotate(x1, x2, c, s, DT: tl.constexpr, COMPILED: tl.constexpr):
    """(x1·cos − x2·sin, x2·cos + x1·sin), each product and sum rounded to DT as transformers rounds.
    transformers adds (-x2)·sin; negation is exact and rounding symmetric, so that is x1·cos − x2·sin."""
    o1 = _round(_round(_mul(x1, c, COMPILED), DT, COMPILED) - _round(_mul(x2, s, COMPILED), DT, COMPILED),
                DT, COMPILED)
    o2 = _round(_round(_mul(x2, c, COMPILED), DT, COMPILED) + _round(_mul(x1, s, COMPILED), DT, COMPILED),
                DT, COMPILED)
    return o1, o2


@triton.jit
def _rotate_heads(base, d_base, h_lo, h_hi, stride_h, HALF, c, s, offs_d, d_mask, take, HAS_DELTA: tl.constexpr,
                  BLOCK_H: tl.constexpr, COMPILED: tl.constexpr):
    """x1' = x1·cos − x2·sin, x2' = x2·cos + x1·sin for heads [h_lo, h_hi) of one token, each op rounded;
    with HAS_DELTA each head first takes its LoRA delta (`d_base`: heads of 2·HALF fp32, contiguous)."""
    DT = base.dtype.element_ty
    for h0 in range(h_lo, h_hi, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < h_hi)[:, None] & d_mask[None, :]
        p1 = base + offs_h[:, None] * stride_h + offs_d[None, :]
        dp1 = offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        x1 = _add_delta(tl.load(p1, mask=mask, other=0.0).to(tl.float32), d_base, dp1, mask, take, DT,
                        HAS_DELTA, COMPILED)
        x2 = _add_delta(tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32), d_base, dp1 + HALF, mask, take,
                        DT, HAS_DELTA, COMPILED)
        o1, o2 = _rotate(x1, x2, c, s, DT, COMPILED)
        tl.store(p1, o1.to(DT), mask=mask)
        tl.store(p1 + HALF, o2.to(DT), mask=mask)


@triton.jit
def _add_heads(base, d_base, h_lo, h_hi, stride_h, HALF, offs_d, d_mask, take, BLOCK_H: tl.constexpr,
               COMPILED: tl.constexpr):
    """x = round(x + delta) for heads [h_lo, h_hi) of one token (v's LoRA delta), in place."""
    DT = base.dtype.element_ty
    for h0 in range(h_lo, h_hi, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < h_hi)[:, None] & d_mask[None, :]
        for half in tl.static_range(2):
            p = base + offs_h[:, None] * stride_h + (half * HALF + offs_d)[None, :]
            dp = offs_h[:, None] * (2 * HALF) + (half * HALF + offs_d)[None, :]
            x = _add_delta(tl.load(p, mask=mask, other=0.0).to(tl.float32), d_base, dp, mask, take, DT, True,
                           COMPILED)
            tl.store(p, x.to(DT), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, d_ptr, rows_ptr, pos_ptr, inv_freq_ptr, HQ, HKV, HALF, stride_qt, stride_qh,
                 stride_kt, stride_kh, stride_vt, stride_vh, stride_dt, stride_pos, HAS_DELTA: tl.constexpr,
                 HAS_ROWS: tl.constexpr, SPLIT_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 COMPILED: tl.constexpr):
    """Program (token, chunk): cos/sin of position · inv_freq (fp32, rounded to q's dtype), then the heads of q and k.
    HAS_DELTA: q, k and v first take their LoRA delta (`d`: [q | k | v] fp32 per token). One program a token walks
    all of them; SPLIT_HEADS: chunk c takes BLOCK_H heads, q's chunks first, then k's, then v's."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    t = tl.program_id(0).to(tl.int64)
    DT = q_ptr.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    c, s = _cos_sin(pos_ptr + t * stride_pos, inv_freq_ptr, offs_d, d_mask, DT, COMPILED)
    d_row = d_ptr + t * stride_dt
    take = _takes_delta(rows_ptr, t, HAS_ROWS)
    q_base, k_base, v_base = q_ptr + t * stride_qt, k_ptr + t * stride_kt, v_ptr + t * stride_vt
    dk_row, dv_row = d_row + HQ * 2 * HALF, d_row + (HQ + HKV) * 2 * HALF
    if SPLIT_HEADS:
        chunk = tl.program_id(1)
        q_chunks = tl.cdiv(HQ, BLOCK_H)
        k_chunks = tl.cdiv(HKV, BLOCK_H)
        if chunk < q_chunks:
            lo = chunk * BLOCK_H
            _rotate_heads(q_base, d_row, lo, tl.minimum(lo + BLOCK_H, HQ), stride_qh, HALF, c, s, offs_d, d_mask,
                          take, HAS_DELTA, BLOCK_H, COMPILED)
        elif chunk < q_chunks + k_chunks:
            lo = (chunk - q_chunks) * BLOCK_H
            _rotate_heads(k_base, dk_row, lo, tl.minimum(lo + BLOCK_H, HKV), stride_kh, HALF, c, s, offs_d, d_mask,
                          take, HAS_DELTA, BLOCK_H, COMPILED)
        elif HAS_DELTA:
            lo = (chunk - q_chunks - k_chunks) * BLOCK_H
            _add_heads(v_base, dv_row, lo, tl.minimum(lo + BLOCK_H, HKV), stride_vh, HALF, offs_d, d_mask, take,
                       BLOCK_H, COMPILED)
    else:
        _rotate_heads(q_base, d_row, 0, HQ, stride_qh, HALF, c, s, offs_d, d_mask, take, HAS_DELTA, BLOCK_H, COMPILED)
        _rotate_heads(k_base, dk_row, 0, HKV, stride_kh, HALF, c, s, offs_d, d_mask, take, HAS_DELTA, BLOCK_H,
                      COMPILED)
        if HAS_DELTA:
            _add_heads(v_base, dv_row, 0, HKV, stride_vh, HALF, offs_d, d_mask, take, BLOCK_H, COMPILED)


# ---------------------------------------------------------------------------------------------
# Launchers. Arguments arrive validated (api.py); these pick tile sizes and launch. T = 0
# launches nothing.

INTERPRETED = type(_rms_norm_kernel).__name__ == "InterpretedFunction"
COMPILED = not INTERPRETED
RMS_MAX_BLOCK = 8192  # rows up to this width are normalised from registers in one pass
SILU_BLOCK = 1024
ROPE_TILE = 1024  # heads × half head dim rotated per step
# Steps of at most ROPE_SPLIT_TOKENS tokens whose q and k heads fill ROPE_SPLIT_CHUNKS chunks or more run a program
# per chunk of heads (SPLIT_HEADS; `rope_splits`)
ROPE_SPLIT_TOKENS = 64
ROPE_SPLIT_CHUNKS = 4
_RMS = Launcher(_rms_norm_kernel)
_SILU = Launcher(_silu_and_mul_kernel)
_ROPE = Launcher(_rope_kernel)



@functools.lru_cache(maxsize=None)
def _inv(n: int) -> float:
    # fp32(1/n), rounded once, as PyTorch's CUDA mean computes its factor.
    return float(np.float32(1.0) / np.float32(n))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
             out: torch.Tensor, s_out: torch.Tensor | None, max_block: int | None = None,
             delta: torch.Tensor | None = None, delta_rows: torch.Tensor | None = None,
             e4m3: QuantizedRows | None = None) -> None:
    """out = weight * normalize(s); s = x (+ delta) (+ residual) written to s_out when either is given.
    `delta_rows` (a LoraDelta's row_slot): only rows with a slot ≥ 0 take the delta. `e4m3` (ops/gemm/fp8.py's
    QuantizedRows): out quantized a row into it, by the same program where the row fits one pass."""
    T, H = x.shape
    if T == 0:
        return
    max_block = max_block or RMS_MAX_BLOCK
    one_pass = pow2(H) <= max_block
    block = pow2(H) if one_pass else pow2(max_block)
    has_res, has_delta = residual is not None, delta is not None
    r = residual if has_res else x          # unused pointers stand in for absent tensors
    s = s_out if s_out is not None else out
    d = delta if has_delta else x
    rows = delta_rows if delta_rows is not None else x
    quantize = e4m3 is not None and one_pass
    q, qs = (e4m3.q, e4m3.scale) if quantize else (out, out)
    args = (x, d, rows, r, weight, out, s, q, qs, H, _inv(H), float(eps), x.stride(0), d.stride(0), r.stride(0),
            out.stride(0), s.stride(0), q.stride(0))
    _RMS((T,), args, dict(HAS_DELTA=has_delta, HAS_ROWS=has_delta and delta_rows is not None, HAS_RESIDUAL=has_res,
                          WRITE_S=s_out is not None, BLOCK=block, ONE_PASS=one_pass, QUANTIZE=quantize,
                          COMPILED=COMPILED), max(1, min(16, block // 512)), 1)
    if e4m3 is not None and not quantize:   # rows too wide for one program's registers
        quantize_rows_fused(out, e4m3.q, e4m3.scale)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor, block: int = SILU_BLOCK,
                 delta: torch.Tensor | None = None, delta_rows: torch.Tensor | None = None) -> None:
    """out = silu(gate_up[:, :I]) * gate_up[:, I:] (each half plus its delta first, in the rows `delta_rows`
    gives a slot ≥ 0 if it is given), rounded as transformers rounds."""
    T, I = out.shape
    if T == 0:
        return
    block = min(pow2(I), block)
    d = delta if delta is not None else gate_up
    rows = delta_rows if delta_rows is not None else gate_up
    _SILU((T, -(-I // block)), (gate_up, d, rows, out, I, gate_up.stride(0), d.stride(0), out.stride(0)),
          dict(HAS_DELTA=delta is not None, HAS_ROWS=delta is not None and delta_rows is not None, BLOCK=block,
               COMPILED=COMPILED), max(1, min(4, block // 256)), 1)


def rope_splits(T: int, Hq: int, Hkv: int, block_h: int) -> bool:
    """Whether a RoPE launch runs a program per (token, chunk of heads) rather than per token: where a step's few
    tokens would leave SMs idle behind long programs. Measured at batch 32 (H100, FP8 backbone): Llama-2-7B's 64
    heads a token (4 chunks) took 0.02-0.05 ms off the decode step; Llama-3-8B's 40 (3 chunks) ran 0.01-0.02 ms
    slower split (docs/design-notes.md)."""
    return T <= ROPE_SPLIT_TOKENS and cdiv(Hq, block_h) + cdiv(Hkv, block_h) >= ROPE_SPLIT_CHUNKS


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               tile: int | None = None, v: torch.Tensor | None = None, delta: torch.Tensor | None = None,
               delta_rows: torch.Tensor | None = None) -> None:
    """Rotate q and k in place (one launch: a program per token, or per token and chunk of heads where
    `rope_splits`); with `delta` ([q | k | v] fp32 per token), q, k and v first take it (only tokens
    `delta_rows` gives a slot ≥ 0, if it is given)."""
    T, Hq, D = q.shape
    if T == 0:
        return
    tile = tile or ROPE_TILE
    half = D // 2
    block_d = pow2(half)
    block_h = min(pow2(max(Hq, k.shape[1])), max(1, tile // block_d))
    has_delta = delta is not None
    v, d = (v, delta) if has_delta else (k, q)   # unused pointers without a delta
    rows = delta_rows if has_delta and delta_rows is not None else positions
    args = (q, k, v, d, rows, positions, inv_freq, Hq, k.shape[1], half, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), d.stride(0), positions.stride(0))
    split = rope_splits(T, Hq, k.shape[1], block_h)
    chunks = cdiv(Hq, block_h) + cdiv(k.shape[1], block_h) * (2 if has_delta else 1)
    _ROPE((T, chunks) if split else (T,), args,
          dict(HAS_DELTA=has_delta, HAS_ROWS=has_delta and delta_rows is not None, SPLIT_HEADS=split,
               BLOCK_H=block_h, BLOCK_D=block_d, COMPILED=COMPILED),
          max(1, min(4, block_h * block_d // 256)), 1)
