"""`_fma_decode_kernel`: split-KV decode attention in fp32 FMAs, no tensor cores (launchers.py's DecodeConfig.fma).

The semantics, splits and partials of kernels.py's `_decode_kernel` (its reduce kernel combines the splits), a
program per query head: program (s, h, split) attends the one query row of sequence s, query head h (kv head
h // G), over the keys [lo + split · chunk, lo + (split + 1) · chunk) ∩ [lo, seq_len):

    for j in keys:  score[j] = (q[h] · K[j]) · qk_scale          (log2 units; K = k_cache[j, h // G] · k_scale)
    p = 2^(score - max(score))
    out[h] = Σ_j p[j] V[j] / Σ_j p[j]                             (V = v_cache[j, h // G] · v_scale)

Why a kernel of its own: `_decode_kernel` pads the G query rows to the 16 rows of a tensor-core dot and converts
each e4m3 tile to fp16 for it, and at short contexts over an e4m3 cache ran 1.76× its bytes' time (H200, Llama-2-7B
heads, batch 32, context 512). Here each key tile is loaded in registers as it lies in the cache (16 contiguous
bytes a lane), converted to fp32 in place and used by plain FMAs, all in the tile's own layout (`_attend`). The
next tile's loads are issued before the current tile's arithmetic, so a program keeps two tiles in flight;
programs are small (one warp or a few), so many are resident an SM. The G query heads of a kv head are G programs
that read the same tiles: launched next to one another (program ids S apart), the repeats come from L2.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import pdl_start
from .kernels import NEG_BIG, decode_keys   # NEG_BIG: finite running maxima (exp2(-inf - NEG_BIG) = 0)


@triton.jit
def _load_tile(k_head, v_head, bt_row, n0, end, stride_kb, stride_kt, C: tl.constexpr, R: tl.constexpr,
               HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    """The K and V rows of keys n0 + c · R + r (c < C, r < R) as stored, [C, R, HEAD_DIM] (zeros at and past `end`),
    gathered through the block table."""
    # in the tiles' 3-D layout from the start (a key's block id is loaded by each lane reading that key)
    offs_n = n0 + tl.arange(0, C)[:, None, None] * R + tl.arange(0, R)[None, :, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, None, :]
    n_mask = offs_n < end
    blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0)
    tok = blk.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_kt
    k = tl.load(k_head + tok + offs_d, mask=n_mask, other=0.0)
    v = tl.load(v_head + tok + offs_d, mask=n_mask, other=0.0)
    return k, v


@triton.jit
def _attend(q, k_head, v_head, bt_row, start, end, stride_kb, stride_kt, BLOCK_N: tl.constexpr, R: tl.constexpr,
            HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    """(unnormalised out [HEAD_DIM], max, sum) of one query head (q [HEAD_DIM], scaled into log2 units) over keys
    [start, end). A tile's keys are [C, R] (key n0 + c · R + r): each of the R key streams keeps its own running
    max, sum and output, combined once at the end, so a step reduces over D (a lane's 16 bytes and a few lanes) and
    over C (within a lane) only. Everything stays in the tiles' layout."""
    C: tl.constexpr = BLOCK_N // R
    tl.static_assert(C * R == BLOCK_N, "a tile's keys must fill its R streams")
    q3 = q[None, None, :]
    m_i = tl.full([R], NEG_BIG, tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, HEAD_DIM], tl.float32)
    k, v = _load_tile(k_head, v_head, bt_row, start, end, stride_kb, stride_kt, C, R, HEAD_DIM, PAGE)
    for n0 in range(start, end, BLOCK_N):
        # the next tile's loads go out before this tile's arithmetic (all masked past the range)
        k_next, v_next = _load_tile(k_head, v_head, bt_row, n0 + BLOCK_N, end, stride_kb, stride_kt, C, R,
                                    HEAD_DIM, PAGE)
        keep = (n0 + tl.arange(0, C)[:, None] * R + tl.arange(0, R)[None, :]) < end
        score = tl.where(keep, tl.sum(q3 * k.to(tl.float32), axis=2), float("-inf"))   # [C, R]
        m_new = tl.maximum(m_i, tl.max(score, 0))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(score - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32), axis=0)
        m_i = m_new
        k, v = k_next, v_next
    m_all = tl.max(m_i, 0)
    w = tl.math.exp2(m_i - m_all)
    return tl.sum(acc * w[:, None], 0), m_all, tl.sum(l_i * w, 0)


@triton.jit
def _fma_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_ml_ptr,
                       block_tables_ptr, seq_lens_ptr, query_start_ptr, k_scale_ptr, v_scale_ptr,
                       qk_scale, window, chunk, num_q_heads, num_splits, ml_stride,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
                       G: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr, HEAD_DIM: tl.constexpr,
                       PAGE: tl.constexpr, SPLIT: tl.constexpr, FP8_KV: tl.constexpr):
    """The module docstring's loop for program (s, h, split): query head h, kv head h // G; other arguments as
    `_decode_kernel`'s."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    s = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.program_id(2)
    q_begin, _, start, end, active = decode_keys(query_start_ptr, seq_lens_ptr, s, sp, window, chunk)
    if active:
        offs_d = tl.arange(0, HEAD_DIM)
        row = q_begin.to(tl.int64)
        if FP8_KV:  # K = k_cache · k_scale: the scale joins the softmax's
            qk_scale = qk_scale * tl.load(k_scale_ptr)
        q = tl.load(q_ptr + row * stride_qt + head * stride_qh + offs_d).to(tl.float32) * qk_scale
        kvh = head // G
        acc, m_all, l_all = _attend(q, k_cache_ptr + kvh * stride_kh, v_cache_ptr + kvh * stride_kh,
                                    block_tables_ptr + s.to(tl.int64) * stride_bt, start, end, stride_kb, stride_kt,
                                    BLOCK_N, R, HEAD_DIM, PAGE)
        if FP8_KV:  # V = v_cache · v_scale: the sums are linear in V
            acc = acc * tl.load(v_scale_ptr)
        if SPLIT:
            idx = (s * num_q_heads + head).to(tl.int64) * num_splits + sp  # partial [s, head, split]
            tl.store(part_o_ptr + idx * HEAD_DIM + offs_d, acc)
            tl.store(part_ml_ptr + idx, m_all)
            tl.store(part_ml_ptr + ml_stride + idx, l_all)
        else:
            tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, (acc / l_all).to(out_ptr.dtype.element_ty))
