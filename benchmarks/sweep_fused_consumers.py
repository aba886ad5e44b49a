"""Sweep the "fused" LoRA path (LORAPLEX_LORA_OVERLAP=fused, ops/lora_product.py) on whole Llama-2-7B decode
forwards captured in CUDA graphs.

`--what tiles`: the tile settings of the ops that expand a product as they load it
(ops/fused_lora_kernels.py). RMSNorm walks a row (o's and down's product: 4,096 × rank B values per row)
in tiles of RMS_BLOCK columns in one program; SiLU-and-mul takes SILU_BLOCK columns of gate and up per
program; RoPE takes ROPE_HEADS heads of q, k or v per program.
`--what projections`: which projections leave their product to the next op (overlap.FUSED_PROJECTIONS);
the others expand beside the GEMM into an fp32 buffer ("full"), which the same op adds.
`--what rms`: RMSNorm's consumer with each row over several programs (RMS_SPLIT columns each, two
launches: ops/fused_lora_rms_split.py) or one program per row (0), with o's and/or down's product left
to it beside q/k/v's.

Every setting is timed at batch 32 with distinct adapters (the Punica case); the best few and the
default again at batch 32 with one shared adapter, at batch 1 and at 64 and 128 distinct. Median
replay times from CUDA events.

    python benchmarks/sweep_fused_consumers.py --what projections --out benchmarks/results/fused_projections.json
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import time_us  # noqa: E402
from bench_model import BLOCK, RANK, capture, fill_pool, tables  # noqa: E402

from loraplex.adapters import AdapterPool  # noqa: E402
from loraplex.models import ForwardBatch, KVCache, SequenceChunk, dummy_model  # noqa: E402
from loraplex.ops.fused import lora_kernels as consumers  # noqa: E402
from loraplex.ops.lora import overlap  # noqa: E402

CASES = ((32, "distinct"), (32, "shared"), (1, "distinct"), (64, "distinct"), (128, "distinct"))
KNOBS = {"tiles": ("RMS_BLOCK", "SILU_BLOCK", "ROPE_HEADS"), "projections": ("FUSED_PROJECTIONS",),
         "rms": ("RMS_SPLIT", "FUSED_PROJECTIONS")}
PROJECTIONS = ("q_proj", "o_proj", "gate_proj", "down_proj")


def grid(what: str) -> list[dict]:
    if what == "tiles":
        return [dict(zip(KNOBS[what], values))
                for values in itertools.product((1024, 2048, 4096), (256, 512, 1024), (2, 4, 8))]
    if what == "rms":
        sets = ({"q_proj"}, {"q_proj", "o_proj"}, {"q_proj", "down_proj"}, {"q_proj", "o_proj", "down_proj"})
        return [dict(RMS_SPLIT=split, FUSED_PROJECTIONS=frozenset(projs))
                for split, projs in itertools.product((0, 256, 512, 1024), sets)]
    return [dict(FUSED_PROJECTIONS=frozenset(p for p, on in zip(PROJECTIONS, mask) if on))
            for mask in itertools.product((True, False), repeat=len(PROJECTIONS))]


def _module(knob: str):
    return overlap if knob == "FUSED_PROJECTIONS" else consumers


def _label(setting: dict) -> dict:
    return {k: sorted(v) if isinstance(v, frozenset) else v for k, v in setting.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", choices=tuple(KNOBS), default="projections")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    os.environ["LORAPLEX_LORA_OVERLAP"] = "fused"
    overlap.MAX_ROWS = max(b for b, _ in CASES)   # the fused path at every batch timed
    overlap.FUSED_MIN_ROWS = 1                       # each setting's projections at every batch, as it says
    overlap.DECODE_EXTRA_FUSED = frozenset()         # and only those (no gate/up added at 5-32 decode rows)
    default = {k: getattr(_module(k), k) for k in KNOBS[args.what]}
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    model = dummy_model("llama-2-7b", dtype="bfloat16", device="cuda")
    c = model.config
    ctx_blocks = -(-args.context // BLOCK)
    most = max(b for b, _ in CASES)
    kv = KVCache(c, most * ctx_blocks, BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.normal_(0, 1, generator=gen)
    pool = AdapterPool(c, num_slots=most, max_rank=RANK, dtype=torch.bfloat16, device="cuda")
    fill_pool(pool, gen)

    def forward_for(B: int, variant: str):
        batch = ForwardBatch.for_graph(B, args.context, block_size=BLOCK, num_blocks=kv.num_blocks,
                                       vocab_size=c.vocab_size, num_adapter_slots=pool.num_slots, device="cuda")
        slots = list(range(B)) if variant == "distinct" else [0] * B
        tokens = torch.randint(0, c.vocab_size, (B,), generator=cpu_gen).tolist()
        batch.update_([SequenceChunk([t], args.context - 1, tab, s)
                       for t, tab, s in zip(tokens, tables(B, ctx_blocks, 0, cpu_gen), slots)])
        return lambda: model(batch, kv, pool)

    fns = {case: forward_for(*case) for case in CASES}

    def timed(setting: dict, case) -> float:
        for k, v in setting.items():
            setattr(_module(k), k, v)
        try:
            fns[case]()   # compiles this setting's kernels outside the capture
            replay, _ = capture(fns[case])
            us = time_us([replay], target_ms=30, reps=7)
            del replay
            return us
        finally:
            for k, v in default.items():
                setattr(_module(k), k, v)

    rows = []
    first = CASES[0]
    for setting in grid(args.what):
        us = timed(setting, first)
        rows.append(dict(setting=setting, batch=first[0], variant=first[1], graph_us=us))
        print(f"{_label(setting)} B={first[0]} {first[1]}: {us:.0f} µs", flush=True)
    best = sorted((r for r in rows), key=lambda r: r["graph_us"])[:args.top]
    finalists = [default] + [r["setting"] for r in best if r["setting"] != default]
    for setting, case in itertools.product(finalists, CASES[1:]):
        us = timed(setting, case)
        rows.append(dict(setting=setting, batch=case[0], variant=case[1], graph_us=us))
        print(f"{_label(setting)} B={case[0]} {case[1]}: {us:.0f} µs", flush=True)

    def geo(setting: dict) -> float:
        ts = [r["graph_us"] for r in rows if r["setting"] == setting]
        return math.exp(sum(map(math.log, ts)) / len(ts)) if len(ts) == len(CASES) else float("inf")

    chosen = min(finalists, key=geo)
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, what=args.what, context=args.context, rank=RANK, default=_label(default),
                  chosen=_label(chosen), gain_vs_default=geo(default) / geo(chosen) - 1,
                  rows=[dict(r, setting=_label(r["setting"])) for r in rows])
    print(f"chosen {_label(chosen)}: {100 * result['gain_vs_default']:.1f}% over the default {_label(default)}",
          flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
