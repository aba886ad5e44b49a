"""`ForwardBatch`: one step's flat batch, as the model reads it (Punica's layout).

All new tokens of all sequences are concatenated; sequence `s` is one contiguous segment of
rows (a prefill chunk, or one decode token), the same segment in the attention metadata and
in the `LoraBatch`. Built on the host from `SequenceChunk`s, checked there, and copied to
the device in one transfer; every layer reads the same tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..ops import LoraBatch


@dataclass
class SequenceChunk:
    """One sequence's share of a step."""

    token_ids: Sequence[int]    # the tokens fed this step: a prompt chunk, or the last sampled token
    num_cached: int             # tokens of this sequence already in the KV cache; the chunk starts there
    block_table: Sequence[int]  # the sequence's KV blocks, enough for num_cached + len(token_ids) tokens
    adapter_slot: int = -1      # its adapter's pool slot, -1 for the base model
    needs_logits: bool = True   # False for a prompt chunk that is not the prompt's last


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor     # int32 [T]
    positions: torch.Tensor     # int32 [T]
    slot_mapping: torch.Tensor  # int32 [T]: KV slot (block * block_size + offset) of each new token
    query_start: torch.Tensor   # int32 [S+1]: rows of sequence s
    seq_lens: torch.Tensor      # int32 [S]: context length of sequence s after this step
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    logits_rows: torch.Tensor   # int32 [N]: the last row of each sequence that needs logits
    lora: LoraBatch
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    logits_seqs: tuple[int, ...]  # which sequences the logits rows belong to, in order
    has_adapters: bool            # any segment uses an adapter

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(cls, chunks: Sequence[SequenceChunk], *, block_size: int, num_blocks: int, vocab_size: int,
              device: torch.device | str = "cpu", num_adapter_slots: int | None = None) -> "ForwardBatch":
        """Check `chunks` against the cache and vocabulary, lay them out, copy them over at once."""
        if not chunks:
            raise ValueError("a forward batch needs at least one sequence")
        lens = np.array([_check_chunk(i, c, block_size, num_blocks, vocab_size, num_adapter_slots)
                         for i, c in enumerate(chunks)], dtype=np.int64)
        cached = np.array([c.num_cached for c in chunks], dtype=np.int64)
        seq_lens = cached + lens
        query_start = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(lens, out=query_start[1:])
        T = int(query_start[-1])
        ids = np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in chunks])
        positions = np.arange(T, dtype=np.int64) - np.repeat(query_start[:-1] - cached, lens)
        max_blocks = max(1, max(-(-int(n) // block_size) for n in seq_lens))
        tables = np.zeros((len(chunks), max_blocks), dtype=np.int64)
        for s, c in enumerate(chunks):
            used = -(-int(seq_lens[s]) // block_size)  # only the blocks the context covers are sent
            tables[s, :used] = np.asarray(c.block_table[:used], dtype=np.int64)
        seq_of_row = np.repeat(np.arange(len(chunks)), lens)
        slot_mapping = tables[seq_of_row, positions // block_size] * block_size + positions % block_size
        logits_seqs = tuple(s for s, c in enumerate(chunks) if c.needs_logits)
        logits_rows = query_start[1:][list(logits_seqs)] - 1 if logits_seqs else np.zeros(0, np.int64)
        parts = [ids, positions, slot_mapping, query_start, seq_lens, tables.ravel(), logits_rows]
        buffer = torch.from_numpy(np.concatenate(parts).astype(np.int32))
        buffer = buffer.to(torch.device(device), non_blocking=True)
        views = list(torch.split(buffer, [len(p) for p in parts]))
        views[5] = views[5].view(len(chunks), max_blocks)
        slots = [c.adapter_slot for c in chunks]
        lora = LoraBatch.from_lengths(lens.tolist(), slots, device)
        return cls(*views, lora=lora, num_tokens=T, max_query_len=int(lens.max()),
                   max_seq_len=int(seq_lens.max()), logits_seqs=logits_seqs, has_adapters=max(slots) >= 0)


def _check_chunk(i: int, c: SequenceChunk, block_size: int, num_blocks: int, vocab_size: int,
                 num_adapter_slots: int | None) -> int:
    """The chunk's token count, after checking it; errors name the sequence and the field."""
    if not isinstance(c, SequenceChunk):
        raise ValueError(f"sequence {i}: expected a SequenceChunk, got {type(c).__name__}")
    ids = np.asarray(c.token_ids)
    if ids.ndim != 1 or len(ids) == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"sequence {i}: token_ids must be a non-empty list of ints, got {c.token_ids!r:.80}")
    bad = np.nonzero((ids < 0) | (ids >= vocab_size))[0]
    if len(bad):
        raise ValueError(f"sequence {i}: token_ids[{bad[0]}] = {ids[bad[0]]} is outside the vocabulary "
                         f"[0, {vocab_size})")
    if not isinstance(c.num_cached, (int, np.integer)) or c.num_cached < 0:
        raise ValueError(f"sequence {i}: num_cached must be an int >= 0, got {c.num_cached!r}")
    need = -(-(int(c.num_cached) + len(ids)) // block_size)
    table = np.asarray(c.block_table[:need], dtype=np.int64) if len(c.block_table) else np.zeros(0, np.int64)
    if len(table) < need:
        raise ValueError(f"sequence {i}: {c.num_cached} cached + {len(ids)} new tokens need {need} blocks of "
                         f"{block_size}; its block_table has {len(c.block_table)}")
    bad = np.nonzero((table < 0) | (table >= num_blocks))[0]
    if len(bad):
        raise ValueError(f"sequence {i}: block_table[{bad[0]}] = {table[bad[0]]} is outside the cache's "
                         f"{num_blocks} blocks")
    slot = c.adapter_slot
    if not isinstance(slot, (int, np.integer)) or slot < -1 or \
            (num_adapter_slots is not None and slot >= num_adapter_slots):
        limit = f" below {num_adapter_slots}" if num_adapter_slots is not None else ""
        raise ValueError(f"sequence {i}: adapter_slot must be -1 or a slot{limit}, got {slot!r}")
    return len(ids)
