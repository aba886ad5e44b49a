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

The kernels are in sgmv_kernels.py. For tiles of a few rows (decode rows with their own adapters) both
have a row-wise path (`_shrink_tile_rows`, `_expand_tile_rows`: fp32 multiply-and-sum on the CUDA cores,
no row padded to 16 for the tensor cores), for every tile or for tiles of a few rows (chosen at run time),
per config (`KernelConfig`; LORAPLEX_LORA_ROWWISE for the decode config, mode 1 by default, see CONFIGS).

A one-launch variant (each program shrinking over the whole K, then expanding its columns) was
measured on an H200 and lost 1.1–3.3× to these two launches at every decode batch: without
split-K each program's K loop is one long latency chain (benchmarks/NOTES.md).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..launch import Launcher
from .sgmv_kernels import ROWWISE_MAX_ROWS, _sgmv_expand_kernel, _sgmv_shrink_kernel

MAX_SLICES = 4
# ---------------------------------------------------------------------------------------------
# Launchers of sgmv_kernels.py's kernels. Arguments arrive validated (see checks.py); these only pick tiles
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
    # Row-wise paths (`_shrink_tile_rows`, `_expand_tile_rows`): 0 never, 1 for tiles of up to ROWWISE_MAX_ROWS
    # rows, 2 for every tile. The expand's needs the rank in one tile, the shrink's a rank tile of ≤ 32
    # (wider ones spill registers); elsewhere the tile product runs.
    shrink_rowwise: int = 0
    expand_rowwise: int = 0
    rows_block_n: int | None = None  # the row-wise expand's columns per step (None: `rows_block_n_for`)
    rows_prefetch: bool = False  # the row-wise paths load each step's weights a step ahead (_expand_tile_rows)
    tile_prefetch: bool = False  # the tile expand loads each step's y tile a step ahead (_expand_tile)
    tile_stages: int = 0  # 2 or more: the tile expand's column loop pipelined by Triton instead (overrides prefetch)
    # Eager forwards whose every row has an adapter: the expand stores into the projection's output, then the
    # GEMM adds to it (ops/stored_lora.py), instead of the expand's read-modify-write after the GEMM.
    store_first: bool = False


MAX_SPLIT_K = 8
MAX_PARTIAL_BYTES = 64 << 20  # the partials span every row of x: a few adapter rows in a huge batch split less
_SHRINK = Launcher(_sgmv_shrink_kernel)
_EXPAND = Launcher(_sgmv_expand_kernel)
# Decode-like tiles (16 rows, few of them) are latency-bound: wide K tiles and many programs, so
# each program's serial loop is short (benchmarks/sweep_decode_lora.py: the 128 add_lora calls of
# a Llama-2-7B decode step in a CUDA graph, batches 1–256, distinct and shared adapters).
# Prefill-like tiles (64 rows) stream x and y. Chosen by benchmarks/sweep_lora_configs.py on an H200.
# LORAPLEX_LORA_ROWWISE: the decode config's row-wise mode for both kernels, "0", "1" (the default) or "2"
# (KernelConfig), or "auto": decode CUDA graphs captured twice, mode 0 and mode 2, and each step replays the
# one its adapters fit (`rows_fit`; engine/cuda_graphs.py). Mode 1 measured on the H200 (2026-12-01,
# benchmarks/results/model_forward_rowwise_*.json): Llama-2-7B decode forwards in CUDA graphs, distinct
# adapters 8.23 → 7.92 ms at 32 rows and 22.6 → 21.0 ms at 160, shared adapters unchanged (6.87 → 6.85 ms
# at 32 rows); mode 2 took the 32-row shared forward to 12.2 ms, as every tile then runs rows one by one.
def _rowwise_setting() -> int | str:
    raw = os.environ.get("LORAPLEX_LORA_ROWWISE", "1")
    value = raw.strip().lower() or "1"
    if value not in ("0", "1", "2", "auto"):
        raise ValueError(f"LORAPLEX_LORA_ROWWISE={raw!r}: expected 0 (off), 1 (tiles of up to "
                         f"{ROWWISE_MAX_ROWS.value} rows), 2 (every tile) or auto")
    return value if value == "auto" else int(value)


# LORAPLEX_LORA_ROWS: options of the decode config's row-wise paths, comma-separated: "prefetch" (loads a step
# ahead, KernelConfig.rows_prefetch) and "n<columns>" (the expand's columns a step, rows_block_n, a power of
# two from 16 to 1024, for every rank). Unset: no prefetch, and `rows_block_n_for`'s columns.
def _rows_options() -> dict:
    raw = os.environ.get("LORAPLEX_LORA_ROWS", "")
    options = {}
    for item in (part.strip().lower() for part in raw.split(",")):
        if item == "prefetch":
            options["rows_prefetch"] = True
        elif item[:1] == "n" and item[1:].isdecimal() and int(item[1:]) in (16, 32, 64, 128, 256, 512, 1024):
            options["rows_block_n"] = int(item[1:])
        elif item:
            raise ValueError(f"LORAPLEX_LORA_ROWS={raw!r}: {item!r} is not an option; expected prefetch and/or "
                             f"n<columns> (a power of two from 16 to 1024), comma-separated")
    return options


# LORAPLEX_LORA_PREFILL: changes to the large tiles' config (prompts), comma-separated: "n<columns>" (the
# expand's BLOCK_N, a power of two from 16 to 256), "epps<x>" (the expand's programs per SM), "ew<warps>" (its
# warps: 2, 4 or 8), "prefetch" / "noprefetch" (KernelConfig.tile_prefetch), "store" / "nostore"
# (KernelConfig.store_first), "rows" / "norows" (row-wise mode 1 for both kernels, or 0: the decode rows of a
# mixed step, each its own adapter and so a tile of one row, go row by row), "rn<columns>" (the row-wise
# expand's columns a step, rows_block_n, a power of two from 16 to 1024) and "ts<stages>" (tile_stages, 2 to 5;
# "ts0": none). Unset: PREFILL_DEFAULT;
# "noprefetch,n128,epps2" gives PREFILL_PLAIN, the default before 2026-12-02.
def _prefill_options(raw: str | None = None) -> dict:
    """The KernelConfig changes a LORAPLEX_LORA_PREFILL value asks for (`raw`; None: the environment's)."""
    raw = os.environ.get("LORAPLEX_LORA_PREFILL", "") if raw is None else raw
    options: dict = {}
    for item in (part.strip().lower() for part in raw.split(",")):
        if item in ("prefetch", "noprefetch"):
            options["tile_prefetch"] = item == "prefetch"
        elif item in ("store", "nostore"):
            options["store_first"] = item == "store"
        elif item.startswith("epps") and item[4:].replace(".", "", 1).isdecimal() and float(item[4:]) > 0:
            options["expand_programs_per_sm"] = float(item[4:])
        elif item.startswith("ew") and item[2:] in ("2", "4", "8"):
            options["expand_warps"] = int(item[2:])
        elif item[:1] == "n" and item[1:].isdecimal() and int(item[1:]) in (16, 32, 64, 128, 256):
            options["expand_block_n"] = int(item[1:])
        elif item in ("rows", "norows"):
            options["shrink_rowwise"] = options["expand_rowwise"] = int(item == "rows")
        elif item[:2] == "rn" and item[2:].isdecimal() and int(item[2:]) in (16, 32, 64, 128, 256, 512, 1024):
            options["rows_block_n"] = int(item[2:])
        elif item[:2] == "ts" and item[2:] in ("0", "2", "3", "4", "5"):
            options["tile_stages"] = int(item[2:])
        elif item:
            raise ValueError(f"LORAPLEX_LORA_PREFILL={raw!r}: {item!r} is not an option; expected n<columns> (16 to "
                             f"256, a power of two), epps<programs per SM>, ew<2|4|8>, (no)prefetch, (no)store, "
                             f"(no)rows, rn<columns> (16 to 1024, a power of two) and/or ts<0|2|3|4|5>, "
                             f"comma-separated")
    return options


def describe_prefill(cfg: KernelConfig) -> str:
    """`cfg`'s expand settings as a LORAPLEX_LORA_PREFILL value (what bench results record)."""
    modes = (cfg.shrink_rowwise, cfg.expand_rowwise)
    # (other row-wise modes have no option; written so that a record still says which ran)
    rows = {(0, 0): "norows", (1, 1): "rows"}.get(modes, f"rowwise{modes[0]}{modes[1]}")
    return (f"{'prefetch' if cfg.tile_prefetch else 'noprefetch'},n{cfg.expand_block_n},"
            f"epps{cfg.expand_programs_per_sm:g},ew{cfg.expand_warps},{'store' if cfg.store_first else 'nostore'},"
            f"{rows}" + (f",rn{cfg.rows_block_n}" if cfg.rows_block_n is not None else "") +
            (f",ts{cfg.tile_stages}" if cfg.tile_stages else ""))


_SETTING = _rowwise_setting()
# The large tiles' config before 2026-12-02 (what the prompt options' tests compare against).
PREFILL_PLAIN = KernelConfig(shrink_block_k=128, expand_block_n=128, expand_programs_per_sm=2.0)
# Without LORAPLEX_LORA_PREFILL (what probes apply its values to): the y tile a step ahead, 64 columns a step
# (at 128 the expand spilled registers), 4 programs per SM. On the H200 (2026-12-02) the LoRA kernels of eager 7B prompt
# forwards took 20% less; the engine's batch-32 runs moved within their spread.
PREFILL_DEFAULT = dataclasses.replace(PREFILL_PLAIN, tile_prefetch=True, expand_block_n=64,
                                      expand_programs_per_sm=4.0)
ROWWISE_AUTO = _SETTING == "auto"
_DECODE_ROWWISE = 0 if ROWWISE_AUTO else _SETTING
CONFIGS = {16: KernelConfig(shrink_block_k=256, expand_block_n=256, shrink_programs_per_sm=16.0,
                            expand_programs_per_sm=16.0, shrink_rowwise=_DECODE_ROWWISE,
                            expand_rowwise=_DECODE_ROWWISE, **_rows_options()),
           64: dataclasses.replace(PREFILL_DEFAULT, **_prefill_options())}


# A row-wise mode for the decode config while a forward runs (`decode_rowwise`): "auto" graphs capture with it.
_DECODE_MODE_NOW: contextvars.ContextVar[int | None] = contextvars.ContextVar("decode_rowwise", default=None)


def config_for(block_m: int) -> KernelConfig:
    return with_decode_mode(CONFIGS.get(block_m, CONFIGS[64]), block_m)


def with_decode_mode(cfg: KernelConfig, block_m: int) -> KernelConfig:
    """`cfg` (the settings for tiles of `block_m` rows) with the row-wise mode `decode_rowwise` set, if any
    is and the tiles are the decode config's."""
    mode = _DECODE_MODE_NOW.get() if block_m == 16 else None
    return cfg if mode is None else _with_mode(cfg, mode)


@functools.cache
def _with_mode(cfg: KernelConfig, mode: int) -> KernelConfig:
    return dataclasses.replace(cfg, shrink_rowwise=mode, expand_rowwise=mode)


@contextlib.contextmanager
def decode_rowwise(mode: int) -> Iterator[None]:
    """The decode config's row-wise mode (0, 1 or 2) for the kernels launched (or captured) inside."""
    if mode not in (0, 1, 2):
        raise ValueError(f"row-wise mode must be 0, 1 or 2, got {mode!r}")
    token = _DECODE_MODE_NOW.set(mode)
    try:
        yield
    finally:
        _DECODE_MODE_NOW.reset(token)


def rows_fit(slots: Iterable[int]) -> bool:
    """Do decode rows with these adapter slots (one row each; -1 none) make only tiles the row-wise path
    takes, i.e. no slot with more than ROWWISE_MAX_ROWS rows?"""
    counts = collections.Counter(s for s in slots if s >= 0)
    return not counts or max(counts.values()) <= ROWWISE_MAX_ROWS.value


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    # On the CPU (Triton's interpreter) pretend to a small GPU so that split-K and N chunks are exercised.
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv: that is a @jit function, and calling it from the host costs µs.
    return -(-a // b)


def _block_r(R: int) -> int:
    return min(max(16, 1 << (max(R, 1) - 1).bit_length()), 64)


# 512 columns a step for ranks up to 16, measured on the H200 (2026-12-01, benchmarks/results/
# model_forward_rows_*.json, Llama-2-7B decode forwards in CUDA graphs, rank 16): distinct adapters 7.96 →
# 7.89 ms at 32 rows and 21.34 → 20.92 ms at 160 against 256 columns, shared unchanged ("prefetch" was
# slower: 21.79 ms at 160). Wider ranks keep expand_block_n: a 512-column tile of rank 32 or 64 would hold
# 2-4× the weights a step in registers (not measured).
ROWS_WIDE_BLOCK_N = 512


def rows_block_n_for(cfg: KernelConfig, block_r: int) -> int:
    """The row-wise expand's columns a step: `cfg.rows_block_n` if set, else ROWS_WIDE_BLOCK_N for rank
    tiles of 16 and `cfg.expand_block_n` for wider ones."""
    if cfg.rows_block_n is not None:
        return cfg.rows_block_n
    return ROWS_WIDE_BLOCK_N if block_r <= 16 and cfg.expand_rowwise else cfg.expand_block_n


def choose_split_k(num_programs: int, K: int, device: torch.device, cfg: KernelConfig,
                   partial_bytes: int = 0) -> int:
    """The power of two (≤ MAX_SPLIT_K, ≥ 1 K-tile per split, partials ≤ MAX_PARTIAL_BYTES) that brings
    the shrink near its program target. `partial_bytes`: the size of one split's fp32 partials."""
    if cfg.split_k is not None:
        return cfg.split_k
    wanted = math.ceil(cfg.shrink_programs_per_sm * _num_sms(device) / max(num_programs, 1))
    limit = min(wanted, MAX_SPLIT_K, max(1, K // cfg.shrink_block_k),
                max(1, MAX_PARTIAL_BYTES // max(partial_bytes, 1)))
    return 1 << (limit.bit_length() - 1)


def choose_n_chunks(num_programs: int, N: int, device: torch.device, cfg: KernelConfig) -> tuple[int, int]:
    """(chunks, columns per program): N cut so that the expand has about its program target."""
    tiles = _cdiv(N, cfg.expand_block_n)
    chunks = cfg.n_chunks or math.ceil(cfg.expand_programs_per_sm * _num_sms(device) / max(num_programs, 1))
    chunks = max(1, min(chunks, tiles))
    per_prog = _cdiv(tiles, chunks) * cfg.expand_block_n
    return _cdiv(N, per_prog), per_prog


def shrink_into(part: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], ranks: list[torch.Tensor],
                batch, cfg: KernelConfig, *, after_gemm: bool = False) -> None:
    """Launch shrink writing `part[split, slice, row, :rank]` (fp32 `[split_k, slices, T, R]`). `after_gemm`: launched
    right after a GEMM over the same x, the shrink's programs may run beside it (the kernel's AFTER_GEMM)."""
    num_slices = len(lora_a)
    split_k = part.shape[0]
    _, R, K = lora_a[0].shape
    block_r = _block_r(R)
    r_tiles = _cdiv(R, block_r)
    k_per_split = _cdiv(_cdiv(K, split_k), cfg.shrink_block_k) * cfg.shrink_block_k
    grid = (batch.num_work * num_slices * r_tiles, split_k)
    if grid[0] == 0:
        return
    pad = MAX_SLICES - num_slices
    precision = "tf32x3" if x.dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs
    args = (x, part, batch.sorted_rows, batch.work_slot, batch.work_start, batch.work_end,
            *lora_a, *[lora_a[0]] * pad, *ranks, *[ranks[0]] * pad, K, k_per_split, r_tiles, R,
            x.stride(0), x.stride(1), lora_a[0].stride(0), lora_a[0].stride(1),
            part.stride(0), part.stride(1), part.stride(2))
    _SHRINK(grid, args, dict(NUM_SLICES=num_slices, BLOCK_M=batch.block_m, BLOCK_R=block_r,
                             BLOCK_K=cfg.shrink_block_k, PRECISION=precision,
                             ROWWISE=cfg.shrink_rowwise if block_r <= 32 else 0, ROWS_PREFETCH=cfg.rows_prefetch,
                             AFTER_GEMM=after_gemm),
            cfg.shrink_warps, cfg.shrink_stages)


def expand_from(y: torch.Tensor, part: torch.Tensor, lora_b: list[torch.Tensor], ranks: list[torch.Tensor],
                scalings: list[torch.Tensor], batch, y_offset: int, cfg: KernelConfig, *,
                accumulate: bool = True) -> None:
    """Launch expand adding `scalings[slot] * Σ_split part @ B[slot]ᵀ` into y's slices; with
    `accumulate=False`, that product is stored instead, rounded to y's dtype (zeros for slices of rank 0; rows
    without an adapter are left as they were): y is an fp32 delta buffer (ops/overlap.py) or a projection's
    output before its GEMM adds to it (ops/stored_lora.py)."""
    num_slices = len(lora_b)
    R = lora_b[0].shape[2]
    ns = [b.shape[1] for b in lora_b]
    cols = [y_offset + sum(ns[:i]) for i in range(num_slices)]
    n_chunks, n_per_prog = choose_n_chunks(batch.num_work * num_slices, max(ns), y.device, cfg)
    grid = (batch.num_work * num_slices * n_chunks,)
    if grid[0] == 0:
        return
    pad = MAX_SLICES - num_slices
    # bf16 keeps fp32's exponent range, so v splits into two bf16 halves without overflow; fp16 would
    # overflow past 65504, so fp16 (exactly representable in fp32) takes the fp32 product.
    dtype = y.dtype if accumulate else lora_b[0].dtype
    precision = cfg.expand_precision or ("split" if dtype == torch.bfloat16 else "tf32x3")
    block_r = _block_r(R)
    args = (y, part, batch.sorted_rows, batch.work_slot, batch.work_start, batch.work_end,
            *lora_b, *[lora_b[0]] * pad, *ranks, *[ranks[0]] * pad, *scalings, *[scalings[0]] * pad,
            *ns, *[0] * pad, *cols, *[0] * pad,
            n_chunks, n_per_prog, R, y.stride(0), y.stride(1), part.stride(0), part.stride(1), part.stride(2))
    _EXPAND(grid, args, dict(NUM_SLICES=num_slices, SPLIT_K=part.shape[0], BLOCK_M=batch.block_m,
                             BLOCK_N=cfg.expand_block_n, BLOCK_R=block_r, ONE_R_TILE=R <= block_r,
                             PRECISION=precision, ACCUMULATE=accumulate,
                             ROWWISE=cfg.expand_rowwise, ROWS_BLOCK_N=rows_block_n_for(cfg, block_r),
                             ROWS_PREFETCH=cfg.rows_prefetch,
                             TILE_PREFETCH=cfg.tile_stages if cfg.tile_stages >= 2 else cfg.tile_prefetch),
            cfg.expand_warps, cfg.expand_stages)


def new_partials(x: torch.Tensor, lora_a: list[torch.Tensor], batch, cfg: KernelConfig) -> torch.Tensor:
    """The shrink's fp32 output `[split_k, slices, T, R]`, split K ways by the rule above."""
    num_slices, R = len(lora_a), lora_a[0].shape[1]
    split_k = choose_split_k(batch.num_work * num_slices * _cdiv(R, _block_r(R)), x.shape[1], x.device, cfg,
                             num_slices * x.shape[0] * R * 4)
    return torch.empty((split_k, num_slices, x.shape[0], R), dtype=torch.float32, device=x.device)


def add_lora(y, x, lora_a, lora_b, batch, ranks, scalings, y_offset: int, cfg: KernelConfig | None = None, *,
             accumulate: bool = True):
    """Shrink into a per-call fp32 partial buffer, then expand into y (two launches); `accumulate` as
    for `expand_from`."""
    cfg = cfg or config_for(batch.block_m)
    part = new_partials(x, lora_a, batch, cfg)
    shrink_into(part, x, lora_a, ranks, batch, cfg)
    expand_from(y, part, lora_b, ranks, scalings, batch, y_offset, cfg, accumulate=accumulate)
    return y
