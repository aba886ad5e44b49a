"""The paged KV cache: fixed-size blocks of keys and values, one preallocated tensor for all layers.

Token `j` of a sequence lives in block `block_table[j // block_size]` at offset
`j % block_size`, in every layer: the block table is per sequence, not per layer. Blocks are
handed out by the engine's block manager; the cache only holds the memory.

Each layer's `k[layer]` and `v[layer]` are `[num_blocks, block_size, Hkv, D]` (the attention ops'
order), contiguous by default. `head_major=True` keeps them `[num_blocks, Hkv, block_size, D]` in
memory (viewed in the same order; the ops follow the strides), so that one kv head's keys of a
block are `block_size · D` contiguous elements rather than `D` strided by `Hkv · D`. See HEAD_MAJOR.
"""
from __future__ import annotations

import torch

from .config import ModelConfig

# Measured on an H200 (docs/design-notes.md, the decode kernel in CUDA graphs,
# bf16, pages shuffled): token-major reads K/V at 0.85–1.01× the copy bandwidth for Llama-2-7B heads at 32 and
# 160 sequences, head-major at 0.84–0.99× (160 sequences at context ~512: 318 vs 330 µs); Llama-3-8B (8 kv
# heads) 0.91 vs 0.92×; prefill alike. So the cache stays token-major.
HEAD_MAJOR = False


class KVCache:
    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int = 16, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 head_major: bool | None = None) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 8 or block_size > 256 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two from 8 to 256, got {block_size!r}")
        if num_blocks * block_size >= 2**31:
            raise ValueError(f"{num_blocks} blocks of {block_size} tokens exceed int32 slot indexing")
        self.model, self.num_blocks, self.block_size, self.dtype = model, num_blocks, block_size, dtype
        self.head_major = HEAD_MAJOR if head_major is None else head_major
        inner = (model.num_key_value_heads, block_size) if self.head_major else (block_size, model.num_key_value_heads)
        self.data = torch.empty((model.num_hidden_layers, 2, num_blocks, *inner, model.head_dim), dtype=dtype,
                                device=device)
        views = [self.data[layer].transpose(2, 3) if self.head_major else self.data[layer]
                 for layer in range(model.num_hidden_layers)]
        self.k = [view[0] for view in views]
        self.v = [view[1] for view in views]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim
        return per_token * block_size * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def for_memory(cls, model: ModelConfig, budget_bytes: int, block_size: int = 16, *,
                   dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> "KVCache":
        """As many blocks as fit in `budget_bytes`."""
        num_blocks = int(budget_bytes // cls.bytes_per_block(model, block_size, dtype))
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                             f"({cls.bytes_per_block(model, block_size, dtype)} bytes each)")
        return cls(model, num_blocks, block_size, dtype=dtype, device=device)

    def describe(self) -> str:
        tokens = self.num_blocks * self.block_size
        return (f"KV cache: {self.num_blocks} blocks × {self.block_size} tokens = {tokens} tokens, "
                f"{str(self.dtype).replace('torch.', '')} on {self.device}: "
                f"{self.data.numel() * self.data.element_size() / 2**30:.2f} GiB")
