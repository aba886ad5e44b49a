"""The block manager: which KV blocks are free, and which sequence holds which.

Token `j` of a sequence lives in `block_table[j // block_size]`; a sequence holds exactly the
blocks its cached and about-to-be-cached tokens need. Blocks are not shared (no prefix caching).
"""
from __future__ import annotations

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # LIFO: recently freed blocks are reused first (warm in L2 for the next prefill)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owner: dict[int, str] = {}   # block → request id, to catch double frees

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` lacks to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.missing(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` the blocks it lacks for `num_tokens` tokens."""
        need = self.missing(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"{seq.request_id}: needs {need} KV blocks, {len(self._free)} free")
        for _ in range(need):
            block = self._free.pop()
            self._owner[block] = seq.request_id
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks; its cached tokens are gone."""
        for block in seq.block_table:
            if self._owner.pop(block, None) != seq.request_id:
                raise RuntimeError(f"{seq.request_id}: block {block} is not its own (double free?)")
            self._free.append(block)
        seq.block_table = []
        seq.num_cached = 0
