"""Triton kernels for batched multi-LoRA: SGMV shrink (`v = x @ Aᵀ`) and expand (`y += s · v @ Bᵀ`).

Both kernels walk the work tiles of a `LoraBatch`: a tile is up to `block_m` rows that share
one adapter slot, gathered through `sorted_rows`. A tile reads its adapter's weights once,
whatever the number of segments behind it, so decode with hundreds of distinct adapters
reads each adapter once and prefill becomes tiled matrix work.

Shrink splits K across `split_k` programs when the batch alone would leave SMs idle. Each
split writes its own fp32 partial `part[split, slice, row, :]` (no atomics, no zero fill,
deterministic); expand sums the partials as it loads them. Each expand program covers a
chunk of N, BLOCK_N columns at a time, so B streams through a pipelined loop. Ranks are
honoured exactly: rank tiles past a slot's rank are skipped, and weight columns past it are
never loaded.

Up to `MAX_SLICES` output slices (fused q/k/v, gate/up) share one launch per direction;
each slice's tensors come in as their own kernel arguments so the compiler keeps their
alignment, and the program picks its slice with a branch.

The kernels are in shrink_kernels.py and expand_kernels.py. For tiles of at most ROWWISE_MAX_ROWS rows (decode
rows with their own adapters) both have a row-wise path (`_shrink_tile_rows`, `_expand_tile_rows`: fp32
multiply-and-sum on the CUDA cores, no row padded to 16 for the tensor cores), chosen per tile at run time where the
config asks for it (`KernelConfig.rowwise`: the decode config does).

A one-launch variant (each program shrinking over the whole K, then expanding its columns) lost 1.1–3.3× to
these two launches at every decode batch on an H200: without split-K each program's K loop is one long latency
chain (docs/design-notes.md).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..launch import Launcher, cdiv, num_sms
from . import b_blocks
from .expand_kernels import _sgmv_expand_kernel
from .shrink_kernels import ROWWISE_MAX_ROWS, _sgmv_shrink_kernel

MAX_SLICES = 4
# ---------------------------------------------------------------------------------------------
# Launchers of the kernels. Arguments arrive validated (see checks.py); these only pick tiles
# and launch.


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes and launch settings. `config_for` picks one per regime (tile height)."""

    shrink_block_k: int = 128
    shrink_warps: int = 4
    shrink_stages: int = 3
    shrink_programs_per_sm: float = 2.0  # split K until the shrink has about this many programs per SM
    expand_block_n: int = 128
    expand_warps: int = 4
    expand_stages: int = 2
    expand_programs_per_sm: float = 4.0  # cut N into chunks until the expand has about this many
    split_k: int | None = None  # fixed K splits (a power of two up to MAX_SPLIT_K) instead of the rule above
    n_chunks: int | None = None  # fixed N chunks per slice instead of the rule above
    expand_precision: str | None = None  # None: "split" for bf16 weights, "tf32x3" for fp16 and fp32
    # The row-wise paths (`_shrink_tile_rows`, `_expand_tile_rows`) for tiles of up to ROWWISE_MAX_ROWS rows. The
    # expand's needs the rank in one tile, the shrink's a rank tile of ≤ 32 (wider ones spill registers); elsewhere
    # the tile product runs.
    rowwise: bool = False
    tile_prefetch: bool = False  # the tile expand loads each step's y tile a step ahead (_expand_tile)


MAX_SPLIT_K = 8
MAX_PARTIAL_BYTES = 64 << 20  # the partials span every row of x: a few adapter rows in a huge batch split less
_SHRINK = Launcher(_sgmv_shrink_kernel)
_EXPAND = Launcher(_sgmv_expand_kernel)
# The tuned configs per tile height (tuned_h200.json: a config sweep (docs/design-notes.md) on an H200). Decode-like
# tiles (16 rows, few of them) are latency-bound: wide K tiles and many programs, so each program's serial loop is
# short, and tiles of a few rows go row by row. Prefill-like tiles (64 rows) stream x and y: the expand loads each
# step's y tile a step ahead, 64 columns a step (at 128 it spilled registers). Other heights take the 64 rows' config.
CONFIGS: dict[int, KernelConfig] = {int(block_m): KernelConfig(**fields) for block_m, fields in json.loads(
    (Path(__file__).with_name("tuned_h200.json")).read_text()).items() if not block_m.startswith("_")}


def config_for(block_m: int) -> KernelConfig:
    return CONFIGS.get(block_m, CONFIGS[64])


def _block_r(R: int) -> int:
    return min(max(16, 1 << (max(R, 1) - 1).bit_length()), 64)


# The row-wise expand's columns a step for rank tiles of 16 (distinct adapters' decode forwards 0.9-1.9% faster than
# with 256); a 512-column tile of rank 32 or 64 would hold 2-4× the weights a step in registers.
ROWS_WIDE_BLOCK_N = 512


def rows_block_n_for(cfg: KernelConfig, block_r: int) -> int:
    """The row-wise expand's columns a step: ROWS_WIDE_BLOCK_N for rank tiles of 16, `cfg.expand_block_n` for
    wider ones (and where the row-wise path is off: the value then goes unused)."""
    return ROWS_WIDE_BLOCK_N if block_r <= 16 and cfg.rowwise else cfg.expand_block_n


def choose_split_k(num_programs: int, K: int, device: torch.device, cfg: KernelConfig,
                   partial_bytes: int = 0) -> int:
    """The power of two (≤ MAX_SPLIT_K, ≥ 1 K-tile per split, partials ≤ MAX_PARTIAL_BYTES) that brings
    the shrink near its program target. `partial_bytes`: the size of one split's fp32 partials."""
    if cfg.split_k is not None:
        return cfg.split_k
    wanted = math.ceil(cfg.shrink_programs_per_sm * num_sms(device) / max(num_programs, 1))
    limit = min(wanted, MAX_SPLIT_K, max(1, K // cfg.shrink_block_k),
                max(1, MAX_PARTIAL_BYTES // max(partial_bytes, 1)))
    return 1 << (limit.bit_length() - 1)


def choose_n_chunks(num_programs: int, N: int, device: torch.device, cfg: KernelConfig) -> tuple[int, int]:
    """(chunks, columns per program): N cut so that the expand has about its program target."""
    tiles = cdiv(N, cfg.expand_block_n)
    chunks = cfg.n_chunks or math.ceil(cfg.expand_programs_per_sm * num_sms(device) / max(num_programs, 1))
    chunks = max(1, min(chunks, tiles))
    per_prog = cdiv(tiles, chunks) * cfg.expand_block_n
    return cdiv(N, per_prog), per_prog


def shrink_into(part: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], ranks: list[torch.Tensor],
                batch, cfg: KernelConfig, *, after_gemm: bool = False) -> None:
    """Launch shrink writing `part[split, slice, entry, :rank]` (fp32 `[split_k, slices, batch.num_entries, R]`;
    entries are rows unless the batch is composed). `after_gemm`: launched
    right after a GEMM over the same x, the shrink's programs may run beside it (the kernel's AFTER_GEMM)."""
    key = ("shrink", len(lora_a), part.shape, part.stride(), x.shape[1], x.stride(), x.dtype, lora_a[0].shape,
           lora_a[0].stride(), lora_a[0].dtype, cfg, after_gemm)
    launch = batch.launches.get(key, _UNSET)
    if launch is _UNSET:
        launch = batch.launches[key] = _shrink_launch(part, x, lora_a, ranks, batch, cfg, after_gemm)
    if launch is not None:
        launch(x, part, *lora_a, *ranks)


_UNSET = object()   # `launches.get(key, _UNSET)`: the key (with the config's dataclass hash) hashed once a call


def _dynamic(first: int, num_slices: int, per_slice: int) -> tuple[int, ...]:
    """The positions of the arguments that change from call to call over one batch: the output and input (0, 1),
    and from `first` the `per_slice` groups of MAX_SLICES tensors (A, or B, ranks and scalings), of which the first
    `num_slices` are used. The rest are the batch's tiles, sizes and the unused slices' placeholders."""
    return (0, 1, *(first + g * MAX_SLICES + i for g in range(per_slice) for i in range(num_slices)))


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """What an unused slice's tensor arguments point at (the kernel never reads them): one small tensor of the
    dtype, 16-byte aligned, so that the compiled variant does not depend on the call's tensors. (Allocated, not
    written: no kernel of its own, even where a CUDA graph is being captured.)"""
    return torch.empty(16, dtype=dtype, device=device)


def _pads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The placeholders of the slices past `tensors` up to MAX_SLICES."""
    return [_placeholder(tensors[0].device, tensors[0].dtype)] * (MAX_SLICES - len(tensors))


def _shrink_launch(part, x, lora_a, ranks, batch, cfg: KernelConfig, after_gemm: bool):
    """The shrink's launch over `batch` for these shapes (None: an empty grid), its tensors as they are now."""
    num_slices = len(lora_a)
    split_k = part.shape[0]
    _, R, K = lora_a[0].shape
    block_r = _block_r(R)
    r_tiles = cdiv(R, block_r)
    k_per_split = cdiv(cdiv(K, split_k), cfg.shrink_block_k) * cfg.shrink_block_k
    grid = (batch.num_shrink_work * num_slices * r_tiles, split_k)
    if grid[0] == 0:
        return None
    precision = "tf32x3" if x.dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs
    weights = batch.shrink_weights if batch.composed else batch.shrink_rows   # (unread unless COMPOSED)
    args = (x, part, batch.shrink_rows, batch.shrink_entries, weights, batch.shrink_work_slot,
            batch.shrink_work_start, batch.shrink_work_end, *lora_a, *_pads(lora_a), *ranks, *_pads(ranks),
            K, k_per_split, r_tiles, R,
            x.stride(0), x.stride(1), lora_a[0].stride(0), lora_a[0].stride(1),
            part.stride(0), part.stride(1), part.stride(2))
    return _SHRINK.prepare(grid, args, dict(NUM_SLICES=num_slices, BLOCK_M=batch.block_m, BLOCK_R=block_r,
                                            BLOCK_K=cfg.shrink_block_k, PRECISION=precision,
                                            ROWWISE=cfg.rowwise and block_r <= 32, AFTER_GEMM=after_gemm,
                                            COMPOSED=batch.composed),
                           cfg.shrink_warps, cfg.shrink_stages, _dynamic(8, num_slices, 2))


def expand_from(y: torch.Tensor, part: torch.Tensor, lora_b: list[torch.Tensor], ranks: list[torch.Tensor],
                scalings: list[torch.Tensor], batch, y_offset: int, cfg: KernelConfig, *,
                accumulate: bool = True) -> None:
    """Launch expand adding `scalings[slot] * Σ_split part @ B[slot]ᵀ` into y's slices, summed over a composed
    batch's members before y rounds; with `accumulate=False`, that sum is stored instead (zeros for slices of rank
    0; rows without an adapter are left as they were): y is an fp32 delta buffer (a LoraDelta,
    ops/lora/overlap.py)."""
    key = ("expand", tuple(b.shape for b in lora_b), lora_b[0].dtype, y.stride(), y.dtype, part.shape,
           part.stride(), y_offset, cfg, accumulate)
    launch = batch.launches.get(key, _UNSET)
    if launch is _UNSET:
        launch = batch.launches[key] = _expand_launch(y, part, lora_b, ranks, scalings, batch, y_offset, cfg,
                                                      accumulate)
    if launch is not None:
        launch(y, part, *lora_b, *ranks, *scalings)


def _expand_launch(y, part, lora_b, ranks, scalings, batch, y_offset: int, cfg: KernelConfig, accumulate: bool):
    """The expand's launch over `batch` for these shapes (None: an empty grid), its tensors as they are now."""
    num_slices = len(lora_b)
    R = lora_b[0].shape[2]
    ns = [b.shape[1] for b in lora_b]
    cols = [y_offset + sum(ns[:i]) for i in range(num_slices)]
    n_chunks, n_per_prog = choose_n_chunks(batch.num_work * num_slices, max(ns), y.device, cfg)
    grid = (batch.num_work * num_slices * n_chunks,)
    if grid[0] == 0:
        return None
    pad = MAX_SLICES - num_slices
    # bf16 keeps fp32's exponent range, so v splits into two bf16 halves without overflow; fp16 would
    # overflow past 65504, so fp16 (exactly representable in fp32) takes the fp32 product.
    dtype = y.dtype if accumulate else lora_b[0].dtype
    precision = cfg.expand_precision or ("split" if dtype == torch.bfloat16 else "tf32x3")
    block_r = _block_r(R)
    member_r = b_blocks.member_r(R)   # a composed row's members two at a time (b_blocks.py)
    composed = batch.composed and batch.lanes > 1   # (a composition of one weighted member expands as a plain row)
    extra_slot = batch.extra_slot if composed else batch.row_slot   # (unread unless COMPOSED)
    args = (y, part, batch.sorted_rows, batch.work_slot, batch.work_start, batch.work_end, extra_slot,
            *lora_b, *_pads(lora_b), *ranks, *_pads(ranks), *scalings, *_pads(scalings),
            *ns, *[0] * pad, *cols, *[0] * pad, n_chunks, n_per_prog, R, batch.num_rows, batch.lanes - 1,
            y.stride(0), y.stride(1), part.stride(0), part.stride(1), part.stride(2))
    return _EXPAND.prepare(grid, args, dict(NUM_SLICES=num_slices, SPLIT_K=part.shape[0], BLOCK_M=batch.block_m,
                                            BLOCK_N=cfg.expand_block_n, BLOCK_R=block_r, ONE_R_TILE=R <= block_r,
                                            PRECISION=precision, ACCUMULATE=accumulate, ROWWISE=cfg.rowwise,
                                            ROWS_BLOCK_N=rows_block_n_for(cfg, 2 * member_r if composed else block_r),
                                            TILE_PREFETCH=cfg.tile_prefetch, COMPOSED=composed, MEMBER_R=member_r),
                           cfg.expand_warps, cfg.expand_stages, _dynamic(7, num_slices, 3))


def new_partials(x: torch.Tensor, lora_a: list[torch.Tensor], batch, cfg: KernelConfig) -> torch.Tensor:
    """The shrink's fp32 output `[split_k, slices, batch.num_entries, R]`, split K ways by the rule above (for
    `batch.split_work` tiles)."""
    num_slices, R, E = len(lora_a), lora_a[0].shape[1], batch.num_entries
    key = ("partials", num_slices, R, x.shape[1], x.device, cfg)
    shape = batch.launches.get(key)
    if shape is None:
        split_k = choose_split_k(batch.split_work * num_slices * cdiv(R, _block_r(R)), x.shape[1], x.device, cfg,
                                 num_slices * E * R * 4)
        shape = batch.launches[key] = (split_k, num_slices, E, R)
    return torch.empty(shape, dtype=torch.float32, device=x.device)


def add_lora(y, x, lora_a, lora_b, batch, ranks, scalings, y_offset: int, cfg: KernelConfig | None = None, *,
             accumulate: bool = True):
    """Shrink into a per-call fp32 partial buffer, then expand into y (two launches); `accumulate` as for
    `expand_from`."""
    cfg = cfg or config_for(batch.block_m)
    part = new_partials(x, lora_a, batch, cfg)
    shrink_into(part, x, lora_a, ranks, batch, cfg)
    expand_from(y, part, lora_b, ranks, scalings, batch, y_offset, cfg, accumulate=accumulate)
    return y
