"""`ForwardBatch`: one step's flat batch, as the model reads it (Punica's layout).

All new tokens of all sequences are concatenated; sequence `s` is one contiguous segment of
rows (a prefill chunk, or one decode token), the same segment in the attention metadata and
in the `LoraBatch`. Built on the host from `SequenceChunk`s, checked there, and copied to
the device in one transfer (the `LoraBatch`'s arrays included); every layer reads the same
tensors.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..ops import LoraBatch
from ..ops.lora.batch import SMALL_BLOCK_M, aligned_views, pad_parts
from ..ops.lora.batch_plan import MAX_MEMBERS
from .lora_plan import DECODE_MAX_ROWS


@dataclass
class SequenceChunk:
    """One sequence's share of a step."""

    token_ids: Sequence[int]    # the tokens fed this step: a prompt chunk, or the last sampled token
    num_cached: int             # tokens of this sequence already in the KV cache; the chunk starts there
    block_table: Sequence[int]  # the sequence's KV blocks, enough for num_cached + len(token_ids) tokens
    adapter_slot: int | tuple[int, ...] = -1   # its adapter's pool slot, -1 for the base model; a composition's slots
    needs_logits: bool = True   # False for a prompt chunk that is not the prompt's last
    adapter_weights: tuple[float, ...] | None = None   # the slots' weights (None: 1.0 each; ops/lora/batch.py)


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
    has_adapters: bool            # any segment uses an adapter (always True for a graph batch)
    block_size: int               # the cache geometry and vocabulary it was checked against
    num_blocks: int
    vocab_size: int
    _buffer: torch.Tensor | None = None  # a graph batch's fixed device buffer (see `for_graph`)
    _capacity: int = 0                   # a graph batch's sequences
    _num_adapter_slots: int | None = None  # a graph batch's adapter slot bound
    _max_prompt_tokens: int = 0          # a graph batch's rows for chunks of several tokens (mixed steps)

    @classmethod
    def build(cls, chunks: Sequence[SequenceChunk], *, block_size: int, num_blocks: int, vocab_size: int,
              device: torch.device | str = "cpu", num_adapter_slots: int | None = None) -> "ForwardBatch":
        """Check `chunks` against the cache and vocabulary, lay them out, copy them over at once."""
        host = _layout(chunks, block_size, num_blocks, vocab_size, num_adapter_slots)
        lens, slots, weights = host.pop("lens"), host.pop("slots"), host.pop("weights")
        parts = [host["ids"], host["positions"], host["slot_mapping"], host["query_start"], host["seq_lens"],
                 host["tables"].ravel(), host["logits_rows"]]
        # Batches that could be a decode graph's take its tile height, so that an eager forward of them
        # runs the LoRA kernels with the settings a replay uses and gives the same bits (models/lora_plan.py).
        lora_parts, lora_plan = LoraBatch.host_parts(
            lens.tolist(), slots, weights=weights, block_m=SMALL_BLOCK_M if lens.sum() <= DECODE_MAX_ROWS else None)
        # One host-to-device copy for everything, the LoraBatch's arrays included, each array
        # 16-byte aligned (kernels are compiled per alignment of their pointer arguments).
        buffer = torch.from_numpy(np.concatenate(pad_parts(parts + lora_parts)).astype(np.int32))
        buffer = buffer.to(torch.device(device), non_blocking=True)
        ours = sum(len(p) for p in pad_parts(parts))
        views = aligned_views(buffer[:ours], [len(p) for p in parts])
        views[5] = views[5].view(host["tables"].shape)
        lora = LoraBatch.from_parts(buffer[ours:], lora_plan)
        return cls(*views, lora=lora, num_tokens=int(lens.sum()), max_query_len=int(lens.max()),
                   max_seq_len=int(host["seq_lens"].max()), logits_seqs=host["logits_seqs"],
                   has_adapters=lora_plan["max_slot"] >= 0, block_size=block_size, num_blocks=num_blocks,
                   vocab_size=vocab_size)

    # ---- CUDA graphs: a batch in fixed buffers, rewritten in place ---------------------------

    @classmethod
    def for_graph(cls, max_seqs: int, max_seq_len: int, *, block_size: int, num_blocks: int, vocab_size: int,
                  num_adapter_slots: int, device: torch.device | str, max_prompt_tokens: int = 0,
                  max_members: int = 1) -> "ForwardBatch":
        """A batch whose tensors, sizes and launch grids stay fixed, so that a forward captured on
        it replays correctly after `update_`.

        It holds up to `max_seqs` sequences in `max_seqs + max_prompt_tokens` rows: decodes (one row each)
        and, when `max_prompt_tokens` > 0, prompt chunks of several rows, which may take every row the
        decodes leave (a mixed step). It always has those rows and `max_seqs` logits rows; rows past the real ones
        write no KV (slot -1), use no adapter and belong to no sequence, and sequences past the real
        ones have no rows. `max_seq_len` bounds every context the batch will hold (it fixes the
        attention's split-KV plan). `has_adapters` is True: whether LoRA runs is decided by passing a
        pool, not by the contents. Chunks that combine adapters or weigh one (`adapter_weights`) need
        `max_members` > 1 (a composed LoraBatch: ops/lora/batch.py).
        """
        _check_positive(max_seqs=max_seqs, max_seq_len=max_seq_len, block_size=block_size,
                        num_blocks=num_blocks, vocab_size=vocab_size, num_adapter_slots=num_adapter_slots)
        if not _is_int(max_prompt_tokens) or max_prompt_tokens < 0:
            raise ValueError(f"max_prompt_tokens must be an int >= 0, got {max_prompt_tokens!r}")
        rows = max_seqs + max_prompt_tokens
        max_blocks = _table_width(-(-max_seq_len // block_size))
        sizes = [rows, rows, rows, max_seqs + 1, max_seqs, max_seqs * max_blocks, max_seqs]
        buffer = torch.zeros(sum(sizes), dtype=torch.int32, device=device)
        views = list(torch.split(buffer, sizes))
        views[5] = views[5].view(max_seqs, max_blocks)
        lora = LoraBatch.with_capacity(rows, max_seqs, device, num_slots=num_adapter_slots, max_members=max_members)
        return cls(*views, lora=lora, num_tokens=rows, max_query_len=rows if max_prompt_tokens else 1,
                   max_seq_len=max_seq_len, logits_seqs=tuple(range(max_seqs)), has_adapters=True,
                   block_size=block_size, num_blocks=num_blocks, vocab_size=vocab_size, _buffer=buffer,
                   _capacity=max_seqs, _num_adapter_slots=num_adapter_slots, _max_prompt_tokens=max_prompt_tokens)

    def update_(self, chunks: Sequence[SequenceChunk]) -> "ForwardBatch":
        """Rewrite a `for_graph` batch with up to `max_seqs` chunks (one host-to-device copy for the
        batch, one for its LoraBatch): one-token chunks, and where it has room for prompt tokens chunks of several,
        in at most its rows together. Logits row i belongs to `logits_seqs[i]` (the chunks that
        need logits, in order); later logits rows are padding. Do not call it while a replay reading
        the batch still runs."""
        if self._buffer is None:
            raise ValueError("update_ needs a batch made by ForwardBatch.for_graph")
        S, P, max_blocks = self._capacity, self._max_prompt_tokens, self.block_tables.shape[1]
        if not 0 < len(chunks) <= S:
            raise ValueError(f"a graph batch for {S} sequences got {len(chunks)}")
        host = _layout(chunks, self.block_size, self.num_blocks, self.vocab_size, self._num_adapter_slots)
        lens, slots, weights = host.pop("lens"), host.pop("slots"), host.pop("weights")
        if not P and (lens > 1).any():
            first = int(np.argmax(lens > 1))
            raise ValueError(f"sequence {first}: a graph batch takes decode chunks of one token, "
                             f"got {int(lens[first])}")
        if lens.sum() > S + P:
            raise ValueError(f"a graph batch of {S + P} rows got chunks of {int(lens.sum())} rows together")
        if host["seq_lens"].max() > self.max_seq_len:
            raise ValueError(f"sequence {int(np.argmax(host['seq_lens']))}: context {int(host['seq_lens'].max())} "
                             f"exceeds the graph batch's max_seq_len={self.max_seq_len}")
        n, T = len(chunks), int(lens.sum())
        tables = np.zeros((S, max_blocks), dtype=np.int64)
        tables[:n, :host["tables"].shape[1]] = host["tables"]
        fill = lambda a, size, value: np.concatenate([a, np.full(size - len(a), value, np.int64)])  # noqa: E731
        rows = S + P
        parts = [fill(host["ids"], rows, 0), fill(host["positions"], rows, 0), fill(host["slot_mapping"], rows, -1),
                 fill(host["query_start"], S + 1, T), fill(host["seq_lens"], S, 0), tables.ravel(),
                 fill(host["logits_rows"], S, 0)]
        self._buffer.copy_(torch.from_numpy(np.concatenate(parts).astype(np.int32)), non_blocking=True)
        self.lora.update_(lens.tolist(), slots, weights)
        self.logits_seqs = host["logits_seqs"]
        return self


TABLE_ALIGN = 16


def _table_width(blocks: int) -> int:
    """Block-table columns for contexts of up to `blocks` blocks: a multiple of TABLE_ALIGN. The
    attention kernels take the row stride as an argument, and Triton compiles a variant per class
    of it (1, a multiple of 16, anything else); a stride that moved between those classes from step
    to step made eager steps stop for seconds to compile mid-run. Columns past a sequence's last
    block are never read."""
    return -(-max(1, blocks) // TABLE_ALIGN) * TABLE_ALIGN


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _layout(chunks: Sequence[SequenceChunk], block_size: int, num_blocks: int, vocab_size: int,
            num_adapter_slots: int | None, *, fast: bool = True) -> dict:
    """The host arrays of a batch (int64 numpy), after checking every chunk. `fast`: check plain chunks
    (lists of ints, as the engine makes them) in bulk, chunk by chunk only when that finds a problem or
    another form (same results; ~1 ms less host time per step at 160 sequences)."""
    _check_positive(block_size=block_size, num_blocks=num_blocks, vocab_size=vocab_size)
    if not chunks:
        raise ValueError("a forward batch needs at least one sequence")
    bulk = _check_plain(chunks, block_size, num_blocks, vocab_size, num_adapter_slots) if fast else None
    if bulk is None:
        checked = [_check_chunk(i, c, block_size, num_blocks, vocab_size, num_adapter_slots)
                   for i, c in enumerate(chunks)]  # (token ids, the blocks the context covers) per chunk
        lens = np.array([len(ids) for ids, _ in checked], dtype=np.int64)
        ids = np.concatenate([ids for ids, _ in checked])
    else:
        lens, ids, used_blocks, covered = bulk
    cached = np.array([c.num_cached for c in chunks], dtype=np.int64)
    seq_lens = cached + lens
    query_start = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start[1:])
    T = int(query_start[-1])
    positions = np.arange(T, dtype=np.int64) - np.repeat(query_start[:-1] - cached, lens)
    max_blocks = _table_width(max(-(-int(n) // block_size) for n in seq_lens))
    tables = np.zeros((len(chunks), max_blocks), dtype=np.int64)
    if bulk is None:
        for s, (_, used) in enumerate(checked):  # only the blocks the context covers are sent
            tables[s, :len(used)] = used
    else:
        tables[np.arange(max_blocks) < covered[:, None]] = used_blocks
    seq_of_row = np.repeat(np.arange(len(chunks)), lens)
    slot_mapping = tables[seq_of_row, positions // block_size] * block_size + positions % block_size
    unique, counts = np.unique(slot_mapping, return_counts=True)
    if (counts > 1).any():  # two new tokens in one KV slot: the writes would race
        rows = np.nonzero(slot_mapping == unique[counts > 1][0])[0]
        raise ValueError(f"sequences {seq_of_row[rows[0]]} and {seq_of_row[rows[1]]} write the same KV slot "
                         f"{unique[counts > 1][0]} (block {unique[counts > 1][0] // block_size})")
    logits_seqs = tuple(s for s, c in enumerate(chunks) if c.needs_logits)
    logits_rows = query_start[1:][list(logits_seqs)] - 1 if logits_seqs else np.zeros(0, np.int64)
    composed = any(c.adapter_weights is not None or not _is_int(c.adapter_slot) for c in chunks)
    slots = [c.adapter_slot if _is_int(c.adapter_slot) else list(c.adapter_slot) for c in chunks]
    weights = [c.adapter_weights for c in chunks] if composed else None
    return dict(lens=lens, slots=slots, weights=weights, ids=ids, positions=positions,
                slot_mapping=slot_mapping, query_start=query_start, seq_lens=seq_lens, tables=tables,
                logits_rows=logits_rows, logits_seqs=logits_seqs)


def _check_plain(chunks: Sequence[SequenceChunk], block_size: int, num_blocks: int, vocab_size: int,
                 num_adapter_slots: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """`_check_chunk`'s checks in bulk, for chunks whose fields are plain (Python ints and bools, lists or
    tuples of Python ints): (tokens per chunk, every token id, the blocks each context covers in order,
    their count per chunk), all int64; None if any chunk is not plain or not valid (`_check_chunk` then
    says which and why, or accepts another form, e.g. numpy arrays)."""
    plain = {int}
    for c in chunks:
        if type(c) is not SequenceChunk or type(c.num_cached) is not int or not 0 <= c.num_cached < 2**40 \
                or type(c.needs_logits) is not bool or type(c.adapter_slot) is not int or c.adapter_slot < -1 \
                or c.adapter_weights is not None \
                or (num_adapter_slots is not None and c.adapter_slot >= num_adapter_slots) \
                or type(c.token_ids) not in (list, tuple) or not c.token_ids \
                or type(c.block_table) not in (list, tuple):
            return None
    # every element a Python int (bools, floats, numpy scalars, nested lists: the per-chunk check decides),
    # the whole of each table as `_check_chunk` sees it, not only the blocks the context covers
    flat_ids = list(itertools.chain.from_iterable(c.token_ids for c in chunks))
    if not set(map(type, flat_ids)) <= plain or \
            not set(map(type, itertools.chain.from_iterable(c.block_table for c in chunks))) <= plain:
        return None
    counts = [-(-(c.num_cached + len(c.token_ids)) // block_size) for c in chunks]
    if any(len(c.block_table) < k for c, k in zip(chunks, counts)):
        return None
    try:
        ids = np.array(flat_ids, dtype=np.int64)
        used = np.array(list(itertools.chain.from_iterable(c.block_table[:k] for c, k in zip(chunks, counts))),
                        dtype=np.int64)
    except OverflowError:   # an id or block past int64: out of range anyway
        return None
    if ids.min() < 0 or ids.max() >= vocab_size or used.min() < 0 or used.max() >= num_blocks:
        return None
    lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, len(chunks))
    return lens, ids, used, np.array(counts, dtype=np.int64)


def _check_chunk(i: int, c: SequenceChunk, block_size: int, num_blocks: int, vocab_size: int,
                 num_adapter_slots: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The chunk's token ids and the blocks its context covers (int64), after checking it;
    errors name the sequence and the field."""
    if not isinstance(c, SequenceChunk):
        raise ValueError(f"sequence {i}: expected a SequenceChunk, got {type(c).__name__}")
    ids = np.asarray(c.token_ids)
    if ids.ndim != 1 or len(ids) == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"sequence {i}: token_ids must be a non-empty list of ints, got {c.token_ids!r:.80}")
    bad = np.nonzero((ids < 0) | (ids >= vocab_size))[0]
    if len(bad):
        raise ValueError(f"sequence {i}: token_ids[{bad[0]}] = {ids[bad[0]]} is outside the vocabulary "
                         f"[0, {vocab_size})")
    if not _is_int(c.num_cached) or c.num_cached < 0:
        raise ValueError(f"sequence {i}: num_cached must be an int >= 0, got {c.num_cached!r}")
    if not isinstance(c.needs_logits, (bool, np.bool_)):
        raise ValueError(f"sequence {i}: needs_logits must be a bool, got {c.needs_logits!r}")
    try:
        full = np.asarray(c.block_table)
    except (TypeError, ValueError):
        full = None
    if full is None or full.ndim != 1 or (len(full) and not np.issubdtype(full.dtype, np.integer)):
        raise ValueError(f"sequence {i}: block_table must be a flat list of block ids, got {c.block_table!r:.80}")
    need = -(-(int(c.num_cached) + len(ids)) // block_size)
    table = full[:need].astype(np.int64)
    if len(table) < need:
        raise ValueError(f"sequence {i}: {c.num_cached} cached + {len(ids)} new tokens need {need} blocks of "
                         f"{block_size}; its block_table has {len(c.block_table)}")
    bad = np.nonzero((table < 0) | (table >= num_blocks))[0]
    if len(bad):
        raise ValueError(f"sequence {i}: block_table[{bad[0]}] = {table[bad[0]]} is outside the cache's "
                         f"{num_blocks} blocks")
    _check_adapters(i, c, num_adapter_slots)
    return ids.astype(np.int64), table


def _check_adapters(i: int, c: SequenceChunk, num_adapter_slots: int | None) -> None:
    slot, limit = c.adapter_slot, f" below {num_adapter_slots}" if num_adapter_slots is not None else ""
    in_range = lambda v: _is_int(v) and 0 <= v and (num_adapter_slots is None or v < num_adapter_slots)  # noqa: E731
    if _is_int(slot) or not isinstance(slot, (tuple, list)):
        if not _is_int(slot) or (slot != -1 and not in_range(slot)):
            raise ValueError(f"sequence {i}: adapter_slot must be -1 or a slot{limit}, got {slot!r}")
        slots = [] if slot == -1 else [slot]
    else:
        if not 1 <= len(slot) <= MAX_MEMBERS or \
                not all(in_range(v) for v in slot) or len(set(slot)) != len(slot):
            raise ValueError(f"sequence {i}: adapter_slot must be -1, a slot{limit}, or 1 to {MAX_MEMBERS} "
                             f"distinct slots{limit}, got {slot!r}")
        slots = list(slot)
    w = c.adapter_weights
    if w is not None and (not isinstance(w, (tuple, list)) or len(w) != len(slots) or
                          not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                  for v in w)):
        raise ValueError(f"sequence {i}: adapter_weights must be None or {len(slots)} finite numbers (one per "
                         f"slot of adapter_slot={slot!r}), got {w!r}")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
