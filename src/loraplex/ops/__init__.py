"""The operators every layer calls: batched multi-LoRA (SGMV) with a Triton and a reference backend."""
from . import reference
from .api import BACKENDS, add_lora, lora_expand, lora_shrink, resolve_backend, triton_interpreted
from .attention import paged_attention, store_kv
from .batch import LoraBatch
from .checks import MAX_SLICES

__all__ = ["LoraBatch", "add_lora", "lora_shrink", "lora_expand", "reference", "resolve_backend",
           "triton_interpreted", "BACKENDS", "MAX_SLICES"]
__all__ += ["paged_attention", "store_kv"]
