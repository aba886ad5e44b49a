"""CUDA graphs of the step forward: decode steps per batch-size bucket, and mixed steps (decodes
beside prompt chunks) per bucket of sequences and of prompt tokens, each with and without LoRA.

A step launches hundreds of small kernels (about 1,500 for a Llama-2-7B forward with adapters);
replaying a captured graph removes their host cost. Eager, a mixed step of 31 decodes and a
24-token prompt with distinct adapters took 29.8 ms against 12.1 ms replayed (H200,
`benchmarks/results/mixed_step.json`), and the Punica workload has a mixed step every ~35 steps.

Each graph reads a `ForwardBatch.for_graph` batch (fixed buffers, rewritten in place by
`update_`, the `LoraBatch` included), so one capture serves every step that fits its bucket: rows
and sequences past the real ones write no KV and use no adapter. Steps where no sequence has an
adapter replay a graph captured without the LoRA launches; with LORAPLEX_LORA_ROWWISE=auto, decode steps
whose adapters make only small tiles (`sgmv.rows_fit`: distinct adapters) replay a third, captured with
the row-wise LoRA kernels (ops/sgmv.py; a kernel holding both paths keeps the larger one's registers, so
the choice is made per step on the host). With an active area (`EngineConfig.lora_in_gemm`), decode shapes
also get graphs that compute LoRA's shrink inside the GEMMs (the model's "in-gemm" path) for each count of
active adapters in `gemm_counts` (the GEMMs' widths depend on it); a decode step whose distinct adapters
fit replays the smallest that holds them, after `ActiveArea.update`. Every graph writes its logits into one
shared buffer, so graphs cost no logits memory each (replays run one at a time, in stream order,
and the sampler reads the logits before the next replay is queued).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..adapters.pool import AdapterPool
from ..models.forward_batch import ForwardBatch, SequenceChunk
from ..models.kv_cache import KVCache
from ..models.llama import LlamaForCausalLM
from ..ops.lora import overlap
from ..ops.lora import sgmv
from ..ops.lora import stream_priority

log = logging.getLogger("loraplex.engine")

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512)


def graph_buckets(max_batch: int) -> list[int]:
    """Decode batches: 1, 2, 4, 8, then every 16 up to `max_batch` (which is always one)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def mixed_buckets(max_batch: int, max_prompt_tokens: int) -> tuple[list[int], list[int]]:
    """Mixed steps: sequence buckets 16, 32, 64, ... (powers of two) up to `max_batch` (always one,
    and fewer buckets than decodes have: each mixed graph is captured for every prompt bucket), and
    prompt-token buckets of PROMPT_BUCKETS up to `max_prompt_tokens` (always one). Empty lists when
    `max_prompt_tokens` is 0."""
    if max_prompt_tokens <= 0:
        return [], []
    seqs = sorted({b for b in (16, 32, 64, 128, 256, 512, 1024) if b < max_batch} | {max_batch})
    prompts = sorted({p for p in PROMPT_BUCKETS if p < max_prompt_tokens} | {max_prompt_tokens})
    return seqs, prompts


def gemm_counts(seqs: int, capacity: int) -> list[int]:
    """Active-adapter counts a decode graph of `seqs` sequences is captured for on the in-gemm path: 1, 2, 4,
    ... and the most it can meet, min(seqs, capacity)."""
    most = min(seqs, capacity)
    return sorted({1 << i for i in range(most.bit_length()) if 1 << i <= most} | {most}) if most > 0 else []


def gemm_count_for(count: int, seqs: int, capacity: int) -> int | None:
    """The smallest of `gemm_counts(seqs, capacity)` that holds `count` active adapters (None if none does):
    the GEMM width a graph, or an eager step of at most `capacity` sequences' worth, runs `count` at."""
    return next((n for n in gemm_counts(seqs, capacity) if n >= count), None)


def prompt_tokens(chunks: Sequence[SequenceChunk]) -> int:
    """Rows of the chunks of several tokens (prompt chunks): what a mixed graph's prompt bucket bounds."""
    return sum(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)


@dataclass
class GraphShapes:
    """Which graphs exist, as (sequences, prompt tokens): (b, 0) for decode buckets, (s, p) for mixed
    ones; and which of them runs a step (host only)."""

    buckets: list[int]
    mixed_seqs: list[int]
    mixed_prompts: list[int]
    max_seq_len: int

    @classmethod
    def make(cls, max_batch: int, max_seq_len: int, max_prompt_tokens: int = 0) -> "GraphShapes":
        return cls(graph_buckets(max_batch), *mixed_buckets(max_batch, max_prompt_tokens), max_seq_len)

    def all(self) -> list[tuple[int, int]]:
        """Every shape, most rows first (smaller graphs then reuse the larger ones' memory)."""
        mixed = [(s, p) for s in self.mixed_seqs for p in self.mixed_prompts]
        return sorted(mixed + [(b, 0) for b in self.buckets], key=lambda sp: (-(sp[0] + sp[1]), -sp[1]))

    def key_for(self, chunks: Sequence[SequenceChunk]) -> tuple[int, int] | None:
        """The smallest shape that runs this step; None if none does (it runs eagerly)."""
        if not chunks or max(c.num_cached + len(c.token_ids) for c in chunks) > self.max_seq_len:
            return None
        prompt = prompt_tokens(chunks)
        if prompt == 0:
            seqs = next((b for b in self.buckets if b >= len(chunks)), None)
            return None if seqs is None else (seqs, 0)
        seqs = next((b for b in self.mixed_seqs if b >= len(chunks)), None)
        bound = next((p for p in self.mixed_prompts if p >= prompt), None)
        return None if seqs is None or bound is None else (seqs, bound)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch


class StepGraphs:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, pool: AdapterPool | None, *, max_batch: int,
                 max_seq_len: int, max_prompt_tokens: int = 0) -> None:
        self.model, self.kv, self.pool = model, kv, pool
        self.shapes = GraphShapes.make(max_batch, max_seq_len, max_prompt_tokens)
        # (sequences, prompt tokens, LoRA): LoRA False (no adapter in the step), True, "rows" (row-wise
        # kernels, decode shapes only, LORAPLEX_LORA_ROWWISE=auto) or ("gemm", count) (decode shapes, the
        # shrink inside the GEMMs of the first `count` active adapters: model.active_area)
        self._graphs: dict[tuple[int, int, bool | str | tuple[str, int]], _Graph] = {}
        self.area = model.active_area if pool is not None else None
        # (ranks above 32 keep the tile product in the shrink, above 64 in the expand: no variant to capture)
        self.rows_variant = pool is not None and sgmv.ROWWISE_AUTO and pool.max_rank <= 32
        self.rows_replays = 0   # steps that replayed a "rows" graph
        self.gemm_replays = 0   # steps that replayed a ("gemm", count) graph
        self._memory = torch.cuda.graph_pool_handle()
        # One warm-up and capture stream per priority, reused by every graph: cuBLAS keeps a workspace (32 MiB on
        # sm90) per stream it has run on, so a stream per graph would pin one each; the warm-up on the capture
        # stream allocates it outside the graph pool.
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._logits = torch.empty((max_batch, model.config.vocab_size), dtype=torch.float32, device=kv.device)

    def capture(self) -> None:
        start = time.perf_counter()
        for seqs, prompt in self.shapes.all():
            variants = (False, True) if self.pool is not None else (False,)
            if self.rows_variant and prompt == 0:
                variants += ("rows",)
            if self.area is not None and prompt == 0:
                variants += tuple(("gemm", n) for n in gemm_counts(seqs, self.area.capacity))
            for lora in variants:
                self._graphs[(seqs, prompt, lora)] = self._capture(seqs, prompt, lora)
        torch.cuda.synchronize()
        sh = self.shapes
        log.info("captured %d CUDA graphs (decode batches %s; mixed: sequences %s × prompt tokens %s) in %.1f s",
                 len(self._graphs), sh.buckets, sh.mixed_seqs, sh.mixed_prompts, time.perf_counter() - start)

    def _capture(self, seqs: int, prompt: int, lora: bool | str | tuple[str, int]) -> _Graph:
        c = self.model.config
        batch = ForwardBatch.for_graph(seqs, self.shapes.max_seq_len, block_size=self.kv.block_size,
                                       num_blocks=self.kv.num_blocks, vocab_size=c.vocab_size,
                                       num_adapter_slots=self.pool.num_slots if self.pool else 1,
                                       device=self.kv.device, max_prompt_tokens=prompt)
        # One real row (into KV block 0, which no sequence holds yet) so every kernel runs while capturing.
        batch.update_([SequenceChunk([0], 0, [0])])
        pool = self.pool if lora else None
        device = self.kv.device
        stream = self._stream(self._priority(lora, batch.num_tokens))   # its kernels keep its priority at replay
        stream.wait_stream(torch.cuda.current_stream(device))
        if lora == "rows":
            mode = sgmv.decode_rowwise(2)
        elif isinstance(lora, tuple):
            mode = self.model.lora_in_gemm(lora[1])
        else:
            mode = contextlib.nullcontext()
        with mode:
            with torch.cuda.stream(stream):  # warm-up outside the graph: Triton compiles, allocator settles
                self.model(batch, self.kv, pool)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory, stream=stream):
                self._logits[:seqs].copy_(self.model(batch, self.kv, pool))
        return _Graph(graph, batch)

    @staticmethod
    def _priority(lora: bool | str | tuple[str, int], rows: int) -> int:
        """The capture stream's priority (ops/stream_priority.py): raised only where the forward's LoRA path is
        a side-stream one, the other graphs (no adapter, LoRA inside the GEMMs, too many rows) have nothing to
        order and would only pay the longer waits between high-priority kernels. (Decode graphs of 5–32 rows keep
        it as measured, although with the shrink after the GEMM, ops/overlap.py's SHRINK_ORDER, none of their
        kernels runs on the side stream: the default priority there is not measured.)"""
        side = bool(lora) and not isinstance(lora, tuple) and overlap.lora_path(rows, capturing=True).endswith("-side")
        return stream_priority.capture_priority() if side else 0

    def _stream(self, priority: int) -> torch.cuda.Stream:
        if priority not in self._streams:
            self._streams[priority] = torch.cuda.Stream(self.kv.device, priority=priority)
        return self._streams[priority]

    def run(self, chunks: Sequence[SequenceChunk], inputs: tuple[torch.Tensor, torch.Tensor] | None, *,
            key: tuple[int, int], in_gemm: int | None = None) -> torch.Tensor:
        """Logits `[chunks that need logits, vocab]` of the step, by replay (a view of the shared
        buffer: read it before the next replay). With `inputs` = (device ids, index), the first
        len(index) chunks are one-token decodes and chunk i's token is `ids[index[i]]` instead of its
        own (prompt chunks may follow them). `key`: the graph, as `shapes.key_for(chunks)` chose it
        (the batch's `update_` refuses chunks it cannot hold). `in_gemm`: the active area was updated
        to this step's adapters, this many (ModelRunner)."""
        if inputs is not None and any(len(c.token_ids) != 1 for c in chunks[:len(inputs[1])]):
            raise ValueError("device-side inputs feed one-token decode chunks, which come first")
        variant = self.lora_variant(chunks, key, in_gemm)
        self.rows_replays += variant == "rows"
        self.gemm_replays += isinstance(variant, tuple)
        g = self._graphs[(*key, variant)]
        g.batch.update_(chunks)
        if inputs is not None:   # rows 0 .. len(index) - 1: the decodes fed from the step in flight
            with torch.inference_mode():
                g.batch.input_ids[:len(inputs[1])].copy_(inputs[0].index_select(0, inputs[1]))
        g.graph.replay()
        return self._logits[:len(g.batch.logits_seqs)]

    def lora_variant(self, chunks: Sequence[SequenceChunk], key: tuple[int, int],
                     in_gemm: int | None = None) -> bool | str | tuple[str, int]:
        """Which graph of the shape `key` runs these chunks: False (no adapter), ("gemm", n) (a decode step
        whose `in_gemm` active adapters fit, the smallest n of `gemm_counts` that holds them), "rows" (a
        decode step whose adapters `sgmv.rows_fit`, when that variant was captured) or True."""
        if self.pool is None or not any(c.adapter_slot >= 0 for c in chunks):
            return False
        if in_gemm is not None and self.area is not None and key[1] == 0:
            n = gemm_count_for(in_gemm, key[0], self.area.capacity)
            if n is not None:
                return ("gemm", n)
        if self.rows_variant and key[1] == 0 and sgmv.rows_fit(c.adapter_slot for c in chunks):
            return "rows"
        return True
