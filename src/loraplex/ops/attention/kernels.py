"""Triton kernels for paged attention (semantics: see paged.py; their launchers and tile tables are in launchers.py,
the store kernel is in store_kernel.py).

A batch's sequences go to two kernels by their number of query rows; each kernel skips the
other's sequences, so a mixed batch (prefill chunks and decode tokens) launches both, and a
decode-only batch (max_query_len == 1) only the second:

- `_prefill_kernel` (sequences of ≥ 2 rows): flash attention over the pages. A program takes one
  tile of BLOCK_Q query rows of one sequence and one kv head, and packs the G query heads that
  share the kv head into the rows of the tile (row m = query row m // G_PAD, head m % G_PAD), so
  each K/V tile is read once per kv head and tl.dot has M = BLOCK_Q * G_PAD ≥ 16 rows. Keys
  stream in tiles of BLOCK_N tokens gathered through the block table token by token (a tile may
  span pages of any size). The online softmax runs in fp32 with exp2 (log2 e folded into the
  scale). Key tiles are walked in three ranges: a masked left edge (sliding window only), an
  unmasked middle that lies inside every row's range, and a masked right edge (the causal
  diagonal); tiles no row of the tile needs are never visited.
  Grid: (T // BLOCK_Q + S, Hkv), from host ints only. Sequence s's tiles are numbered from
  query_start[s] // BLOCK_Q + s: the numbering is non-decreasing, leaves each sequence room for
  its cdiv(q_len, BLOCK_Q) tiles, and ends by query_start[S] // BLOCK_Q + S ≤ T // BLOCK_Q + S.
  A program finds its sequence by counting the sequences that start at or before its tile
  number (one vector load of query_start per SCAN_SEQS sequences); programs in the gaps (at most one
  per sequence) and on one-row sequences exit at once. Programs run in reverse order so the
  long last tiles of each sequence start first.

- `_decode_kernel` + `_decode_reduce_kernel` (sequences of 1 row): split-KV flash decoding.
  Grid (S, Hkv, splits): a program handles the G query heads of one kv head over a contiguous
  range of its sequence's context: `split_span`'s tokens, at least `chunk` (the launcher's) and at least an even
  share of this sequence's own context in whole BLOCK_N steps (so a chunk planned for the longest context a CUDA
  graph may hold splits the shorter ones as evenly as the launcher asks). tl.dot needs 16 rows, so the G heads are
  padded to M = max(16, G_PAD) with masked rows: decode is memory bound, the padded rows cost only idle
  tensor-core cycles, and the dot path lets Triton pipeline the K/V tile loads through shared
  memory (cp.async), which is what keeps HBM busy. (Inside the prefill kernel a decode row would
  fill G of its 64-128 tile rows, so there the wasted tensor-core work would outlast the reads.)
  With one split the program writes `out` directly; with more, each writes fp32 partials
  (unnormalised acc, running max, running sum) and the reduce kernel (grid (S, Hq)) combines
  the splits a sequence's context reaches.

An e4m3 cache (FP8_KV) is read as is: each K and V tile is converted to q's dtype after its load (exact:
every e4m3 value is a bf16, fp16 and fp32 value; for bf16 q on the GPU by ops/e4m3.py's integer operations,
E4M3_PTX, where Triton's conversion goes through fp16), k_scale is folded into the softmax scale and v_scale
into the output's normalisation (the split decode's partial sums), so the scales cost two scalar loads a
program. E4M3_PTX is the prompt kernel's; decode over an e4m3 cache with bf16 q takes F16_DOTS (measured faster
there): the tiles convert to fp16 by the hardware's paired instruction (V's in the layout it was loaded in, by
ops/e4m3.py's `e4m3_to_f16_in_place`), q is scaled into fp16 by a power of two (exact; ops/e4m3.py's
`f16_range_scales`, the power folded into the softmax scale) and the dots, P·V's included, run in fp16. fp16 q
(an fp16 model's) takes the same fp16 tiles, unscaled.

The caches are addressed through their strides (block, token, head; D innermost), so both a contiguous
`[num_blocks, block_size, Hkv, D]` cache and the head-major one `KVCache` keeps (`[num_blocks, Hkv,
block_size, D]` in memory, viewed in that order) work; k and v share strides.
Offsets into the caches are computed in int64 (num_blocks × block_size × Hkv × D may pass 2^31).
Block table entries are loaded only for tokens below the sequence's length (masked loads).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..e4m3 import e4m3_to_bf16, e4m3_to_f16_in_place, f16_range_scales
from ..pdl import pdl_start

# Running maxima start finite: a row whose first tiles are all masked (sliding window) then gets
# exp2(-inf - NEG_BIG) = 0 rather than exp2(-inf + inf) = NaN.
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _online_softmax_step(acc, m_i, l_i, q, k, v, qk_scale, keep, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of flash attention: rescale the running (acc, max, sum) and add this tile.
    Scores are in log2 units (qk_scale includes log2 e); `keep` is only read when MASKED."""
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_range(acc, m_i, l_i, q, k_head, v_head, bt_row, n_begin, n_end, pos, kv_lo, kv_hi, qk_scale, window,
                  stride_kb, stride_kt, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                  MASKED: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr, E4M3_PTX: tl.constexpr):
    """Flash-attention steps over the key tiles starting at n_begin, n_begin + BLOCK_N, ... < n_end.

    Keys outside [kv_lo, kv_hi) are never read (nor their block table entries). MASKED tiles also
    mask each row's scores to keys j ≤ pos (and j > pos - window with WINDOW); unmasked tiles must
    lie inside every row's range. Each tile's K and V rows are gathered token by token through the
    block table. The block ids are loaded one step ahead and carried to the next iteration: the K/V
    addresses then do not depend on a load of the same iteration, so Triton's pipeliner treats the
    K/V loads as direct ones and keeps num_stages - 1 tiles in flight (with the ids loaded in the
    same iteration it keeps one)."""
    offs_d = tl.arange(0, HEAD_DIM)
    # fp16 q (F16_DOTS's scaled bf16 q, or an fp16 model's) over an e4m3 cache: fp16 tiles, V's converted in place
    F16_TILES: tl.constexpr = (k_head.dtype.element_ty == tl.float8e4nv) and (q.dtype == tl.float16)
    first = n_begin + tl.arange(0, BLOCK_N)
    blk = tl.load(bt_row + first // PAGE, mask=(first >= kv_lo) & (first < kv_hi), other=0)
    for n0 in range(n_begin, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = (offs_n >= kv_lo) & (offs_n < kv_hi)
        nxt = offs_n + BLOCK_N
        blk_next = tl.load(bt_row + nxt // PAGE, mask=(nxt >= kv_lo) & (nxt < kv_hi), other=0)
        tok = blk.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_kt
        if MASKED:  # masked tokens are not read: zeros instead, and -inf scores below
            k = tl.load(k_head + tok[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            v = tl.load(v_head + tok[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k = tl.load(k_head + tok[:, None] + offs_d[None, :])
            v = tl.load(v_head + tok[:, None] + offs_d[None, :])
        if F16_TILES:   # an e4m3 cache's tiles in fp16 (exact)
            k = k.to(tl.float16)
            v = e4m3_to_f16_in_place(v)   # (converted into the dot's layout, V would load a byte at a time)
        elif E4M3_PTX:   # an e4m3 cache's tiles in bf16 (exact); V's in place, as above (sm_89's mma.sync reads it)
            k = e4m3_to_bf16(k)
            v = e4m3_to_bf16(v, IN_PLACE=True)
        else:   # an e4m3 cache's tiles in q's dtype (exact); otherwise nothing to do
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        keep = n_mask[None, :] & (offs_n[None, :] <= pos[:, None])
        if WINDOW:
            keep = keep & (offs_n[None, :] > pos[:, None] - window)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, qk_scale, keep, MASKED, PRECISION)
        blk = blk_next
    return acc, m_i, l_i


@triton.jit
def _find_sequence(query_start_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr, SCAN_SEQS: tl.constexpr):
    """The number of sequences s ≥ 1 whose first tile, query_start[s] // BLOCK_Q + s, is ≤ tile:
    the sequence `tile` belongs to (num_seqs if past the last)."""
    count = tile * 0
    for c in range(0, num_seqs, SCAN_SEQS):
        idx = c + 1 + tl.arange(0, SCAN_SEQS)
        valid = idx <= num_seqs
        first = tl.load(query_start_ptr + idx, mask=valid, other=0) // BLOCK_Q + idx
        count += tl.sum((valid & (first <= tile)).to(tl.int32), 0)
    return count


# num_seqs changes from step to step (1, 16, 31...): specializing on it would compile a variant per class mid-run.
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
                    k_scale_ptr, v_scale_ptr, num_seqs, qk_scale, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
                    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SCAN_SEQS: tl.constexpr, WINDOW: tl.constexpr,
                    PRECISION: tl.constexpr, FP8_KV: tl.constexpr, E4M3_PTX: tl.constexpr):
    """out[rows, heads] for one tile of BLOCK_Q query rows × the G heads of kv head program_id(1)."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    s = _find_sequence(query_start_ptr, num_seqs, tile, BLOCK_Q, SCAN_SEQS)
    s_safe = tl.minimum(s, num_seqs - 1)
    q_begin = tl.load(query_start_ptr + s_safe)
    q_len = tl.load(query_start_ptr + s_safe + 1) - q_begin
    t0 = (tile - (q_begin // BLOCK_Q + s_safe)) * BLOCK_Q  # first query row of this tile, within the sequence
    # One-row sequences (decode tokens) are the decode kernel's: in a tile of BLOCK_M rows they would
    # use G of them, and the wasted tensor-core work would outlast reading their keys.
    if (s < num_seqs) & (t0 >= 0) & (t0 < q_len) & (q_len > 1):
        seq_len = tl.load(seq_lens_ptr + s)
        n_rows = tl.minimum(q_len - t0, BLOCK_Q)
        p_first = seq_len - q_len + t0  # positions of the tile's first and last query rows
        p_last = p_first + n_rows - 1
        offs_m = tl.arange(0, BLOCK_M)
        qi = offs_m // G_PAD
        head = kvh * G + offs_m % G_PAD
        m_mask = (qi < n_rows) & (offs_m % G_PAD < G)
        pos = p_first + qi
        row = (q_begin + t0 + qi).to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None], other=0.0)
        out_scale = 1.0
        if FP8_KV:  # K = k_cache · k_scale, V = v_cache · v_scale
            qk_scale = qk_scale * tl.load(k_scale_ptr)
            out_scale = tl.load(v_scale_ptr)
        bt_row = block_tables_ptr + s.to(tl.int64) * stride_bt
        k_head = k_cache_ptr + kvh * stride_kh
        v_head = v_cache_ptr + kvh * stride_kh
        m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kv_hi = p_last + 1  # keys the tile needs: [kv_lo, kv_hi)
        kv_lo = p_first * 0
        # Tiles in [full_lo, full_hi) lie inside every row's range [lo(p), p]: no mask needed.
        full_lo = p_first * 0
        full_hi = (p_first + 1) // BLOCK_N * BLOCK_N
        if WINDOW:
            kv_lo = tl.maximum(p_first - window + 1, 0)
            full_lo = (tl.maximum(p_last - window + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
            acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, k_head, v_head, bt_row, kv_lo // BLOCK_N * BLOCK_N,
                                          tl.minimum(full_lo, kv_hi), pos, kv_lo, kv_hi, qk_scale, window,
                                          stride_kb, stride_kt, BLOCK_N, HEAD_DIM, PAGE, True, WINDOW, PRECISION,
                                          E4M3_PTX)
        acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, k_head, v_head, bt_row, full_lo, full_hi, pos, kv_lo, kv_hi,
                                      qk_scale, window, stride_kb, stride_kt, BLOCK_N, HEAD_DIM, PAGE, False, WINDOW,
                                      PRECISION, E4M3_PTX)
        acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, k_head, v_head, bt_row, tl.maximum(full_lo, full_hi), kv_hi,
                                      pos, kv_lo, kv_hi, qk_scale, window, stride_kb, stride_kt, BLOCK_N, HEAD_DIM,
                                      PAGE, True, WINDOW, PRECISION, E4M3_PTX)
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # rows outside the tile have no keys; they are not stored
        o = acc * (out_scale / l_safe)[:, None]
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit
def split_span(context, chunk, num_splits, BLOCK_N: tl.constexpr):
    """Tokens a split of a `context`-token range covers: `chunk`, or an even share of the context in whole BLOCK_N
    steps where that is more (the decode kernel and its reduce agree through this)."""
    return tl.maximum(chunk, tl.cdiv(tl.cdiv(context, num_splits), BLOCK_N) * BLOCK_N)


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_ml_ptr,
                   block_tables_ptr, seq_lens_ptr, query_start_ptr, k_scale_ptr, v_scale_ptr,
                   qk_scale, window, chunk, num_q_heads, num_splits, ml_stride,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_bt,
                   G: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, FP8_KV: tl.constexpr,
                   F16_DOTS: tl.constexpr):
    """The one query row of sequence program_id(0), G heads of kv head program_id(1), over keys
    [lo + split · span, lo + (split + 1) · span) ∩ [lo, seq_len) of split program_id(2), span = `split_span`'s."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + s)
    q_end = tl.load(query_start_ptr + s + 1)
    seq_len = tl.load(seq_lens_ptr + s)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    span = split_span(seq_len - lo, chunk, num_splits, BLOCK_N)
    start = lo + sp * span
    end = tl.minimum(start + span, seq_len)
    if (q_end - q_begin == 1) & (start < end):  # sequences with more rows are the prefill kernel's
        offs_m = tl.arange(0, M)
        offs_d = tl.arange(0, HEAD_DIM)
        m_mask = offs_m < G
        head = kvh * G + offs_m
        row = q_begin.to(tl.int64)
        q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None], other=0.0)
        if FP8_KV:  # K = k_cache · k_scale, V = v_cache · v_scale (the splits' sums are linear in V)
            qk_scale = qk_scale * tl.load(k_scale_ptr)
        if F16_DOTS:   # q = q16 · 2^e: q16 into the dots, 2^e into the softmax scale
            q32 = q.to(tl.float32)
            down, up = f16_range_scales(tl.max(tl.max(tl.abs(q32), axis=1), axis=0))
            q = (q32 * down).to(tl.float16)
            qk_scale = qk_scale * up
        bt_row = block_tables_ptr + s.to(tl.int64) * stride_bt
        k_head = k_cache_ptr + kvh * stride_kh
        v_head = v_cache_ptr + kvh * stride_kh
        m_i = tl.full([M], NEG_BIG, tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, HEAD_DIM], tl.float32)
        pos = tl.zeros([M], tl.int32) + (seq_len - 1)  # the query row's position
        acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, k_head, v_head, bt_row, start, end, pos, start, end, qk_scale,
                                      window, stride_kb, stride_kt, BLOCK_N, HEAD_DIM, PAGE, True, False, PRECISION,
                                      False)
        if FP8_KV:
            acc = acc * tl.load(v_scale_ptr)
        if SPLIT:
            idx = (s * num_q_heads + head).to(tl.int64) * num_splits + sp  # partial [s, head, split]
            tl.store(part_o_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=m_mask[:, None])
            tl.store(part_ml_ptr + idx, m_i, mask=m_mask)
            tl.store(part_ml_ptr + ml_stride + idx, l_i, mask=m_mask)
        else:
            o = acc * (1.0 / l_i)[:, None]
            tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit
def _decode_reduce_kernel(part_o_ptr, part_ml_ptr, out_ptr, seq_lens_ptr, query_start_ptr,
                          window, chunk, num_q_heads, num_splits, ml_stride, stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[row, h] = Σ_split 2^(m_split - M) acc_split / Σ_split 2^(m_split - M) l_split over the
    splits this sequence's context reaches (the decode kernel wrote nothing for the others)."""
    pdl_start()   # ops/pdl.py: with LORAPLEX_PDL=on, wait for the grids before this one first
    s = tl.program_id(0)
    h = tl.program_id(1)
    q_begin = tl.load(query_start_ptr + s)
    q_end = tl.load(query_start_ptr + s + 1)
    if q_end - q_begin == 1:
        seq_len = tl.load(seq_lens_ptr + s)
        lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
        span = split_span(seq_len - lo, chunk, num_splits, BLOCK_N)
        used = tl.minimum((seq_len - lo + span - 1) // span, num_splits)
        offs_sp = tl.arange(0, SPLITS_PAD)
        sp_mask = offs_sp < used
        idx = (s * num_q_heads + h).to(tl.int64) * num_splits + offs_sp
        m = tl.load(part_ml_ptr + idx, mask=sp_mask, other=float("-inf"))
        l_sum = tl.load(part_ml_ptr + ml_stride + idx, mask=sp_mask, other=0.0)
        w = tl.math.exp2(m - tl.max(m, 0))
        offs_d = tl.arange(0, HEAD_DIM)
        o = tl.load(part_o_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=sp_mask[:, None], other=0.0)
        res = tl.sum(o * w[:, None], 0) / tl.sum(w * l_sum, 0)
        tl.store(out_ptr + q_begin.to(tl.int64) * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty))
