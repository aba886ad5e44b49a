"""`EngineConfig`: every engine setting in one validated dataclass."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("fp8",)   # EngineConfig.quantization's values besides None
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")   # vLLM's names; fp8 is e4m3
# adapters/composition.py's MAX_MEMBERS (the LoRA kernels' lanes), not imported: this module stays free of torch
MAX_ADAPTERS_PER_REQUEST = 4


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    """What the engine serves and how. Checked on construction; errors name the field."""

    # Each field's metadata holds its "help" (one sentence: meaning, units, what None means) and its
    # "group"; the `loraplex` command builds its flags from them, so a new field is a new flag. Tuning
    # knobs most users leave alone are "advanced": listed by `--help-all`, not `--help`.
    model: str | Path = field(metadata={
        "group": "model", "help": "A Hugging Face model folder, or dummy:<preset> (random weights of a published "
                                  "shape); the commands' default: the demo model shipped with loraplex, with its "
                                  "adapters."})
    tokenizer: str | Path | None = field(default=None, metadata={
        "group": "model", "help": "Folder with the tokenizer files; default: the model folder (dummy models have "
                                  "none)."})
    dtype: str = field(default="auto", metadata={
        "group": "model", "choices": DTYPES,
        "help": "Precision of weights and activations; auto: the checkpoint's torch_dtype on a GPU (bfloat16 for "
                "dummy models, float32 when the checkpoint names none), float32 on the CPU."})
    quantization: str | None = field(default=None, metadata={
        "group": "model", "choices": QUANTIZATIONS,
        "help": "fp8: quantize a float checkpoint's decoder projections to float8 e4m3 at load (one scale per "
                "output row); FP8 checkpoints (compressed-tensors, transformers fp8) load as FP8 without it. "
                "Adapters stay in the model's dtype."})
    device: str | None = field(default=None, metadata={
        "group": "model", "help": "cuda, cuda:N or cpu; default: cuda when available, else cpu."})
    dummy_layers: int | None = field(default=None, metadata={
        "group": "model", "advanced": True,
        "help": "Layers to build for a dummy:<preset> model; default: the preset's."})
    seed: int = field(default=0, metadata={
        "group": "model", "help": "Seed of dummy weights, and of sampling for requests that bring no seed."})

    max_num_seqs: int = field(default=256, metadata={
        "group": "batching", "help": "Most sequences in one engine step (the running batch)."})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "group": "batching", "help": "Most tokens in one engine step, prompt chunks and decodes together; at least "
                                     "max_num_seqs."})
    max_model_len: int | None = field(default=None, metadata={
        "group": "batching", "help": "Most tokens per sequence, prompt and output together; default: the model's "
                                     "max_position_embeddings."})
    max_batch_wait_ms: float = field(default=0.0, metadata={
        "group": "batching", "advanced": True,
        "help": "Milliseconds new prompts may wait for a fuller batch; 0 starts them at once."})
    admission_lookahead: int = field(default=256, metadata={
        "group": "batching", "advanced": True,
        "help": "Most tokens of growth the running sequences keep room for when a request is "
                "admitted (raised after a preemption, lowered step by step without one); "
                "0 admits whatever fits now."})
    overlap_admissions: bool = field(default=True, metadata={
        "group": "batching", "advanced": True,
        "help": "Queue a step that admits new prompts while the step before it still runs, "
                "as decode steps are; off: wait for that step to finish."})
    max_queue_skip_ms: float = field(default=2000.0, metadata={
        "group": "batching", "advanced": True,
        "help": "Milliseconds a waiting request may be overtaken while its adapter loads."})

    block_size: int = field(default=16, metadata={
        "group": "memory", "advanced": True,
        "help": "Tokens per paged KV-cache block."})
    gpu_memory_utilization: float = field(default=0.90, metadata={
        "group": "memory", "help": "Share of the GPU's memory, in (0, 1], for weights, adapters and KV cache."})
    num_kv_blocks: int | None = field(default=None, metadata={
        "group": "memory", "advanced": True,
        "help": "A fixed number of KV-cache blocks; default: as many as the memory budget holds."})
    cpu_kv_cache_gib: float = field(default=1.0, metadata={
        "group": "memory", "help": "KV-cache size in GiB when running on the CPU."})
    kv_cache_dtype: str = field(default="auto", metadata={
        "group": "memory", "choices": KV_CACHE_DTYPES, "advanced": True,
        "help": "What the KV cache stores: auto (the model's dtype) or fp8 / fp8_e4m3 (float8 e4m3, one byte a "
                "value: twice the tokens of bfloat16 in the same memory), with per-layer scales from the "
                "checkpoint's kv_cache_scheme, else 1.0; GPUs of compute capability 8.9 on."})
    calculate_kv_scales: bool = field(default=False, metadata={
        "group": "memory", "advanced": True,
        "help": "With an fp8 KV cache: compute each layer's k_scale and v_scale at start-up, from a forward over "
                "random tokens (twice its largest key or value over e4m3's 448), instead of taking the "
                "checkpoint's or 1.0; for models whose keys or values reach past 448."})

    max_gpu_adapters: int = field(default=8, metadata={
        "group": "adapters", "help": "Adapter slots on the device: the most distinct adapters in one step."})
    max_lora_rank: int = field(default=16, metadata={
        "group": "adapters", "help": "Highest LoRA rank an adapter may have (sets the size of each slot)."})
    max_cpu_adapters: int = field(default=32, metadata={
        "group": "adapters", "help": "Adapters kept as host-memory copies for fast reloads into slots (0: none)."})
    max_adapters_per_request: int = field(default=4, metadata={
        "group": "adapters", "advanced": True,
        "help": "Most adapters one request may combine, each with a weight (1 to 4); 1 refuses "
                "compositions and weights, and captures no CUDA graphs for them."})
    adapter_loader_threads: int = field(default=2, metadata={
        "group": "adapters", "advanced": True,
        "help": "Threads that read adapters from disk."})
    adapter_host_reserve_gib: float | None = field(default=None, metadata={
        "group": "adapters", "advanced": True,
        "help": "GiB of pinned host memory set aside at start-up for adapter reads (CUDA only); "
                "default: what max_cpu_adapters + adapter_loader_threads adapters of "
                "max_lora_rank take, at most 8 GiB and a quarter of the host's memory."})
    enforce_eager: bool = field(default=False, metadata={
        "group": "execution", "help": "Run every step eagerly, capturing no CUDA graphs."})
    cuda_graph_max_batch: int = field(default=256, metadata={
        "group": "execution", "advanced": True,
        "help": "Largest decode batch, in sequences, replayed from a CUDA graph."})
    cuda_graph_max_prompt_tokens: int = field(default=2048, metadata={
        "group": "execution", "advanced": True,
        "help": "Most prompt tokens in a step replayed from a CUDA graph (at most max_num_batched_tokens; buckets of "
                "16 to 256 tokens, then every 128); larger steps run eagerly; 0: decode steps only."})
    freeze_gc_heap: bool = field(default=True, metadata={
        "group": "execution", "advanced": True,
        "help": "Freeze the objects alive after start-up (gc.freeze), so that Python's full "
                "garbage collections skip them instead of stalling steps."})

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise ValueError(f"EngineConfig.model must be a model folder or 'dummy:<preset>', got {self.model!r}")
        if self.device is None:
            self.device = _default_device()
        if self.dtype == "auto" and str(self.device).startswith("cpu"):
            # the CPU's bfloat16 and float16 matmuls are slow and round more: the same policy for every model
            self.dtype = "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"EngineConfig.quantization must be None or 'fp8', got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        positive = ["max_num_seqs", "max_num_batched_tokens", "block_size", "max_gpu_adapters", "max_lora_rank",
                    "cuda_graph_max_batch", "adapter_loader_threads"]
        for name in positive:
            _check_int(name, getattr(self, name), 1)
        _check_int("max_cpu_adapters", self.max_cpu_adapters, 0)
        _check_int("max_adapters_per_request", self.max_adapters_per_request, 1)
        if self.max_adapters_per_request > MAX_ADAPTERS_PER_REQUEST:
            raise ValueError(f"EngineConfig.max_adapters_per_request must be at most {MAX_ADAPTERS_PER_REQUEST}, "
                             f"got {self.max_adapters_per_request}")
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
        for name in ("enforce_eager", "overlap_admissions", "freeze_gc_heap", "calculate_kv_scales"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.calculate_kv_scales and not self.fp8_kv_cache:
            raise ValueError("EngineConfig.calculate_kv_scales applies to an fp8 KV cache (kv_cache_dtype fp8 or "
                             f"fp8_e4m3); kv_cache_dtype is {self.kv_cache_dtype!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence must be able to decode in one step
            raise ValueError(f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                             f"least max_num_seqs ({self.max_num_seqs})")

    @property
    def is_dummy(self) -> bool:
        return str(self.model).startswith("dummy:")

    @property
    def fp8_kv_cache(self) -> bool:
        """Does the KV cache store float8 e4m3 (kv_cache_dtype fp8 or fp8_e4m3)?"""
        return self.kv_cache_dtype != "auto"

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
