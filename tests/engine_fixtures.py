"""A tiny served model with adapters on disk, and the transformers + PEFT `generate` oracle."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from adapter_fixtures import make_adapter
from model_fixtures import HFOracle, make_hf_model

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_served_model(root: Path, variant: str = "llama-gqa-llama3rope") -> tuple[Path, dict[str, Path]]:
    """A base model and three adapters that differ in rank, targets and scaling."""
    base = make_hf_model(root / "base", variant, seed=3)
    adapters = {
        "all-r8": make_adapter(base, root / "all-r8", seed=11, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
        "qv-r4": make_adapter(base, root / "qv-r4", seed=12, r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
        "mlp-r2-rslora": make_adapter(base, root / "mlp-r2", seed=13, r=2, lora_alpha=4, use_rslora=True,
                                      target_modules=["gate_proj", "up_proj", "down_proj"]),
    }
    return base, adapters


class GenerateOracle(HFOracle):
    """Greedy token ids from transformers' `generate` (+ PEFT per adapter), float32, cached; and
    the models' logits (`HFOracle.logits`)."""

    def __init__(self, base: Path, adapters: dict[str, Path]) -> None:
        super().__init__(base, adapters)
        self._generated: dict = {}

    def greedy(self, prompt: list[int], adapter: str | None, max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), adapter, max_new_tokens)
        if key not in self._generated:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = self._model(adapter).generate(
                    torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                    do_sample=False, eos_token_id=None, pad_token_id=0)
            self._generated[key] = out[0, len(prompt):].tolist()
        return self._generated[key]


def random_prompts(n: int, vocab: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (s,), generator=gen).tolist() for s in sizes]
