"""What LoRA adds to an eager prefill (or mixed) step of Llama-2-7B, and which large-tile settings cut it (GPU probe).

The engine benchmark of issue 5 (prompts 128–512, batch 32) runs its prompts in eager steps of ~2,000 rows
("direct" path: sgmv.add_lora after each GEMM), and with 32 distinct adapters those steps took ~10 ms more
than the backbone's ~40 (results/engine.md, 2026-12-02). Cases, each a ForwardBatch of 7B-sized rows in tiles
of 64 (sgmv.CONFIGS[64], the config LORAPLEX_LORA_PREFILL changes; the values apply to sgmv.PREFILL_DEFAULT):
- `prompts6`: six 320-token prompts, each its own adapter (1,920 rows);
- `mixed20`: five 320-token prompts and 20 decodes at context 400, every sequence its own adapter;
- `prompt2048`: one 2,048-token prompt.
For each case and LORAPLEX_LORA_PREFILL value: the forward's median µs (CUDA events; these eager forwards are
GPU-bound, and their times move by ~1 ms run to run; `--rounds` alternates the variants), and the GPU time
of the LoRA kernels, of cuBLAS's GEMMs and of all kernels from the PyTorch profiler over 3 forwards (shrink
and expand apart: precise where the forward's time is not). The value with the least kernel time over all
cases (every kernel of the forward: "store" changes the GEMMs too; before the nineteenth session, the LoRA
kernels' alone) is written to `--best` (for a run of the engine benchmark with it).

    python benchmarks/probe_prefill_lora.py --out benchmarks/results/probe_prefill_lora.json --best best.txt
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import time_us  # noqa: E402
from bench_model import BLOCK, RANK, fill_pool, tables  # noqa: E402

from loraplex.adapters import AdapterPool  # noqa: E402
from loraplex.models import ForwardBatch, KVCache, SequenceChunk, dummy_model  # noqa: E402
from loraplex.ops.lora import sgmv  # noqa: E402
from loraplex.ops.lora.batch import LoraBatch  # noqa: E402

CASES = {"prompts6": ([320] * 6, 0), "mixed20": ([320] * 5, 20), "prompt2048": ([2048], 0)}
# Changes to sgmv.PREFILL_DEFAULT (prefetch, 64 columns, 4 programs per SM since 2026-12-02); the last is PREFILL_PLAIN.
VARIANTS = ["", "n128", "noprefetch", "epps8", "n32,epps8", "noprefetch,n128,epps2"]


def build(model, kv, prompts: list[int], decodes: int, context: int, adapters: bool, gen: torch.Generator):
    c = model.config
    seqs = len(prompts) + decodes
    blocks = -(-max(max(prompts), context + 1) // BLOCK)
    tabs = tables(seqs, blocks, 0, gen)
    chunks = []
    for i, n in enumerate(prompts):
        ids = torch.randint(0, c.vocab_size, (n,), generator=gen).tolist()
        chunks.append(SequenceChunk(ids, 0, tabs[i], i if adapters else -1))
    for j in range(decodes):
        i = len(prompts) + j
        chunks.append(SequenceChunk([int(torch.randint(0, c.vocab_size, (1,), generator=gen))], context - 1, tabs[i],
                                    i if adapters else -1))
    return ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=kv.num_blocks, vocab_size=c.vocab_size,
                              device="cuda", num_adapter_slots=64)


GEMM_NAMES = ("gemm", "xmma", "cutlass", "nvjet", "sm90_")   # cuBLAS's kernels (their names vary by version)


def lora_kernel_us(fn, reps: int = 3) -> dict:
    """GPU µs per call of `fn` in the LoRA kernels (shrink, expand), in cuBLAS's GEMMs (whose epilogue reads the
    stored products with KernelConfig.store_first) and in all kernels, from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {"shrink": 0.0, "expand": 0.0, "gemm": 0.0, "all": 0.0}
    for e in prof.key_averages():
        total = getattr(e, "self_device_time_total", None)
        total = e.self_cuda_time_total if total is None else total
        if not total or e.key.startswith("cuda") or e.key.startswith("Memcpy"):
            continue
        for kind in ("shrink", "expand"):
            if e.key == f"_sgmv_{kind}_kernel":
                out[kind] += total / reps
        if any(n in e.key.lower() for n in GEMM_NAMES) and not e.key.startswith("_"):
            out["gemm"] += total / reps
        out["all"] += total / reps
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--variants", default=";".join(VARIANTS), help="LORAPLEX_LORA_PREFILL values, ';'-separated")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=1,
                    help="forward timings per variant, the variants alternating round by round (median reported)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--best", type=Path, help="write the LORAPLEX_LORA_PREFILL value of least kernel time here")
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    model = dummy_model("llama-2-7b", dtype="bfloat16", device="cuda")
    kv = KVCache(model.config, 40 * 128, BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.normal_(0, 1, generator=g)
    pool = AdapterPool(model.config, num_slots=64, max_rank=RANK, dtype=torch.bfloat16, device="cuda")
    fill_pool(pool, g)
    # the variants are changes to the default, whatever LORAPLEX_LORA_PREFILL was at import
    base_cfg, pick = sgmv.PREFILL_DEFAULT, LoraBatch.pick_block_m
    start_cfg = sgmv.CONFIGS[64]
    variants = args.variants.split(";")
    # each variant's config, built once (a bad value fails before any timing)
    configs = {v: dataclasses.replace(base_cfg, **sgmv._prefill_options(v)) for v in variants}
    rows, totals = [], {v: 0.0 for v in variants}
    LoraBatch.pick_block_m = staticmethod(lambda *_: 64)
    try:
        for case in args.cases.split(","):
            prompts, decodes = CASES[case]
            batch = build(model, kv, prompts, decodes, args.context, False, torch.Generator().manual_seed(1))
            backbone = time_us([lambda: model(batch, kv, None)], reps=7)
            base_kernels = lora_kernel_us(lambda: model(batch, kv, None))
            print(f"{case:11s} backbone {backbone:9.0f} µs  GEMMs {base_kernels['gemm']:7.0f}  all kernels "
                  f"{base_kernels['all']:7.0f} µs", flush=True)
            batch = build(model, kv, prompts, decodes, args.context, True, torch.Generator().manual_seed(1))
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for value in variants:
                    sgmv.CONFIGS[64] = configs[value]
                    times[value].append(time_us([lambda: model(batch, kv, pool)], reps=7))
            for value in variants:
                sgmv.CONFIGS[64] = configs[value]
                us = statistics.median(times[value])
                kernels = lora_kernel_us(lambda: model(batch, kv, pool))
                totals[value] += kernels["all"]   # with "store" the GEMMs change too
                rows.append(dict(case=case, prefill=value, rows=batch.num_tokens, forward_us=round(us, 1),
                                 forward_us_rounds=[round(t, 1) for t in times[value]],
                                 backbone_us=round(backbone, 1), backbone_gemm_us=round(base_kernels["gemm"], 1),
                                 backbone_kernels_us=round(base_kernels["all"], 1),
                                 shrink_us=round(kernels["shrink"], 1),
                                 expand_us=round(kernels["expand"], 1), gemm_us=round(kernels["gemm"], 1),
                                 kernels_us=round(kernels["all"], 1)))
                print(f"{case:11s} {value or 'base':20s} forward {us:9.0f} µs (+{us - backbone:6.0f})  shrink "
                      f"{kernels['shrink']:7.0f}  expand {kernels['expand']:7.0f}  GEMMs {kernels['gemm']:7.0f}  "
                      f"all kernels {kernels['all']:7.0f} µs", flush=True)
    finally:
        sgmv.CONFIGS[64] = start_cfg
        LoraBatch.pick_block_m = staticmethod(pick)
    best = min(totals, key=totals.get)
    print("kernel µs over the cases:", {k or "base": round(v) for k, v in totals.items()}, "best:", best or "base")
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, context=args.context, rank=RANK, base_config=dataclasses.asdict(base_cfg),
                  kernel_us_total=totals, best=best, rows=rows)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.best:
        args.best.write_text(best)
    return result


if __name__ == "__main__":
    main()
