"""A projection's GEMM and its LoRA shrink side by side, for decode steps captured in CUDA graphs.

At decode the LoRA kernels are short and latency-bound (a few µs each for a few MB), while the
projection's GEMM streams its weight for tens of µs. The shrink reads only x, so it need not wait
for the GEMM: it runs on a side stream, forked from and joined back to the current one, and the
expand adds into the GEMM's output once both are done:

    main:  y = x @ Wᵀ (+ bias) ───────────────┐
    side:  part = shrink(x, A[slot]) ─────────┴─> expand: y += scaling · part @ B[slot]ᵀ

Same result as `F.linear` followed by `sgmv.add_lora`, bit for bit (the same kernels on the same
data). Used while a CUDA graph of at most `MAX_ROWS` rows is captured, where the fork and join cost
nothing at replay; eager steps keep one stream (each fork/join costs host time there).
LORAPLEX_LORA_OVERLAP=0 turns it off.

Measured on an H200 (`benchmarks/bench_lora_overlap.py`, results/lora_overlap.md): Llama-2-7B decode
forwards 7.5% faster at batch 1, 0.4% (distinct adapters) and 5% (one shared) at batch 32; at 256
no faster (distinct) and 2% slower (shared), where the GEMMs fill the GPU: hence `MAX_ROWS`.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .batch import LoraBatch

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


MAX_ROWS = 32   # larger decode batches keep one stream (measured no faster at 256; 64–128 not measured)


def enabled(rows: int) -> bool:
    """Overlap the LoRA of a captured forward of `rows` rows? (LORAPLEX_LORA_OVERLAP=0: never.)"""
    value = os.environ.get("LORAPLEX_LORA_OVERLAP", "1").strip().lower()
    return value not in ("0", "false", "no", "off") and rows <= MAX_ROWS


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    # One of PyTorch's pooled streams, drawn once per device, as the adapter cache's copy stream is: the
    # two may be the same stream. That is safe because it is only used while graphs are captured, and
    # the engine captures them at start-up, before any adapter load exists.
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def linear_with_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], batch: LoraBatch,
                     ranks: list[torch.Tensor], scalings: list[torch.Tensor]) -> torch.Tensor:
    """`F.linear(x, weight, bias)` plus `sgmv.add_lora` of the slices, the shrink beside the GEMM (CUDA only)."""
    from . import sgmv   # Triton: imported where it runs, so that the CPU path needs none
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    if side == main:   # PyTorch hands out pooled streams in turn: this capture may have drawn ours
        return sgmv.add_lora(F.linear(x, weight, bias), x, lora_a, lora_b, batch, ranks, scalings, 0)
    cfg = sgmv.config_for(batch.block_m)
    part = sgmv.new_partials(x, lora_a, batch, cfg)   # allocated on the main stream, which frees it
    side.wait_stream(main)          # x is ready
    with torch.cuda.stream(side):
        sgmv.shrink_into(part, x, lora_a, ranks, batch, cfg)
    y = F.linear(x, weight, bias)
    main.wait_stream(side)
    sgmv.expand_from(y, part, lora_b, ranks, scalings, batch, 0, cfg)
    return y
