"""Quality of FP8 serving on the shipped demo model: held-out loss of the base model and of each adapter, with the
checkpoint's bf16 weights, with FP8 weights (`--quantization fp8`: e4m3, a scale per output channel) and with FP8
weights and an FP8 KV cache, through loraplex's own model (its CPU reference path here, the Triton kernels on a GPU).

The held-out text is the demo's (src/loraplex/demo/data/heldout: documents neither training stage saw), tokenized as
scripts/demo/train_demo.py did (<s> text </s> a document), cut into windows of `--ctx` + 1 tokens; the loss is the
mean next-token cross-entropy over every position, as the training script's `held_out_loss` (whose bf16 numbers,
in the demo's eval.json, the bf16 rows here reproduce). Each adapter is scored on every domain.

    python benchmarks/fp8_quality.py --out benchmarks/results/fp8_quality.json --md benchmarks/results/fp8_quality.md
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.adapters import AdapterPool, inspect_peft_adapter, read_peft_adapter
from loraplex.demo.assets import demo_adapters, demo_model_dir, heldout_path
from loraplex.models import ForwardBatch, KVCache, SequenceChunk, load_model

BLOCK = 16
SEQS_PER_FORWARD = 4


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Every document as <s> text </s>, concatenated (train_demo.py's token_stream)."""
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=True)["input_ids"]:
        ids += enc + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


class Scorer:
    """A loraplex model with the demo adapters in a pool, and a KV cache for SEQS_PER_FORWARD windows."""

    def __init__(self, model_dir: Path, adapters: dict[str, Path], ctx: int, dtype: torch.dtype, device: str,
                 quantization: str | None, kv_dtype: str) -> None:
        self.model = load_model(model_dir, dtype=dtype, device=device, quantization=quantization)
        c = self.model.config
        self.pool = AdapterPool(c, num_slots=len(adapters), max_rank=64, dtype=dtype, device=device)
        self.slots: dict[str | None, int] = {None: -1}
        for slot, (name, folder) in enumerate(adapters.items()):
            self.pool.write(slot, read_peft_adapter(inspect_peft_adapter(folder, c, name=name), dtype))
            self.slots[name] = slot
        self.blocks = -(-(ctx + 1) // BLOCK)
        self.kv = make_cache(self.model, SEQS_PER_FORWARD * self.blocks, dtype, device, kv_dtype)

    def loss(self, stream: torch.Tensor, ctx: int, adapter: str | None) -> float:
        """Mean next-token loss over the stream's windows of ctx + 1 tokens."""
        n = (len(stream) - 1) // ctx
        windows = [stream[i * ctx:i * ctx + ctx + 1] for i in range(n)]
        total = 0.0
        for start in range(0, n, SEQS_PER_FORWARD):
            group = windows[start:start + SEQS_PER_FORWARD]
            chunks = [SequenceChunk(w[:-1].tolist(), 0, list(range(i * self.blocks, (i + 1) * self.blocks)),
                                    self.slots[adapter]) for i, w in enumerate(group)]
            batch = ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=self.kv.num_blocks,
                                       vocab_size=self.model.config.vocab_size, device=self.model.device)
            batch.logits_rows = torch.arange(len(group) * ctx, dtype=torch.int32, device=self.model.device)
            logits = self.model(batch, self.kv, self.pool)
            targets = torch.cat([w[1:] for w in group]).to(logits.device)
            total += F.cross_entropy(logits, targets, reduction="sum").item()
        return total / (n * ctx)


def make_cache(model, num_blocks: int, dtype: torch.dtype, device: str, kv_dtype: str) -> KVCache:
    """The model's dtype ("auto"), or e4m3 with the checkpoint's per-layer scales (1.0 where it has none)."""
    if kv_dtype == "auto":
        return KVCache(model.config, num_blocks, BLOCK, dtype=dtype, device=device)
    scales = {} if model.kv_scales is None else dict(k_scale=model.kv_scales.k, v_scale=model.kv_scales.v)
    return KVCache(model.config, num_blocks, BLOCK, dtype=torch.float8_e4m3fn, device=device, **scales)


CONFIGS = {"bf16": (None, "auto"), "fp8 weights": ("fp8", "auto"), "fp8 weights + fp8 KV": ("fp8", "fp8")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="activations: bfloat16 on a GPU, float32 on the CPU (default)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    model_dir, adapters = demo_model_dir(), demo_adapters()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    domains = sorted(adapters)
    streams = {k: token_stream(tokenizer, [json.loads(line)["text"] for line in
                                           heldout_path(k).read_text().splitlines() if line.strip()]) for k in domains}
    result = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", dtype=str(dtype),
                  date=datetime.date.today().isoformat(), ctx=args.ctx, loss={})
    for name in args.configs.split(","):
        quantization, kv_dtype = CONFIGS[name]
        scorer = Scorer(model_dir, adapters, args.ctx, dtype, args.device, quantization, kv_dtype)
        result["loss"][name] = {str(a): {k: scorer.loss(streams[k], args.ctx, a) for k in domains}
                                for a in [None, *domains]}
        print(name, json.dumps(result["loss"][name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        args.md.write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    names = list(r["loss"])
    base = r["loss"][names[0]]
    lines = [f"# FP8 quality on the demo model — {r['device']}, {r['dtype']}, {r['date']}", "",
             f"Held-out loss (nats a token, windows of {r['ctx']}) of each model on its own domain (the base: the mean "
             "over the domains), and its change against the first configuration.", "",
             "| model | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for adapter in base:
        cells = []
        for name in names:
            losses = r["loss"][name][adapter]
            own = sum(losses.values()) / len(losses) if adapter == "None" else losses[adapter]
            ref = base[adapter]
            ref_own = sum(ref.values()) / len(ref) if adapter == "None" else ref[adapter]
            cells.append(f"{own:.4f}" + ("" if name == names[0] else f" ({100 * (own / ref_own - 1):+.2f}%)"))
        lines.append(f"| {'base' if adapter == 'None' else adapter} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
