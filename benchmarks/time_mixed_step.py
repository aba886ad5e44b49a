"""Eager vs graph-replayed *mixed* steps (decode rows plus a prompt chunk) of a Llama-2-7B forward: how
much of an eager mixed step is host time, i.e. what capturing mixed steps in CUDA graphs could save.

Each case: `--decodes` decode rows (default 31, context 600, distinct adapters or none) plus one prompt of
P tokens (its own adapter). Eager: a forward launched from Python (median of CUDA-event blocks, which on a
host-bound forward is its wall time); graph: the same built batch captured once and replayed.
`--graph-seqs S1,S2,...` also replays the batch as the engine's graphs hold it: a `ForwardBatch.for_graph`
batch of S sequences and the prompt bucket of P (engine/cuda_graphs.py), padded rows and sequences
included, for each S that holds the step (what padding a step up to its graph's shape costs).

    python benchmarks/time_mixed_step.py --out benchmarks/results/mixed_step.json
    python benchmarks/time_mixed_step.py --decodes 162 --prompts 0,64 --graph-seqs 176,192,256 \
        --out benchmarks/results/mixed_step_unlimited.json
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import time_us  # noqa: E402
from bench_model import BLOCK, RANK, capture, fill_pool, tables  # noqa: E402

from loraplex.adapters import AdapterPool  # noqa: E402
from loraplex.engine.cuda_graphs import PROMPT_BUCKETS  # noqa: E402
from loraplex.models import ForwardBatch, KVCache, SequenceChunk, dummy_model  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="0,24,128")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--decodes", type=int, default=31)
    ap.add_argument("--graph-seqs", default="", help="graph batches of these many sequences too (comma-separated)")
    ap.add_argument("--max-seq-len", type=int, default=2048, help="the graph batches' context bound")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    graph_seqs = [int(s) for s in args.graph_seqs.split(",") if s.strip()]
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    model = dummy_model("llama-2-7b", dtype="bfloat16", device="cuda")
    c = model.config
    decodes, ctx_blocks = args.decodes, -(-args.context // BLOCK)
    kv = KVCache(c, (decodes + 1) * ctx_blocks + 64, BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.normal_(0, 1, generator=gen)
    pool = AdapterPool(c, num_slots=decodes + 1, max_rank=RANK, dtype=torch.bfloat16, device="cuda")
    fill_pool(pool, gen)
    tabs = tables(decodes + 1, ctx_blocks, 0, cpu_gen)
    rows = []
    for prompt in (int(p) for p in args.prompts.split(",")):
        for variant in ("backbone", "distinct"):
            slots = list(range(decodes + 1)) if variant == "distinct" else [-1] * (decodes + 1)
            chunks = [SequenceChunk([int(t)], args.context - 1, tabs[i], slots[i])
                      for i, t in enumerate(torch.randint(0, c.vocab_size, (decodes,), generator=cpu_gen))]
            if prompt:
                ids = torch.randint(0, c.vocab_size, (prompt,), generator=cpu_gen).tolist()
                chunks.append(SequenceChunk(ids, 0, tabs[decodes], slots[decodes]))
            batch = ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=kv.num_blocks, vocab_size=c.vocab_size,
                                       device="cuda", num_adapter_slots=pool.num_slots)
            use_pool = None if variant == "backbone" else pool
            fn = lambda: model(batch, kv, use_pool)  # noqa: E731
            eager = time_us([fn], reps=7)
            replay, _ = capture(fn)
            graph = time_us([replay])
            rows.append(dict(prompt=prompt, decodes=decodes, variant=variant, batch="built", rows=batch.num_tokens,
                             eager_us=eager, graph_us=graph))
            print(f"prompt {prompt:4d} + {decodes} decodes {variant:9s} eager {eager:8.0f} µs  graph {graph:8.0f} µs",
                  flush=True)
            del replay
            torch.cuda.empty_cache()
            bucket = next((p for p in PROMPT_BUCKETS if p >= prompt), None) if prompt else 0
            for seqs in (s for s in graph_seqs if s >= len(chunks) and bucket is not None):
                padded = ForwardBatch.for_graph(seqs, args.max_seq_len, block_size=BLOCK, num_blocks=kv.num_blocks,
                                                vocab_size=c.vocab_size, num_adapter_slots=pool.num_slots,
                                                device="cuda", max_prompt_tokens=bucket).update_(chunks)
                replay, _ = capture(functools.partial(model, padded, kv, use_pool))
                graph = time_us([replay])
                rows.append(dict(prompt=prompt, decodes=decodes, variant=variant, batch=f"graph {seqs}x{bucket}",
                                 rows=seqs + bucket, eager_us=None, graph_us=graph))
                print(f"prompt {prompt:4d} + {decodes} decodes {variant:9s} graph batch {seqs}x{bucket}: "
                      f"{graph:8.0f} µs", flush=True)
                del replay, padded
                torch.cuda.empty_cache()
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, context=args.context, rank=RANK, rows=rows)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
