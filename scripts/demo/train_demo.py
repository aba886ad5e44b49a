"""Train loraplex's demo model and its adapters from the corpus of collect_corpus.py.

Stages, all from one seed:
1. a byte-level BPE tokenizer (8,192 tokens) on the training split of every kind;
2. a small Llama (≈10 M parameters) on a mix of every kind, as a plain language model;
3. one PEFT LoRA adapter per kind (python, docs, fortune, json), rank 16 on all seven projections,
   fine-tuned from the base on that kind only;
4. held-out text (documents neither stage saw), the held-out loss of the base and of every adapter on
   every kind (eval.json), and sample generations (samples.md).

    python scripts/demo/collect_corpus.py --out build/demo_corpus
    python scripts/demo/train_demo.py --corpus build/demo_corpus --out src/loraplex/demo/data

On an H200 the whole run takes a few minutes; on a CPU use --base-steps/--adapter-steps to try it small.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch

KINDS = ("python", "docs", "fortune", "json")
# roughly by size, so that no kind is seen many more times than the others; few enough steps that the
# base stays a generalist (a few epochs of each kind), leaving the adapters room to specialise
BASE_MIX = {"python": 0.45, "docs": 0.03, "fortune": 0.22, "json": 0.30}
# fine-tuning steps per adapter: fewer for the smallest kind, which would otherwise be memorised
ADAPTER_STEPS = {"python": 400, "docs": 120, "fortune": 400, "json": 200}
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n{% else %}"
                 "{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")
SAMPLE_PROMPTS = ["The ", "def ", "{", "A "]


def split_docs(corpus: Path, kind: str) -> tuple[list[str], list[str]]:
    """(train, held-out): a document is held out when its hash says so (1 in 20), whatever the order."""
    train, held = [], []
    for line in (corpus / f"{kind}.jsonl").read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        (held if hashlib.sha256(text.encode()).digest()[0] % 20 == 0 else train).append(text)
    return train, held


def train_tokenizer(docs: list[str], vocab_size: int, out: Path):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False, model_max_length=1024)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def token_stream(tok, docs: list[str]) -> torch.Tensor:
    """Every document as <s> text </s>, concatenated."""
    ids: list[int] = []
    for enc in tok(docs, add_special_tokens=True)["input_ids"]:
        ids.extend(enc)
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def batches(streams: dict[str, torch.Tensor], mix: dict[str, float], batch: int, ctx: int, gen: torch.Generator):
    """Endless batches of `ctx + 1` tokens at random offsets, each row's kind drawn from `mix`."""
    kinds = list(mix)
    weights = torch.tensor([mix[k] for k in kinds])
    while True:
        rows = []
        for k in torch.multinomial(weights, batch, replacement=True, generator=gen).tolist():
            s = streams[kinds[k]]
            start = int(torch.randint(0, len(s) - ctx - 1, (1,), generator=gen))
            rows.append(s[start:start + ctx + 1])
        yield torch.stack(rows)


def lm_loss(model, rows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=rows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))


def fit(model, params, data, steps: int, lr: float, device: str, label: str, warmup: int = 50) -> list[float]:
    from tqdm.auto import tqdm
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    losses = []
    model.train()
    bar = tqdm(range(steps), desc=label, mininterval=5)
    for _ in bar:
        rows = next(data).to(device, non_blocking=True)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = lm_loss(model, rows)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.eval()
    return losses


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, ctx: int, device: str) -> float:
    """Mean next-token loss over the held-out stream in windows of ctx + 1 tokens."""
    n = (len(stream) - 1) // ctx
    rows = torch.stack([stream[i * ctx:i * ctx + ctx + 1] for i in range(n)]).to(device)
    total = 0.0
    for chunk in rows.split(16):
        total += lm_loss(model, chunk).item() * len(chunk)
    return total / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=320)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=5)
    ap.add_argument("--intermediate", type=int, default=864)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--base-steps", type=int, default=700)
    ap.add_argument("--base-lr", type=float, default=2e-3)
    ap.add_argument("--adapter-steps", type=float, default=1.0, help="scale of ADAPTER_STEPS")
    ap.add_argument("--adapter-batch", type=int, default=32)
    ap.add_argument("--adapter-lr", type=float, default=2e-3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--heldout-chars", type=int, default=12000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    base_dir, adapters_dir, held_dir = args.out / "model", args.out / "adapters", args.out / "heldout"
    for d in (base_dir, adapters_dir, held_dir):
        d.mkdir(parents=True, exist_ok=True)
    splits = {k: split_docs(args.corpus, k) for k in KINDS}
    tok = train_tokenizer([d for k in KINDS for d in splits[k][0]], args.vocab_size, base_dir)
    held_text = {}
    for k in KINDS:   # the shipped held-out text: whole documents up to heldout_chars
        docs, size = [], 0
        for d in splits[k][1]:
            docs.append(d[:args.heldout_chars - size])
            size += len(docs[-1])
            if size >= args.heldout_chars:
                break
        held_text[k] = docs
        (held_dir / f"{k}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train = {k: token_stream(tok, splits[k][0]) for k in KINDS}
    held = {k: token_stream(tok, held_text[k]) for k in KINDS}
    print({k: len(v) for k, v in train.items()}, "training tokens;", {k: len(v) for k, v in held.items()},
          "held-out", file=sys.stderr)

    config = LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=1024, rope_theta=10000.0,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=None, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config).to(args.device)
    print(f"base model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters", file=sys.stderr)
    base_losses = fit(model, list(model.parameters()), batches(train, BASE_MIX, args.batch, args.ctx, gen),
                      args.base_steps, args.base_lr, args.device, "base")
    model.to(torch.bfloat16).save_pretrained(base_dir)
    model.generation_config.save_pretrained(base_dir)
    model = LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).to(args.device)

    evals = {"base": {k: held_out_loss(model, held[k], args.ctx, args.device) for k in KINDS}}
    adapter_losses = {}
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for kind in KINDS:
        peft_model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                      target_modules=targets, task_type="CAUSAL_LM"))
        params = [p for p in peft_model.parameters() if p.requires_grad]
        adapter_losses[kind] = fit(peft_model, params, batches(train, {kind: 1.0}, args.adapter_batch, args.ctx, gen),
                                   max(1, round(ADAPTER_STEPS[kind] * args.adapter_steps)), args.adapter_lr, args.device, kind,
                                   warmup=20)
        evals[kind] = {k: held_out_loss(peft_model, held[k], args.ctx, args.device) for k in KINDS}
        peft_model.save_pretrained(adapters_dir / kind)
        model = peft_model.unload()   # the base again, without LoRA layers
    result = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if args.device == "cuda"
                  else "cpu", seconds=round(time.time() - t0, 1), args={k: str(v) for k, v in vars(args).items()},
                  train_tokens={k: len(v) for k, v in train.items()}, heldout_loss=evals,
                  base_loss_curve=base_losses[::50], adapter_loss_curves={k: v[::20] for k, v in adapter_losses.items()})
    (args.out / "eval.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(evals, indent=1))
    (args.out / "samples.md").write_text(samples(model, tok, adapters_dir, args.device))
    return 0


def samples(model, tok, adapters_dir: Path, device: str) -> str:
    """Greedy continuations of a few prompts by the base and by each adapter."""
    from peft import PeftModel
    lines = ["# Demo model samples (greedy, 48 tokens)", ""]
    for prompt in SAMPLE_PROMPTS:
        lines += [f"## prompt {prompt!r}", ""]
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        for name in (None,) + KINDS:
            m = model if name is None else PeftModel.from_pretrained(model, adapters_dir / name)
            out = m.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=tok.eos_token_id)
            text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            lines += [f"**{name or 'base'}**:", "```", prompt + text, "```", ""]
            if name is not None:
                model = m.unload()
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
