"""Compile, at start-up, every Triton LoRA kernel variant a step can launch.

Triton compiles a kernel per set of compile-time parameters the first time it meets it: about a
second each. The LoRA kernels have a few such parameters that depend on the batch (the tile
height, the number of K splits the shrink used, whether N is cut into chunks), so without this a
server would stall for seconds on its first mixed steps with adapters (measured: 12 mixed steps
of a Llama-2-7B benchmark took 10.7 s instead of 0.8 s). Compiled kernels are cached on disk by
Triton, so later start-ups are quick.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from ..adapters.pool import AdapterPool
from ..ops import LoraBatch
from ..ops.fused import api as fused
from ..ops.launch import precompile
from ..ops.lora import sgmv
from ..ops.lora.batch import LARGE_BLOCK_M, SMALL_BLOCK_M
from ..ops.lora.batch_plan import MAX_MEMBERS
from ..ops.lora.product import LoraProduct
from .config import ModelConfig
from .lora_plan import DECODE_EXPAND_IN_CONSUMER, DECODE_MAX_ROWS

log = logging.getLogger("loraplex.models")

# (projections of one add_lora call, the width of its input): what each layer runs
CALLS = ((("q_proj", "k_proj", "v_proj"), "hidden"), (("o_proj",), "attention"),
         (("gate_proj", "up_proj"), "hidden"), (("down_proj",), "intermediate"))


def compile_lora_kernels(config: ModelConfig, pool: AdapterPool, dtype: torch.dtype, *,
                         compositions: bool = False) -> int:
    """Launch each variant once on a tile whose adapter slots have rank 0 (nothing is computed; the
    fp32-product variants store zeros into their scratch buffers); returns the number of launches.
    `compositions`: also the variants of batches that combine adapters (ops/lora/batch.py's composed
    batches: the weighted shrink, and the expand that adds every member of a row). The same calls run first
    under ops/launch.py's `precompile`, which compiles the variants on every CPU at once."""
    device = pool.device
    start = time.perf_counter()
    zeroed = 2 if compositions and pool.num_slots > 1 else 1
    saved = pool.ranks[:, :, :zeroed].clone()
    pool.ranks[:, :, :zeroed] = 0   # slots 0 (and 1) read nothing, whatever they hold
    try:
        precompile(lambda: _launch_variants(config, pool, dtype, compositions, zeroed))
        compiled = time.perf_counter()
        launches = _launch_variants(config, pool, dtype, compositions, zeroed)
    finally:
        pool.ranks[:, :, :zeroed] = saved
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("compiled the LoRA kernels' variants (%d calls) in %.1f s, launched them in %.1f s", launches,
             compiled - start, time.perf_counter() - compiled)
    return launches


def _launch_variants(config: ModelConfig, pool: AdapterPool, dtype: torch.dtype, compositions: bool,
                     zeroed: int) -> int:
    """`compile_lora_kernels`' calls, on slots 0 (and 1, `zeroed` 2) of rank 0; returns their number."""
    device, launches = pool.device, 0
    widths = {"hidden": config.hidden_size, "attention": config.num_attention_heads * config.head_dim,
              "intermediate": config.intermediate_size}
    members = [([0], None)] + ([([[0, 1]], [[0.5, 0.5]])] if compositions else [])
    for (block_m, base, accumulate), (slots, weights) in itertools.product(_variants(), members):
        if zeroed == 2 or weights is None:
            batch = LoraBatch.from_lengths([block_m], slots, device, weights=weights, block_m=block_m)
        else:   # one slot: a composed batch (two lanes) whose rows weigh slot 0: both kernels' composed variants
            batch = LoraBatch.with_capacity(block_m, 1, device, num_slots=1, block_m=block_m, max_members=2)
            batch.update_([block_m], [[0]], [[0.5]])
        # layers 0-3: the per-layer rank and scaling views take every alignment they can take
        for layer, (projs, width) in itertools.product(range(min(4, config.num_hidden_layers)), CALLS):
            a, b, ranks, scalings = pool.stacks(layer, projs)
            x = torch.zeros(block_m, widths[width], dtype=dtype, device=device)
            y = torch.zeros(block_m, sum(t.shape[1] for t in b),
                            dtype=dtype if accumulate else torch.float32, device=device)
            n_tiles = -(-max(t.shape[1] for t in b) // base.expand_block_n)
            for split_k, n_chunks in itertools.product((1, 2, 4, 8), _chunk_classes(n_tiles)):
                cfg = dataclasses.replace(base, split_k=split_k, n_chunks=n_chunks)
                sgmv.add_lora(y, x, a, b, batch, ranks, scalings, 0, cfg, accumulate=accumulate)
                launches += 1
    return launches + _compile_consumers(config, pool, dtype, compositions)


def _compile_consumers(config: ModelConfig, pool: AdapterPool, dtype: torch.dtype, compositions: bool) -> int:
    """The consumers that expand a projection's product (models/lora_plan.py's "decode" forwards: RMSNorm for o and
    down, SiLU-and-mul for gate/up, RoPE for q/k/v), for every K-split count the shrink can pick in forwards of up
    to DECODE_MAX_ROWS rows, on rows of slot 0 (rank 0 here: nothing read); with `compositions` also their
    variants for a composed batch's product (rows whose other members are slot 0 too)."""
    device, c = pool.device, config
    cfg = sgmv.config_for(SMALL_BLOCK_M)
    R = pool.max_rank
    # at most this many shrink programs (tiles × 3 slices × rank tiles of at least 16, over a composed batch's
    # entries: up to MAX_MEMBERS a row): an upper bound
    entries = MAX_MEMBERS if compositions else 1
    most = (-(-DECODE_MAX_ROWS // SMALL_BLOCK_M) + DECODE_MAX_ROWS) * 3 * -(-R // 16) * entries
    widths = (c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size)
    splits = sorted({sgmv.choose_split_k(n, k, device, cfg) for n in range(1, most + 1) for k in widths})
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    launches = 0
    # layers 0-3: the per-layer rank and scaling views take every alignment they can take (as above)
    # 2 and 3 lanes: with 1-row products, partial strides (lanes · rows · R) of both divisibility classes
    lanes = (1, 2, 3) if compositions else (1,)
    for layer, split_k, rows, lane in itertools.product(range(min(4, c.num_hidden_layers)), splits,
                                                        (1, SMALL_BLOCK_M), lanes):
        def product(projs):
            _, b, ranks, scalings = pool.stacks(layer, projs)
            part = torch.zeros(split_k, len(b), lane * rows, R, dtype=torch.float32, device=device)
            row_slot = torch.zeros(rows, dtype=torch.int32, device=device)
            extra = torch.zeros((lane - 1) * rows, dtype=torch.int32, device=device) if lane > 1 else None
            return LoraProduct(part, tuple(b), tuple(ranks), tuple(scalings), row_slot, extra_slot=extra, lanes=lane)
        zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        if DECODE_EXPAND_IN_CONSUMER & {"o_proj", "down_proj"}:
            weight = torch.ones(c.hidden_size, dtype=dtype, device=device)
            fused.rms_norm(zeros(rows, c.hidden_size), weight, c.rms_norm_eps, residual=zeros(rows, c.hidden_size),
                           delta=product(("o_proj",)))
            launches += 1
        if "gate_proj" in DECODE_EXPAND_IN_CONSUMER:
            fused.silu_and_mul(zeros(rows, 2 * c.intermediate_size), delta=product(("gate_proj", "up_proj")))
            launches += 1
        if "q_proj" in DECODE_EXPAND_IN_CONSUMER:
            qkv = zeros(rows, (hq + 2 * hkv) * d)
            q = qkv[:, :hq * d].view(rows, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].view(rows, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(rows, hkv, d)
            inv_freq = torch.ones(d // 2, dtype=torch.float32, device=device)
            fused.apply_rope(q, k, torch.zeros(rows, dtype=torch.int32, device=device), inv_freq, v=v,
                             delta=product(("q_proj", "k_proj", "v_proj")))
            launches += 1
    return launches


def _variants() -> list[tuple[int, sgmv.KernelConfig, bool]]:
    """(tile height, settings, accumulate) of every way a step can launch the kernels: after the GEMMs (into y),
    and the expanded products into fp32 buffers (`LoraDelta`s) of forwards of up to DECODE_MAX_ROWS rows
    (16-row tiles; 64-row ones only for hand-built batches)."""
    return [(block_m, sgmv.config_for(block_m), accumulate)
            for block_m in (SMALL_BLOCK_M, LARGE_BLOCK_M) for accumulate in (True, False)]


def _chunk_classes(n_tiles: int) -> list[int]:
    """N-chunk counts (as `KernelConfig.n_chunks`) whose resulting chunk count covers each way
    Triton specializes an int: equal to 1, divisible by 16, neither."""
    found: dict[object, int] = {}
    for wanted in range(1, n_tiles + 1):
        per_prog = -(-n_tiles // wanted)
        chunks = -(-n_tiles // per_prog)
        key = 1 if chunks == 1 else chunks % 16 == 0
        found.setdefault(key, wanted)
    return list(found.values())
