"""A tiny served model with adapters on disk, the transformers + PEFT `generate` oracle, and the GPU tests' engines
of it."""
from __future__ import annotations

import gc
import warnings
from pathlib import Path

import torch

from adapter_fixtures import make_adapter
from model_fixtures import HFOracle, make_hf_model

from loraplex import LLM

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


def make_llm(served, **settings) -> LLM:
    """An engine of the served model; its KV cache a fixed number of blocks, not a share of the GPU's memory, so
    that it starts whatever other test processes hold (benchmarks/gpu_tests.sh runs several)."""
    gc.unfreeze()  # (an engine left open keeps its frozen heap: engine/gc_heap.py)
    gc.collect()  # engines of earlier tests give their memory back before this one measures it
    torch.cuda.empty_cache()
    base, adapters, _ = served
    defaults = dict(dtype="float32", device="cuda", block_size=16, max_num_seqs=16, max_num_batched_tokens=128,
                    max_gpu_adapters=4, num_kv_blocks=1024)
    return LLM(str(base), adapters={k: str(v) for k, v in adapters.items()}, **{**defaults, **settings})


def record_variants(monkeypatch) -> list[str]:
    """The graph variant of each replay (engine/cuda_graphs.py's lora_variant), in order."""
    from loraplex.engine import cuda_graphs
    seen: list[str] = []
    real = cuda_graphs.lora_variant
    monkeypatch.setattr(cuda_graphs, "lora_variant", lambda chunks: seen.append(real(chunks)) or seen[-1])
    return seen
