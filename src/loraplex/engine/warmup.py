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
from ..models.config import ModelConfig
from ..ops import LoraBatch
from ..ops.fused import api as fused
from ..ops.lora import overlap
from ..ops.lora import sgmv
from ..ops.fused import silu_lora_tiles
from ..ops.lora.batch import LARGE_BLOCK_M, SMALL_BLOCK_M
from ..ops.lora.delta import LoraDelta
from ..ops.lora.lora_in_gemm import expand_in_gemm
from ..ops.lora.product import LoraProduct
from ..ops.fused.silu_shrink import silu_and_mul_shrink

log = logging.getLogger("loraplex.engine")

# (projections of one add_lora call, the width of its input): what each layer runs
CALLS = ((("q_proj", "k_proj", "v_proj"), "hidden"), (("o_proj",), "attention"),
         (("gate_proj", "up_proj"), "hidden"), (("down_proj",), "intermediate"))


def compile_lora_kernels(config: ModelConfig, pool: AdapterPool, dtype: torch.dtype) -> int:
    """Launch each variant once on a tile whose adapter slot has rank 0 (nothing is computed; the
    fp32-product variants store zeros into their scratch buffers); returns the number of launches."""
    device = pool.device
    widths = {"hidden": config.hidden_size, "attention": config.num_attention_heads * config.head_dim,
              "intermediate": config.intermediate_size}
    start, launches = time.perf_counter(), 0
    saved = pool.ranks[:, :, 0].clone()
    pool.ranks[:, :, 0] = 0   # slot 0 reads nothing, whatever it holds
    try:
        for block_m, base, accumulate, in_model_dtype in _variants():
            batch = LoraBatch.from_lengths([block_m], [0], device, block_m=block_m)
            # layers 0-3: the per-layer rank and scaling views take every alignment they can take
            for layer, (projs, width) in itertools.product(range(min(4, config.num_hidden_layers)), CALLS):
                a, b, ranks, scalings = pool.stacks(layer, projs)
                x = torch.zeros(block_m, widths[width], dtype=dtype, device=device)
                y = torch.zeros(block_m, sum(t.shape[1] for t in b),
                                dtype=dtype if accumulate or in_model_dtype else torch.float32, device=device)
                n_tiles = -(-max(t.shape[1] for t in b) // base.expand_block_n)
                for split_k, n_chunks in itertools.product((1, 2, 4, 8), _chunk_classes(n_tiles)):
                    cfg = dataclasses.replace(base, split_k=split_k, n_chunks=n_chunks)
                    sgmv.add_lora(y, x, a, b, batch, ranks, scalings, 0, cfg, accumulate=accumulate)
                    launches += 1
                if not accumulate and not in_model_dtype and projs == ("down_proj",) and _down_shrink_in_silu():
                    launches += _compile_silu_shrink(x, y, a, b, ranks, scalings, batch, base, n_tiles)
        if overlap.mode() == "fused":
            launches += _compile_consumers(config, pool, dtype)
        if silu_lora_tiles.enabled():
            launches += _compile_silu_tiles(config, pool, dtype)
    finally:
        pool.ranks[:, :, 0] = saved
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("compiled the LoRA kernels' variants (%d calls) in %.1f s", launches, time.perf_counter() - start)
    return launches


def compile_skinny_lora(config: ModelConfig, pool: AdapterPool, dtype: torch.dtype) -> int:
    """LORAPLEX_SKINNY_LORA=on: the projections' GEMM-and-LoRA launches (ops/skinny_lora.py) of forwards of 1-16 and
    17-32 rows, with 16-row work tiles and 64-row ones (many rows of one adapter), with the model's biases, on a
    slot of rank 0 (nothing of it is read) and a weight of zero stride (the kernel a real weight compiles: its row
    stride is only known to be divisible by 16); returns the number of launches."""
    from ..ops.gemm import skinny as skinny_gemm
    from ..ops.gemm import skinny_lora
    if not skinny_lora.used_for(1, dtype, pool.device):
        return 0
    device, start, launches = pool.device, time.perf_counter(), 0
    widths = {"hidden": config.hidden_size, "attention": config.num_attention_heads * config.head_dim,
              "intermediate": config.intermediate_size}
    saved = pool.ranks[:, :, 0].clone()
    pool.ranks[:, :, 0] = 0
    try:
        for rows, block_m in itertools.product((1, SMALL_BLOCK_M + 1), (SMALL_BLOCK_M, LARGE_BLOCK_M)):
            batch = LoraBatch.from_lengths([rows], [0], device, block_m=block_m)
            for layer, (projs, width) in itertools.product(range(min(4, config.num_hidden_layers)), CALLS):
                a, b, ranks, scalings = pool.stacks(layer, projs)
                n, k = sum(t.shape[1] for t in b), widths[width]
                x = torch.zeros(rows, k, dtype=dtype, device=device)
                weight = torch.zeros(1, k, dtype=dtype, device=device).expand(n, k)
                bias = torch.zeros(n, dtype=dtype, device=device) if _has_bias(config, projs) else None
                if skinny_lora.applies(x, weight, [t.shape[1] for t in b]):
                    skinny_lora.skinny_lora_linear(x, weight, bias, a, b, batch, ranks, scalings)
                    launches += 1
    finally:
        pool.ranks[:, :, 0] = saved
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("compiled the GEMM-and-LoRA projections' variants (%d calls, LORAPLEX_SKINNY_GEMM=%s) in %.1f s",
             launches, skinny_gemm.SETTING, time.perf_counter() - start)
    return launches


def _has_bias(config: ModelConfig, projs: tuple[str, ...]) -> bool:
    """Does the model add a bias to this projection (models/llama.py's biases)?"""
    if projs[0] == "q_proj":
        return bool(config.qkv_bias)
    if projs[0] == "o_proj":
        return bool(config.o_bias)
    return bool(config.mlp_bias)


def compile_in_gemm(config: ModelConfig, pool: AdapterPool, dtype: torch.dtype, capacity: int) -> int:
    """EngineConfig.lora_in_gemm: what decode steps on the in-gemm path launch beyond the GEMMs, for 1 to
    `capacity` active adapters (the work items and the GEMM's width, which set the kernels' chunking and row
    stride, follow them): the in-gemm expand of o, gate/up and down (16-row tiles, and 64-row ones where
    many rows share an adapter) and RoPE expanding q/k/v's product from the GEMM's columns (models/llama.py),
    on slots of rank 0 (nothing read); returns the number of launches."""
    from ..models.llama import IN_GEMM_QKV_TO_ROPE, QKV
    device, start, launches = pool.device, time.perf_counter(), 0
    c, R = config, pool.max_rank
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    saved = pool.ranks.clone()
    pool.ranks.zero_()
    slot_active = torch.arange(pool.num_slots, dtype=torch.int32, device=device).clamp_(max=capacity - 1)
    try:
        for count in range(1, capacity + 1):
            batches = [LoraBatch.from_lengths([1] * count, list(range(count)), device, block_m=SMALL_BLOCK_M)]
            if count == 1:   # many rows of one adapter: large tiles
                batches.append(LoraBatch.from_lengths([1] * (SMALL_BLOCK_M + 1), [0] * (SMALL_BLOCK_M + 1), device,
                                                      block_m=LARGE_BLOCK_M))
            for batch, layer, (projs, _) in itertools.product(batches, range(min(4, c.num_hidden_layers)), CALLS):
                _, b, ranks, scalings = pool.stacks(layer, projs)
                n_base = sum(t.shape[1] for t in b)
                rows = batch.num_rows
                y_ext = torch.zeros(rows, n_base + count * len(b) * R, dtype=dtype, device=device)
                if projs == QKV and IN_GEMM_QKV_TO_ROPE:
                    part = torch.as_strided(y_ext, (1, len(b), rows, R), (0, R, y_ext.stride(0), 1), n_base)
                    product = LoraProduct(part, tuple(b), tuple(ranks), tuple(scalings),
                                          torch.zeros(rows, dtype=torch.int32, device=device), slot_active, count)
                    q = y_ext[:, :hq * d].view(rows, hq, d)
                    k = y_ext[:, hq * d:(hq + hkv) * d].view(rows, hkv, d)
                    v = y_ext[:, (hq + hkv) * d:n_base].view(rows, hkv, d)
                    fused.apply_rope(q, k, torch.zeros(rows, dtype=torch.int32, device=device),
                                     torch.ones(d // 2, dtype=torch.float32, device=device), v=v, delta=product)
                else:
                    expand_in_gemm(y_ext, n_base, b, ranks, scalings, batch, slot_active)
                launches += 1
    finally:
        pool.ranks.copy_(saved)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("compiled the in-gemm path's variants (%d calls) in %.1f s", launches, time.perf_counter() - start)
    return launches


def _compile_consumers(config: ModelConfig, pool: AdapterPool, dtype: torch.dtype) -> int:
    """"fused" (ops/lora_product.py): the ops that expand the products of overlap.FUSED_PROJECTIONS (and of
    DECODE_EXTRA_FUSED, fused in decode forwards of up to DECODE_EXTRA_MAX_ROWS rows), for every K-split count
    the shrink can pick in forwards of up to overlap.MAX_ROWS rows, on rows of slot 0 (rank 0 here: nothing
    read)."""
    device, c = pool.device, config
    cfg = overlap.config_for(SMALL_BLOCK_M)
    R = pool.max_rank
    # at most this many shrink programs (tiles × 3 slices × rank tiles of at least 16): an upper bound
    most = (-(-overlap.MAX_ROWS // SMALL_BLOCK_M) + overlap.MAX_ROWS) * 3 * -(-R // 16)
    widths = (c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size)
    splits = sorted({sgmv.choose_split_k(n, k, device, cfg) for n in range(1, most + 1) for k in widths})
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    launches = 0
    # layers 0-3: the per-layer rank and scaling views take every alignment they can take (as above)
    for layer, split_k, rows in itertools.product(range(min(4, c.num_hidden_layers)), splits, (1, SMALL_BLOCK_M)):
        def product(projs):
            _, b, ranks, scalings = pool.stacks(layer, projs)
            part = torch.zeros(split_k, len(b), rows, R, dtype=torch.float32, device=device)
            return LoraProduct(part, tuple(b), tuple(ranks), tuple(scalings),
                               torch.zeros(rows, dtype=torch.int32, device=device))
        zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        if overlap.FUSED_PROJECTIONS & {"o_proj", "down_proj"}:
            weight = torch.ones(c.hidden_size, dtype=dtype, device=device)
            fused.rms_norm(zeros(rows, c.hidden_size), weight, c.rms_norm_eps, residual=zeros(rows, c.hidden_size),
                           delta=product(("o_proj",)))
            launches += 1
        if "gate_proj" in overlap.FUSED_PROJECTIONS | overlap.DECODE_EXTRA_FUSED:
            fused.silu_and_mul(zeros(rows, 2 * c.intermediate_size), delta=product(("gate_proj", "up_proj")))
            launches += 1
        if "q_proj" in overlap.FUSED_PROJECTIONS:
            qkv = zeros(rows, (hq + 2 * hkv) * d)
            q = qkv[:, :hq * d].view(rows, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].view(rows, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(rows, hkv, d)
            inv_freq = torch.ones(d // 2, dtype=torch.float32, device=device)
            fused.apply_rope(q, k, torch.zeros(rows, dtype=torch.int32, device=device), inv_freq, v=v,
                             delta=product(("q_proj", "k_proj", "v_proj")))
            launches += 1
    return launches


def _compile_silu_tiles(config: ModelConfig, pool: AdapterPool, dtype: torch.dtype) -> int:
    """LORAPLEX_LORA_SILU_TILES=on (ops/silu_lora_tiles.py): SiLU-and-mul expanding gate/up's product over the work
    tiles, for both tile heights and every K-split count the shrink can pick, on a tile of slot 0 (rank 0 here)."""
    device, launches = pool.device, 0
    for block_m, layer, split_k in itertools.product((SMALL_BLOCK_M, LARGE_BLOCK_M),
                                                     range(min(4, config.num_hidden_layers)), (1, 2, 4, 8)):
        batch = LoraBatch.from_lengths([block_m], [0], device, block_m=block_m)
        _, b, ranks, scalings = pool.stacks(layer, ("gate_proj", "up_proj"))
        part = torch.zeros(split_k, 2, block_m, pool.max_rank, dtype=torch.float32, device=device)
        product = LoraProduct(part, tuple(b), tuple(ranks), tuple(scalings), batch.row_slot, tiles=batch)
        fused.silu_and_mul(torch.zeros(block_m, 2 * config.intermediate_size, dtype=dtype, device=device),
                           delta=product)
        launches += 1
    return launches


def _down_shrink_in_silu() -> bool:
    """Does the model compute down's shrink in SiLU-and-mul (models/llama.py) in forwards that leave the
    products to the next op ("full" and "fused" modes)?"""
    from ..models import llama
    # as models/llama.py: not where gate/up's product is a LoraProduct (a "fused" projection); where down's is,
    # the expand variants compiled here go unused
    fused_gate = overlap.mode() == "fused" and "gate_proj" in overlap.FUSED_PROJECTIONS
    return llama.DOWN_SHRINK_IN_SILU and overlap.mode() in ("full", "fused") and not fused_gate


def _compile_silu_shrink(x, y, a, b, ranks, scalings, batch, base: sgmv.KernelConfig, n_tiles: int) -> int:
    """models/llama.py's down projection in the "delta" and "product" paths: SiLU-and-mul computing the
    shrink (ops/silu_shrink.py) after gate/up's LoraDelta, then the expand of its partials (their own K split)."""
    rows, I = x.shape
    row_slot = torch.zeros(rows, dtype=torch.int32, device=x.device)   # slot 0: rank 0 here
    gate_up = torch.zeros(rows, 2 * I, dtype=x.dtype, device=x.device)
    delta = LoraDelta(torch.zeros(rows, 2 * I, dtype=torch.float32, device=x.device), row_slot)
    _, part = silu_and_mul_shrink(gate_up, a[0], ranks[0], row_slot, delta=delta)
    for n_chunks in _chunk_classes(n_tiles):
        cfg = dataclasses.replace(base, n_chunks=n_chunks)
        sgmv.expand_from(y, part, b, ranks, scalings, batch, 0, cfg, accumulate=False)
    return 1 + len(_chunk_classes(n_tiles))


def _variants() -> list[tuple[int, sgmv.KernelConfig, bool, bool]]:
    """(tile height, settings, accumulate, stored in the model's dtype) of every way a step can launch the
    kernels: after the GEMMs, and in "full" and "fused" (ops/overlap.py) the products into fp32 buffers, which
    eager forwards of up to overlap.MAX_ROWS rows launch too (16-row tiles; 64-row ones only for hand-built
    batches); with KernelConfig.store_first (LORAPLEX_LORA_PREFILL=store) the products stored into the
    projections' outputs (ops/stored_lora.py)."""
    tiles = (SMALL_BLOCK_M, LARGE_BLOCK_M)
    found = [(block_m, sgmv.config_for(block_m), True, False) for block_m in tiles]
    if overlap.mode() in ("full", "fused"):   # ("shrink" launches the plain order's variants)
        found += [(block_m, overlap.config_for(block_m), False, False) for block_m in tiles]
    found += [(block_m, sgmv.config_for(block_m), False, True) for block_m in tiles
              if sgmv.config_for(block_m).store_first]
    if sgmv.ROWWISE_AUTO:   # the decode graphs' row-wise variant (engine/cuda_graphs.py)
        with sgmv.decode_rowwise(2):
            found.append((SMALL_BLOCK_M, sgmv.config_for(SMALL_BLOCK_M), True, False))
            if overlap.mode() in ("full", "fused"):
                found.append((SMALL_BLOCK_M, overlap.config_for(SMALL_BLOCK_M), False, False))
    return found


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
