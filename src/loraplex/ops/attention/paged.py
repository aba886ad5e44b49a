"""Paged attention: write new keys and values into the paged KV cache, attend over it.

The cache of one layer is two tensors `k_cache`, `v_cache` `[num_blocks, block_size, Hkv, D]`.
Token `j` of a sequence lives at `k_cache[block_table[j // block_size], j % block_size]`.
A step's new tokens are first written with `store_kv`, then `paged_attention` reads every key,
old and new, from the cache. The flat batch is the model's (Punica's) layout: the query rows
of sequence `s` are `q[query_start[s]:query_start[s+1]]`, the last `q_len` tokens of its
`seq_lens[s]`-token context, so one call serves prefill chunks over a cached prefix and decode
tokens side by side.

Two backends, as for the LoRA ops (see `api.resolve_backend`): Triton kernels for CUDA tensors
(`attention_kernels.py`; they never synchronise with the host, so a decode step can be captured
in a CUDA graph), and the PyTorch reference below, which is the CPU path and reads the batch
metadata on the host. Shapes, dtypes and devices are checked from metadata for both; values that
live on the device (lengths, block ids) are checked by the reference only, since the Triton path
cannot read them without a sync.
"""
from __future__ import annotations

import math

import torch

from ..lora.api import _bump_version, _on, resolve_backend

try:  # the kernels need Triton; without it resolve_backend only ever returns "reference"
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is a dependency on Linux
    attention_kernels = None
else:
    from . import kernels as attention_kernels

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Head sizes the Triton kernels are built for (tl.arange needs a power of two; tl.dot at least 16).
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
_REFERENCE_SCORE_ELEMENTS = 1 << 25  # scores held at once per sequence by the reference (128 MiB fp32)


def _desc(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)}, {str(t.dtype).replace('torch.', '')} on {t.device}"


def _check_tensor(t, name: str, ndim: int, device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got {_desc(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _check_rows(t: torch.Tensor, name: str) -> None:
    """Float rows with a unit stride along the last dimension (other strides may be anything)."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {_desc(t)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}'s last dimension must have stride 1, got {_desc(t)} with strides {t.stride()}")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but the attention ops are not differentiable: call them under "
                         f"torch.no_grad() or torch.inference_mode()")


def _check_caches(k_cache, v_cache, device: torch.device | None) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(c, name, 4, device)
        if c.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {_desc(c)}")
        if (c.shape[3] > 1 and c.stride(3) != 1) or torch._debug_has_internal_overlap(c) == 1:
            raise ValueError(f"{name} [num_blocks, block_size, Hkv, D] must have D innermost (stride 1) and the "
                             f"other dimensions apart (contiguous, or head-major: KVCache's), got {_desc(c)} with "
                             f"strides {c.stride()}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must match k_cache: {_desc(v_cache)} vs {_desc(k_cache)}")
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache's strides {v_cache.stride()} differ from k_cache's {k_cache.stride()}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device} but k_cache is on {k_cache.device}")


def _check_int(value, name: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_head_dim_for_triton(head_dim: int) -> None:
    if head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"the Triton attention kernels need head_dim in {TRITON_HEAD_DIMS}, got {head_dim}; "
                         f"use backend='reference' for other sizes")


# ---------------------------------------------------------------------------------------------
# store_kv


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, backend: str | None = None) -> None:
    """Write this step's keys and values into the paged cache, in place.

    `k`, `v` `[T, Hkv, D]` (any strides with the last one 1: slices of a fused qkv output are
    fine), in the caches' dtype; `k_cache`, `v_cache` `[num_blocks, block_size, Hkv, D]` with D innermost
    and equal strides (contiguous, or head-major as `KVCache` keeps them);
    `slot_mapping` int32 or int64 `[T]`, slot = block * block_size + offset.

        for t in range(T):
            slot = slot_mapping[t]
            if slot < 0: continue                      # a padding row
            k_cache[slot // block_size, slot % block_size] = k[t]
            v_cache[slot // block_size, slot % block_size] = v[t]

    Slots must be distinct and below num_blocks * block_size (the reference checks this; the
    Triton path cannot without a host sync). One launch for k and v; never syncs with the host.
    """
    for name, t in (("k", k), ("v", v)):
        _check_tensor(t, name, 3, None)
        _check_rows(t, name)
    device = k.device
    if v.device != device:
        raise ValueError(f"v is on {v.device} but k is on {device}")
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v must match k: {_desc(v)} vs {_desc(k)}")
    _check_caches(k_cache, v_cache, None)
    if k_cache.device != device:
        raise ValueError(f"k_cache is on {k_cache.device} but k is on {device}")
    T, Hkv, D = k.shape
    if tuple(k_cache.shape[2:]) != (Hkv, D):
        raise ValueError(f"k [T, Hkv, D] = {_desc(k)} does not fit the cache's [num_blocks, block_size, Hkv={Hkv}, "
                         f"D={D}]: {_desc(k_cache)}")
    if k_cache.dtype != k.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but k is {k.dtype}: cast k first")
    _check_tensor(slot_mapping, "slot_mapping", 1, None)
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but k is on {device}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape[0] != T:
        raise ValueError(f"slot_mapping must be int32 or int64 [T={T}], got {_desc(slot_mapping)}")
    if T == 0:
        return
    if resolve_backend(backend, device) == "triton":
        with _on(device):
            attention_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)
        _bump_version(k_cache)
        _bump_version(v_cache)
        return
    _store_kv_reference(k, v, k_cache, v_cache, slot_mapping)


def _store_kv_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slots.numel():
        if int(slots.max()) >= num_slots:
            raise ValueError(f"slot_mapping holds slot {int(slots.max())} but the cache has {num_slots} slots")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slot_mapping writes one slot twice: slots of non-padding rows must be distinct")
    bs = k_cache.shape[1]  # through the caches' strides, so a head-major cache (KVCache's) works too
    k_cache[slots // bs, slots % bs] = k[keep]
    v_cache[slots // bs, slots % bs] = v[keep]


# ---------------------------------------------------------------------------------------------
# paged_attention


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start: torch.Tensor, *, max_query_len: int, max_seq_len: int,
                    scale: float, sliding_window: int = 0, out: torch.Tensor | None = None,
                    backend: str | None = None) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged keys and values.

    `q` `[T, Hq, D]` (any strides with the last one 1, e.g. `qkv[:, :Hq*D].view(T, Hq, D)`);
    `k_cache`, `v_cache` `[num_blocks, block_size, Hkv, D]` (strides as for `store_kv`) in q's dtype, Hq a
    multiple of Hkv (G = Hq // Hkv query heads share a kv head); `block_tables` int32
    `[S, max_blocks]` (entries past a sequence's last block are never read); `seq_lens` int32
    `[S]`: context length of sequence s including this step's tokens, already in the cache;
    `query_start` int32 `[S+1]`: sequence s owns rows `query_start[s]:query_start[s+1]`.

        for s in range(S):
            q_len = query_start[s+1] - query_start[s]
            for i in range(q_len):
                row = query_start[s] + i; p = seq_lens[s] - q_len + i
                lo = max(0, p - sliding_window + 1) if sliding_window > 0 else 0
                for h in range(Hq):
                    K = [k_cache[block_tables[s, j // bs], j % bs, h // G] for j in range(lo, p + 1)]; V likewise
                    out[row, h] = softmax(scale * K @ q[row, h]) @ V     # softmax in fp32, out in q's dtype

    `max_query_len` ≥ every q_len and `max_seq_len` ≥ every seq_len are host ints (loose bounds
    are fine), so the Triton launch grid needs no device read and a decode step with fixed bounds
    can be captured in a CUDA graph. There, sequences of several rows take a flash-attention
    prefill kernel and one-row sequences a split-KV decode kernel: a decode batch
    (max_query_len == 1) launches the latter only (plus a small reduce when it splits the
    context), a mixed batch both.

    Rows of `out` no sequence owns (past query_start[S]) are left as they are: uninitialised when
    `out` is None. Returns `out` `[T, Hq, D]` in q's dtype, contiguous when allocated here (a given
    `out` may have any strides with the last one 1). Never syncs with the host on the Triton path;
    the reference reads the metadata, so it also checks the values (query_start ordered within q,
    lengths within the bounds, block ids within the cache) and raises ValueError. Not differentiable.
    """
    out = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start, max_query_len=max_query_len,
                               max_seq_len=max_seq_len, scale=scale, sliding_window=sliding_window, out=out)
    return checked_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len, scale=scale,
                                   sliding_window=sliding_window, out=out, backend=backend)


def checked_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start: torch.Tensor, *, max_query_len: int, max_seq_len: int,
                            scale: float, sliding_window: int, out: torch.Tensor,
                            backend: str | None = None) -> torch.Tensor:
    """`paged_attention` on arguments `check_attention_args` accepted (its `out`): no second check."""
    (T, _, D), S, device = q.shape, block_tables.shape[0], q.device
    if T == 0 or S == 0 or max_query_len == 0:
        return out
    if resolve_backend(backend, device) == "triton":
        _check_head_dim_for_triton(D)
        with _on(device):
            # Sequences of several rows take the prefill kernel, one-row sequences (decode tokens,
            # also inside a mixed batch) the split-KV decode kernel; each skips the other's.
            if max_query_len > 1:
                attention_kernels.prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start, out,
                                          scale=float(scale), window=sliding_window)
            attention_kernels.decode(q, k_cache, v_cache, block_tables, seq_lens, query_start, out,
                                     max_seq_len=max_seq_len, scale=float(scale), window=sliding_window)
        _bump_version(out)
        return out
    _attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start, out, max_query_len,
                         max_seq_len, float(scale), sliding_window)
    return out


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, query_start: torch.Tensor, *, max_query_len: int, max_seq_len: int,
                         scale: float, sliding_window: int, out: torch.Tensor | None) -> torch.Tensor:
    """`paged_attention`'s argument checks (ValueError naming the argument); returns `out`, allocated if None."""
    _check_tensor(q, "q", 3, None)
    _check_rows(q, "q")
    device = q.device
    T, Hq, D = q.shape
    _check_caches(k_cache, v_cache, device)
    Hkv = k_cache.shape[2]
    if k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but q is {q.dtype}")
    if k_cache.shape[3] != D:
        raise ValueError(f"k_cache has head_dim {k_cache.shape[3]} but q has {D} ({_desc(k_cache)} vs {_desc(q)})")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q's {Hq} heads are not a multiple of the cache's {Hkv} kv heads")
    _check_tensor(block_tables, "block_tables", 2, device)
    if block_tables.dtype != torch.int32 or (block_tables.shape[1] > 1 and block_tables.stride(1) != 1):
        raise ValueError(f"block_tables must be int32 [S, max_blocks] with stride 1 along the last dimension, "
                         f"got {_desc(block_tables)} with strides {block_tables.stride()}")
    S = block_tables.shape[0]
    for name, t, n in (("seq_lens", seq_lens, S), ("query_start", query_start, S + 1)):
        _check_tensor(t, name, 1, device)
        if t.dtype != torch.int32 or t.shape[0] != n or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32 [{n}] (block_tables has S={S} rows), got {_desc(t)}")
    _check_int(max_query_len, "max_query_len", 0)
    _check_int(max_seq_len, "max_seq_len", 0)
    _check_int(sliding_window, "sliding_window", 0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=device)
    else:
        _check_tensor(out, "out", 3, device)
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be {list(q.shape)} {q.dtype} like q, got {_desc(out)}")
        if D > 1 and out.stride(-1) != 1:
            raise ValueError(f"out's last dimension must have stride 1, got strides {out.stride()}")
        if torch._debug_has_internal_overlap(out) == 1:
            raise ValueError(f"out has elements that share memory ({_desc(out)}, strides {out.stride()})")
    return out


def _check_query_start(starts: list[int], T: int) -> None:
    for s in range(len(starts) - 1):
        begin, end = starts[s], starts[s + 1]
        if begin < 0 or end < begin or end > T:
            raise ValueError(f"query_start[{s}:{s + 2}] = [{begin}, {end}] must be non-decreasing within q's {T} rows")


def _check_lengths(s: int, q_len: int, seq_len: int, max_query_len: int, max_seq_len: int) -> None:
    if q_len > max_query_len:
        raise ValueError(f"sequence {s} has {q_len} query rows but max_query_len={max_query_len}")
    if seq_len < q_len:
        raise ValueError(f"seq_lens[{s}]={seq_len} is below the sequence's {q_len} query rows: seq_lens counts "
                         f"this step's tokens too")
    if seq_len > max_seq_len:
        raise ValueError(f"seq_lens[{s}]={seq_len} exceeds max_seq_len={max_seq_len}")


def _attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start, out, max_query_len: int,
                         max_seq_len: int, scale: float, window: int) -> None:
    """The docstring's loop, one masked matmul and softmax in fp32 per sequence (per row chunk)."""
    T, Hq, D = q.shape
    num_blocks, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    starts, lens = query_start.tolist(), seq_lens.tolist()
    _check_query_start(starts, T)
    for s in range(len(lens)):
        begin, end, L = starts[s], starts[s + 1], lens[s]
        q_len = end - begin
        if q_len == 0:
            continue
        _check_lengths(s, q_len, L, max_query_len, max_seq_len)
        first_p = L - q_len
        # Only keys from the first row's window start on are needed: gather those pages.
        lo = max(0, first_p - window + 1) if window > 0 else 0
        first_block, n_blocks = lo // bs, -(-L // bs)
        if n_blocks > block_tables.shape[1]:
            raise ValueError(f"sequence {s} needs {n_blocks} blocks for seq_lens[{s}]={L} but block_tables has "
                             f"{block_tables.shape[1]} columns")
        blocks = block_tables[s, first_block:n_blocks].long()
        if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
            raise ValueError(f"block_tables[{s}] holds block ids outside [0, {num_blocks}) among its first "
                             f"{n_blocks}: {blocks.tolist()}")
        key0 = first_block * bs  # position of the first gathered key
        keys = k_cache[blocks].reshape(-1, Hkv, D)[lo - key0:L - key0].float().permute(1, 0, 2)  # [Hkv, n, D]
        vals = v_cache[blocks].reshape(-1, Hkv, D)[lo - key0:L - key0].float().permute(1, 0, 2)
        key_pos = torch.arange(lo, L, device=q.device)
        chunk = max(1, _REFERENCE_SCORE_ELEMENTS // max(1, Hq * (L - lo)))
        for i0 in range(0, q_len, chunk):
            i1 = min(q_len, i0 + chunk)
            qs = q[begin + i0:begin + i1].float().reshape(i1 - i0, Hkv, G, D).permute(1, 2, 0, 3)  # [Hkv, G, m, D]
            scores = (qs @ keys.transpose(1, 2).unsqueeze(1)) * scale  # [Hkv, G, m, n]
            pos = torch.arange(first_p + i0, first_p + i1, device=q.device)[:, None]
            allowed = key_pos[None, :] <= pos
            if window > 0:
                allowed &= key_pos[None, :] > pos - window
            scores.masked_fill_(~allowed, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ vals.unsqueeze(1)  # [Hkv, G, m, D]
            out[begin + i0:begin + i1] = o.permute(2, 0, 1, 3).reshape(i1 - i0, Hq, D).to(out.dtype)
