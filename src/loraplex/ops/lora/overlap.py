"""A projection's LoRA beside its GEMM, for decode steps of at most `MAX_ROWS` rows.

At decode the LoRA kernels are short and latency-bound (a few µs each for a few MB), while the
projection's GEMM streams its weight for tens of µs. Neither LoRA kernel needs the GEMM's output
if the expand writes its product into a buffer of its own, so both run on a side stream, forked
from and joined back to the current one, and the op that consumes the projection adds that
buffer as it loads its input (RMSNorm, SiLU-and-mul, RoPE: ops/fused.py's `delta` arguments):

    main:  y = x @ Wᵀ (+ bias) ───────────────────────────────────┐
    side:  part = shrink(x, A[slot]); delta = scaling · part @ B[slot]ᵀ ─┴─> consumer(y + delta)

The delta (`LoraDelta`, ops/lora_delta.py) is written only in rows with an adapter (zeros for slices of
rank 0) and the consumer adds it only there: no zero fill. A fill launched first on the side stream let
the GEMM take the SMs before the shrink, and cost ~90 µs of a 7.9 ms Llama-2-7B decode forward at batch 32
(H200, 2026-12-01, benchmarks/results/decode_graph_trace.json).

`y + delta` is the sum the in-place expand computes (fp32, rounded once to y's dtype; the expand
may fuse its product into that sum, so the two can differ in the last bit). Used for the forwards
of at most MAX_ROWS rows with the Triton kernels, captured or not, so that eager decode steps and
graph replays compute the same bits; the side stream only while a CUDA graph is captured, where the
fork and join cost nothing at replay (eager steps keep one stream: each fork/join costs host time).
Captured forwards of more rows, up to SHRINK_MAX_ROWS, run only the shrink beside the GEMM and the
expand after it, into y (bit-identical to the plain order).

"fused" (the default) goes one step further for the projections in fused_projections(): only the shrink
runs, and the consumer expands each row's product itself as it loads the row (`LoraProduct`,
ops/lora_product.py): one LoRA launch instead of two (shrink, expand). By default (SHRINK_ORDER "after") that
shrink runs on the main stream right after the GEMM, its programs beside the GEMM's (PDL), so that the
consumer depends on one stream only and is placed early, as after a plain GEMM:

    main:  y = x @ Wᵀ ──> part = shrink(x, A[slot]) ──> consumer(y + scaling · part @ B[slot]ᵀ, row by row)

The other projections take "full"'s way in the same forward.

Down's shrink can run inside the SiLU-and-mul before it instead, in both ways (models/llama.py's
DOWN_SHRINK_IN_SILU, off by default: measured slower; ops/silu_shrink.py): `linear_with_lora_expand` is then
the expand alone beside the GEMM.

LORAPLEX_LORA_OVERLAP: "fused" (default; also "1"), "full", "shrink" (only the shrink beside the GEMM,
up to SHRINK_MAX_ROWS rows), "off" (also "0"). LORAPLEX_GRAPH_PRIORITY (ops/stream_priority.py): which of the
two streams' kernels the SMs take first at replay ("gemm": a third stream for the GEMMs).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from ...env_switch import env_switch
from ..gemm import skinny_lora
from .batch import LoraBatch
from .delta import LoraDelta
from .product import LoraProduct
# the projections' GEMM: ops/skinny_gemm's kernel for few rows on GPUs (LORAPLEX_SKINNY_GEMM), else F.linear
from ..gemm.skinny import linear as base_linear, linear_into as _linear_into
from .stream_priority import gemm_stream_priority

log = logging.getLogger("loraplex.ops")
_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
_GEMM_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
_warned_same_stream = False

MODES = ("fused", "full", "shrink", "off")
# Measured on an H200 (results/lora_overlap.md, Llama-2-7B decode forwards): both kernels beside the
# GEMM win up to 32 rows (12% at batch 1, 2.4% at 32 with distinct adapters); from 64 rows only the
# shrink beside it wins (1.4–1.9% at 64 and 128); at 256 the GEMMs fill the GPU and the plain order is best.
MAX_ROWS = 32           # the LoRA product beside the GEMM, added by the next op ("full", "fused")
SHRINK_MAX_ROWS = 128   # the shrink beside the GEMM (captured forwards; "full", "fused" and "shrink")
# The projections (named by their first part) whose product "fused" leaves unexpanded (fused_projections); the
# others take "full"'s way (expand beside the GEMM into an fp32 buffer), which the same consumers add. q/k/v's:
# RoPE expands it at no cost. o's and down's: the RMSNorm after each expands it, each row over programs of
# fused_lora_kernels.RMS_SPLIT columns (one program a row took 10.6 µs against 2.5). On an H200 (2026-12-02,
# fourteenth session; Llama-2-7B decode forwards in CUDA graphs, distinct adapters, paired rounds against q/k/v
# alone, results/decode_graph_trace_od512_b*.json): 0.985× at batch 32 (21 rounds, results/decode_graph_trace_
# split.json; 1,024-column programs 0.988×, 2,048 1.021×, gate/up's too 0.987×), 0.993× at 16, 0.986× at 8,
# 0.998× at 4, 1.019× at 2 and 1.023× at 1. So decode forwards of fewer than FUSED_MIN_ROWS rows leave only
# q/k/v's (FEW_ROWS_FUSED). Decode graphs are captured for 1, 2, 4, 8, 16, … sequences (engine/cuda_graphs.py),
# so from 5 rows a replay runs the 8-row graph: with the bound at 5, an eager decode step (enforce_eager) picks
# what its graph would. Mixed steps (prompts in them) are captured at more than 16 rows: every fused projection.
# (Before the thirteenth session's stream priority, q/k/v alone was the fastest of all 16 choices at batch 32,
# results/fused_projections.json.)
FUSED_PROJECTIONS = frozenset({"q_proj", "o_proj", "down_proj"})
FEW_ROWS_FUSED = frozenset({"q_proj"})
FUSED_MIN_ROWS = 5
# gate/up's product left to SiLU-and-mul too in decode forwards of FUSED_MIN_ROWS to DECODE_EXTRA_MAX_ROWS rows.
# Each SiLU program reads its row's B columns, so prompts (many rows of one adapter, whose B the tile expand
# reads once per 16 to 64 rows) keep the expand. Once B was read 16 bytes at a time (sgmv_kernels._load_rank_block),
# SiLU's product took 15 µs a layer against 17 for the expand and plain SiLU (H200, 2026-12-02, seventeenth
# session: Llama-2-7B decode forwards at batch 32 in CUDA graphs, 7,539 against 7,593 µs, paired rounds 0.992×;
# results/decode_graph_trace_gate_silu.json). With 2-byte loads it had been level (0.987× against 0.985×).
# Fewer rows and more were not measured; 32 is a graph bucket (engine/cuda_graphs.py), so eager steps agree.
DECODE_EXTRA_FUSED = frozenset({"gate_proj"})
DECODE_EXTRA_MAX_ROWS = 32


def fused_projections(rows: int, decode: bool) -> frozenset[str]:
    """The projections whose product "fused" leaves to the next op to expand, in a forward of `rows` rows;
    `decode`: every row is a sequence's one new token (else prompts are in it: FUSED_PROJECTIONS). Decode
    forwards: q/k/v's alone below FUSED_MIN_ROWS rows, FUSED_PROJECTIONS and DECODE_EXTRA_FUSED up to
    DECODE_EXTRA_MAX_ROWS, FUSED_PROJECTIONS beyond."""
    if not decode:
        return FUSED_PROJECTIONS
    if rows < FUSED_MIN_ROWS:
        return FUSED_PROJECTIONS & FEW_ROWS_FUSED
    return FUSED_PROJECTIONS | DECODE_EXTRA_FUSED if rows <= DECODE_EXTRA_MAX_ROWS else FUSED_PROJECTIONS


# `linear_with_lora_expand` (the expand alone beside the GEMM, down's shrink done by SiLU-and-mul) captures the
# GEMM first: launched first, the expand took every SM for ~5 µs before the GEMM could start (H200, batch 32).
EXPAND_GEMM_FIRST = True
# The side stream's priority (PyTorch's numbering: lower is higher; 0, the default, is CUDA's lowest). Captured
# kernels keep their stream's priority (PyTorch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority),
# and where CTAs of both streams wait for SMs the block scheduler places the higher priority's first.
SIDE_STREAM_PRIORITY = 0
# Where a "fused" projection's shrink runs (LORAPLEX_LORA_SHRINK_ORDER; linear_with_lora_product):
# - "after" (the default; also "on"/"1"): on the current stream right after the GEMM. With PDL the shrink's programs
#   release the consumer first and wait for the grids before them last (sgmv_kernels' AFTER_GEMM), so they run
#   beside the GEMM's, and the consumer's programs are placed, and read their B blocks early, while both run, as
#   after a plain GEMM. Only where PDL is on and the GEMM is skinny_gemm's Triton kernel (decode forwards of up to
#   32 rows; `shrink_order`): elsewhere "side".
# - "side" (also "off"/"0"; the order before 2026-12-03): a side stream beside the GEMM while capturing, the current
#   stream before it in eager forwards. The consumer then depends on both streams and is launched only once the
#   side stream's shrink has completed.
# - "before": the current stream, before the GEMM.
# The shrink computes the same bits in each. H200, 2026-12-03 (Llama-2-7B, distinct adapters): batch-32 decode
# forwards in CUDA graphs 0.970x "side"'s time ("before" 1.039x; paired rounds, results/decode_graph_trace_shrink_
# order.json); issue 5's engine benchmark, alternating processes (results/engine_order_{a,b}_*.md): decode step
# 6.75-6.79 against 6.93-6.99 ms, distinct/backbone median 0.857 (7 processes) against 0.846 (6).
SHRINK_ORDERS = ("after", "side", "before")
SHRINK_ORDER = env_switch("LORAPLEX_LORA_SHRINK_ORDER", "after", on="after", off="side", others=("before",))
# Kernel settings of the "full" path, per tile height, where they differ from sgmv.CONFIGS (tuned for
# the kernels alone): benchmarks/sweep_overlap_configs.py found none better (results/overlap_sweep.json).
CONFIGS: dict = {}


def config_for(block_m: int):
    """The sgmv.KernelConfig of the "full" path (eager forwards of up to MAX_ROWS rows use it too). The
    shrink-only path keeps sgmv's, so that it stays bit-identical to the plain order."""
    from . import sgmv
    cfg = CONFIGS.get(block_m)
    return sgmv.config_for(block_m) if cfg is None else sgmv.with_decode_mode(cfg, block_m)


def mode() -> str:
    """The LORAPLEX_LORA_OVERLAP setting, one of MODES."""
    return env_switch("LORAPLEX_LORA_OVERLAP", "fused", on="fused", off="off", others=("full", "shrink"))


def enabled(rows: int) -> bool:
    """Does a captured forward of `rows` rows run LoRA kernels beside its GEMMs (on a side stream, or, for the
    fused projections' shrink, by default after the GEMM on the same stream: `shrink_order`)?"""
    return rows <= SHRINK_MAX_ROWS and mode() != "off"


def uses_delta(rows: int) -> bool:
    """Does a forward of `rows` rows (captured or eager) leave each LoRA product to the next op?"""
    return rows <= MAX_ROWS and mode() in ("full", "fused")


def lora_path(rows: int, capturing: bool, dtype: torch.dtype | None = None, device: torch.device | None = None) -> str:
    """How a Triton forward of `rows` rows adds LoRA: "gemm-lora" (LORAPLEX_SKINNY_LORA=on, for a model of `dtype`
    on `device` whose projections skinny_gemm takes), "product-side", "product" ("fused"), "delta-side", "delta"
    ("full"), "shrink-side" or "direct" (see LlamaForCausalLM._lora_path). `capturing`: a CUDA graph is being
    captured."""
    if dtype is not None and skinny_lora.used_for(rows, dtype, device):   # LoRA inside the GEMM: ops/skinny_lora.py
        return "gemm-lora"
    if uses_delta(rows):
        kind = "product" if mode() == "fused" else "delta"
        return f"{kind}-side" if capturing else kind
    return "shrink-side" if capturing and enabled(rows) else "direct"


def _pooled_stream(cache: dict[tuple[int, int], torch.cuda.Stream], device: torch.device,
                   priority: int) -> torch.cuda.Stream:
    """One of PyTorch's pooled streams at `priority`, drawn once per device and priority into `cache`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, priority) not in cache:
        cache[(index, priority)] = torch.cuda.Stream(device=index, priority=priority)
    return cache[(index, priority)]


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    # Drawn from PyTorch's pool as the adapter cache's copy stream is: the two may be the same stream. That is
    # safe because it is only used while graphs are captured, and the engine captures them at start-up, before
    # any adapter load exists.
    return _pooled_stream(_SIDE_STREAMS, device, SIDE_STREAM_PRIORITY)


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


def _usable_gemm_stream(device: torch.device, main: torch.cuda.Stream,
                        side: torch.cuda.Stream) -> torch.cuda.Stream | None:
    """The stream of a GEMM beside LoRA kernels ("gemm" priority scheme), None: the main stream."""
    priority = gemm_stream_priority()
    if priority is None:
        return None
    stream = _pooled_stream(_GEMM_STREAMS, device, priority)
    return None if stream in (main, side) else stream


def _beside_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, side: bool,
                 work: Callable[[], None], gemm_first: bool = False) -> torch.Tensor:
    """`base_linear(x, weight, bias)` with `work` (LoRA kernels that read only x, or inputs ready with x) queued
    before it: on a side stream that forks after x is ready and joins after the GEMM when `side` (capture
    only) and one is usable, else on the current stream. `gemm_first`: the GEMM is captured before the side
    stream's work (both still wait only for x), so at replay its CTAs take their SMs first and the work runs
    on the SMs it leaves (a kernel that starts first takes every SM). Under the "gemm" priority scheme the GEMM
    runs on a high-priority stream of its own instead, into a buffer of the main stream's, always queued before
    the work (its priority, not the order, decides). Tensors `work` writes must be allocated by the caller on
    the main stream, which frees them after the join."""
    stream = _usable_side(x.device) if side else None
    if stream is None:
        work()
        return base_linear(x, weight, bias)
    main = torch.cuda.current_stream(x.device)
    gemm_stream = _usable_gemm_stream(x.device, main, stream) if x.dim() == 2 else None
    if gemm_stream is not None:   # the "gemm" priority scheme: the GEMM on a stream of its own, forked beside
        y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)   # main's: freed after
        gemm_stream.wait_stream(main)   # x is ready
        stream.wait_stream(main)
        # the first GEMM on this stream allocates its cuBLAS workspace (32 MiB on sm90) inside that capture's pool:
        # one stream per device, so once
        with torch.cuda.stream(gemm_stream):
            _linear_into(y, x, weight, bias)
        with torch.cuda.stream(stream):
            work()
        main.wait_stream(gemm_stream)
        main.wait_stream(stream)
        return y
    if gemm_first:
        ready = torch.cuda.Event()
        ready.record(main)
        y = base_linear(x, weight, bias)
        stream.wait_event(ready)   # x is ready
    else:
        stream.wait_stream(main)    # x is ready
    with torch.cuda.stream(stream):
        work()
    if not gemm_first:
        y = base_linear(x, weight, bias)
    main.wait_stream(stream)
    return y


def _delta_values(x: torch.Tensor, lora_b: list[torch.Tensor]) -> torch.Tensor:
    """The fp32 `[T, ΣN]` buffer a LoraDelta holds, allocated on the current (main) stream, unfilled: the expand
    writes the rows with an adapter and the consumers read only those."""
    return torch.empty((x.shape[0], sum(b.shape[1] for b in lora_b)), dtype=torch.float32, device=x.device)


def linear_with_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], batch: LoraBatch,
                     ranks: list[torch.Tensor], scalings: list[torch.Tensor]) -> torch.Tensor:
    """"shrink": `base_linear(x, weight, bias)` plus `sgmv.add_lora` of the slices, the shrink beside the GEMM."""
    from . import sgmv   # Triton: imported where it runs, so that the CPU path needs none
    cfg = sgmv.config_for(batch.block_m)   # the plain order's settings: the same bits
    if _usable_side(x.device) is None:
        return sgmv.add_lora(base_linear(x, weight, bias), x, lora_a, lora_b, batch, ranks, scalings, 0, cfg)
    part = sgmv.new_partials(x, lora_a, batch, cfg)
    y = _beside_gemm(x, weight, bias, True, lambda: sgmv.shrink_into(part, x, lora_a, ranks, batch, cfg))
    sgmv.expand_from(y, part, lora_b, ranks, scalings, batch, 0, cfg)
    return y


def linear_with_lora_delta(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], batch: LoraBatch,
                           ranks: list[torch.Tensor], scalings: list[torch.Tensor], *,
                           side: bool) -> tuple[torch.Tensor, LoraDelta]:
    """"full": `(base_linear(x, weight, bias), delta)`, delta the fp32 `[T, ΣN]` LoRA product of the slices in
    the rows with an adapter (a LoraDelta: the other rows are not written), for the consumer to add.
    `side`: on a side stream (capture only)."""
    from . import sgmv
    cfg = config_for(batch.block_m)
    part = sgmv.new_partials(x, lora_a, batch, cfg)
    values = _delta_values(x, lora_b)

    def work() -> None:
        sgmv.shrink_into(part, x, lora_a, ranks, batch, cfg)
        sgmv.expand_from(values, part, lora_b, ranks, scalings, batch, 0, cfg, accumulate=False)

    return _beside_gemm(x, weight, bias, side, work), LoraDelta(values, batch.row_slot)


def shrink_order(x: torch.Tensor, weight: torch.Tensor) -> str:
    """SHRINK_ORDER (checked: tests and benchmarks set it) for a fused projection of x by weight: "after" only where
    it pays and its late wait is safe, with PDL on and the GEMM skinny_gemm's Triton kernel, which releases the
    shrink only after its own wait (ops/pdl.py); elsewhere (cuBLAS's GEMMs, GPUs without PDL, where the shrink
    after the GEMM could not run beside it) "side"."""
    if SHRINK_ORDER not in SHRINK_ORDERS:
        raise ValueError(f"LORAPLEX_LORA_SHRINK_ORDER must be one of {SHRINK_ORDERS}, got {SHRINK_ORDER!r}")
    if SHRINK_ORDER == "after" and not _after_applies(x, weight):
        return "side"
    return SHRINK_ORDER


def _after_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    from .. import pdl
    from ..gemm import skinny as skinny_gemm
    return bool(pdl.PDL) and skinny_gemm.takes_input(x, weight)


def linear_with_lora_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], batch: LoraBatch,
                             ranks: list[torch.Tensor], scalings: list[torch.Tensor], *,
                             side: bool, tiles: bool = False) -> tuple[torch.Tensor, LoraProduct]:
    """"fused": `(base_linear(x, weight, bias), product)`, the product the shrink of the slices left for the
    consumer to expand (ops/lora_product.py). `side`: the shrink on a side stream (capture only), unless
    `shrink_order` puts it on the current stream ("after" the GEMM, "before" it). `tiles`: the product carries the
    batch, for a consumer that expands it over the work tiles (ops/silu_lora_tiles.py)."""
    from . import sgmv
    cfg = config_for(batch.block_m)
    part = sgmv.new_partials(x, lora_a, batch, cfg)
    order = shrink_order(x, weight)
    if order == "after":
        y = base_linear(x, weight, bias)
        sgmv.shrink_into(part, x, lora_a, ranks, batch, cfg, after_gemm=True)
    else:
        y = _beside_gemm(x, weight, bias, side and order == "side",
                         lambda: sgmv.shrink_into(part, x, lora_a, ranks, batch, cfg))
    return y, LoraProduct(part, tuple(lora_b), tuple(ranks), tuple(scalings), batch.row_slot,
                          tiles=batch if tiles else None)


def linear_with_lora_expand(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, part: torch.Tensor,
                            lora_b: list[torch.Tensor], batch: LoraBatch, ranks: list[torch.Tensor],
                            scalings: list[torch.Tensor], *, side: bool) -> tuple[torch.Tensor, LoraDelta]:
    """"full" for a projection whose shrink the op before it computed (`part`, the fp32 split-K partials
    `[splits, slices, T, R]`: ops/silu_shrink.py): `(base_linear(x, weight, bias), delta)`, only the expand beside
    the GEMM. `side`: on a side stream (capture only)."""
    from . import sgmv
    cfg = config_for(batch.block_m)
    values = _delta_values(x, lora_b)

    def work() -> None:
        sgmv.expand_from(values, part, lora_b, ranks, scalings, batch, 0, cfg, accumulate=False)

    return _beside_gemm(x, weight, bias, side, work, gemm_first=EXPAND_GEMM_FIRST), LoraDelta(values, batch.row_slot)
