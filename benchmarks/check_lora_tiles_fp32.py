"""How far each LoRA tile height's bf16 logits are from an fp32 forward of the same weights: a Llama-2-7B
mixed step (decode rows with distinct adapters beside a prompt), its LoRA in 16-row or 64-row tiles, against
the same model, adapters and KV cache in fp32. Says whether the two tile heights' difference
(time_lora_tiles.py) is bf16 rounding carried through 32 layers or one path's error.

    python benchmarks/check_lora_tiles_fp32.py --out benchmarks/results/lora_tiles_fp32.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import BLOCK, RANK, fill_pool, tables  # noqa: E402

from loraplex.adapters import AdapterPool  # noqa: E402
from loraplex.models import ForwardBatch, KVCache, SequenceChunk, dummy_model  # noqa: E402
from loraplex.ops.lora.batch import LoraBatch  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    models = {torch.bfloat16: dummy_model("llama-2-7b", dtype="bfloat16", device="cuda")}
    c = models[torch.bfloat16].config
    models[torch.float32] = dummy_model("llama-2-7b", dtype="float32", device="cuda")
    with torch.no_grad():
        for p32, p16 in zip(models[torch.float32].parameters(), models[torch.bfloat16].parameters()):
            p32.copy_(p16)
    d, ctx_blocks = args.decodes, -(-args.context // BLOCK)
    num_blocks = d * ctx_blocks + -(-args.prompt // BLOCK) + 8
    kvs = {dt: KVCache(c, num_blocks, BLOCK, dtype=dt, device="cuda") for dt in models}
    kvs[torch.bfloat16].data.normal_(0, 1, generator=gen)
    pools = {dt: AdapterPool(c, num_slots=d + 1, max_rank=RANK, dtype=dt, device="cuda") for dt in models}
    fill_pool(pools[torch.bfloat16], gen)
    with torch.no_grad():
        for layer in range(c.num_hidden_layers):
            for proj in pools[torch.bfloat16].lora_a[layer]:
                for w in ("lora_a", "lora_b"):
                    getattr(pools[torch.float32], w)[layer][proj].copy_(getattr(pools[torch.bfloat16], w)[layer][proj])
        pools[torch.float32].ranks.copy_(pools[torch.bfloat16].ranks)
        pools[torch.float32].scalings.copy_(pools[torch.bfloat16].scalings)
    tabs = tables(d, ctx_blocks, 0, cpu_gen)
    prompt_tab = list(range(d * ctx_blocks, d * ctx_blocks + -(-args.prompt // BLOCK)))
    chunks = [SequenceChunk([int(t)], args.context - 1, tabs[i], i)
              for i, t in enumerate(torch.randint(0, c.vocab_size, (d,), generator=cpu_gen))]
    chunks.append(SequenceChunk(torch.randint(0, c.vocab_size, (args.prompt,), generator=cpu_gen).tolist(), 0,
                                prompt_tab, d))
    logits = {}
    for name, dt, tiles in (("fp32", torch.float32, 16), ("bf16 16", torch.bfloat16, 16),
                            ("bf16 64", torch.bfloat16, 64)):
        # the prompt's KV is written by the forward; the decode rows' contexts come from the bf16 cache
        if dt is torch.float32:
            kvs[dt].data.copy_(kvs[torch.bfloat16].data)
        with mock.patch.object(LoraBatch, "pick_block_m", staticmethod(lambda lens, slots, m=tiles: m)):
            batch = ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=num_blocks, vocab_size=c.vocab_size,
                                       device="cuda", num_adapter_slots=d + 1)
        with torch.no_grad():
            logits[name] = models[dt](batch, kvs[dt], pools[dt]).float()
        torch.cuda.synchronize()
    rows = {}
    for a, b in (("bf16 16", "fp32"), ("bf16 64", "fp32"), ("bf16 16", "bf16 64")):
        diff = (logits[a] - logits[b]).abs()
        rows[f"{a} vs {b}"] = dict(max=diff.max().item(), mean=diff.mean().item())
        print(f"{a:8s} vs {b:8s}: max {diff.max().item():.4f}  mean {diff.mean().item():.5f}", flush=True)
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  decodes=d, prompt=args.prompt, context=args.context, logits_abs_max=logits["fp32"].abs().max().item(),
                  diffs=rows)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
