"""Sweep the decode-regime (16-row tile) LoRA kernel settings on what a decode step really runs:
the 4 `add_lora` calls of each of Llama-2-7B's 32 layers (q/k/v fused, o, gate/up fused, down),
rank 16, on a CUDA-graph batch as the engine builds it, captured and replayed.

    python benchmarks/sweep_decode_lora.py --out benchmarks/results/decode_lora_sweep.json

(`results/decode_lora_fused.json` came from this script's former `--fused` option, which timed a
one-launch kernel beside these two launches; it lost at every batch and was removed.)
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import copy_bandwidth_gbs, time_us  # noqa: E402
from bench_model import RANK, fill_pool  # noqa: E402

from loraplex.adapters import AdapterPool  # noqa: E402
from loraplex.models import ForwardBatch, SequenceChunk  # noqa: E402
from loraplex.models.presets import preset_config  # noqa: E402
from loraplex.ops import add_lora
from loraplex.ops.lora import sgmv  # noqa: E402

CALLS = [(("q_proj", "k_proj", "v_proj"), "hidden"), (("o_proj",), "hidden"), (("gate_proj", "up_proj"), "hidden"),
         (("down_proj",), "intermediate")]


def lora_step(pool: AdapterPool, batch: ForwardBatch, xs: dict, ys: dict):
    def fn():
        for layer in range(pool.model.num_hidden_layers):
            for projs, xin in CALLS:
                a, b, r, s = pool.stacks(layer, projs)
                add_lora(ys[projs], xs[xin], a, b, batch.lora, r, s)
    return fn


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    c = preset_config("llama-2-7b")
    batches = [int(b) for b in args.batches.split(",")]
    pool = AdapterPool(c, num_slots=max(batches), max_rank=RANK, dtype=torch.bfloat16, device="cuda")
    fill_pool(pool, torch.Generator(device="cuda").manual_seed(0))
    copy_gbs = copy_bandwidth_gbs()
    base = sgmv.CONFIGS[16]
    grid = list(itertools.product((128, 256), (2.0, 4.0, 8.0, 16.0), (64, 128, 256), (2.0, 4.0, 8.0, 16.0)))
    rows = []
    for B in batches:
        xs = {"hidden": torch.randn(B, c.hidden_size, device="cuda", dtype=torch.bfloat16),
              "intermediate": torch.randn(B, c.intermediate_size, device="cuda", dtype=torch.bfloat16)}
        ys = {projs: torch.zeros(B, sum(c.projection_shape(p)[1] for p in projs), device="cuda",
                                 dtype=torch.bfloat16) for projs, _ in CALLS}
        for variant in ("distinct", "shared"):
            batch = ForwardBatch.for_graph(B, 1024, block_size=16, num_blocks=B * 64, vocab_size=32000,
                                           num_adapter_slots=pool.num_slots, device="cuda")
            slots = list(range(B)) if variant == "distinct" else [0] * B
            batch.update_([SequenceChunk([1], 100, list(range(i * 64, i * 64 + 8)), s) for i, s in enumerate(slots)])
            used = B if variant == "distinct" else 1
            floor_us = used * adapter_bytes_of(c) / copy_gbs / 1e3
            for sbk, spps, ebn, epps in grid:
                sgmv.CONFIGS[16] = dataclasses.replace(base, shrink_block_k=sbk, shrink_programs_per_sm=spps,
                                                       expand_block_n=ebn, expand_programs_per_sm=epps)
                fn = lora_step(pool, batch, xs, ys)
                fn()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                us = time_us([graph.replay], target_ms=20, reps=5)
                row = dict(batch=B, variant=variant, shrink_block_k=sbk, shrink_pps=spps,
                           expand_block_n=ebn, expand_pps=epps, us=us, floor_us=floor_us,
                           default=(sbk, spps, ebn, epps) == (
                               base.shrink_block_k, base.shrink_programs_per_sm, base.expand_block_n,
                               base.expand_programs_per_sm))
                rows.append(row)
                del graph
            sgmv.CONFIGS[16] = base
            mine = [r for r in rows if r["batch"] == B and r["variant"] == variant]
            best = min(mine, key=lambda r: r["us"])
            default = next((r for r in mine if r["default"]), None)
            print(f"B={B:4d} {variant:8s} best {best['us']:7.0f} µs {best} | default "
                  f"{default['us'] if default else float('nan'):7.0f} µs | floor {floor_us:6.0f} µs", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), copy_gbs=copy_gbs, rows=rows), indent=1))


def adapter_bytes_of(c) -> int:
    from loraplex.models import PROJECTIONS
    return RANK * sum(sum(c.projection_shape(p)) for p in PROJECTIONS) * c.num_hidden_layers * 2


if __name__ == "__main__":
    main()
