"""Pinned host memory for adapter reads, page-locked once at start-up instead of during the first loads.

Every adapter read packs its weights into pinned (page-locked) host chunks (spec.pack_host_adapter), taken from
PyTorch's caching host allocator. Once the CPU tier is full, each read reuses the chunks an evicted copy gave
back; until then every chunk is a fresh cudaHostAlloc, which page-locks memory page by page, inside the CUDA
driver (where it may also hold up the engine's own CUDA calls). On an H200 host (Llama-2-7B-shaped
rank-16 adapters, batch 32, distinct adapters; docs/design-notes.md) the first 64 reads of a run took 0.24 s
on average against 0.049 s for the median read of a whole run (0.58 s with four loader threads: the slow part
does not spread over threads), and a whole run's batches lacked 9,527 rows over 602 steps while they came in,
all in its first tenth.

`reserve_pinned` allocates the chunks that `count` full adapters (the largest rank, every projection of every
layer) take, all at once, then frees them: PyTorch keeps freed pinned blocks for later allocations of the same
size, so the first reads find them ready. It must run after the engine has captured its CUDA graphs: each
capture (torch.cuda.graph) first hands every cached pinned block back to CUDA (torch._C._host_emptyCache).
Measured on the H200 (the first 120 requests of that workload, 4 runs with it and 3 without,
docs/design-notes.md): the start-up page-locked fresh memory ~20 times instead of ~355 (0.04 s of
cudaHostAlloc instead of 2.6-4.5 s), and the one ~120-310 ms decode GPU span of every run (the driver stalling
the device while it page-locked) went (longest 15-36 ms); throughput +1.1%, inside the spread. The first reads
were not faster (0.19-0.30 s either way): page-locking is not what slows them.
"""
from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import torch

from ..models.config import PROJECTIONS, ModelConfig
from .spec import host_chunk_sizes

log = logging.getLogger("loraplex.adapters")

DEFAULT_MAX_GIB = 8.0   # the default reserve's bound (EngineConfig.adapter_host_reserve_gib None)


def full_adapter_chunks(model: ModelConfig, rank: int, dtype: torch.dtype) -> list[int]:
    """The pinned chunks (elements each) of a rank-`rank` adapter on every projection of every layer, as
    pack_host_adapter lays them out (modules in sorted order, each A then B)."""
    sizes = []
    for _, proj in sorted((layer, proj) for layer in range(model.num_hidden_layers) for proj in PROJECTIONS):
        in_f, out_f = model.projection_shape(proj)
        sizes += [rank * in_f, out_f * rank]
    return host_chunk_sizes(sizes, dtype, pin=True)


_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int | None:
    """Memory this process may use: the host's physical memory, or its container's limit where lower (None where
    the OS says neither)."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in _CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():   # "max" (v2) or a huge number (v1): no limit
            sizes.append(int(text))
    return min(sizes) if sizes else None


def pinned_bytes(chunks: list[int], dtype: torch.dtype) -> int:
    """Bytes PyTorch's caching host allocator takes for `chunks` (elements each): it rounds every block up to a
    power of two."""
    item = torch.tensor([], dtype=dtype).element_size()
    return sum(1 << max(0, n * item - 1).bit_length() for n in chunks)


def reserve_count(model: ModelConfig, rank: int, dtype: torch.dtype, adapters: int, max_gib: float | None) -> int:
    """How many full adapters' chunks to reserve: `adapters`, at most `max_gib` GiB of them (None: the default
    bound, DEFAULT_MAX_GIB and a quarter of the memory this process may use)."""
    if max_gib is not None and (isinstance(max_gib, bool) or not isinstance(max_gib, (int, float))
                                or not math.isfinite(max_gib) or max_gib < 0):
        raise ValueError(f"the adapters' host memory reserve must be a non-negative number of GiB, got {max_gib!r}")
    per_adapter = pinned_bytes(full_adapter_chunks(model, rank, dtype), dtype)
    bound = (max_gib if max_gib is not None else DEFAULT_MAX_GIB) * 2**30
    if max_gib is None and (memory := host_memory_bytes()):
        bound = min(bound, memory / 4)
    return max(0, min(adapters, int(bound // per_adapter)))


def reserve_pinned(chunks: list[int], count: int, dtype: torch.dtype) -> int:
    """Allocate `count` sets of pinned `chunks` (elements each) at once, then free them into PyTorch's caching
    host allocator; the bytes it holds for them (rounded up as it rounds). A failed allocation (the host out of
    lockable memory) stops the reserve there, with a warning: it is only a head start for the first reads."""
    start = time.perf_counter()
    held = []
    try:
        for _ in range(count):
            held += [torch.empty(n, dtype=dtype, pin_memory=True) for n in chunks]
    except RuntimeError as e:
        log.warning("reserved pinned host memory for %d of %d adapter reads only: %s", len(held) // len(chunks),
                    count, e)
    nbytes = pinned_bytes([t.numel() for t in held], dtype)
    del held
    if count:
        log.info("reserved %.2f GiB of pinned host memory for adapter reads in %.1f s", nbytes / 2**30,
                 time.perf_counter() - start)
    return nbytes
