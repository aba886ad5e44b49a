"""`EngineConfig`: every engine setting in one validated dataclass."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    """What the engine serves and how. Checked on construction; errors name the field."""

    model: str | Path                      # a Hugging Face model folder, or "dummy:<preset>" (random weights)
    tokenizer: str | Path | None = None    # a folder with tokenizer files; default: the model folder
    dtype: str = "auto"                    # auto | bfloat16 | float16 | float32
    device: str | None = None              # default: cuda when available, else cpu
    dummy_layers: int | None = None        # "dummy:" models only: fewer layers than the preset
    seed: int = 0                          # the sampler's seed for requests that bring none

    # batching
    max_num_seqs: int = 256                # sequences in one step at most
    max_num_batched_tokens: int = 2048     # tokens in one step at most (prefill chunks + decodes)
    max_model_len: int | None = None       # prompt + output tokens per sequence; default: the model's limit
    max_batch_wait_ms: float = 0.0         # latency ↔ throughput: how long new prompts may wait for a fuller batch
    max_queue_skip_ms: float = 2000.0      # after waiting this long, no later request is admitted before it

    # memory
    block_size: int = 16                   # tokens per KV block
    gpu_memory_utilization: float = 0.90   # share of the GPU's memory the engine may use in all
    num_kv_blocks: int | None = None       # fixed KV size instead of sizing from memory
    cpu_kv_cache_gib: float = 1.0          # KV budget on the CPU, where free memory is not measured

    # adapters
    max_gpu_adapters: int = 8              # adapter slots on the GPU = distinct adapters in one step at most
    max_lora_rank: int = 16
    max_cpu_adapters: int = 32             # pinned host copies kept for fast reloads

    # execution
    enforce_eager: bool = False            # no CUDA graphs
    cuda_graph_max_batch: int = 256        # decode batches above this run eagerly

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise ValueError(f"EngineConfig.model must be a model folder or 'dummy:<preset>', got {self.model!r}")
        if self.device is None:
            self.device = _default_device()
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"EngineConfig.dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        positive = ["max_num_seqs", "max_num_batched_tokens", "block_size", "max_gpu_adapters", "max_lora_rank",
                    "cuda_graph_max_batch"]
        for name in positive:
            _check_int(name, getattr(self, name), 1)
        _check_int("max_cpu_adapters", self.max_cpu_adapters, 0)
        _check_int("seed", self.seed, 0)
        for name in ("max_model_len", "num_kv_blocks", "dummy_layers"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        for name in ("max_batch_wait_ms", "max_queue_skip_ms", "cpu_kv_cache_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"EngineConfig.{name} must be a finite number >= 0, got {value!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {u!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"EngineConfig.enforce_eager must be a bool, got {self.enforce_eager!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence must be able to decode in one step
            raise ValueError(f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                             f"least max_num_seqs ({self.max_num_seqs})")

    @property
    def is_dummy(self) -> bool:
        return str(self.model).startswith("dummy:")

    @classmethod
    def from_kwargs(cls, model: str | Path, **settings) -> "EngineConfig":
        """Like the constructor, but an unknown setting is an error that lists the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; known: {sorted(known - {'model'})}")
        return cls(model=model, **settings)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"EngineConfig.{name} must be an integer >= {minimum}, got {value!r}")
