"""Paged attention: write new keys and values into the paged KV cache, attend over it.

The cache of one layer is two tensors `k_cache`, `v_cache` `[num_blocks, block_size, Hkv, D]`.
Token `j` of a sequence lives at `k_cache[block_table[j // block_size], j % block_size]`.
A step's new tokens are first written with `store_kv`, then `paged_attention` reads every key,
old and new, from the cache. The flat batch is the model's (Punica's) layout: the query rows
of sequence `s` are `q[query_start[s]:query_start[s+1]]`, the last `q_len` tokens of its
`seq_lens[s]`-token context, so one call serves prefill chunks over a cached prefix and decode
tokens side by side.

The cache holds the inputs' dtype, or float8 e4m3 (`KV_FP8`, one byte an element) beside activations of
any float dtype: then each layer's keys and values carry a dequantization scale, `k_scale` and `v_scale`
(a float, or a float32 tensor of one element that a CUDA graph reads at replay; None is 1.0), and

    k_cache[slot] = e4m3(clamp(k / k_scale, ±448))    # fp32 division, round to nearest even (store_kv)
    K = k_cache[...] · k_scale,  V = v_cache[...] · v_scale    # what attention reads (paged_attention)

Two backends, as for the LoRA ops (see `api.resolve_backend`): Triton kernels for CUDA tensors
(`kernels.py`, `store_kernel.py`; they never synchronise with the host, so a decode step can be captured
in a CUDA graph), and the PyTorch reference below, which is the CPU path and reads the batch
metadata on the host. Arguments are checked as checks.py says.
"""
from __future__ import annotations

import torch

from ..lora.api import _bump_version, _on, resolve_backend
from .checks import (E4M3_MAX, KV_FP8, TRITON_HEAD_DIMS, check_attention_args, check_cache_dtype, check_caches,
                     check_head_dim_for_triton, check_lengths, check_query_start, check_rows, check_scales,
                     check_tensor, desc, scale_value)

try:  # the kernels need Triton; without it resolve_backend only ever returns "reference"
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is a dependency on Linux
    launchers = store_kernel = None
else:
    from . import launchers
    from . import store_kernel

__all__ = ["KV_FP8", "TRITON_HEAD_DIMS", "check_attention_args", "checked_paged_attention", "paged_attention",
           "store_kv"]
Scale = float | torch.Tensor | None   # an e4m3 cache's dequantization scale (the module docstring)

_REFERENCE_SCORE_ELEMENTS = 1 << 25  # scores held at once per sequence by the reference (128 MiB fp32)


# ---------------------------------------------------------------------------------------------
# store_kv


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: Scale = None, v_scale: Scale = None,
             backend: str | None = None) -> None:
    """Write this step's keys and values into the paged cache, in place.

    `k`, `v` `[T, Hkv, D]` (any strides with the last one 1: slices of a fused qkv output are
    fine); `k_cache`, `v_cache` `[num_blocks, block_size, Hkv, D]` with D innermost and equal strides
    (contiguous, or head-major as `KVCache` keeps them), in k's dtype or float8_e4m3fn;
    `slot_mapping` int32 or int64 `[T]`, slot = block * block_size + offset; `k_scale`, `v_scale` (e4m3
    caches only): the module docstring's scales.

        for t in range(T):
            slot = slot_mapping[t]
            if slot < 0: continue                      # a padding row
            if e4m3 cache: k_cache[slot // block_size, slot % block_size] = e4m3(clamp(float32(k[t]) / k_scale, ±448))
            else:          k_cache[slot // block_size, slot % block_size] = k[t]
            (v likewise, with v_scale)

    e4m3(x) rounds to the nearest e4m3 value, ties to even (torch's cast). Slots must be distinct and
    below num_blocks * block_size (the reference checks this; the Triton path cannot without a host
    sync). One launch for k and v; never syncs with the host.
    """
    for name, t in (("k", k), ("v", v)):
        check_tensor(t, name, 3, None)
        check_rows(t, name)
    device = k.device
    if v.device != device:
        raise ValueError(f"v is on {v.device} but k is on {device}")
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v must match k: {desc(v)} vs {desc(k)}")
    check_caches(k_cache, v_cache, None)
    if k_cache.device != device:
        raise ValueError(f"k_cache is on {k_cache.device} but k is on {device}")
    T, Hkv, D = k.shape
    if tuple(k_cache.shape[2:]) != (Hkv, D):
        raise ValueError(f"k [T, Hkv, D] = {desc(k)} does not fit the cache's [num_blocks, block_size, Hkv={Hkv}, "
                         f"D={D}]: {desc(k_cache)}")
    check_cache_dtype(k_cache.dtype, k.dtype, "k")
    check_scales(k_scale, v_scale, k_cache.dtype, device)
    check_tensor(slot_mapping, "slot_mapping", 1, None)
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but k is on {device}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape[0] != T:
        raise ValueError(f"slot_mapping must be int32 or int64 [T={T}], got {desc(slot_mapping)}")
    if T == 0:
        return
    if resolve_backend(backend, device) == "triton":
        with _on(device):
            store_kernel.store_kv(k, v, k_cache, v_cache, slot_mapping, *_scale_tensors(k_cache, k_scale, v_scale))
        _bump_version(k_cache)
        _bump_version(v_cache)
        return
    _store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _scale_tensors(cache: torch.Tensor, k_scale: Scale, v_scale: Scale) -> tuple:
    """The kernels' scale arguments: fp32 tensors of one element for an e4m3 cache (a float becomes one, on the
    device: the engine passes KVCache's tensors instead, which cost nothing), None otherwise."""
    if cache.dtype != KV_FP8:
        return None, None
    as_tensor = lambda s: s if isinstance(s, torch.Tensor) else \
        torch.full((1,), 1.0 if s is None else float(s), dtype=torch.float32, device=cache.device)  # noqa: E731
    return as_tensor(k_scale), as_tensor(v_scale)


def quantize_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The store's rule: e4m3 of float32(x) / scale, clamped to ±448, rounded to nearest even."""
    return (x.float() / torch.tensor(scale, dtype=torch.float32)).clamp_(-E4M3_MAX, E4M3_MAX).to(KV_FP8)


def _store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale: Scale, v_scale: Scale) -> None:
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slots.numel():
        if int(slots.max()) >= num_slots:
            raise ValueError(f"slot_mapping holds slot {int(slots.max())} but the cache has {num_slots} slots")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slot_mapping writes one slot twice: slots of non-padding rows must be distinct")
    k, v = k[keep], v[keep]
    if k_cache.dtype == KV_FP8:
        k = quantize_e4m3(k, scale_value(k_scale, "k_scale"))
        v = quantize_e4m3(v, scale_value(v_scale, "v_scale"))
    bs = k_cache.shape[1]  # through the caches' strides, whatever their layout
    k_cache[slots // bs, slots % bs] = k
    v_cache[slots // bs, slots % bs] = v


# ---------------------------------------------------------------------------------------------
# paged_attention


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start: torch.Tensor, *, max_query_len: int, max_seq_len: int,
                    scale: float, sliding_window: int = 0, out: torch.Tensor | None = None, k_scale: Scale = None,
                    v_scale: Scale = None, backend: str | None = None) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged keys and values.

    `q` `[T, Hq, D]` (any strides with the last one 1, e.g. `qkv[:, :Hq*D].view(T, Hq, D)`);
    `k_cache`, `v_cache` `[num_blocks, block_size, Hkv, D]` (strides as for `store_kv`) in q's dtype or
    float8_e4m3fn (then dequantized by `k_scale`, `v_scale`: the module docstring), Hq a
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
                    if e4m3 cache: K, V = K * k_scale, V * v_scale
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
    lengths within the bounds, block ids within the cache, scales positive) and raises ValueError.
    Not differentiable.
    """
    out = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start, max_query_len=max_query_len,
                               max_seq_len=max_seq_len, scale=scale, sliding_window=sliding_window, out=out,
                               k_scale=k_scale, v_scale=v_scale)
    return checked_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len, scale=scale,
                                   sliding_window=sliding_window, out=out, k_scale=k_scale, v_scale=v_scale,
                                   backend=backend)


def checked_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start: torch.Tensor, *, max_query_len: int, max_seq_len: int,
                            scale: float, sliding_window: int, out: torch.Tensor, k_scale: Scale = None,
                            v_scale: Scale = None, backend: str | None = None) -> torch.Tensor:
    """`paged_attention` on arguments `check_attention_args` accepted (its `out`): no second check."""
    (T, _, D), S, device = q.shape, block_tables.shape[0], q.device
    if T == 0 or S == 0 or max_query_len == 0:
        return out
    if resolve_backend(backend, device) == "triton":
        check_head_dim_for_triton(D)
        ks, vs = _scale_tensors(k_cache, k_scale, v_scale)
        with _on(device):
            # Sequences of several rows take the prefill kernel, one-row sequences (decode tokens,
            # also inside a mixed batch) the split-KV decode kernel; each skips the other's.
            if max_query_len > 1:
                launchers.prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start, out,
                                  scale=float(scale), window=sliding_window, k_scale=ks, v_scale=vs)
            launchers.decode(q, k_cache, v_cache, block_tables, seq_lens, query_start, out,
                             max_seq_len=max_seq_len, scale=float(scale), window=sliding_window,
                             k_scale=ks, v_scale=vs)
        _bump_version(out)
        return out
    dequant = None
    if k_cache.dtype == KV_FP8:
        dequant = (scale_value(k_scale, "k_scale"), scale_value(v_scale, "v_scale"))
    _attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start, out, max_query_len,
                         max_seq_len, float(scale), sliding_window, dequant)
    return out


def _attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start, out, max_query_len: int,
                         max_seq_len: int, scale: float, window: int,
                         dequant: tuple[float, float] | None) -> None:
    """The docstring's loop, one masked matmul and softmax in fp32 per sequence (per row chunk); `dequant`:
    (k_scale, v_scale) of an e4m3 cache."""
    T, Hq, D = q.shape
    num_blocks, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    starts, lens = query_start.tolist(), seq_lens.tolist()
    check_query_start(starts, T)
    for s in range(len(lens)):
        begin, end, L = starts[s], starts[s + 1], lens[s]
        q_len = end - begin
        if q_len == 0:
            continue
        check_lengths(s, q_len, L, max_query_len, max_seq_len)
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
        if dequant is not None:
            keys, vals = keys * dequant[0], vals * dequant[1]
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
