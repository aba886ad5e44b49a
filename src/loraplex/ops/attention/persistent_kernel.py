"""The persistent decode kernel: one-row sequences' attention (kernels.py's `_decode_kernel` unsplit) by a grid sized
to the GPU, each program walking its (sequence, kv head) items' key tiles in one loop.

`_decode_kernel` gives each (sequence, kv head) a program of its own. At a few hundred tokens of context that is a
few key tiles a program, so each program spends much of its life waiting for its first tiles while its pipeline
fills, and every wave of programs pays that again. Here program p takes items p, p + P, p + 2P, ... (P programs,
a few an SM: `DecodeConfig.persistent_per_sm`) and walks all their tiles as one sequence of steps, so Triton's
pipeliner keeps num_stages - 1 tiles in flight across items; only the program's first tile waits.

Per program, with `steps[j]` the tiles of its j-th item (cdiv(keys, BLOCK_N) for a one-row sequence, 0 for any
other) and `ends` their running sum:

    for t in range(sum(steps)):
        j = number of items whose end <= t            # t's item; its tile t - (ends[j] - steps[j])
        if t is j's first tile: acc, max, sum = 0, -big, 0
        acc, max, sum = one online-softmax step over that tile's keys   (kernels.py's `_online_softmax_step`)
        if t is j's last tile: out[j's row, j's heads] = acc · v_scale / sum

The same tiles, the same operations in the same order as `_decode_kernel` with one split: the outputs are the same
bits. The block ids of the next step's tile are loaded one step ahead, as `_attend_range` does, so that the K/V
loads' addresses never wait on a load of their own step. An item's fields are picked out of the program's
per-item vectors (a masked sum each), so the loop reads no scalars from memory.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..e4m3 import f16_range_scales
from ..pdl import pdl_start
from .kernels import NEG_BIG, _online_softmax_step


@triton.jit
def _tile(t, slot, ends, item, base, seq_len, q_begin, window, num_kv_heads, BLOCK_N: tl.constexpr):
    """Step t's (sequence, kv head, query row, first key, the item's keys [lo, hi): lo, hi)."""
    hit = slot == tl.sum((ends <= t).to(tl.int32), 0)
    it = tl.sum(tl.where(hit, item, 0), 0)
    n0 = tl.sum(tl.where(hit, base, 0), 0) + t * BLOCK_N
    hi = tl.sum(tl.where(hit, seq_len, 0), 0)
    row = tl.sum(tl.where(hit, q_begin, 0), 0)
    lo = tl.where(window > 0, tl.maximum(hi - window, 0), 0)
    return it // num_kv_heads, it % num_kv_heads, row, n0, lo, hi


@triton.jit(do_not_specialize=["num_seqs"])
def _decode_persistent_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
                              query_start_ptr, k_scale_ptr, v_scale_ptr, qk_scale, window, num_seqs, num_kv_heads,
                              stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
                              G: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                              PAGE: tl.constexpr, ITEMS: tl.constexpr, PRECISION: tl.constexpr,
                              FP8_KV: tl.constexpr, F16_DOTS: tl.constexpr):
    """One-row sequences' attention: this program's items are (sequence, kv head) = divmod(item, num_kv_heads) for
    item = program_id + i · num_programs, i < ITEMS (the module docstring's loop)."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    slot = tl.arange(0, ITEMS)
    item = tl.program_id(0) + slot * tl.num_programs(0)
    real = item < num_seqs * num_kv_heads
    seq = tl.where(real, item // num_kv_heads, 0)
    q_begin = tl.load(query_start_ptr + seq, mask=real, other=0)
    q_len = tl.load(query_start_ptr + seq + 1, mask=real, other=0) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq, mask=real, other=0)
    lows = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    steps = tl.where(real & (q_len == 1) & (lows < seq_len), (seq_len - lows + BLOCK_N - 1) // BLOCK_N, 0)
    ends = tl.cumsum(steps, 0)
    total = tl.sum(steps, 0)
    base = lows - (ends - steps) * BLOCK_N   # step t of item j starts at key base[j] + t · BLOCK_N

    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < G
    v_scale = 1.0
    if FP8_KV:  # K = k_cache · k_scale, V = v_cache · v_scale
        qk_scale = qk_scale * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    s, kvh, row, n0, lo, hi = _tile(0, slot, ends, item, base, seq_len, q_begin, window, num_kv_heads,
                                             BLOCK_N)
    keys = n0 + offs_n
    blk = tl.load(block_tables_ptr + s.to(tl.int64) * stride_bt + keys // PAGE, mask=keys < hi, other=0)
    m_i = tl.full([M], NEG_BIG, tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    for t in range(0, total):
        s2, kvh2, row2, n02, lo2, hi2 = _tile(t + 1, slot, ends, item, base, seq_len, q_begin, window,
                                                        num_kv_heads, BLOCK_N)
        keys2 = n02 + offs_n
        blk_next = tl.load(block_tables_ptr + s2.to(tl.int64) * stride_bt + keys2 // PAGE,
                           mask=keys2 < hi2, other=0)   # past the last step: no item, hi2 = 0
        head = kvh * G + offs_m
        q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None], other=0.0)
        step_scale = qk_scale
        if F16_DOTS:   # q = q16 · 2^e: q16 into the dots, 2^e into the softmax scale (as _decode_kernel)
            q32 = q.to(tl.float32)
            down, up = f16_range_scales(tl.max(tl.max(tl.abs(q32), axis=1), axis=0))
            q = (q32 * down).to(tl.float16)
            step_scale = qk_scale * up
        keys = n0 + offs_n
        n_mask = keys < hi
        tok = blk.to(tl.int64) * stride_kb + (keys % PAGE) * stride_kt
        k = tl.load(k_cache_ptr + kvh * stride_kh + tok[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kvh * stride_kh + tok[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        if F16_DOTS:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        else:   # an e4m3 cache's tiles in q's dtype (exact); otherwise nothing to do
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        first = n0 == lo   # the item's first tile: a fresh softmax
        m_i = tl.where(first, NEG_BIG, m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, step_scale, n_mask[None, :], True, PRECISION)
        o = acc
        if FP8_KV:
            o = o * v_scale
        o = o * (1.0 / l_i)[:, None]
        tl.store(out_ptr + row.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=(m_mask & (offs_m * 0 + n0 + BLOCK_N >= hi))[:, None])   # the last tile
        s, kvh, row, n0, lo, hi = s2, kvh2, row2, n02, lo2, hi2
        blk = blk_next
