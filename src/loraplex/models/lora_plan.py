"""`LoraPlan`: how every projection of one forward adds its LoRA, decided once from the batch.

The model builds one plan per forward (`LoraPlan.make`) and hands it to every layer; each projection
(`LoraLinear`) calls `plan.linear`, the one place that says which kernels add a projection's LoRA:

    kind          when                                        a projection's LoRA
    "none"        no row uses an adapter (or no pool)          not run
    "reference"   the PyTorch reference backend (the CPU)     ops.add_lora into y, after the GEMM
    "tiles"       Triton, eager, or captured above 128 rows   sgmv shrink + expand into y, after the GEMM
    "beside"      Triton, captured, 33-128 rows               the shrink beside the GEMM, the expand after it
    "decode"      Triton, at most 32 rows                     left for the next op to add (`pending`):
                                                              a LoraProduct (only the shrink ran; the consumer
                                                              expands it) for `plan.expand_in_consumer`, else
                                                              a LoraDelta (expanded beside the GEMM)

The consumers are fixed by the model's math: RoPE adds q/k/v's, the next RMSNorm adds o's and down's,
SiLU-and-mul adds gate/up's. "decode" and "beside" run their LoRA kernels on a side stream only while a
CUDA graph is captured; eager forwards compute the same bits on one stream (ops/lora/overlap.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..ops import add_lora, resolve_backend
from ..ops.gemm.fp8 import QuantizedRows
from ..ops.lora import overlap
from ..ops.lora.batch import LoraBatch
from ..ops.lora.delta import LoraDelta
from ..ops.lora.product import LoraProduct
from .fp8.gemm import BaseWeight, base_linear, gemm_operand   # the base GEMM for a dense or an FP8 weight

if TYPE_CHECKING:
    from ..adapters.pool import AdapterPool

Pending = LoraProduct | LoraDelta | None   # a projection's LoRA, left for the op after it to add

# LoRA beside the GEMM, added by the next op, in forwards of at most this many rows (both kernels beside the GEMM
# measured 12% faster at batch 1 and 2.4% at 32 with distinct adapters; from 64 rows only the shrink beside it paid,
# 1.4-1.9% at 64 and 128; at 256 the GEMMs fill the GPU and the plain order is best).
DECODE_MAX_ROWS = 32
BESIDE_MAX_ROWS = 128
# The projections (named by their first part) whose consumer expands the product itself. q/k/v's: RoPE expands it
# at no cost. o's and down's: the RMSNorm after each, over programs of a few hundred columns a row. gate/up's:
# SiLU-and-mul, in decode forwards of 5 to 32 rows only (each SiLU program reads its row's B columns, which the tile
# expand reads once per 16-64 rows of a prompt). Below 5 rows only q/k/v's pays (fusing all took 1.02x at 1-2 rows).
EXPAND_IN_CONSUMER = frozenset({"q_proj", "o_proj", "down_proj"})
FEW_ROWS_EXPAND_IN_CONSUMER = frozenset({"q_proj"})
FEW_ROWS = 4
DECODE_EXPAND_IN_CONSUMER = EXPAND_IN_CONSUMER | {"gate_proj"}


def expand_in_consumer(rows: int, decode: bool) -> frozenset[str]:
    """The projections whose product the consumer expands in a "decode" forward of `rows` rows; `decode`: every row
    is a sequence's one new token (else prompts are in it)."""
    if not decode:
        return EXPAND_IN_CONSUMER
    return FEW_ROWS_EXPAND_IN_CONSUMER if rows <= FEW_ROWS else DECODE_EXPAND_IN_CONSUMER


def side_stream_rows(rows: int) -> bool:
    """Does a captured Triton forward of `rows` rows with adapters run LoRA kernels on the side stream (so that its
    graph is captured at overlap.CAPTURE_PRIORITY)?"""
    return rows <= BESIDE_MAX_ROWS


@dataclass(frozen=True)
class LoraPlan:
    kind: str                                   # "none", "reference", "tiles", "beside" or "decode"
    pool: "AdapterPool | None" = None
    batch: LoraBatch | None = None
    backend: str | None = None                  # the ops backend ("reference" kind only)
    capturing: bool = False                     # a CUDA graph is being captured: LoRA kernels may take a side stream
    expand_in_consumer: frozenset[str] = frozenset()

    @classmethod
    def make(cls, rows: int, decode: bool, batch: LoraBatch, pool: "AdapterPool | None", has_adapters: bool,
             backend: str | None, device: torch.device) -> "LoraPlan":
        """The plan of a forward of `rows` rows (`decode`: one new token a sequence) over `batch`'s adapters."""
        if pool is None or not has_adapters:
            return cls("none")
        if resolve_backend(backend, device) != "triton":
            return cls("reference", pool, batch, backend)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if rows <= DECODE_MAX_ROWS:
            return cls("decode", pool, batch, None, capturing, expand_in_consumer(rows, decode))
        if capturing and rows <= BESIDE_MAX_ROWS:
            return cls("beside", pool, batch, None, capturing)
        return cls("tiles", pool, batch)

    def linear(self, x: torch.Tensor, weight: BaseWeight, bias: torch.Tensor | None, layer: int,
               parts: tuple[str, ...], x_e4m3: QuantizedRows | None = None) -> tuple[torch.Tensor, Pending]:
        """`x @ weightᵀ + bias` plus each row's adapter's LoRA of the projections `parts` (fused: one launch for all
        slices): added into the output, or returned as `pending` for the next op to add. An FP8 weight takes the
        FP8 GEMMs (models/fp8/gemm.py), with x quantized a row where `x_e4m3` is given; the LoRA reads the same x
        either way."""
        if self.kind == "none":
            return base_linear(x, weight, bias, x_e4m3), None
        a, b, ranks, scalings = self.pool.stacks(layer, parts)
        if self.kind in ("decode", "beside"):   # ops/lora/overlap.py runs the GEMM beside the LoRA kernels
            weight = gemm_operand(weight)
        if self.kind == "decode":
            if parts[0] in self.expand_in_consumer:
                return overlap.linear_with_lora_product(x, weight, bias, a, b, self.batch, ranks, scalings,
                                                        side=self.capturing, x_e4m3=x_e4m3)
            return overlap.linear_with_lora_delta(x, weight, bias, a, b, self.batch, ranks, scalings,
                                                  side=self.capturing, x_e4m3=x_e4m3)
        if self.kind == "beside":
            return overlap.linear_with_lora(x, weight, bias, a, b, self.batch, ranks, scalings, x_e4m3), None
        y = base_linear(x, weight, bias, x_e4m3)
        if self.kind == "tiles":   # the model's own arguments: the checks of ops.add_lora cost more host time than
            from ..ops.lora import sgmv   # the kernels take in eager steps
            return sgmv.add_lora(y, x, a, b, self.batch, ranks, scalings, 0), None
        return add_lora(y, x, a, b, self.batch, ranks, scalings, backend=self.backend), None
