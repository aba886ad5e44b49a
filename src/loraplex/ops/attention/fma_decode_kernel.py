"""`_fma_decode_kernel`: split-KV decode attention in fp32 FMAs, no tensor cores (launchers.py's DecodeConfig.fma).

The same semantics, grid, splits and partials as kernels.py's `_decode_kernel` (its reduce kernel combines the
splits): program (s, kvh, split) attends the one query row of sequence s, the G query heads of kv head kvh, over
the keys [lo + split · chunk, lo + (split + 1) · chunk) ∩ [lo, seq_len):

    for g in range(G):
        for j in keys:  score[g, j] = (q[g] · K[j]) · qk_scale          (log2 units; K = k_cache[j] · k_scale)
        p[g, :] = 2^(score[g, :] - max(score[g, :]))
        out[g] = Σ_j p[g, j] V[j] / Σ_j p[g, j]                           (V = v_cache[j] · v_scale)

Why a kernel of its own: `_decode_kernel` pads the G query rows to the 16 rows of a tensor-core dot and converts
each e4m3 tile to fp16 for it, and at short contexts over an e4m3 cache ran 1.76× its bytes' time (H200, Llama-2-7B
heads, batch 32, context 512). Here each key tile is loaded in registers as it lies in the cache (16 contiguous
bytes a lane), converted to fp32 in place and used by plain FMAs: the scores reduce over D within a lane and a few
lanes, the values' sum over a tile's keys likewise; nothing goes through shared memory unless a program has more
than one warp. The next tile's loads are issued before the current tile's arithmetic (held in registers), so each
program keeps two tiles in flight; programs are small (1-4 warps), so many are resident an SM.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import pdl_start

NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)   # finite running maxima: exp2(-inf - NEG_BIG) = 0, not NaN


@triton.jit
def _load_tile(k_head, v_head, bt_row, n0, end, stride_kb, stride_kt, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    """The K and V rows of keys n0 .. n0 + BLOCK_N - 1 as stored (zeros at and past `end`), gathered through the
    block table."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_mask = offs_n < end
    blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0)
    tok = blk.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_kt
    k = tl.load(k_head + tok[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    v = tl.load(v_head + tok[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    return k, v


@triton.jit
def _fma_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_ml_ptr,
                       block_tables_ptr, seq_lens_ptr, query_start_ptr, k_scale_ptr, v_scale_ptr,
                       qk_scale, window, chunk, num_q_heads, num_splits, ml_stride,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
                       G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                       PAGE: tl.constexpr, SPLIT: tl.constexpr, FP8_KV: tl.constexpr):
    """The module docstring's loop for program (s, kvh, split); arguments as `_decode_kernel`'s."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + s)
    q_end = tl.load(query_start_ptr + s + 1)
    seq_len = tl.load(seq_lens_ptr + s)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    start = lo + sp * chunk
    end = tl.minimum(start + chunk, seq_len)
    if (q_end - q_begin == 1) & (start < end):  # sequences with more rows are the prefill kernel's
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        g_mask = offs_g < G
        head = kvh * G + offs_g
        row = q_begin.to(tl.int64)
        q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None], other=0.0).to(tl.float32)
        if FP8_KV:  # K = k_cache · k_scale: the scale joins the softmax's
            qk_scale = qk_scale * tl.load(k_scale_ptr)
        q = q * qk_scale   # scores in log2 units straight from the FMAs
        bt_row = block_tables_ptr + s.to(tl.int64) * stride_bt
        k_head = k_cache_ptr + kvh * stride_kh
        v_head = v_cache_ptr + kvh * stride_kh
        m_i = tl.full([G_PAD], NEG_BIG, tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
        k, v = _load_tile(k_head, v_head, bt_row, start, end, stride_kb, stride_kt, BLOCK_N, HEAD_DIM, PAGE)
        for n0 in range(start, end, BLOCK_N):
            # the next tile's loads go out before this tile's arithmetic (all masked past the range)
            k_next, v_next = _load_tile(k_head, v_head, bt_row, n0 + BLOCK_N, end, stride_kb, stride_kt, BLOCK_N,
                                        HEAD_DIM, PAGE)
            keep = (n0 + tl.arange(0, BLOCK_N)) < end
            kf = k.to(tl.float32)
            score = tl.sum(q[:, None, :] * kf[None, :, :], axis=2)            # [G_PAD, BLOCK_N]
            score = tl.where(keep[None, :], score, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(score, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(score - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vf = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vf[None, :, :], axis=1)
            m_i = m_new
            k, v = k_next, v_next
        if FP8_KV:
            acc = acc * tl.load(v_scale_ptr)
        if SPLIT:
            idx = (s * num_q_heads + head).to(tl.int64) * num_splits + sp  # partial [s, head, split]
            tl.store(part_o_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
            tl.store(part_ml_ptr + idx, m_i, mask=g_mask)
            tl.store(part_ml_ptr + ml_stride + idx, l_i, mask=g_mask)
        else:
            o = acc * (1.0 / l_i)[:, None]
            tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
