"""Which LoRA tile height an eager mixed step should use: a Llama-2-7B forward of decode rows (distinct
adapters, context 600) beside long prompts (their own adapters), with the batch's LoRA tiles 16 rows high
(the decode config: row-wise kernels for tiles of up to 4 rows, many programs) or 64 (the prefill config),
and which `LoraBatch.pick_block_m` picks (`picked`; the committed results ran under the rule before this
probe's, which took 64-row tiles as soon as one adapter had more than 16 rows: `picked_before`). Times are
CUDA-graph replays of the built batch (GPU time, no host time); the backbone alone (no adapters) is the
floor. The logits of both tile heights are compared.

A graph-replayed 162-decode step beside a 64-token prompt took 43.0 ms with 64-row tiles and 25.4 ms as the
engine's graphs hold it with 16-row tiles (results/mixed_step_unlimited.json): each decode row padded to a
64-row tensor-core tile, and the prefill config's few long-running programs.

    python benchmarks/time_lora_tiles.py --out benchmarks/results/lora_tiles_mixed.json
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import time_us  # noqa: E402
from bench_model import BLOCK, RANK, capture, fill_pool, tables  # noqa: E402

from loraplex.adapters import AdapterPool  # noqa: E402
from loraplex.models import ForwardBatch, KVCache, SequenceChunk, dummy_model  # noqa: E402
from loraplex.ops.lora.batch import LoraBatch  # noqa: E402

# (decode rows, prompt lengths): eager mixed steps as the engine makes them (prompt chunks over
# cuda_graph_max_prompt_tokens, or batches over cuda_graph_max_batch), and prefill alone
CASES = [(162, [64]), (162, [512]), (32, [512]), (32, [2048]), (4, [2048]), (0, [2048]), (0, [256] * 8),
         (64, [128] * 4)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    model = dummy_model("llama-2-7b", dtype="bfloat16", device="cuda")
    c = model.config
    max_decodes, max_prompts = max(d for d, _ in CASES), max(len(p) for _, p in CASES)
    decode_blocks = -(-args.context // BLOCK)
    prompt_blocks = -(-max(max(p) for _, p in CASES) // BLOCK)
    num_blocks = max_decodes * decode_blocks + max_prompts * prompt_blocks
    kv = KVCache(c, num_blocks + 64, BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.normal_(0, 1, generator=gen)
    pool = AdapterPool(c, num_slots=max(d + len(p) for d, p in CASES), max_rank=RANK, dtype=torch.bfloat16,
                       device="cuda")
    fill_pool(pool, gen)
    decode_tabs = tables(max_decodes, decode_blocks, 0, cpu_gen)
    prompt_tabs = tables(max_prompts, prompt_blocks, max_decodes * decode_blocks, cpu_gen)
    rows = []
    for decodes, prompts in CASES:
        chunks = [SequenceChunk([int(t)], args.context - 1, decode_tabs[i], i)
                  for i, t in enumerate(torch.randint(0, c.vocab_size, (decodes,), generator=cpu_gen))]
        for j, p in enumerate(prompts):
            ids = torch.randint(0, c.vocab_size, (p,), generator=cpu_gen).tolist()
            chunks.append(SequenceChunk(ids, 0, prompt_tabs[j], decodes + j))
        times, logits = {}, {}
        for tiles in ("backbone", 16, 64):
            with mock.patch.object(LoraBatch, "pick_block_m", staticmethod(lambda lens, slots, m=tiles: m)):
                batch = ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=kv.num_blocks,
                                           vocab_size=c.vocab_size, device="cuda", num_adapter_slots=pool.num_slots)
            use_pool = None if tiles == "backbone" else pool
            replay, out = capture(functools.partial(model, batch, kv, use_pool))
            times[str(tiles)] = time_us([replay])
            if tiles in (16, 64):
                replay()
                torch.cuda.synchronize()
                logits[tiles] = out.float().clone()
            print(f"{decodes:4d} decodes + prompts {prompts}: {tiles!s:>8s} {times[str(tiles)]:9.0f} µs", flush=True)
            del replay, out, batch
            torch.cuda.empty_cache()
        diff = (logits[16] - logits[64]).abs().max().item()
        scale = logits[64].abs().max().item()
        auto = LoraBatch.pick_block_m(*_lens_slots(chunks))
        rows.append(dict(decodes=decodes, prompts=prompts, context=args.context, graph_us=times,
                         picked=auto, logits_max_diff=diff, logits_max=scale))
        print(f"     picked: {auto}; 16 vs 64 tiles: logits differ by at most {diff:.3g} (largest {scale:.3g})",
              flush=True)
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, rank=RANK, rows=rows)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def _lens_slots(chunks):
    import numpy as np
    return (np.array([len(ch.token_ids) for ch in chunks]), np.array([ch.adapter_slot for ch in chunks]))


if __name__ == "__main__":
    main()
