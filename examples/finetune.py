"""Fine-tune a LoRA adapter with PEFT, then serve it with loraplex.

    python examples/finetune.py --base MODEL_DIR --data train.jsonl --out adapters/mine \\
        --rank 8 --alpha 16 [--targets q_proj v_proj ...] [--epochs 3] [--lr 2e-4] [--batch-size 8] \\
        [--max-len 256] [--dropout 0.0] [--chat] [--eval-fraction F] [--seed 0] [--device auto|cpu|cuda] \\
        [--max-steps N]

MODEL_DIR is a Hugging Face Llama-family folder (config.json, safetensors, tokenizer files).
train.jsonl holds one JSON object per line: {"prompt": "...", "response": "..."} ("completion" is
accepted for "response"). The model learns the response tokens (+ end of sequence) only; the
prompt is context. With --chat the prompt is rendered as a user turn by the tokenizer's chat
template, as `/v1/chat/completions` renders it. --max-steps, when given, overrides --epochs. The
held-out loss is printed before and after training (--eval-fraction: default 0.1 from 10 examples
on). OUT_DIR becomes a standard PEFT adapter folder (adapter_config.json +
adapter_model.safetensors) that `loraplex serve --model MODEL_DIR --lora NAME=OUT_DIR` serves.
Needs `pip install transformers peft`. A small model trains on the CPU in minutes.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IGNORE = -100   # the label that cross-entropy skips: prompt and padding tokens
Features = tuple[list[int], list[int]]   # input ids, labels


@dataclass(frozen=True)
class Example:
    prompt: str
    response: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="Hugging Face model folder")
    p.add_argument("--data", type=Path, required=True, help="JSONL of {prompt, response}")
    p.add_argument("--out", type=Path, required=True, help="where the PEFT adapter is saved")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--targets", nargs="+", default=list(ALL_PROJECTIONS), metavar="MODULE")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps (overrides --epochs)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=256, help="tokens per example, prompt included")
    p.add_argument("--chat", action="store_true", help="format the prompt with the chat template")
    p.add_argument("--eval-fraction", type=float, default=None,
                   help="held-out share of the data; default 0.1 from 10 examples on, else 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = p.parse_args(argv)
    for name in ("rank", "epochs", "batch_size", "max_len", "max_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.eval_fraction is not None and not 0 <= args.eval_fraction < 1:
        p.error(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    return args


def load_examples(path: Path) -> list[Example]:
    """The examples of a JSONL file; a bad line is a SystemExit naming the file, line and field."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {path}: cannot read it ({e})") from None
    examples = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            examples.append(_parse_line(line, f"{path} line {number}"))
    if not examples:
        raise SystemExit(f"error: {path}: no examples (the file is empty)")
    return examples


def _parse_line(line: str, where: str) -> Example:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: {where}: not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(row, dict):
        raise SystemExit(f"error: {where}: expected a JSON object with \"prompt\" and \"response\"")
    if "response" in row and "completion" in row:
        raise SystemExit(f"error: {where}: give \"response\" or \"completion\", not both")
    key = "completion" if "completion" in row else "response"
    for field in ("prompt", key):
        if field not in row:
            raise SystemExit(f"error: {where}: \"{field}\" is missing")
        if not isinstance(row[field], str):
            raise SystemExit(f"error: {where}: \"{field}\" must be a string, got {type(row[field]).__name__}")
    if not row[key]:
        raise SystemExit(f"error: {where}: \"{key}\" is empty")
    return Example(row["prompt"], row[key])


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA GPU is available")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def load_model(base: Path, device: torch.device):
    """The base model (fp32 on the CPU, bf16 on a GPU that has it) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not (base / "config.json").is_file():
        raise SystemExit(f"error: --base {base}: not a Hugging Face model folder (no config.json)")
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16 if bf16 else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: --base {base}: the tokenizer has no end-of-sequence token")
    return model.to(device), tokenizer


def add_lora(model, args: argparse.Namespace):
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=list(args.targets),
                        lora_dropout=args.dropout, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:   # e.g. a target module the model does not have
        raise SystemExit(f"error: --targets {' '.join(args.targets)}: {e}") from None


def encode(example: Example, tokenizer, max_len: int, chat: bool) -> Features:
    """Prompt ids (labels IGNORE) + response ids + eos, cut to max_len; tokenized apart, as served."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        prompt = tokenizer(example.prompt)["input_ids"]
    response = tokenizer(example.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + response)[:max_len]
    labels = ([IGNORE] * len(prompt) + response)[:max_len]
    return ids, labels


def encode_all(examples: list[Example], tokenizer, args: argparse.Namespace) -> list[Features]:
    if args.chat and not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"error: --chat: the tokenizer of {args.base} has no chat template")
    features = [encode(e, tokenizer, args.max_len, args.chat) for e in examples]
    kept = [f for f in features if any(label != IGNORE for label in f[1])]
    if len(kept) < len(features):
        print(f"skipped {len(features) - len(kept)} examples whose prompt fills --max-len {args.max_len}")
    if not kept:
        raise SystemExit(f"error: {args.data}: no example has a response token within --max-len {args.max_len}")
    return kept


def split(features: list[Features], fraction: float | None, seed: int) -> tuple[list[Features], list[Features]]:
    """(train, held out), shuffled with `seed`; the default fraction is 0.1 from 10 examples on."""
    if fraction is None:
        fraction = 0.1 if len(features) >= 10 else 0.0
    shuffled = features[:]
    random.Random(seed).shuffle(shuffled)
    held = min(len(shuffled) - 1, math.ceil(fraction * len(shuffled))) if fraction > 0 else 0
    return shuffled[held:], shuffled[:held]


def collate(batch: list[Features], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and labels (IGNORE on padding)."""
    width = max(len(ids) for ids, _ in batch)
    ids = [i + [pad_id] * (width - len(i)) for i, _ in batch]
    mask = [[1] * len(i) + [0] * (width - len(i)) for i, _ in batch]
    labels = [lab + [IGNORE] * (width - len(lab)) for _, lab in batch]
    return {k: torch.tensor(v, device=device) for k, v in
            (("input_ids", ids), ("attention_mask", mask), ("labels", labels))}


def batches(features: list[Features], size: int, rng: random.Random | None) -> Iterator[list[Features]]:
    order = list(range(len(features)))
    if rng is not None:   # None: in order (evaluation)
        rng.shuffle(order)
    for start in range(0, len(order), size):
        yield [features[i] for i in order[start:start + size]]


@torch.no_grad()
def mean_loss(model, features: list[Features], batch_size: int, pad_id: int, device: torch.device) -> float:
    """Cross-entropy per response token over `features`."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches(features, batch_size, None):
        inputs = collate(batch, pad_id, device)
        tokens = int((inputs["labels"][:, 1:] != IGNORE).sum())
        total += float(model(**inputs).loss) * tokens
        count += tokens
    return total / max(count, 1)


def train(model, features: list[Features], args: argparse.Namespace, pad_id: int, device: torch.device) -> None:
    """AdamW with a linear warm-up (first 10% of steps) and linear decay to zero, on seeded shuffles."""
    from tqdm import tqdm
    steps_per_epoch = math.ceil(len(features) / args.batch_size)
    total = args.max_steps or args.epochs * steps_per_epoch
    warmup = max(1, total // 10)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / max(1, total - warmup))))
    rng = random.Random(args.seed)
    model.train()
    with tqdm(total=total, desc="training", unit="step") as bar:
        while bar.n < total:
            for batch in batches(features, args.batch_size, rng):
                loss = model(**collate(batch, pad_id, device)).loss
                loss.backward()
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
                bar.set_postfix(loss=f"{loss.item():.4f}")
                bar.update()
                if bar.n >= total:
                    break


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.base.is_dir():
        raise SystemExit(f"error: --base {args.base}: no such folder")
    examples = load_examples(args.data)
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.base, device)
    train_set, held_out = split(encode_all(examples, tokenizer, args), args.eval_fraction, args.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = add_lora(model, args)
    model.print_trainable_parameters()
    print(f"{len(train_set)} training examples, {len(held_out)} held out, on {device}")
    if held_out:
        print(f"held-out loss before: {mean_loss(model, held_out, args.batch_size, pad_id, device):.4f}")
    train(model, train_set, args, pad_id, device)
    if held_out:
        print(f"held-out loss after:  {mean_loss(model, held_out, args.batch_size, pad_id, device):.4f}")
    model.save_pretrained(args.out)
    print(f"saved the adapter to {args.out}; serve it with:")
    print(f"loraplex serve --model {args.base} --lora {args.out.name or 'adapter'}={args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
