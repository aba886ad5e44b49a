"""Decode attention that also computes the o projection's LoRA shrink.

`decode_attention_shrink(q, k_cache, v_cache, ..., lora_a=A, ranks=..., row_slot=...)` returns `(out, part)`:
`out` is exactly `attention.paged_attention(...)` of a decode batch (every sequence one query row), and `part`
the fp32 split-K partials `[Hkv, 1, T, R]` of the shrink `v = out.view(T, Hq·D) @ A[slot]ᵀ`, one split per kv
head, that `sgmv.expand_from` sums (`overlap.linear_with_lora_expand`):

    for every row m a sequence owns with s = row_slot[m] ≥ 0 and r < rank = min(ranks[s], R):
        Σ_h part[h, 0, m, r] = Σ_c out[m, c] · A[s, r, c]        (fp32 products of out's rounded values)

Nothing else of `part` is written (rows without an adapter, columns past a rank: the expand never reads them).
At decode the o shrink ran alone between the attention and the o GEMM, latency-bound (~3 µs of each
Llama-2-7B layer at batch 32 on an H200, benchmarks/results/decode_graph_trace.json); here each attention
program reads A's columns of its heads. `part` is None where the decode kernel splits the context (small
batches of long sequences: `attention_kernels.plan_decode`) or R > MAX_RANK: the caller shrinks as usual.
Triton for CUDA tensors, the reference (PyTorch, one split per kv head too) otherwise. Bad arguments raise
ValueError naming the argument.
"""
from __future__ import annotations

import torch

from ..lora.api import _bump_version, _on, resolve_backend
from .paged import _check_head_dim_for_triton, check_attention_args, checked_paged_attention
from ..lora.checks import check_shrink_inputs

MAX_RANK = 64   # the epilogue holds a [R, D] tile of A per head


def decode_attention_shrink(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start: torch.Tensor, *, max_seq_len: int, scale: float,
                            sliding_window: int = 0, lora_a: torch.Tensor, ranks: torch.Tensor,
                            row_slot: torch.Tensor,
                            backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(out [T, Hq, D], part [Hkv, 1, T, R] or None)`, see the module docstring. The attention arguments as for
    `paged_attention` with max_query_len 1; `lora_a [slots, R, Hq·D]` (q's dtype, last dimension contiguous),
    `ranks` int32 `[slots]`, `row_slot` int32 `[T]` (-1: no adapter)."""
    out = check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start, max_query_len=1,
                               max_seq_len=max_seq_len, scale=scale, sliding_window=sliding_window, out=None)
    T, Hq, D = q.shape
    dev = q.device
    check_shrink_inputs(lora_a, ranks, row_slot, T, Hq * D, "Hq*D", q.dtype, dev)
    R = lora_a.shape[1]
    kwargs = dict(max_query_len=1, max_seq_len=max_seq_len, scale=scale, sliding_window=sliding_window, out=out)
    S = block_tables.shape[0]
    if R == 0 or R > MAX_RANK or T == 0 or S == 0:
        return checked_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, backend=backend,
                                       **kwargs), None
    if resolve_backend(backend, dev) == "reference":
        checked_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, backend="reference",
                                **kwargs)
        return out, _reference_part(out, lora_a, ranks, row_slot, k_cache.shape[2])
    from . import kernels as ak
    _check_head_dim_for_triton(D)
    Hkv = k_cache.shape[2]
    if ak.plan_decode(S, Hkv, max_seq_len, sliding_window, dev, ak.decode_config(D, q.dtype))[0] > 1:
        return checked_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, backend=backend,
                                       **kwargs), None
    part = torch.empty((Hkv, 1, T, R), dtype=torch.float32, device=dev)
    with _on(dev):
        done = ak.decode(q, k_cache, v_cache, block_tables, seq_lens, query_start, out, max_seq_len=max_seq_len,
                         scale=float(scale), window=sliding_window, lora=(lora_a, ranks, row_slot, part))
    if not done:
        raise RuntimeError("the decode kernel split the context after plan_decode said it would not")
    _bump_version(out)
    return out, part


def _reference_part(out: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, row_slot: torch.Tensor,
                    Hkv: int) -> torch.Tensor:
    """The documented sum, one split per kv head (fp32); zeros in rows without an adapter and past a rank."""
    T, Hq, D = out.shape
    R = lora_a.shape[1]
    part = torch.zeros((Hkv, 1, T, R), dtype=torch.float32, device=out.device)
    has = row_slot >= 0
    if bool(has.any()):
        slots = row_slot[has].long()
        a = lora_a[slots].float().view(-1, R, Hkv, Hq // Hkv * D)          # [rows, R, Hkv, G·D]
        o = out[has].float().view(-1, Hkv, Hq // Hkv * D)                   # [rows, Hkv, G·D]
        v = torch.einsum("mrhc,mhc->hmr", a, o)
        keep = torch.arange(R, device=out.device)[None, :] < ranks[slots].clamp(max=R)[:, None]
        part[:, 0, has] = torch.where(keep[None], v, 0.0)
    return part
