"""`LoraBatch`: the per-forward segment metadata that every LoRA op reads.

A flat batch is `T` rows cut into `S` contiguous segments (one per request); segment `s` is rows
`seg_indptr[s]:seg_indptr[s+1]` and uses no adapter (-1), one adapter slot, or a composition: up to 4 slots with
weights (`slot_ids=[[3, 7], 2, -1], weights=[[0.7, 0.3], None, None]`). The ops add, for every row,

    for s in range(S):
        for slot, w in zip(slot_ids[s], weights[s]):          # one member: weight 1.0 unless given
            r = ranks[slot]; rows = seg_indptr[s]:seg_indptr[s+1]
            y[rows] += w * scalings[slot] * (x[rows] @ lora_a[slot, :r].T) @ lora_b[slot, :, :r].T

The kernels do not walk segments. They walk *work tiles*: the rows of all segments that share a slot are gathered
into one group (`sorted_rows`), and each group is cut into tiles of at most `block_m` rows. One tile reads its
adapter's weights once, so an adapter used by many segments is read once per tile, not once per segment. A
composed batch (`composed`: some segment has several members or a weight other than 1) also has the shrink's
tiles over *entries*, one per (row, member) (batch_plan.py): the shrink writes each entry's weighted product, and
the expand's tiles group rows by their whole member list, so that a tile adds every member of its rows (the first
from `work_slot`, the others from `extra_slot`) before it rounds.

Everything is computed on the host from Python lists and copied to the device in one transfer; the ops never read
it back, so they can be captured in a CUDA graph. For graph replay, `with_capacity` + `update_` keep the device
buffers and the launch grids fixed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .batch_plan import MAX_MEMBERS, HostPlan, Members, as_int_list, members, pick_block_m, plan, validate_lengths

# Tile heights the kernels are compiled for: decode-like groups fit in the small one.
SMALL_BLOCK_M = 16
LARGE_BLOCK_M = 64
BLOCK_M_CHOICES = (16, 32, 64, 128)  # tl.dot needs at least 16 rows; powers of two for tl.arange

# The arrays of a batch, in buffer order: the first seven always, the rest in composed batches only.
_PLAIN = ("seg_indptr", "slot_ids", "sorted_rows", "work_slot", "work_start", "work_end", "row_slot")
_COMPOSED = ("shrink_rows", "shrink_entries", "shrink_weights", "shrink_work_slot", "shrink_work_start",
             "shrink_work_end", "extra_slot")


def _check_block_m(block_m: int) -> None:
    if block_m not in BLOCK_M_CHOICES:
        raise ValueError(f"block_m must be one of {BLOCK_M_CHOICES}, got {block_m!r}")


def _arrays(p: HostPlan) -> list[np.ndarray]:
    out = [p.seg_indptr, p.slot_ids, p.rows.order, p.rows.work_slot, p.rows.work_start, p.rows.work_end, p.row_slot]
    if p.entries is not None:
        out += [p.entry_rows, p.entry_ids, p.entry_weights.view(np.int32).astype(np.int64), p.entries.work_slot,
                p.entries.work_start, p.entries.work_end, p.extra_slot]
    return out


def _host_values(p: HostPlan) -> dict:
    ents = p.entries if p.entries is not None else p.rows
    return dict(num_rows=int(p.seg_indptr[-1]), num_segments=len(p.slot_ids), num_work=len(p.rows.work_slot),
                max_slot=int(max(p.slot_ids.max(initial=-1), -1 if p.extra_slot is None else
                                 p.extra_slot.max(initial=-1))),
                group_slots=tuple(p.rows.group_slots.tolist()), group_bounds=tuple(p.rows.group_bounds.tolist()),
                composed=p.entries is not None, lanes=p.lanes, num_shrink_work=len(ents.work_slot),
                shrink_group_slots=tuple(ents.group_slots.tolist()),
                shrink_group_bounds=tuple(ents.group_bounds.tolist()))


@dataclass
class LoraBatch:
    """Segment metadata for one forward pass, on the device.

    Device tensors (int32): `seg_indptr [S+1]`, `slot_ids [S]` (each segment's first member), `sorted_rows` (the
    rows of every segment with an adapter, grouped by slot; in a composed batch by member list), the work tiles
    `work_slot`, `work_start`, `work_end` (each tile is `sorted_rows[work_start:work_end]`, rows of one slot, or of
    one member list whose first slot `work_slot` is), and `row_slot [T]`, each
    row's first member's slot (-1: none), for ops that add a row's LoRA product themselves (ops/lora/product.py).
    The shrink's tiles: `shrink_rows` (the row of each entry, grouped by slot), `shrink_entries` (its entry id,
    `member * T + row`: where the shrink writes its product), `shrink_weights` (float32, its member's weight),
    `shrink_work_*`; and `extra_slot [(lanes-1) * T]`, the slot of member l ≥ 1 of row r at `(l-1) * T + r` (-1:
    none). In batches that are not `composed` the shrink's arrays are the expand's, `shrink_weights` and
    `extra_slot` None, and entries are rows (`lanes` 1).
    Host values: sizes, the tile height `block_m`, the number of tiles each grid covers (`num_work`,
    `num_shrink_work`), and the groups (slot and bounds) for the reference path.
    """

    seg_indptr: torch.Tensor
    slot_ids: torch.Tensor
    sorted_rows: torch.Tensor
    work_slot: torch.Tensor
    work_start: torch.Tensor
    work_end: torch.Tensor
    row_slot: torch.Tensor
    num_rows: int
    num_segments: int
    block_m: int
    num_work: int
    max_slot: int
    group_slots: tuple[int, ...]
    group_bounds: tuple[int, ...]
    _buffer: torch.Tensor = field(repr=False)
    composed: bool = False
    lanes: int = 1
    num_shrink_work: int = 0
    shrink_group_slots: tuple[int, ...] = ()
    shrink_group_bounds: tuple[int, ...] = (0,)
    shrink_rows: torch.Tensor | None = field(default=None, repr=False)
    shrink_entries: torch.Tensor | None = field(default=None, repr=False)
    shrink_weights: torch.Tensor | None = field(default=None, repr=False)
    shrink_work_slot: torch.Tensor | None = field(default=None, repr=False)
    shrink_work_start: torch.Tensor | None = field(default=None, repr=False)
    shrink_work_end: torch.Tensor | None = field(default=None, repr=False)
    extra_slot: torch.Tensor | None = field(default=None, repr=False)
    _capacity: tuple[int, int, int, int] | None = field(default=None, repr=False)  # rows, segments, slots, members
    # the SGMV launches over this batch and the shapes of their partials, by the shapes they serve
    # (ops/lora/sgmv.py): built at a forward's first layer, reused by the others
    launches: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.composed:   # the shrink walks the expand's tiles; entries are rows
            self.shrink_rows = self.shrink_entries = self.sorted_rows
            self.shrink_work_slot, self.shrink_work_start, self.shrink_work_end = \
                self.work_slot, self.work_start, self.work_end

    @property
    def device(self) -> torch.device:
        return self._buffer.device

    @property
    def num_entries(self) -> int:
        """Rows of the shrink's output: one per (row, member lane)."""
        return self.lanes * self.num_rows

    @property
    def split_work(self) -> int:
        """The shrink tiles its K split is sized for (sgmv.new_partials): its own, but a composed capacity batch's
        row tiles: its entries keep room for `max_members` adapters a row, mostly empty, and sized by that room
        its shrink would take fewer splits, so longer chains of loads, than a plain batch of the same rows."""
        return self.num_work if self.composed and self._capacity is not None else self.num_shrink_work

    @property
    def all_rows_have_adapters(self) -> bool:
        """Does every row have an adapter, whatever `update_` writes later? (never for a capacity batch)"""
        return self._capacity is None and self.group_bounds[-1] == self.num_rows

    @classmethod
    def from_lengths(cls, seg_lens: Sequence[int], slot_ids: Sequence, device: torch.device | str | None = None,
                     *, weights: Sequence | None = None, block_m: int | None = None) -> "LoraBatch":
        """Build the metadata for segments of `seg_lens` rows using `slot_ids` (per segment: -1 for no adapter, a
        slot, or a sequence of up to 4 distinct slots) with `weights` (None: 1.0; else per segment None, a float
        or a sequence matching its slots)."""
        parts, values = cls.host_parts(seg_lens, slot_ids, weights=weights, block_m=block_m)
        buffer = torch.from_numpy(np.concatenate(pad_parts(parts)).astype(np.int32))
        buffer = buffer.to(torch.device(device) if device is not None else "cpu", non_blocking=True)
        return cls.from_parts(buffer, values)

    @classmethod
    def host_parts(cls, seg_lens: Sequence[int], slot_ids: Sequence, *, weights: Sequence | None = None,
                   block_m: int | None = None) -> tuple[list[np.ndarray], dict]:
        """The host arrays of a batch (checked), for a caller that copies them over inside its own
        buffer; `from_parts` then makes the batch from the device copy."""
        lens = as_int_list(seg_lens, "seg_lens")
        validate_lengths(lens)
        mem = members(slot_ids, weights, len(lens))
        if block_m is None:
            block_m = cls.pick_block_m(lens, mem)
        _check_block_m(block_m)
        p = plan(lens, mem, block_m, mem.composed)
        parts = _arrays(p)
        return parts, dict(_host_values(p), block_m=block_m, sizes=[len(a) for a in parts])

    @classmethod
    def from_parts(cls, buffer: torch.Tensor, values: dict) -> "LoraBatch":
        """The batch over `buffer`: int32, the `host_parts` arrays concatenated after `pad_parts`,
        on its device, starting 16-byte aligned."""
        values = dict(values)
        views = aligned_views(buffer, values.pop("sizes"))
        named = dict(zip(_PLAIN + _COMPOSED, views))
        if "shrink_weights" in named:
            named["shrink_weights"] = named["shrink_weights"].view(torch.float32)
        return cls(**named, **values, _buffer=buffer)

    @staticmethod
    def pick_block_m(seg_lens: np.ndarray, slot_ids: "np.ndarray | Members") -> int:
        """The tile height `from_lengths` picks (batch_plan.pick_block_m) for segments on these slots: one a
        segment, or `Members` (compositions)."""
        mem = slot_ids if isinstance(slot_ids, Members) else members([int(s) for s in slot_ids], None, len(seg_lens))
        return pick_block_m(np.asarray(seg_lens, np.int64), mem, SMALL_BLOCK_M, LARGE_BLOCK_M)

    # ---- CUDA-graph use: fixed buffers and grid, contents updated in place ----------------

    @classmethod
    def with_capacity(cls, max_rows: int, max_segments: int, device: torch.device | str, *, num_slots: int,
                      block_m: int = SMALL_BLOCK_M, max_members: int = 1) -> "LoraBatch":
        """A batch whose device buffers and launch grids stay fixed across `update_` calls.

        Every batch written into it covers exactly `max_rows` rows (the rows past the real segments form one extra
        segment with no adapter), so a graph captured on tensors of `max_rows` rows can be replayed with any mix of
        up to `max_segments` segments on slots below `num_slots` (checked by `update_`: a replayed graph checks
        nothing). With `max_members` > 1 it is `composed` and takes compositions of up to that many members (and
        weights); with 1 only plain segments. `update_` writes the buffers on the current stream; do not call it
        while a replay reading them runs on another stream.
        """
        if max_rows < 1 or max_segments < 1 or num_slots < 1:
            raise ValueError(f"capacity needs max_rows, max_segments and num_slots >= 1, got {max_rows}, "
                             f"{max_segments}, {num_slots}")
        if not 1 <= max_members <= MAX_MEMBERS:
            raise ValueError(f"max_members must be 1 to {MAX_MEMBERS}, got {max_members!r}")
        _check_block_m(block_m)
        sizes = _capacity_sizes(max_rows, max_segments, block_m, max_members)
        buffer = torch.zeros(sum(sizes), dtype=torch.int32, device=device)
        composed = max_members > 1
        named = dict(zip(_PLAIN + _COMPOSED, _split(buffer, sizes)))
        if composed:
            named["shrink_weights"] = named["shrink_weights"].view(torch.float32)
        batch = cls(**named, num_rows=max_rows, num_segments=max_segments + 1, block_m=block_m,
                    num_work=sizes[3], max_slot=-1, group_slots=(), group_bounds=(0,), _buffer=buffer,
                    composed=composed, lanes=max_members, num_shrink_work=sizes[10] if composed else sizes[3],
                    _capacity=(max_rows, max_segments, num_slots, max_members))
        return batch.update_([max_rows], [-1])

    def update_(self, seg_lens: Sequence[int], slot_ids: Sequence, weights: Sequence | None = None) -> "LoraBatch":
        """Overwrite a `with_capacity` batch in place with new segments (one host-to-device copy)."""
        if self._capacity is None:
            raise ValueError("update_ needs a batch made by LoraBatch.with_capacity")
        max_rows, max_segments, num_slots, max_members = self._capacity
        lens = as_int_list(seg_lens, "seg_lens")
        validate_lengths(lens)
        mem = members(slot_ids, weights, len(lens))
        _check_capacity(lens, mem, max_rows, max_segments, num_slots, max_members)
        lens = np.append(lens, max_rows - lens.sum())  # padding rows: one segment, no adapter
        lanes = max_members if self.composed else 1
        slots = np.full((len(lens), lanes), -1, np.int64)
        wts = np.ones((len(lens), lanes), np.float64)
        slots[:-1, :mem.lanes], wts[:-1, :mem.lanes] = mem.slots, mem.weights
        p = plan(lens, Members(slots, wts), self.block_m, self.composed)
        sizes = _capacity_sizes(max_rows, max_segments, self.block_m, max_members)
        fills = (max_rows, -1, 0, -1, 0, 0, -1, 0, 0, 0, -1, 0, 0, -1)   # padding: no work, no adapter
        host = [np.concatenate([a, np.full(n - len(a), v, np.int64)]) for a, n, v in zip(_arrays(p), sizes, fills)]
        self._buffer.copy_(torch.from_numpy(np.concatenate(host).astype(np.int32)), non_blocking=True)
        values = _host_values(p)
        self.num_segments = values["num_segments"]
        self.max_slot = values["max_slot"]
        self.group_slots, self.group_bounds = values["group_slots"], values["group_bounds"]
        self.shrink_group_slots = values["shrink_group_slots"]
        self.shrink_group_bounds = values["shrink_group_bounds"]
        self.launches.clear()
        return self


def _check_capacity(lens: np.ndarray, mem: Members, max_rows: int, max_segments: int, num_slots: int,
                    max_members: int) -> None:
    bad = np.argwhere(mem.slots >= num_slots)
    if len(bad):
        s = int(bad[0][0])
        shown = int(mem.slots[s, 0]) if mem.lanes == 1 else mem.slots[s][mem.slots[s] >= 0].tolist()
        raise ValueError(f"slot_ids[{s}] = {shown} but this batch was made for {num_slots} slots")
    if len(lens) > max_segments or lens.sum() > max_rows:
        raise ValueError(f"{len(lens)} segments of {lens.sum()} rows exceed the capacity of "
                         f"{max_segments} segments and {max_rows} rows")
    if mem.composed and max_members == 1:
        raise ValueError("this batch was made for one adapter a segment at weight 1 (max_members=1); "
                         "compositions and weights need a batch made with max_members > 1")
    if mem.lanes > max_members:
        raise ValueError(f"a segment combines {mem.lanes} adapters but this batch was made for {max_members}")


def _capacity_sizes(max_rows: int, max_segments: int, block_m: int, max_members: int = 1) -> list[int]:
    """Lengths of a capacity batch's arrays: room for one padding segment, and for the worst tiling (every group
    adds at most one partial tile); a composed one's entries and their tiles too."""
    segments, work = max_segments + 1, -(-max_rows // block_m) + max_segments
    sizes = [segments + 1, segments, max_rows, work, work, work, max_rows]
    if max_members > 1:
        entries = max_members * max_rows
        shrink_work = -(-entries // block_m) + max_segments * max_members
        sizes += [entries, entries, entries, shrink_work, shrink_work, shrink_work, (max_members - 1) * max_rows]
    return sizes


ALIGN = 4  # int32 elements = 16 bytes


def pad_parts(parts: list[np.ndarray]) -> list[np.ndarray]:
    """Each array zero-padded to a multiple of 16 bytes (int32), so that views into their
    concatenation all start 16-byte aligned. Triton compiles a kernel variant per alignment
    pattern of its pointer arguments: unaligned views that shift with the batch's sizes would
    make almost every new batch shape a new compile (seconds, mid-serving)."""
    return [np.concatenate([p, np.zeros(-len(p) % ALIGN, dtype=p.dtype)]) if len(p) % ALIGN else p for p in parts]


def aligned_views(buffer: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The arrays of `sizes` elements laid out by `pad_parts` in `buffer`."""
    views, offset = [], 0
    for n in sizes:
        views.append(buffer[offset:offset + n])
        offset += n + (-n % ALIGN)
    return views


def _split(buffer: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(buffer, sizes))
