"""The model runner: owns the model, the KV cache, the adapter cache and the sampler; turns a
step's scheduled chunks into one flat batch, runs it (eagerly, or by replaying a CUDA graph of a
decode or mixed step) and samples the next token of every sequence that reached its end."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Sequence as Seq

import torch

from ..adapters import AdapterCache
from ..adapters.priority import HOST_PRIORITY
from ..config import EngineConfig
from ..models import dummy_model, load_model
from ..models.forward_batch import ForwardBatch, SequenceChunk
from ..models.fp8.kv_calibration import calibrate_kv_scales, calibration_prompts
from ..models.kv_cache import KVCache
from ..models.llama import LlamaForCausalLM
from ..ops.attention import KV_FP8
from ..ops.gemm.fp8 import fp8_capable
from ..sampling import PendingSample, Sampler, SamplingParams
from ..models.warmup import compile_lora_kernels
from .cuda_graphs import GraphShapes, StepGraphs
from .scheduler import ScheduledChunk
from .sequence import Sequence

log = logging.getLogger("loraplex.engine")

GRAPH_MEMORY_RESERVE = 512 << 20   # CUDA graphs' private memory pool and the sampler's temporaries


def _profile_lens(tokens: int, seqs: int) -> list[int]:
    """The profile step's sequence lengths: `tokens` spread over `seqs` sequences."""
    return [tokens // seqs + (1 if i < tokens % seqs else 0) for i in range(seqs)]


def graph_pool_bytes(activations: int, profile_rows: int, graph_rows: int) -> int:
    """The KV budget's allowance for the CUDA graphs' private pool: GRAPH_MEMORY_RESERVE, or the activations of the
    largest graph's forward where they need more. A forward's temporaries grow with its rows, so a graph of
    `graph_rows` takes that share of the `activations` measured for a step of `profile_rows` (the pool is shared:
    graphs are captured largest first and replayed one at a time)."""
    if profile_rows <= 0:
        raise ValueError(f"graph_pool_bytes: profile_rows must be positive, got {profile_rows}")
    return max(GRAPH_MEMORY_RESERVE, -(-activations * graph_rows // profile_rows))


class GpuSpan:
    """CUDA events around one step's work on the stream: its input copies, forward (or graph replay) and
    sample. The start fires when the GPU reaches the step, so an overlapped step (queued while the one
    before still ran) spans its own GPU time; a step queued onto an idle GPU also spans the gaps where the
    GPU waited for the host to queue more (an eager step's launches from Python)."""

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.start.record()

    def seconds(self) -> float:
        """Waits for the step's end on the GPU if it has not come yet."""
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def chunk_adapters(seq: Sequence) -> tuple[int | tuple[int, ...], tuple[float, ...] | None]:
    """A running sequence's `SequenceChunk.adapter_slot` and `adapter_weights`: (-1, None) for the base model, (its
    slot, None) for one adapter at weight 1 (what plain single-adapter batches and their CUDA graphs take), else
    (every member's slot, every member's weight) in the composition's order."""
    slots = seq.adapter_slots
    if not slots:
        return -1, None
    weights = seq.adapter.weights
    if len(slots) == 1 and weights[0] == 1.0:
        return slots[0], None
    return slots, weights


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._check_fp8_kv_device()
        self.model = self._load_model()
        self.kv_dtype, self.kv_scales = self._kv_storage()
        # the largest decode batch replayed from a graph (the graphs' shared logits buffer has its rows)
        self.graph_batch = min(config.cuda_graph_max_batch, config.max_num_seqs)
        c = self.model.config
        self.max_model_len = min(config.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
        self.adapters = AdapterCache(c, max_gpu_adapters=config.max_gpu_adapters,
                                     max_lora_rank=config.max_lora_rank, max_cpu_adapters=config.max_cpu_adapters,
                                     dtype=self.model.dtype, device=self.device,
                                     loader_threads=config.adapter_loader_threads)
        self.sampler = Sampler(self.device, seed=config.seed)
        self.kv = KVCache(c, self._num_kv_blocks(), config.block_size, dtype=self.kv_dtype, device=self.device,
                          **self.kv_scales)
        log.info(self.kv.describe())
        capacity = self.kv.num_blocks * self.kv.block_size
        if self.max_model_len > capacity:
            log.warning("max_model_len %d lowered to the KV cache's %d tokens", self.max_model_len, capacity)
            self.max_model_len = capacity
        self.graphs: StepGraphs | None = None
        if self.device.type == "cuda":
            compile_lora_kernels(c, self.adapters.pool, self.model.dtype, compositions=self._max_members > 1)
        if self.device.type == "cuda" and not config.enforce_eager:
            torch.cuda.set_device(self.device)   # capture on our GPU
            self.graphs = StepGraphs(self.model, self.kv, self.adapters.pool, self._graph_shapes(),
                                     max_members=self._max_members)
            self.graphs.capture()
        # after the captures: each hands PyTorch's cached pinned blocks back to CUDA (adapters/pinned_reserve.py)
        self.adapters.reserve_host_memory(config.adapter_host_reserve_gib)   # nothing off CUDA

    # ---- setup ------------------------------------------------------------------------------------
    def _load_model(self) -> LlamaForCausalLM:
        cfg = self.config
        if cfg.is_dummy:
            dtype = "bfloat16" if cfg.dtype == "auto" else cfg.dtype
            return dummy_model(str(cfg.model)[len("dummy:"):], dtype=dtype, device=self.device,
                               num_layers=cfg.dummy_layers, seed=cfg.seed, quantization=cfg.quantization)
        if cfg.dummy_layers is not None:
            raise ValueError("EngineConfig.dummy_layers applies to 'dummy:<preset>' models only")
        return load_model(cfg.model, dtype=cfg.dtype, device=self.device, quantization=cfg.quantization)

    def _check_fp8_kv_device(self) -> None:
        if self.config.fp8_kv_cache and self.device.type == "cuda" and not fp8_capable(self.device.index):
            # Triton converts e4m3 from compute capability 8.9 (Ada, Hopper) on
            raise ValueError(f"EngineConfig.kv_cache_dtype={self.config.kv_cache_dtype!r} needs a GPU of compute "
                             f"capability 8.9 or newer; {torch.cuda.get_device_name(self.device)} is "
                             f"{'.'.join(map(str, torch.cuda.get_device_capability(self.device)))}")

    def _kv_storage(self) -> tuple[torch.dtype, dict]:
        """(the KV cache's dtype, its k_scale/v_scale arguments): e4m3 with the checkpoint's scales (1.0 where it
        has none, as vLLM) for kv_cache_dtype fp8; the model's dtype otherwise, ignoring any scales (as vLLM)."""
        scales = self.model.kv_scales
        if not self.config.fp8_kv_cache:
            if scales is not None:
                log.info("the checkpoint's KV-cache scales are unused: kv_cache_dtype 'auto' keeps the cache in %s",
                         str(self.model.dtype).replace("torch.", ""))
            return self.model.dtype, {}
        if self.config.calculate_kv_scales:
            t0 = time.perf_counter()
            c = self.model.config
            prompts = calibration_prompts(c.vocab_size, min(self.config.max_model_len or c.max_position_embeddings,
                                                            c.max_position_embeddings), self.config.seed)
            scales = calibrate_kv_scales(self.model, prompts, block_size=self.config.block_size)
            log.info("calculated KV-cache scales in %.1f s (k_scale %.3g–%.3g, v_scale %.3g–%.3g)",
                     time.perf_counter() - t0, scales.k.min(), scales.k.max(), scales.v.min(), scales.v.max())
        elif scales is None:
            log.warning("kv_cache_dtype %r: the checkpoint has no KV-cache scales (kv_cache_scheme), so keys and "
                        "values are stored unscaled (k_scale = v_scale = 1.0); calculate_kv_scales computes them",
                        self.config.kv_cache_dtype)
            return KV_FP8, {}
        return KV_FP8, dict(k_scale=scales.k, v_scale=scales.v)

    @property
    def _max_members(self) -> int:
        """The composed capacity of the graphs: the requests' limit. Not cut to the GPU slots: with one slot a
        request may still weigh its adapter, which only the composed variant runs."""
        return self.config.max_adapters_per_request

    def _num_kv_blocks(self) -> int:
        cfg, c = self.config, self.model.config
        per_block = KVCache.bytes_per_block(c, cfg.block_size, self.kv_dtype)   # 1 byte a value for FP8
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type != "cuda":
            return max(1, int(cfg.cpu_kv_cache_gib * 2**30 // per_block))
        # What one step at full size needs beyond the weights and the pool, measured by running it.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        profile_kv = self._profile_step()
        torch.cuda.synchronize(self.device)
        # (the step's throwaway KV cache is no temporary of a forward: the budget below holds the real one)
        activations = torch.cuda.max_memory_allocated(self.device) - before - profile_kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)   # CUDA context, other processes
        # CUDA graphs: their private pool and the logits buffer they share (StepGraphs)
        graph_logits = 0 if cfg.enforce_eager else self.graph_batch * c.vocab_size * 4
        pool = GRAPH_MEMORY_RESERVE if cfg.enforce_eager else graph_pool_bytes(
            activations, cfg.max_num_batched_tokens, self._graph_shapes().largest_graph_rows())
        budget = total * cfg.gpu_memory_utilization - others - before - activations - pool - graph_logits
        blocks = int(budget // per_block)
        if blocks < 1:
            raise ValueError(f"no GPU memory left for the KV cache: {total / 2**30:.1f} GiB × "
                             f"gpu_memory_utilization {cfg.gpu_memory_utilization} leaves {budget / 2**30:.2f} GiB "
                             f"after weights, adapter pool ({self.adapters.pool.nbytes / 2**30:.2f} GiB) and "
                             f"activations ({activations / 2**30:.2f} GiB); lower max_gpu_adapters "
                             f"or max_num_batched_tokens, or raise gpu_memory_utilization")
        return blocks

    def _graph_shapes(self) -> GraphShapes:
        """The CUDA graphs' shapes at the settings and the current max_model_len (the KV budget sizes their pool
        before the cache may lower max_model_len; the rows, which size it, do not depend on it)."""
        cfg = self.config
        return GraphShapes.make(self.graph_batch, self.max_model_len,
                                min(cfg.cuda_graph_max_prompt_tokens, cfg.max_num_batched_tokens),
                                cfg.max_num_batched_tokens)

    def _profile_step(self) -> int:
        """One forward + sample of the largest step the settings allow, on a throwaway cache; returns that cache's
        bytes."""
        cfg, c = self.config, self.model.config
        tokens = cfg.max_num_batched_tokens
        seqs = min(cfg.max_num_seqs, tokens)
        lens = _profile_lens(tokens, seqs)
        blocks_each = [-(-n // cfg.block_size) for n in lens]
        kv = KVCache(c, sum(blocks_each), cfg.block_size, dtype=self.kv_dtype, device=self.device,
                     **self.kv_scales)
        kv_bytes = sum(blocks_each) * KVCache.bytes_per_block(c, cfg.block_size, self.kv_dtype)
        # every sequence with as many adapters as a request may combine: the LoRA path's largest temporaries
        members = min(self._max_members, self.adapters.pool.num_slots)
        lora = dict(adapter_slot=0) if self._max_members == 1 else \
            dict(adapter_slot=tuple(range(members)), adapter_weights=(0.5,) * members)
        chunks, start = [], 0
        for i, n in enumerate(lens):
            chunks.append(SequenceChunk([1] * n, 0, list(range(start, start + blocks_each[i])), **lora))
            start += blocks_each[i]
        batch = ForwardBatch.build(chunks, block_size=kv.block_size, num_blocks=kv.num_blocks,
                                   vocab_size=c.vocab_size, device=self.device,
                                   num_adapter_slots=self.adapters.pool.num_slots)
        # (no slot holds an adapter yet: their ranks are 0, so the LoRA launches run but read no weights)
        with torch.cuda.device(self.device):
            logits = self.model(batch, kv, self.adapters.pool)
            self.sampler(logits, [SamplingParams(top_p=0.9, top_k=50)] * len(lens), [None] * len(lens))
        del kv, batch, logits
        return kv_bytes

    # ---- one step ---------------------------------------------------------------------------------
    def launch(self, chunks: Seq[ScheduledChunk], inputs: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[PendingSample, tuple[int, int] | None, "GpuSpan | None"]:
        """Queue one step: the sample of the chunks that need logits (in their order), the shape
        (sequences, prompt tokens) of the CUDA graph that runs it (None when it runs eagerly), and its
        GpuSpan on CUDA (None on the CPU).
        `inputs` = (device token ids, index): the first len(index) chunks are one-token decodes whose token
        is `ids[index[i]]`, sampled by a step still in flight (their host value is not known yet); any
        after them feed their own tokens (prompts admitted beside)."""
        from_device = 0 if inputs is None else len(inputs[1])
        if any(c.num_tokens != 1 for c in chunks[:from_device]):
            raise ValueError("chunks fed from a step in flight must be one-token decodes, and come first")
        batch_chunks = []
        for i, c in enumerate(chunks):
            ids = [0] if i < from_device else c.seq.token_ids[c.start:c.start + c.num_tokens]
            slot, weights = chunk_adapters(c.seq)
            batch_chunks.append(SequenceChunk(ids, c.start, c.seq.block_table, slot, c.needs_logits, weights))
        graph = self.graphs.shapes.key_for(batch_chunks) if self.graphs is not None else None
        # everything on our GPU's current stream, whichever device the calling thread has current
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            span = GpuSpan() if self.device.type == "cuda" else None
            if graph is not None:
                logits = self.graphs.run(batch_chunks, inputs, key=graph)
            else:
                # Host-bound (~1,500 launches from Python): adapter loads step aside meanwhile, where
                # graphed steps leave them host time. Without graphs every step is eager, and
                # loads would only crawl at the checkpoints' bound, so they keep running.
                with HOST_PRIORITY.busy() if self.graphs is not None else contextlib.nullcontext():
                    logits = self._run_eager(batch_chunks, inputs)
            sampled = [c.seq for c in chunks if c.needs_logits]
            pending = self.sampler.launch(logits, [s.params for s in sampled], [s.generator for s in sampled])
            if span is not None:
                span.end.record()
        return pending, graph, span

    def _run_eager(self, chunks: list[SequenceChunk], inputs=None) -> torch.Tensor:
        c = self.model.config
        batch = ForwardBatch.build(chunks, block_size=self.kv.block_size, num_blocks=self.kv.num_blocks,
                                   vocab_size=c.vocab_size, device=self.device,
                                   num_adapter_slots=self.adapters.pool.num_slots)
        if inputs is not None:   # the first len(index) chunks are one-token decodes: rows 0 .. len(index) - 1
            with torch.inference_mode():
                batch.input_ids[:len(inputs[1])].copy_(inputs[0].index_select(0, inputs[1]))
        return self.model(batch, self.kv, self.adapters.pool if batch.has_adapters else None)

    def new_generator(self, seed: int) -> torch.Generator:
        return self.sampler.new_generator(seed)

    def close(self) -> None:
        """Give the GPU memory back (the object is unusable after)."""
        self.adapters.close()
        self.graphs = None
        self.kv = None
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
