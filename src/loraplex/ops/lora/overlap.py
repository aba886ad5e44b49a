"""A projection's GEMM with its LoRA kernels beside it, for small (decode-sized) forwards.

At decode the LoRA kernels are short and latency-bound (a few µs each for a few MB), while the
projection's GEMM streams its weight for tens of µs. So the LoRA work runs beside the GEMM and
the op that consumes the projection's output (RMSNorm, SiLU-and-mul, RoPE: ops/fused's `delta`
arguments) adds the LoRA as it loads its input. Three launchers, each returning the GEMM's output:

- `linear_with_lora_product`: only the shrink runs; the consumer expands each row's product itself
  (a `LoraProduct`: one LoRA launch a projection instead of two). With PDL and the Triton GEMM the
  shrink runs on the main stream right after the GEMM, its programs placed beside the GEMM's
  (`shrink_order` "after"); elsewhere on a side stream while a CUDA graph is captured ("side"):

      main:  y = x @ Wᵀ ──> part = shrink(x, A[slot]) ──> consumer(y + scaling · part @ B[slot]ᵀ, row by row)

- `linear_with_lora_delta`: shrink and expand beside the GEMM into an fp32 buffer of their own (a
  `LoraDelta`, written only in rows with an adapter), which the consumer adds:

      main:  y = x @ Wᵀ (+ bias) ───────────────────────────────────┐
      side:  part = shrink(x, A[slot]); delta = scaling · part @ B[slot]ᵀ ─┴─> consumer(y + delta)

- `linear_with_lora`: the shrink beside the GEMM, the expand after it into y (the plain order's bits).

In a composed batch (ops/lora/batch.py) every member of a row is added before the row rounds: a `LoraProduct`
carries the members after the first to the consumer, which adds them with the first; the expand kernel sums them
itself for a `LoraDelta` and into y.

The side stream is used only while a CUDA graph is captured, where its fork and join cost nothing at
replay; eager forwards keep one stream (each fork/join costs host time) and compute the same bits.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from .. import pdl
from ..gemm import linear as gemm
from ..gemm.fp8 import QuantizedRows
from ..gemm.linear import GemmWeight
from .batch import LoraBatch
from .delta import LoraDelta
from .product import LoraProduct

log = logging.getLogger("loraplex.ops")
_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
_warned_same_stream = False

# The side stream's priority (PyTorch's numbering: lower is higher; 0 is CUDA's lowest). Graphs with side-stream
# LoRA kernels are captured on a higher-priority stream (CAPTURE_PRIORITY), so the GEMMs go first wherever CTAs
# of both streams wait for SMs (captured kernels keep their stream's priority at replay).
SIDE_STREAM_PRIORITY = 0
CAPTURE_PRIORITY = -5


def shrink_order(x: torch.Tensor, weight: GemmWeight) -> str:
    """Where `linear_with_lora_product` runs the shrink: "after" the GEMM on the current stream where PDL is on and
    the GEMM is one of the Triton kernels (dense or FP8: ops/gemm/linear.py), which releases the shrink only after
    its own wait (ops/pdl.py), so the shrink's programs run beside the GEMM's; else "side" (cuBLAS's GEMMs, GPUs without PDL)."""
    return "after" if pdl.PDL and gemm.takes_input(x, weight) else "side"


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    # Drawn from PyTorch's pool, as the adapter cache's copy stream is: the two may be the same stream. That is
    # safe because it is only used while graphs are captured, at start-up, before any adapter load exists.
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, SIDE_STREAM_PRIORITY)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=index, priority=SIDE_STREAM_PRIORITY)
    return _SIDE_STREAMS[key]


def _usable_side(device: torch.device) -> torch.cuda.Stream | None:
    global _warned_same_stream
    main, side = torch.cuda.current_stream(device), _side_stream(device)
    if side != main:
        return side
    if not _warned_same_stream:   # PyTorch hands out pooled streams in turn: this capture may hold ours
        _warned_same_stream = True
        log.warning("the LoRA side stream is the stream being captured: that graph runs its LoRA kernels in the "
                    "plain order, without the overlap")
    return None


def _beside_gemm(x: torch.Tensor, weight: GemmWeight, bias: torch.Tensor | None, side: bool,
                 work: Callable[[], None], x_e4m3: QuantizedRows | None = None) -> torch.Tensor:
    """`gemm.linear(x, weight, bias, x_e4m3)` (a dense or an FP8 weight) with `work` (LoRA kernels that read only x)
    queued before it: on a side stream that forks after x is ready and joins after the GEMM when `side` (capture
    only) and one is usable, else on the current stream. Tensors `work` writes must be allocated by the caller on
    the main stream."""
    stream = _usable_side(x.device) if side else None
    if stream is None:
        work()
        return gemm.linear(x, weight, bias, x_e4m3)
    main = torch.cuda.current_stream(x.device)
    stream.wait_stream(main)    # x is ready
    with torch.cuda.stream(stream):
        work()
    y = gemm.linear(x, weight, bias, x_e4m3)
    main.wait_stream(stream)
    return y


def linear_with_lora(x: torch.Tensor, weight: GemmWeight, bias: torch.Tensor | None,
                     lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], batch: LoraBatch,
                     ranks: list[torch.Tensor], scalings: list[torch.Tensor],
                     x_e4m3: QuantizedRows | None = None) -> torch.Tensor:
    """`linear(x, weight, bias, x_e4m3)` plus `sgmv.add_lora` of the slices, the shrink on a side stream beside the
    GEMM (capture only), the expand after it: bit-identical to the plain order."""
    from . import sgmv   # Triton: imported where it runs, so that the CPU path needs none
    cfg = sgmv.config_for(batch.block_m)
    if _usable_side(x.device) is None:
        return sgmv.add_lora(gemm.linear(x, weight, bias, x_e4m3), x, lora_a, lora_b, batch, ranks, scalings, 0,
                             cfg)
    part = sgmv.new_partials(x, lora_a, batch, cfg)
    y = _beside_gemm(x, weight, bias, True, lambda: sgmv.shrink_into(part, x, lora_a, ranks, batch, cfg), x_e4m3)
    sgmv.expand_from(y, part, lora_b, ranks, scalings, batch, 0, cfg)
    return y


def linear_with_lora_delta(x: torch.Tensor, weight: GemmWeight, bias: torch.Tensor | None,
                           lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], batch: LoraBatch,
                           ranks: list[torch.Tensor], scalings: list[torch.Tensor], *, side: bool,
                           x_e4m3: QuantizedRows | None = None) -> tuple[torch.Tensor, LoraDelta]:
    """`(linear(x, weight, bias, x_e4m3), delta)`, delta the fp32 `[T, ΣN]` LoRA product of the slices in the rows
    with an adapter (the other rows are not written), for the consumer to add. `side`: on a side stream (capture
    only)."""
    from . import sgmv
    cfg = sgmv.config_for(batch.block_m)
    part = sgmv.new_partials(x, lora_a, batch, cfg)
    values = torch.empty((x.shape[0], sum(b.shape[1] for b in lora_b)), dtype=torch.float32, device=x.device)

    def work() -> None:
        sgmv.shrink_into(part, x, lora_a, ranks, batch, cfg)
        sgmv.expand_from(values, part, lora_b, ranks, scalings, batch, 0, cfg, accumulate=False)

    return _beside_gemm(x, weight, bias, side, work, x_e4m3), LoraDelta(values, batch.row_slot)


def linear_with_lora_product(x: torch.Tensor, weight: GemmWeight, bias: torch.Tensor | None,
                             lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], batch: LoraBatch,
                             ranks: list[torch.Tensor], scalings: list[torch.Tensor], *, side: bool,
                             x_e4m3: QuantizedRows | None = None) -> tuple[torch.Tensor, LoraProduct]:
    """`(linear(x, weight, bias, x_e4m3), product)`, the product the shrink of the slices left for the consumer to
    expand (ops/lora/product.py). The shrink runs where `shrink_order` puts it; "side" only when `side` (capture
    only)."""
    from . import sgmv
    cfg = sgmv.config_for(batch.block_m)
    part = sgmv.new_partials(x, lora_a, batch, cfg)
    if shrink_order(x, weight) == "after":
        y = gemm.linear(x, weight, bias, x_e4m3)
        sgmv.shrink_into(part, x, lora_a, ranks, batch, cfg, after_gemm=True)
    else:
        y = _beside_gemm(x, weight, bias, side, lambda: sgmv.shrink_into(part, x, lora_a, ranks, batch, cfg),
                         x_e4m3)
    # a composed batch's members after the first: the consumer adds them with the first (product.py)
    lanes = batch.lanes if batch.composed else 1
    return y, LoraProduct(part, tuple(lora_b), tuple(ranks), tuple(scalings), batch.row_slot,
                          extra_slot=batch.extra_slot if lanes > 1 else None, lanes=lanes)
