"""`LoraBatch`: the per-forward segment metadata that every LoRA op reads.

A flat batch is `T` rows cut into `S` contiguous segments (one per request); segment `s`
is rows `seg_indptr[s]:seg_indptr[s+1]` and uses adapter slot `slot_ids[s]` (-1: none).

The kernels do not walk segments. They walk *work tiles*: the rows of all segments that
share a slot are gathered into one group (`sorted_rows`), and each group is cut into tiles
of at most `block_m` rows. One tile reads its adapter's weights once, so an adapter used by
many segments (decode with popular adapters) is read once per tile, not once per segment.

Everything is computed on the host from Python lists and copied to the device in one
transfer; the ops never read it back, so they can be captured in a CUDA graph. For graph
replay, `with_capacity` + `update_` keep the device buffers and the launch grid fixed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

# Tile heights the kernels are compiled for: decode-like groups fit in the small one.
SMALL_BLOCK_M = 16
LARGE_BLOCK_M = 64
BLOCK_M_CHOICES = (16, 32, 64, 128)  # tl.dot needs at least 16 rows; powers of two for tl.arange


def _check_block_m(block_m: int) -> None:
    if block_m not in BLOCK_M_CHOICES:
        raise ValueError(f"block_m must be one of {BLOCK_M_CHOICES}, got {block_m!r}")


def _as_int_list(values: Sequence[int], name: str) -> np.ndarray:
    try:
        arr = np.asarray(list(values), dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a sequence of ints, got {values!r}") from exc
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of ints, got shape {arr.shape}")
    return arr


@dataclass
class _HostPlan:
    """Host-side arrays for one batch (int64 numpy)."""

    seg_indptr: np.ndarray
    slot_ids: np.ndarray
    sorted_rows: np.ndarray
    group_slots: np.ndarray
    group_bounds: np.ndarray
    work_slot: np.ndarray
    work_start: np.ndarray
    work_end: np.ndarray
    row_slot: np.ndarray


def _plan(seg_lens: np.ndarray, slot_ids: np.ndarray, block_m: int) -> _HostPlan:
    indptr = np.zeros(len(seg_lens) + 1, dtype=np.int64)
    np.cumsum(seg_lens, out=indptr[1:])
    active = np.nonzero((slot_ids >= 0) & (seg_lens > 0))[0]
    # Stable sort keeps each slot's segments (and so its rows) in batch order.
    segs = active[np.argsort(slot_ids[active], kind="stable")]
    lens = seg_lens[segs]
    total = int(lens.sum())
    out_start = np.cumsum(lens) - lens
    sorted_rows = np.arange(total, dtype=np.int64) + np.repeat(indptr[segs] - out_start, lens)

    group_slots, first = np.unique(slot_ids[segs], return_index=True)
    group_rows = np.add.reduceat(lens, first) if len(segs) else np.zeros(0, np.int64)
    group_bounds = np.zeros(len(group_slots) + 1, dtype=np.int64)
    np.cumsum(group_rows, out=group_bounds[1:])

    tiles = -(-group_rows // block_m)
    tile_idx = np.arange(int(tiles.sum()), dtype=np.int64) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    work_start = np.repeat(group_bounds[:-1], tiles) + tile_idx * block_m
    work_end = np.minimum(work_start + block_m, np.repeat(group_bounds[1:], tiles))
    return _HostPlan(indptr, slot_ids, sorted_rows, group_slots, group_bounds,
                     np.repeat(group_slots, tiles), work_start, work_end, np.repeat(slot_ids, seg_lens))


def _validate(seg_lens: np.ndarray, slot_ids: np.ndarray) -> None:
    if len(seg_lens) != len(slot_ids):
        raise ValueError(f"seg_lens has {len(seg_lens)} entries but slot_ids has {len(slot_ids)}")
    bad = np.nonzero(seg_lens < 0)[0]
    if len(bad):
        raise ValueError(f"seg_lens[{bad[0]}] = {seg_lens[bad[0]]} is negative")
    bad = np.nonzero(slot_ids < -1)[0]
    if len(bad):
        raise ValueError(f"slot_ids[{bad[0]}] = {slot_ids[bad[0]]}; slots are >= 0, or -1 for no adapter")
    if seg_lens.sum() >= 2**31:
        raise ValueError(f"batch of {seg_lens.sum()} rows does not fit int32 indexing")


@dataclass
class LoraBatch:
    """Segment metadata for one forward pass, on the device.

    Device tensors (int32): `seg_indptr [S+1]`, `slot_ids [S]`, `sorted_rows` (the rows of
    every segment with an adapter, grouped by slot), and the work tiles `work_slot`,
    `work_start`, `work_end` (each tile is `sorted_rows[work_start:work_end]`, one slot), and
    `row_slot [T]`, each row's slot (-1: none), for ops that add a row's LoRA product themselves
    (ops/lora/product.py).
    Host values: sizes, the tile height `block_m`, the number of tiles the grid covers
    (`num_work`), and the groups (slot and bounds in `sorted_rows`) for the reference path.
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
    _capacity: tuple[int, int, int] | None = field(default=None, repr=False)  # rows, segments, slots

    @property
    def device(self) -> torch.device:
        return self._buffer.device

    @property
    def all_rows_have_adapters(self) -> bool:
        """Does every row have an adapter, whatever `update_` writes later? (never for a capacity batch)"""
        return self._capacity is None and self.group_bounds[-1] == self.num_rows

    @classmethod
    def from_lengths(cls, seg_lens: Sequence[int], slot_ids: Sequence[int],
                     device: torch.device | str | None = None, *, block_m: int | None = None) -> "LoraBatch":
        """Build the metadata for segments of `seg_lens` rows using `slot_ids` (-1: no adapter)."""
        parts, plan = cls.host_parts(seg_lens, slot_ids, block_m=block_m)
        buffer = torch.from_numpy(np.concatenate(pad_parts(parts)).astype(np.int32))
        buffer = buffer.to(torch.device(device) if device is not None else "cpu", non_blocking=True)
        return cls.from_parts(buffer, plan)

    @classmethod
    def host_parts(cls, seg_lens: Sequence[int], slot_ids: Sequence[int], *,
                   block_m: int | None = None) -> tuple[list[np.ndarray], dict]:
        """The host arrays of a batch (checked), for a caller that copies them over inside its own
        buffer; `from_parts` then makes the batch from the device copy."""
        lens = _as_int_list(seg_lens, "seg_lens")
        slots = _as_int_list(slot_ids, "slot_ids")
        _validate(lens, slots)
        if block_m is None:
            block_m = cls.pick_block_m(lens, slots)
        _check_block_m(block_m)
        plan = _plan(lens, slots, block_m)
        parts = [plan.seg_indptr, plan.slot_ids, plan.sorted_rows, plan.work_slot, plan.work_start, plan.work_end,
                 plan.row_slot]
        return parts, dict(num_rows=int(plan.seg_indptr[-1]), num_segments=len(lens), block_m=block_m,
                           num_work=len(plan.work_slot), max_slot=int(slots.max(initial=-1)),
                           group_slots=tuple(plan.group_slots.tolist()),
                           group_bounds=tuple(plan.group_bounds.tolist()), sizes=[len(p) for p in parts])

    @classmethod
    def from_parts(cls, buffer: torch.Tensor, plan: dict) -> "LoraBatch":
        """The batch over `buffer`: int32, the `host_parts` arrays concatenated after `pad_parts`,
        on its device, starting 16-byte aligned."""
        plan = dict(plan)
        return cls(*aligned_views(buffer, plan.pop("sizes")), **plan, _buffer=buffer)

    @staticmethod
    def pick_block_m(seg_lens: np.ndarray, slot_ids: np.ndarray) -> int:
        """Small tiles (sgmv's decode config) unless the rows of slots too large for one small tile outnumber
        what large tiles would waste on the others: each slot of at most SMALL_BLOCK_M rows (a decode row with
        its own adapter) would take a whole LARGE_BLOCK_M-row tile, and the prefill config's few long-running
        programs. On an H200 (results/lora_tiles_mixed.json, Llama-2-7B mixed steps in CUDA graphs) large
        tiles took 162 decodes beside a 64-token prompt from 26.0 to 42.8 ms and 32 beside 512 from 19.6 to
        22.1, while they took 3.4% less time for a 2048-token prompt alone (53.6 against 55.5 ms) and 2.2%
        less beside 4 decodes (53.6 against 54.8); this rule picks the faster in all eight cases measured."""
        used = slot_ids >= 0
        if not used.any():
            return SMALL_BLOCK_M
        per_slot = np.bincount(slot_ids[used], weights=seg_lens[used])
        per_slot = per_slot[per_slot > 0]
        small = per_slot <= SMALL_BLOCK_M
        return SMALL_BLOCK_M if int(small.sum()) * LARGE_BLOCK_M >= per_slot[~small].sum() else LARGE_BLOCK_M

    # ---- CUDA-graph use: fixed buffers and grid, contents updated in place ----------------

    @classmethod
    def with_capacity(cls, max_rows: int, max_segments: int, device: torch.device | str, *, num_slots: int,
                      block_m: int = SMALL_BLOCK_M) -> "LoraBatch":
        """A batch whose device buffers and launch grid stay fixed across `update_` calls.

        Every batch written into it covers exactly `max_rows` rows (the rows past the real
        segments form one extra segment with no adapter), so a graph captured on tensors of
        `max_rows` rows can be replayed with any mix of up to `max_segments` segments on slots
        below `num_slots` (checked by `update_`: a replayed graph checks nothing). `update_`
        writes the buffers on the current stream; do not call it while a replay reading them
        runs on another stream.
        """
        if max_rows < 1 or max_segments < 1 or num_slots < 1:
            raise ValueError(f"capacity needs max_rows, max_segments and num_slots >= 1, got {max_rows}, "
                             f"{max_segments}, {num_slots}")
        _check_block_m(block_m)
        sizes = _capacity_sizes(max_rows, max_segments, block_m)
        buffer = torch.zeros(sum(sizes), dtype=torch.int32, device=device)
        batch = cls(*_split(buffer, sizes), num_rows=max_rows, num_segments=max_segments + 1, block_m=block_m,
                    num_work=sizes[3], max_slot=-1, group_slots=(), group_bounds=(0,), _buffer=buffer,
                    _capacity=(max_rows, max_segments, num_slots))
        return batch.update_([max_rows], [-1])

    def update_(self, seg_lens: Sequence[int], slot_ids: Sequence[int]) -> "LoraBatch":
        """Overwrite a `with_capacity` batch in place with new segments (one host-to-device copy)."""
        if self._capacity is None:
            raise ValueError("update_ needs a batch made by LoraBatch.with_capacity")
        max_rows, max_segments, num_slots = self._capacity
        lens = _as_int_list(seg_lens, "seg_lens")
        slots = _as_int_list(slot_ids, "slot_ids")
        _validate(lens, slots)
        bad = np.nonzero(slots >= num_slots)[0]
        if len(bad):
            raise ValueError(f"slot_ids[{bad[0]}] = {slots[bad[0]]} but this batch was made for {num_slots} slots")
        if len(lens) > max_segments or lens.sum() > max_rows:
            raise ValueError(f"{len(lens)} segments of {lens.sum()} rows exceed the capacity of "
                             f"{max_segments} segments and {max_rows} rows")
        lens = np.append(lens, max_rows - lens.sum())  # padding rows: one segment, no adapter
        slots = np.append(slots, -1)
        plan = _plan(lens, slots, self.block_m)
        n_ptr, n_seg, rows, work, _, _, _ = _capacity_sizes(max_rows, max_segments, self.block_m)
        pad = lambda a, n, fill: np.concatenate([a, np.full(n - len(a), fill, np.int64)])
        host = np.concatenate([pad(plan.seg_indptr, n_ptr, max_rows), pad(plan.slot_ids, n_seg, -1),
                               pad(plan.sorted_rows, rows, 0), pad(plan.work_slot, work, -1),
                               pad(plan.work_start, work, 0), pad(plan.work_end, work, 0), plan.row_slot])
        self._buffer.copy_(torch.from_numpy(host.astype(np.int32)), non_blocking=True)
        self.num_rows, self.num_segments = max_rows, n_seg
        self.max_slot = int(slots.max(initial=-1))
        self.group_slots = tuple(plan.group_slots.tolist())
        self.group_bounds = tuple(plan.group_bounds.tolist())
        return self


def _capacity_sizes(max_rows: int, max_segments: int, block_m: int) -> list[int]:
    """Lengths of a capacity batch's seven arrays: room for one padding segment, and for the worst
    tiling (every group adds at most one partial tile)."""
    segments, work = max_segments + 1, -(-max_rows // block_m) + max_segments
    return [segments + 1, segments, max_rows, work, work, work, max_rows]


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
