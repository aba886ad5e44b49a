"""The paged KV cache: fixed-size blocks of keys and values, one preallocated tensor for all layers.

Token `j` of a sequence lives in block `block_table[j // block_size]` at offset
`j % block_size`, in every layer: the block table is per sequence, not per layer. Blocks are
handed out by the engine's block manager; the cache only holds the memory.

Each layer's `k[layer]` and `v[layer]` are `[num_blocks, block_size, Hkv, D]` (the attention ops'
order), contiguous: token-major. A head-major layout (each kv head's keys of a block contiguous) read
no faster, in bf16 or e4m3 (docs/design-notes.md), so it is not offered.

`dtype` is what the cache stores: the model's dtype, or float8 e4m3 (`KV_FP8`, one byte an element, so
a memory budget holds twice the blocks of a bf16 cache). An e4m3 cache keeps fp32 dequantization scales
per layer, `k_scale` and `v_scale` `[layers]`: the checkpoint's (compressed-tensors' `kv_cache_scheme`),
or 1.0 where it has none, as vLLM does (values then keep e4m3's relative precision, 2^-4, down to 2^-6
in magnitude, and saturate at ±448). The attention ops' module docstring (ops/attention/paged.py) gives
the semantics: stored = e4m3(x / scale), read = stored · scale.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..ops.attention import CACHE_DTYPES, KV_FP8
from .config import ModelConfig


class KVCache:
    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int = 16, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 k_scale: Sequence[float] | torch.Tensor | None = None,
                 v_scale: Sequence[float] | torch.Tensor | None = None) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 8 or block_size > 256 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two from 8 to 256, got {block_size!r}")
        if num_blocks * block_size >= 2**31:
            raise ValueError(f"{num_blocks} blocks of {block_size} tokens exceed int32 slot indexing")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype must be float32, float16, bfloat16 or float8_e4m3fn, got {dtype}")
        self.model, self.num_blocks, self.block_size, self.dtype = model, num_blocks, block_size, dtype
        self.data = torch.empty((model.num_hidden_layers, 2, num_blocks, block_size, model.num_key_value_heads,
                                 model.head_dim), dtype=dtype, device=device)
        self.k = [self.data[layer, 0] for layer in range(model.num_hidden_layers)]
        self.v = [self.data[layer, 1] for layer in range(model.num_hidden_layers)]
        self.k_scale, self.v_scale, self._scales = self._make_scales(k_scale, v_scale)

    def _make_scales(self, k_scale, v_scale) -> tuple:
        """(k_scale, v_scale, [per-layer (k, v) views]): fp32 `[layers]` tensors for an e4m3 cache, else Nones."""
        layers = self.model.num_hidden_layers
        if self.dtype != KV_FP8:
            if k_scale is not None or v_scale is not None:
                raise ValueError(f"k_scale and v_scale scale a float8_e4m3fn cache; this one is {self.dtype}")
            return None, None, [(None, None)] * layers
        # Each layer's scalar 16 bytes from the next: Triton compiles a pointer argument apart by its alignment,
        # so views of a packed [layers] tensor would compile each kernel twice.
        data = torch.ones((2, layers, 4), dtype=torch.float32, device=self.device)
        for i, (name, given) in enumerate((("k_scale", k_scale), ("v_scale", v_scale))):
            if given is not None:
                data[i, :, 0] = _check_scales(name, given, layers)
        k, v = data[0, :, 0], data[1, :, 0]
        return k, v, [(k[layer], v[layer]) for layer in range(layers)]

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer`'s (k_scale, v_scale) as the attention ops take them: one-element fp32 tensors of an e4m3
        cache, (None, None) otherwise."""
        return self._scales[layer]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block over every layer, keys and values, in the stored `dtype` (1 a value for e4m3)."""
        per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim
        return per_token * block_size * dtype.itemsize

    @classmethod
    def for_memory(cls, model: ModelConfig, budget_bytes: int, block_size: int = 16, *,
                   dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                   **scales) -> "KVCache":
        """As many blocks as fit in `budget_bytes` (`scales`: k_scale, v_scale of an e4m3 cache)."""
        num_blocks = int(budget_bytes // cls.bytes_per_block(model, block_size, dtype))
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                             f"({cls.bytes_per_block(model, block_size, dtype)} bytes each)")
        return cls(model, num_blocks, block_size, dtype=dtype, device=device, **scales)

    def describe(self) -> str:
        tokens = self.num_blocks * self.block_size
        scales = ""
        if self.k_scale is not None:   # (a host read: start-up only)
            span = lambda t: f"{t.min().item():.4g}" if t.min() == t.max() else \
                f"{t.min().item():.4g}–{t.max().item():.4g}"  # noqa: E731
            scales = f" (k_scale {span(self.k_scale)}, v_scale {span(self.v_scale)})"
        return (f"KV cache: {self.num_blocks} blocks × {self.block_size} tokens = {tokens} tokens, "
                f"{str(self.dtype).replace('torch.', '')}{scales} on {self.device}: "
                f"{self.data.numel() * self.data.element_size() / 2**30:.2f} GiB")


def _check_scales(name: str, given: Sequence[float] | torch.Tensor, layers: int) -> torch.Tensor:
    """fp32 `[layers]` of positive finite scales, or ValueError naming `name`."""
    values = given.detach().to("cpu", torch.float32) if isinstance(given, torch.Tensor) else \
        torch.tensor(list(given), dtype=torch.float32)
    if tuple(values.shape) != (layers,):
        raise ValueError(f"{name} must hold one scale per layer, [{layers}], got shape {list(values.shape)}")
    if not all(math.isfinite(x) and x > 0 for x in values.tolist()):
        raise ValueError(f"{name} must be positive and finite, got {values.tolist()}")
    return values
