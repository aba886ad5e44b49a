"""Eager vs graph-replayed *mixed* steps (decode rows plus a prompt chunk) of a Llama-2-7B forward: how
much of an eager mixed step is host time, i.e. what capturing mixed steps in CUDA graphs could save.

Each case: 31 decode rows (context 600, distinct adapters or none) plus one prompt of P tokens (its own
adapter). Eager: a forward launched from Python (median of CUDA-event blocks, which on a host-bound
forward is its wall time); graph: the same built batch captured once and replayed.

    python benchmarks/time_mixed_step.py --out benchmarks/results/mixed_step.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import time_us  # noqa: E402
from bench_model import BLOCK, RANK, capture, fill_pool, tables  # noqa: E402

from loraplex.adapters import AdapterPool  # noqa: E402
from loraplex.models import ForwardBatch, KVCache, SequenceChunk, dummy_model  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="0,24,128")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    model = dummy_model("llama-2-7b", dtype="bfloat16", device="cuda")
    c = model.config
    decodes, ctx_blocks = 31, -(-args.context // BLOCK)
    kv = KVCache(c, (decodes + 1) * ctx_blocks + 64, BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.normal_(0, 1, generator=gen)
    pool = AdapterPool(c, num_slots=32, max_rank=RANK, dtype=torch.bfloat16, device="cuda")
    fill_pool(pool, gen)
    tabs = tables(decodes + 1, ctx_blocks, 0, cpu_gen)
    rows = []
    for prompt in (int(p) for p in args.prompts.split(",")):
        for variant in ("backbone", "distinct"):
            slots = list(range(32)) if variant == "distinct" else [-1] * 32
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
            rows.append(dict(prompt=prompt, decodes=decodes, variant=variant, rows=batch.num_tokens,
                             eager_us=eager, graph_us=graph))
            print(f"prompt {prompt:4d} + {decodes} decodes {variant:9s} eager {eager:8.0f} µs  graph {graph:8.0f} µs",
                  flush=True)
            del replay
            torch.cuda.empty_cache()
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, context=args.context, rank=RANK, rows=rows)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
