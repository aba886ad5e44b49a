"""Decode forwards with the LoRA kernels beside the GEMMs or after them, side by side (one H200 run).

Llama-2-7B shapes, dummy bf16 weights, rank-16 adapters on all seven projections, context 512,
batches of 1–256 sequences in graph batches as the engine captures them (16-row LoRA tiles; runs
before 2026-12-02 built their batches with `ForwardBatch.build`, which gave one shared adapter
64-row tiles from 17 sequences up): the backbone alone, then each sequence with its own adapter ("distinct")
and all sharing one ("shared"), each captured in a CUDA graph three ways (ops/overlap.py): `off`
(shrink and expand after the GEMM, one stream), `shrink` (the shrink on a side stream beside the
GEMM) and `full` (shrink and expand beside the GEMM, the product added by the next op), at every
batch size whatever `overlap.MAX_ROWS` and `SHRINK_MAX_ROWS` say. Median replay times
from CUDA events, beside the memory floor (weights, KV and each used adapter once over the copy
bandwidth measured in the same run).

    python benchmarks/bench_lora_overlap.py --out benchmarks/results/lora_overlap.json \
        --md benchmarks/results/lora_overlap.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import copy_bandwidth_gbs, time_us  # noqa: E402
from bench_model import BLOCK, RANK, adapter_bytes, capture, fill_pool, kv_bytes, tables, weight_bytes  # noqa: E402

from loraplex.adapters import AdapterPool  # noqa: E402
from loraplex.models import ForwardBatch, KVCache, SequenceChunk, dummy_model  # noqa: E402
from loraplex.ops.lora import overlap  # noqa: E402

MODES = ("off", "shrink", "full", "fused")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-2-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batches", default="1,32,64,128,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--carveouts", default="0",
                    help="SMs kept from cuBLAS's GEMMs while capturing (torch._C._set_sm_carveout_experimental), "
                         "comma-separated; values > 0 are timed for the backbone and --carveout-mode only")
    ap.add_argument("--carveout-mode", default="fused", choices=MODES[1:])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    carveouts = [int(v) for v in args.carveouts.split(",")]
    overlap.MAX_ROWS = overlap.SHRINK_MAX_ROWS = 1 << 30   # time every way at every size
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    model = dummy_model(args.preset, dtype="bfloat16", device="cuda", num_layers=args.layers)
    c = model.config
    ctx_blocks = -(-args.context // BLOCK)
    kv = KVCache(c, max(batches) * ctx_blocks, BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.normal_(0, 1, generator=gen)
    pool = AdapterPool(c, num_slots=max(batches), max_rank=RANK, dtype=torch.bfloat16, device="cuda")
    fill_pool(pool, gen)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    for B in batches:
        tabs = tables(B, ctx_blocks, 0, cpu_gen)
        tokens = torch.randint(0, c.vocab_size, (B,), generator=cpu_gen).tolist()
        for variant in ("backbone", "distinct", "shared"):
            slots = {"backbone": [-1] * B, "distinct": list(range(B)), "shared": [0] * B}[variant]
            # A graph batch, as the engine captures: 16-row LoRA tiles whatever the adapters.
            batch = ForwardBatch.for_graph(B, args.context, block_size=BLOCK, num_blocks=kv.num_blocks,
                                           vocab_size=c.vocab_size, num_adapter_slots=pool.num_slots, device="cuda")
            batch.update_([SequenceChunk([t], args.context - 1, tab, s) for t, tab, s in zip(tokens, tabs, slots)])
            use_pool = None if variant == "backbone" else pool
            fn = lambda: model(batch, kv, use_pool)  # noqa: E731
            adapters = {"backbone": 0, "distinct": B, "shared": 1}[variant]
            floor_us = (weight_bytes(model, B) + kv_bytes(model, B * args.context)
                        + adapters * adapter_bytes(model)) / copy_gbs / 1e3
            runs = [(mode, 0) for mode in (("off",) if variant == "backbone" else MODES)]
            runs += [("off" if variant == "backbone" else args.carveout_mode, c) for c in carveouts if c > 0]
            for mode, carveout in runs:
                os.environ["LORAPLEX_LORA_OVERLAP"] = mode
                eager = fn().clone()   # "full" and "fused" change the eager forward too (the next op adds the product)
                # The GEMMs' kernels (and grids) are chosen while capturing: the carve-out holds at replay.
                torch._C._set_sm_carveout_experimental(carveout or None)
                try:
                    replay, out = capture(fn)
                finally:
                    torch._C._set_sm_carveout_experimental(None)
                with torch.inference_mode():
                    out.fill_(float("nan"))
                replay()
                err = (out - eager).abs().max().item() / max(eager.abs().max().item(), 1e-30)
                us = time_us([replay], target_ms=30, reps=7)
                rows.append(dict(batch=B, variant=variant, overlap=mode, carveout=carveout, graph_us=us,
                                 floor_us=floor_us, of_floor=floor_us / us, rel_err_vs_eager=err))
                print(f"B={B:4d} {variant:9s} {mode:7s} carve-out {carveout:3d} {us:8.0f} µs  floor {floor_us:7.0f} µs "
                      f"({100 * floor_us / us:.0f}%)  rel err vs eager {err:.1e}", flush=True)
                del replay, out
        torch.cuda.empty_cache()
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, preset=args.preset, layers=c.num_hidden_layers, rank=RANK,
                  context=args.context, copy_gbs=copy_gbs, carveout_mode=args.carveout_mode,
                  fused_projections=sorted(overlap.FUSED_PROJECTIONS), fused_min_rows=overlap.FUSED_MIN_ROWS,
                  decode_extra_fused=sorted(overlap.DECODE_EXTRA_FUSED),   # no key before the seventeenth session: []
                  decode_extra_max_rows=overlap.DECODE_EXTRA_MAX_ROWS,
                  rows=rows)   # decode forwards of fewer rows than fused_min_rows: q/k/v's product alone
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.md:
        args.md.write_text(markdown(result))
    return result


def _projs(result: dict) -> str:
    # Runs before 2026-12-01's third session left every projection's product to the next op.
    names = result.get("fused_projections", ["down_proj", "gate_proj", "o_proj", "q_proj"])
    short = {"q_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up", "down_proj": "down"}
    text = "/".join(short[n] for n in names)
    extra = [n for n in result.get("decode_extra_fused", []) if n not in names]   # since the seventeenth session
    if extra:
        text += f" (and {'/'.join(short[n] for n in extra)} at {result.get('fused_min_rows', 5)}-"
        text += f"{result.get('decode_extra_max_rows', 32)} rows)"
    return text


def markdown(result: dict) -> str:
    lines = [f"# Decode forward, LoRA beside the GEMMs — {result['gpu']}, {result['date'][:10]}", "",
             f"{result['preset']} ({result['layers']} layers), dummy bf16 weights, rank {result['rank']} on all "
             f"7 projections, context {result['context']}; CUDA-graph replays, median of CUDA events; copy "
             f"bandwidth {result['copy_gbs']:.0f} GB/s.", "",
             "| batch | adapters | LoRA after the GEMM (µs) | shrink beside it (µs) | both beside it (µs) | "
             f"fused: {_projs(result)} expanded by the next op, the rest both beside (µs) | "
             "backbone (µs) | floor (µs) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    all_rows = result["rows"]
    rows = [r for r in all_rows if not r.get("carveout")]
    for B in sorted({r["batch"] for r in rows}):
        base = next(r for r in rows if r["batch"] == B and r["variant"] == "backbone")
        for variant in ("distinct", "shared"):
            t = {r["overlap"]: r for r in rows if r["batch"] == B and r["variant"] == variant}
            cell = lambda m: f"{t[m]['graph_us']:.0f}" if m in t else "–"  # noqa: E731
            lines.append(f"| {B} | {variant} | {cell('off')} | {cell('shrink')} | {cell('full')} | {cell('fused')} | "
                         f"{base['graph_us']:.0f} | {t['off']['floor_us']:.0f} |")
    carved = sorted({r["carveout"] for r in all_rows if r.get("carveout")})
    if carved:
        carve_mode = result.get("carveout_mode", "full")
        lines += ["", "SMs kept from the GEMMs while capturing (cuBLAS SM carve-out); backbone and "
                      f"\"{carve_mode}\":", "",
                  "| batch | adapters | " + " | ".join(f"{c} SMs (µs)" for c in [0] + carved) + " |",
                  "|---:|---|" + "---:|" * (len(carved) + 1)]
        for B in sorted({r["batch"] for r in all_rows}):
            for variant in ("backbone", "distinct", "shared"):
                mode = "off" if variant == "backbone" else carve_mode
                t = {r.get("carveout", 0): r["graph_us"] for r in all_rows
                     if r["batch"] == B and r["variant"] == variant and r["overlap"] == mode}
                lines.append(f"| {B} | {variant} | " + " | ".join(f"{t[c]:.0f}" if c in t else "–"
                                                                  for c in [0] + carved) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
