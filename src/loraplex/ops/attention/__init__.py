"""Paged attention over the KV cache: the ops, their Triton kernels and the reference."""
from .checks import CACHE_DTYPES
from .paged import KV_FP8, TRITON_HEAD_DIMS, paged_attention, store_kv

__all__ = ["CACHE_DTYPES", "KV_FP8", "TRITON_HEAD_DIMS", "paged_attention", "store_kv"]
