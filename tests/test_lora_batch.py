"""LoraBatch: segment bounds, grouping by slot, work tiles, capacity updates, bad input."""
from __future__ import annotations

import numpy as np
import pytest

from loraplex.ops import LoraBatch
from loraplex.ops.lora.batch import LARGE_BLOCK_M, SMALL_BLOCK_M


def _tiles(batch):
    return list(zip(batch.work_slot.tolist(), batch.work_start.tolist(), batch.work_end.tolist()))


@pytest.mark.parametrize("seed", range(6))
def test_tiles_cover_each_slots_rows_once(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    lens = [int(v) for v in rng.integers(0, 150 if seed % 2 else 2, size=n)]
    slots = [int(v) for v in rng.integers(-1, 6, size=n)]
    batch = LoraBatch.from_lengths(lens, slots)
    indptr = np.concatenate([[0], np.cumsum(lens)])
    assert batch.seg_indptr.tolist() == indptr.tolist() and batch.slot_ids.tolist() == slots
    assert batch.num_rows == sum(lens) and batch.num_segments == n
    rows = batch.sorted_rows.tolist()
    want = {}
    for s, slot in enumerate(slots):
        if slot >= 0:
            want.setdefault(slot, []).extend(range(indptr[s], indptr[s + 1]))
    covered = {}
    for slot, start, end in _tiles(batch):
        assert 0 < end - start <= batch.block_m
        covered.setdefault(slot, []).extend(rows[start:end])
    assert covered == {k: v for k, v in want.items() if v}
    assert batch.group_slots == tuple(sorted(k for k, v in want.items() if v))


def test_block_m_small_for_decodes_large_for_prefill():
    assert LoraBatch.from_lengths([1] * 300, list(range(300))).block_m == SMALL_BLOCK_M  # distinct decode
    assert LoraBatch.from_lengths([1] * 64, [3] * 64).block_m == LARGE_BLOCK_M  # identical decode
    assert LoraBatch.from_lengths([500, 2], [0, 1]).block_m == LARGE_BLOCK_M  # prefill
    assert LoraBatch.from_lengths([500, 2], [-1, -1]).block_m == SMALL_BLOCK_M
    assert LoraBatch.from_lengths([100], [0], block_m=32).num_work == 4


@pytest.mark.parametrize("decodes, prompts, block_m", [
    # the mixed steps timed on an H200 (results/lora_tiles_mixed.json), each with the faster tile height
    (162, [64], SMALL_BLOCK_M), (162, [512], SMALL_BLOCK_M), (32, [512], SMALL_BLOCK_M),
    (32, [2048], SMALL_BLOCK_M), (64, [128] * 4, SMALL_BLOCK_M),
    (4, [2048], LARGE_BLOCK_M), (0, [2048], LARGE_BLOCK_M), (0, [256] * 8, LARGE_BLOCK_M)])
def test_mixed_steps_take_large_tiles_only_where_prompt_rows_outweigh_the_decodes(decodes, prompts, block_m):
    lens, slots = [1] * decodes + prompts, list(range(decodes + len(prompts)))
    rng = np.random.default_rng(decodes + len(prompts))
    order = rng.permutation(len(lens))   # the rule counts rows per slot, in any order
    batch = LoraBatch.from_lengths([lens[i] for i in order], [slots[i] for i in order])
    assert batch.block_m == block_m


def test_block_m_counts_rows_per_adapter_slot():
    # decode rows of the base model count for nothing; shared ones join their slot's rows
    assert LoraBatch.from_lengths([1] * 100 + [600], [-1] * 100 + [0]).block_m == LARGE_BLOCK_M
    assert LoraBatch.from_lengths([1] * 40 + [600], [1] * 40 + [0]).block_m == LARGE_BLOCK_M
    assert LoraBatch.from_lengths([1] * 10 + [600], list(range(1, 11)) + [0]).block_m == SMALL_BLOCK_M


def test_one_adapter_many_segments_is_one_group():
    batch = LoraBatch.from_lengths([1] * 10, [7] * 10)
    assert batch.group_slots == (7,) and batch.num_work == 1
    assert batch.sorted_rows.tolist() == list(range(10))


def test_empty_and_adapterless_batches_have_no_work():
    assert LoraBatch.from_lengths([], []).num_work == 0
    batch = LoraBatch.from_lengths([4, 0, 3], [-1, 2, -1])
    assert batch.num_work == 0 and batch.num_rows == 7 and batch.max_slot == 2


@pytest.mark.parametrize("lens, slots, match", [
    ([1, 2], [0], "seg_lens has 2 entries but slot_ids has 1"),
    ([1, -2], [0, 0], r"seg_lens\[1\] = -2 is negative"),
    ([1, 2], [0, -3], r"slot_ids\[1\] = -3"),
    (["a"], [0], "seg_lens must be a sequence of ints"),
    ([[1, 2]], [0], "flat sequence"),
])
def test_bad_segments_are_named(lens, slots, match):
    with pytest.raises(ValueError, match=match):
        LoraBatch.from_lengths(lens, slots)


def test_capacity_batch_keeps_buffers_and_grid():
    batch = LoraBatch.with_capacity(32, 8, "cpu", num_slots=6)
    buffer, work = batch._buffer, batch.num_work
    batch.update_([3, 1, 4], [5, -1, 5])
    assert batch._buffer is buffer and batch.num_work == work and batch.num_rows == 32
    assert batch.seg_indptr.tolist()[:5] == [0, 3, 4, 8, 32]
    tiles = [t for t in _tiles(batch) if t[0] >= 0]
    assert tiles == [(5, 0, 7)] and batch.sorted_rows.tolist()[:7] == [0, 1, 2, 4, 5, 6, 7]
    assert sum(1 for t in _tiles(batch) if t[0] < 0) == work - 1  # padding tiles do nothing
    with pytest.raises(ValueError, match="exceed the capacity of 8 segments and 32 rows"):
        batch.update_([33], [0])
    with pytest.raises(ValueError, match="exceed the capacity"):
        batch.update_([1] * 9, [0] * 9)
    with pytest.raises(ValueError, match=r"slot_ids\[1\] = 6 but this batch was made for 6 slots"):
        batch.update_([1, 1], [5, 6])
    with pytest.raises(ValueError, match="with_capacity"):
        LoraBatch.from_lengths([1], [0]).update_([1], [0])


@pytest.mark.parametrize("block_m", [0, 8, 24, 256])
def test_tile_height_must_be_one_the_kernels_take(block_m):
    with pytest.raises(ValueError, match=r"block_m must be one of \(16, 32, 64, 128\)"):
        LoraBatch.from_lengths([4], [0], block_m=block_m)
    with pytest.raises(ValueError, match="block_m must be one of"):
        LoraBatch.with_capacity(8, 2, "cpu", num_slots=1, block_m=block_m)
