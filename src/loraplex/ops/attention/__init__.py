"""Paged attention over the KV cache: the ops, their Triton kernels and the reference."""
from .paged import KV_FP8, TRITON_HEAD_DIMS, paged_attention, store_kv

__all__ = ["KV_FP8", "TRITON_HEAD_DIMS", "paged_attention", "store_kv"]
