"""`EngineConfig`: every engine setting in one validated dataclass."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32")


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    """What the engine serves and how. Checked on construction; errors name the field."""

    # Each field's metadata holds its "help" (one sentence: meaning, units, what None means) and its
    # "group"; the `loraplex` command builds its flags from them, so a new field is a new flag.
    model: str | Path = field(metadata={
        "group": "model", "help": "The base model: a Hugging Face model folder (config.json + safetensors), "
                                  "or dummy:<preset> for random weights of a published shape; the commands' default: "
                                  "the demo model shipped with loraplex, with its adapters."})
    tokenizer: str | Path | None = field(default=None, metadata={
        "group": "model", "help": "Folder with the tokenizer files; default: the model folder (dummy models have "
                                  "none, so their prompts are token ids)."})
    dtype: str = field(default="auto", metadata={
        "group": "model", "choices": DTYPES,
        "help": "Precision of weights and activations; auto is the checkpoint's torch_dtype (float32 when it "
                "names none; bfloat16 for dummy models)."})
    device: str | None = field(default=None, metadata={
        "group": "model", "help": "Device to run on (cuda, cuda:N or cpu); default: cuda when available, else cpu."})
    dummy_layers: int | None = field(default=None, metadata={
        "group": "model", "help": "For dummy:<preset> models only: build this many layers instead of the "
                                  "preset's; default: all of them."})
    seed: int = field(default=0, metadata={
        "group": "model", "help": "Seed of dummy weights and of sampling for requests that bring no seed."})

    max_num_seqs: int = field(default=256, metadata={
        "group": "batching", "help": "Maximum number of sequences in one engine step (the running batch)."})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "group": "batching", "help": "Maximum number of tokens in one engine step, prefill chunks and decodes "
                                     "together; at least max_num_seqs."})
    max_model_len: int | None = field(default=None, metadata={
        "group": "batching", "help": "Maximum number of tokens per sequence, prompt and output together; "
                                     "default: the model's max_position_embeddings."})
    max_batch_wait_ms: float = field(default=0.0, metadata={
        "group": "batching", "help": "Milliseconds new prompts may wait for a fuller batch (latency traded for "
                                     "throughput); 0 starts them at once."})
    admission_lookahead: int = field(default=256, metadata={
        "group": "batching", "help": "At most this many tokens of growth (up to each one's max_tokens) the running "
                                     "sequences keep room for when a request is admitted: each preemption (which "
                                     "recomputes a whole context) raises the lookahead by 128 tokens, each step "
                                     "without one lowers it by 1; 0 admits whatever fits now. The default, 256, "
                                     "halved the preemptions of the paper's unlimited-batch run on an H200."})
    overlap_admissions: bool = field(default=True, metadata={
        "group": "batching", "help": "Queue a step that admits new prompts while the step before it still runs, "
                                     "as decode steps are (their tokens come from that step's sample on the "
                                     "GPU). On by default: it took the paper's unlimited-batch run on an H200 "
                                     "from 5,094 to 5,278 tokens/s. Off: such steps are scheduled once the "
                                     "step before has finished, while the GPU waits."})
    max_queue_skip_ms: float = field(default=2000.0, metadata={
        "group": "batching", "help": "Milliseconds a waiting request may be overtaken while its adapter loads; "
                                     "after that nothing later is admitted before it."})

    block_size: int = field(default=16, metadata={
        "group": "memory", "help": "Tokens per paged KV-cache block."})
    gpu_memory_utilization: float = field(default=0.90, metadata={
        "group": "memory", "help": "Share of the GPU's memory, in (0, 1], the engine may use for weights, "
                                   "adapters and KV cache together."})
    num_kv_blocks: int | None = field(default=None, metadata={
        "group": "memory", "help": "A fixed number of KV-cache blocks; default: as many as the memory budget holds."})
    cpu_kv_cache_gib: float = field(default=1.0, metadata={
        "group": "memory", "help": "KV-cache budget in GiB on the CPU, where free memory is not measured."})

    max_gpu_adapters: int = field(default=8, metadata={
        "group": "adapters", "help": "Adapter slots on the GPU, which is the most distinct adapters in one step."})
    max_lora_rank: int = field(default=16, metadata={
        "group": "adapters", "help": "Highest LoRA rank an adapter may have (sets the size of each GPU slot)."})
    max_cpu_adapters: int = field(default=32, metadata={
        "group": "adapters", "help": "Adapters kept as pinned host copies for fast reloads into GPU slots "
                                     "(0: none)."})
    adapter_loader_threads: int = field(default=2, metadata={
        "group": "adapters", "help": "Threads that read adapters from disk into host copies (more: faster "
                                     "loads of many distinct adapters, at the cost of host CPU)."})
    adapter_host_reserve_gib: float | None = field(default=None, metadata={
        "group": "adapters", "help": "Pinned host memory page-locked at start-up for adapter reads, so that the "
                                     "first loads reuse it instead of page-locking fresh memory beside running "
                                     "steps (CUDA only; adapters/pinned_reserve.py). Default: what "
                                     "max_cpu_adapters + adapter_loader_threads adapters of max_lora_rank on "
                                     "every projection take, at most 8 GiB and a quarter of the host's memory; "
                                     "a number: at most that many GiB of it; 0: none."})
    enforce_eager: bool = field(default=False, metadata={
        "group": "execution", "help": "Run every step eagerly, capturing no CUDA graphs."})
    cuda_graph_max_batch: int = field(default=256, metadata={
        "group": "execution", "help": "Largest decode batch, in sequences, replayed from a CUDA graph; larger "
                                      "ones run eagerly."})
    cuda_graph_max_prompt_tokens: int = field(default=256, metadata={
        "group": "execution", "help": "Most prompt tokens (chunks of several tokens) in a step replayed from a CUDA "
                                      "graph beside its decodes; steps with more run eagerly; 0: only pure decode "
                                      "steps replay graphs."})
    freeze_gc_heap: bool = field(default=True, metadata={
        "group": "execution", "help": "Once started, freeze the objects alive (gc.freeze) so that Python's full "
                                      "garbage collections skip them: without it they walked the model's and "
                                      "the adapters' objects for over 200 ms at a time, stalling every "
                                      "request (engine/gc_heap.py)."})

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise ValueError(f"EngineConfig.model must be a model folder or 'dummy:<preset>', got {self.model!r}")
        if self.device is None:
            self.device = _default_device()
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        positive = ["max_num_seqs", "max_num_batched_tokens", "block_size", "max_gpu_adapters", "max_lora_rank",
                    "cuda_graph_max_batch", "adapter_loader_threads"]
        for name in positive:
            _check_int(name, getattr(self, name), 1)
        _check_int("max_cpu_adapters", self.max_cpu_adapters, 0)
        _check_int("cuda_graph_max_prompt_tokens", self.cuda_graph_max_prompt_tokens, 0)
        _check_int("admission_lookahead", self.admission_lookahead, 0)
        _check_int("seed", self.seed, 0)
        for name in ("max_model_len", "num_kv_blocks", "dummy_layers"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        for name in ("max_batch_wait_ms", "max_queue_skip_ms", "cpu_kv_cache_gib", "adapter_host_reserve_gib"):
            value = getattr(self, name)
            if value is None and name == "adapter_host_reserve_gib":   # its default bound
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"EngineConfig.{name} must be a finite number >= 0, got {value!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {u!r}")
        for name in ("enforce_eager", "overlap_admissions", "freeze_gc_heap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
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
