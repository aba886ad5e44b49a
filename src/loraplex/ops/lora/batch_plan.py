"""The host side of a `LoraBatch`: segments and their adapters checked, rows grouped by slot, cut into work tiles.

A segment uses no adapter, one, or a composition of up to MAX_MEMBERS `(slot, weight)` pairs. A segment's rows
become *entries*, one per (row, member): member `l` of row `r` is entry `l * T + r` (T rows), so the first member's
entries are the rows themselves and a batch with no composition has entries == rows. The shrink walks entries
grouped by slot (each adapter read once per tile whatever the number of segments using it); the expand walks rows
grouped by their whole member list, so that every row of one of its tiles has the same members (`extra_slot` holds
the members after the first) and the tile adds them all before it rounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_MEMBERS = 4   # adapters one segment may combine (adapters/composition.py)

SlotSpec = "int | Sequence[int]"          # per segment: -1 (none), a slot, or up to MAX_MEMBERS slots
WeightSpec = "float | Sequence[float] | None"


def as_int_list(values: Sequence[int], name: str) -> np.ndarray:
    try:
        arr = np.asarray(list(values), dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a sequence of ints, got {values!r}") from exc
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of ints, got shape {arr.shape}")
    return arr


@dataclass
class Members:
    """Each segment's members as `[S, lanes]` arrays: slots (-1 past a segment's members) and weights."""

    slots: np.ndarray      # int64 [S, lanes]
    weights: np.ndarray    # float64 [S, lanes]

    @property
    def lanes(self) -> int:
        return self.slots.shape[1]

    @property
    def composed(self) -> bool:
        """Does any segment combine adapters or weigh its adapter (the kernels' composed path)?"""
        used = self.slots >= 0
        return self.lanes > 1 or bool((self.weights[used] != 1.0).any())


def members(slot_ids: Sequence, weights: Sequence | None, num_segments: int) -> Members:
    """Check and normalise per-segment slots (an int, -1 for none, or a sequence of distinct slots) and weights
    (None: 1.0 each; else a float per slot)."""
    if len(slot_ids) != num_segments:
        raise ValueError(f"seg_lens has {num_segments} entries but slot_ids has {len(slot_ids)}")
    if weights is not None and len(weights) != num_segments:
        raise ValueError(f"weights has {len(weights)} entries but slot_ids has {num_segments}")
    rows_s, rows_w = [], []
    for s, spec in enumerate(slot_ids):
        slots = _segment_slots(spec, s)
        rows_s.append(slots)
        rows_w.append(_segment_weights(None if weights is None else weights[s], len(slots), s))
    lanes = max((len(r) for r in rows_s), default=1) or 1
    out_s = np.full((num_segments, lanes), -1, np.int64)
    out_w = np.ones((num_segments, lanes), np.float64)
    for s, (sl, wt) in enumerate(zip(rows_s, rows_w)):
        out_s[s, :len(sl)], out_w[s, :len(wt)] = sl, wt
    return Members(out_s, out_w)


def _segment_slots(spec, s: int) -> list[int]:
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        if spec < -1:
            raise ValueError(f"slot_ids[{s}] = {spec}; slots are >= 0, or -1 for no adapter")
        return [] if spec == -1 else [int(spec)]
    try:
        slots = [int(v) for v in spec]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"slot_ids[{s}] must be a slot or a sequence of slots, got {spec!r}") from exc
    if any(isinstance(v, bool) or (isinstance(v, float) and v != int(v)) for v in spec):
        raise ValueError(f"slot_ids[{s}] must hold ints, got {spec!r}")
    if len(slots) > MAX_MEMBERS:
        raise ValueError(f"slot_ids[{s}] combines {len(slots)} adapters; at most {MAX_MEMBERS}")
    if any(v < 0 for v in slots):
        raise ValueError(f"slot_ids[{s}] = {spec!r}; a composition's slots are >= 0")
    if len(set(slots)) != len(slots):
        raise ValueError(f"slot_ids[{s}] = {spec!r} names a slot twice")
    return slots


def _segment_weights(spec, n: int, s: int) -> list[float]:
    if spec is None:
        return [1.0] * n
    values = [spec] if isinstance(spec, (int, float, np.number)) and not isinstance(spec, bool) else spec
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"weights[{s}] must be a number or a sequence of numbers, got {spec!r}") from exc
    if len(out) != n:
        raise ValueError(f"weights[{s}] has {len(out)} values for {n} slots")
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"weights[{s}] = {spec!r}; weights must be finite")
    return out


def validate_lengths(seg_lens: np.ndarray) -> None:
    bad = np.nonzero(seg_lens < 0)[0]
    if len(bad):
        raise ValueError(f"seg_lens[{bad[0]}] = {seg_lens[bad[0]]} is negative")
    if seg_lens.sum() * MAX_MEMBERS >= 2**31:
        raise ValueError(f"batch of {seg_lens.sum()} rows does not fit int32 indexing")


@dataclass
class Tiles:
    """Items (rows or entries) grouped by slot, and the work tiles over them."""

    order: np.ndarray       # int64: indices into the flat item list, grouped by slot (stable)
    group_slots: np.ndarray
    group_bounds: np.ndarray
    work_slot: np.ndarray
    work_start: np.ndarray
    work_end: np.ndarray


def tiles(item_slots: np.ndarray, block_m: int) -> Tiles:
    """Group the items with a slot (>= 0) by slot, in item order within a slot, and cut each group into tiles of at
    most `block_m` items."""
    active = np.nonzero(item_slots >= 0)[0]
    order = active[np.argsort(item_slots[active], kind="stable")]
    group_slots, first, counts = np.unique(item_slots[order], return_index=True, return_counts=True)
    group_bounds = np.zeros(len(group_slots) + 1, dtype=np.int64)
    np.cumsum(counts, out=group_bounds[1:])
    n_tiles = -(-counts // block_m)
    tile_idx = np.arange(int(n_tiles.sum()), dtype=np.int64) - np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    work_start = np.repeat(group_bounds[:-1], n_tiles) + tile_idx * block_m
    work_end = np.minimum(work_start + block_m, np.repeat(group_bounds[1:], n_tiles))
    return Tiles(order, group_slots, group_bounds, np.repeat(group_slots, n_tiles), work_start, work_end)


@dataclass
class HostPlan:
    """Host arrays of one batch (int64 numpy; weights float32). `entries`/`extra_slot` only for composed batches."""

    seg_indptr: np.ndarray
    slot_ids: np.ndarray          # [S]: each segment's first member's slot (-1: none)
    row_slot: np.ndarray          # [T]: each row's first member's slot
    rows: Tiles                   # the rows with adapters, by member list (the expand's tiles; slots: the first's)
    entries: Tiles | None         # every (row, member) entry, by slot (the shrink's tiles)
    entry_rows: np.ndarray | None     # [E] the row of each entry in `entries.order`
    entry_ids: np.ndarray | None      # [E] the entry id (member * T + row) of each
    entry_weights: np.ndarray | None  # float32 [E] its member's weight
    extra_slot: np.ndarray | None     # [(lanes - 1) * T]: slot of member l >= 1 of row r at (l - 1) * T + r
    lanes: int


def plan(seg_lens: np.ndarray, mem: Members, block_m: int, composed: bool) -> HostPlan:
    """The host plan; `composed` lays out entries even where `mem` needs none (a capacity batch's fixed kernels)."""
    indptr = np.zeros(len(seg_lens) + 1, dtype=np.int64)
    np.cumsum(seg_lens, out=indptr[1:])
    T, lanes = int(indptr[-1]), mem.lanes
    lane_slots = np.repeat(mem.slots, seg_lens, axis=0)          # [T, lanes]
    row_slot = lane_slots[:, 0] if T else np.zeros(0, np.int64)
    rows = tiles(row_slot, block_m) if lanes == 1 else _tiles_by_members(lane_slots, block_m)
    if not composed:
        return HostPlan(indptr, mem.slots[:, 0], row_slot, rows, None, None, None, None, None, 1)
    lane_weights = np.repeat(mem.weights, seg_lens, axis=0)
    flat_slots = lane_slots.T.reshape(-1)                         # entry id = lane * T + row
    ents = tiles(flat_slots, block_m)
    entry_ids = ents.order
    return HostPlan(indptr, mem.slots[:, 0], row_slot, rows, ents, entry_ids % max(T, 1), entry_ids,
                    lane_weights.T.reshape(-1)[entry_ids].astype(np.float32), lane_slots[:, 1:].T.reshape(-1),
                    lanes)


def _tiles_by_members(lane_slots: np.ndarray, block_m: int) -> Tiles:
    """`tiles` over rows keyed by their whole member list (`[T, lanes]` slots; lists in lexicographic order, so by
    first slot first), with each group's and tile's slot its first member's."""
    lists, key = np.unique(lane_slots, axis=0, return_inverse=True)
    key = np.where(lane_slots[:, 0] >= 0, key.reshape(-1), -1)
    by_list = tiles(key, block_m)
    first = lists[:, 0]
    return Tiles(by_list.order, first[by_list.group_slots], by_list.group_bounds, first[by_list.work_slot],
                 by_list.work_start, by_list.work_end)


def pick_block_m(seg_lens: np.ndarray, mem: Members, small: int, large: int) -> int:
    """Small tiles (sgmv's decode config) unless the rows of slots too large for one small tile outnumber what large
    tiles would waste on the others: each slot of at most `small` rows (a decode row with its own adapter) would
    take a whole `large`-row tile, and the prefill config's few long-running programs. On an H200
    (results/lora_tiles_mixed.json, Llama-2-7B mixed steps in CUDA graphs) large tiles took 162 decodes beside a
    64-token prompt from 26.0 to 42.8 ms and 32 beside 512 from 19.6 to 22.1, while they took 3.4% less time for a
    2048-token prompt alone (53.6 against 55.5 ms) and 2.2% less beside 4 decodes (53.6 against 54.8); this rule
    picks the faster in all eight cases measured. Rows count once per member adapter."""
    slots = mem.slots.reshape(-1)
    lens = np.repeat(seg_lens, mem.lanes)
    used = slots >= 0
    if not used.any():
        return small
    per_slot = np.bincount(slots[used], weights=lens[used])
    per_slot = per_slot[per_slot > 0]
    is_small = per_slot <= small
    return small if int(is_small.sum()) * large >= per_slot[~is_small].sum() else large
