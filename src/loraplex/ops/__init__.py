"""The operators every layer calls: batched multi-LoRA (SGMV) with a Triton and a reference backend."""
from .lora import reference
from .lora.api import BACKENDS, add_lora, lora_expand, lora_shrink, resolve_backend, triton_interpreted
from .attention.paged import paged_attention, store_kv
from .lora.batch import LoraBatch
from .lora.checks import MAX_SLICES

__all__ = ["LoraBatch", "add_lora", "lora_shrink", "lora_expand", "reference", "resolve_backend",
           "triton_interpreted", "BACKENDS", "MAX_SLICES"]
__all__ += ["paged_attention", "store_kv"]
