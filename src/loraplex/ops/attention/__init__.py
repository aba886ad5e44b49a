"""Paged attention over the KV cache: the ops, their Triton kernels and the reference."""
from .paged import TRITON_HEAD_DIMS, paged_attention, store_kv

__all__ = ["TRITON_HEAD_DIMS", "paged_attention", "store_kv"]
