"""CUDA graphs of the step forward: decode steps per batch-size bucket, and mixed steps (decodes
beside prompt chunks) per bucket of sequences and of prompt tokens, each in up to three variants:
without LoRA, with one adapter per sequence, and with compositions (sequences that combine adapters).

A step launches hundreds of small kernels (about 1,500 for a Llama-2-7B forward with adapters);
replaying a captured graph removes their host cost. Eager, a mixed step of 31 decodes and a
24-token prompt with distinct adapters took 29.8 ms against 12.1 ms replayed (H200,
`benchmarks/results/mixed_step.json`), and the Punica workload has a mixed step every ~35 steps.

Each graph reads a `ForwardBatch.for_graph` batch (fixed buffers, rewritten in place by
`update_`, the `LoraBatch` included), so one capture serves every step that fits its bucket: rows
and sequences past the real ones write no KV and use no adapter. The variant is chosen per step
(`lora_variant`): steps where no sequence has an adapter replay a graph captured without the LoRA
launches; steps where every sequence has one adapter at weight 1 (or none) replay the plain LoRA
graph, as they did before compositions existed; a step with any composition (several adapters, or a
weight other than 1) replays a graph whose batch takes up to `max_members` adapters a sequence
(`ForwardBatch.for_graph(..., max_members=...)`), captured only where the engine allows compositions
(`EngineConfig.max_adapters_per_request` > 1). Every graph writes its logits into one
shared buffer, so graphs cost no logits memory each (replays run one at a time, in stream order,
and the sampler reads the logits before the next replay is queued).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from ..adapters.pool import AdapterPool
from ..models.forward_batch import ForwardBatch, SequenceChunk
from ..models.kv_cache import KVCache
from ..models.llama import LlamaForCausalLM

log = logging.getLogger("loraplex.engine")

# Mixed steps' prompt-token buckets: powers of two up to 256 for every sequence bucket; past 256, the largest sequence
# bucket only, every PROMPT_BUCKET_STEP tokens. A graph runs its whole shape whatever the step holds, so large shapes
# stay close together: a step pads < 128 rows, where powers of two padded a 1,337-token step 53%
# (docs/design-notes.md).
PROMPT_BUCKETS = (16, 32, 64, 128, 256)
PROMPT_BUCKET_STEP = 128

# The graph variants, by what the step's sequences use (lora_variant)
BASE, LORA, COMPOSED = "base", "lora", "composed"


def lora_variant(chunks: Sequence[SequenceChunk]) -> str:
    """COMPOSED if a chunk combines adapters or weighs its adapter (a tuple of slots, or weights given), else LORA
    if a chunk uses an adapter, else BASE."""
    variant = BASE
    for c in chunks:
        if c.adapter_weights is not None or type(c.adapter_slot) is not int:
            return COMPOSED
        if c.adapter_slot >= 0:
            variant = LORA
    return variant


def graph_buckets(max_batch: int) -> list[int]:
    """Decode batches: 1, 2, 4, 8, then every 16 up to `max_batch` (which is always one)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def mixed_buckets(max_batch: int, max_prompt_tokens: int, max_rows: int | None = None
                  ) -> tuple[list[int], list[int], list[int]]:
    """Mixed steps' shapes, (sequence buckets, prompt buckets, wide prompt buckets); empty lists when
    `max_prompt_tokens` is 0. Every sequence bucket (16, 32, 64, ... powers of two, up to `max_batch`, always one) is
    captured with the prompt buckets (PROMPT_BUCKETS up to `max_prompt_tokens`, always one; GraphShapes leaves out
    the shapes another outdoes); past 256 prompt tokens only `max_batch` sequences are, with the wide buckets: every
    PROMPT_BUCKET_STEP tokens up to min(`max_prompt_tokens`, `max_rows` - `max_batch`), always that one.
    `max_rows`: the most rows a step holds (max_num_batched_tokens; default unbounded). A step's decodes and prompt
    chunks share its graph's rows (ForwardBatch.for_graph), so a wide graph pads a step by less than
    PROMPT_BUCKET_STEP rows whatever its number of sequences."""
    if max_prompt_tokens <= 0:
        return [], [], []
    seqs = sorted({b for b in (16, 32, 64, 128, 256, 512, 1024) if b < max_batch} | {max_batch})
    small = min(max_prompt_tokens, PROMPT_BUCKETS[-1])
    prompts = sorted({p for p in PROMPT_BUCKETS if p < small} | {small})
    top = min(max_prompt_tokens, (max_batch + max_prompt_tokens if max_rows is None else max_rows) - max_batch)
    wide = list(range(small + PROMPT_BUCKET_STEP, top, PROMPT_BUCKET_STEP)) + ([top] if top > small else [])
    return seqs, prompts, wide


def prompt_tokens(chunks: Sequence[SequenceChunk]) -> int:
    """Rows of the chunks of several tokens (prompt chunks)."""
    return sum(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)


@dataclass
class GraphShapes:
    """Which graphs exist, as (sequences, prompt tokens): (b, 0) for decode buckets, (s, p) for mixed
    ones (s + p rows, which the step's decodes and prompt chunks share); and which of them runs a step (host
    only). A step with more than `max_prompt_tokens` prompt tokens runs eagerly."""

    buckets: list[int]
    mixed_seqs: list[int]
    mixed_prompts: list[int]
    wide_prompts: list[int]
    max_seq_len: int
    max_prompt_tokens: int = 0
    max_rows: int | None = None   # the most rows a step holds (max_num_batched_tokens), where known

    @classmethod
    def make(cls, max_batch: int, max_seq_len: int, max_prompt_tokens: int = 0,
             max_rows: int | None = None) -> "GraphShapes":
        return cls(graph_buckets(max_batch), *mixed_buckets(max_batch, max_prompt_tokens, max_rows), max_seq_len,
                   max_prompt_tokens, max_rows)

    def __post_init__(self) -> None:
        mixed = [(s, p) for s in self.mixed_seqs for p in self.mixed_prompts]
        mixed += [(self.mixed_seqs[-1], p) for p in self.wide_prompts]
        self._mixed = sorted((sp for sp in mixed if not self._outdone(sp, mixed)),
                             key=lambda sp: (sp[0] + sp[1], sp[0]))   # fewest rows first

    def _outdone(self, shape: tuple[int, int], mixed: list[tuple[int, int]]) -> bool:
        """Whether another shape holds every step `shape` holds (steps have at most max_rows rows) in fewer rows, or
        in as many with room for more sequences: then `shape` is not captured."""
        s, p = shape
        need = s + p if self.max_rows is None else min(s + p, self.max_rows)
        return any(s2 >= s and need <= s2 + p2 and (s2 + p2, -s2) < (s + p, -s) for s2, p2 in mixed)

    def all(self) -> list[tuple[int, int]]:
        """Every shape, most rows first (smaller graphs then reuse the larger ones' memory)."""
        return sorted(self._mixed + [(b, 0) for b in self.buckets], key=lambda sp: (-(sp[0] + sp[1]), -sp[1]))

    def largest_graph_rows(self) -> int:
        """The rows of the largest graph (what its forward's temporaries grow with)."""
        return max(s + p for s, p in self.all())

    def key_for(self, chunks: Sequence[SequenceChunk]) -> tuple[int, int] | None:
        """The shape of fewest rows that runs this step; None if none does (it runs eagerly)."""
        if not chunks or max(c.num_cached + len(c.token_ids) for c in chunks) > self.max_seq_len:
            return None
        prompt = prompt_tokens(chunks)
        if prompt == 0:
            seqs = next((b for b in self.buckets if b >= len(chunks)), None)
            return None if seqs is None else (seqs, 0)
        if prompt > self.max_prompt_tokens:
            return None
        n, rows = len(chunks), sum(len(c.token_ids) for c in chunks)
        return next(((s, p) for s, p in self._mixed if s >= n and s + p >= rows), None)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch


class StepGraphs:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, pool: AdapterPool | None, shapes: GraphShapes, *,
                 max_members: int = 1) -> None:
        self.model, self.kv, self.pool, self.shapes = model, kv, pool, shapes
        # the variants captured for every shape: COMPOSED where a request may combine adapters (max_members > 1)
        self.variants = [BASE] if pool is None else [BASE, LORA] + ([COMPOSED] if max_members > 1 else [])
        self.max_members = max_members
        # (sequences, prompt tokens, variant)
        self._graphs: dict[tuple[int, int, str], _Graph] = {}
        self._memory = torch.cuda.graph_pool_handle()
        # One warm-up and capture stream per priority, reused by every graph: cuBLAS keeps a workspace (32 MiB on
        # sm90) per stream it has run on, so a stream per graph would pin one each; the warm-up on the capture
        # stream allocates it outside the graph pool.
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._logits = torch.empty((shapes.buckets[-1], model.config.vocab_size), dtype=torch.float32,
                                   device=kv.device)   # (the largest decode bucket: max_batch)

    def capture(self) -> None:
        from ..ops.launch import precompile   # (Triton: imported where graphs are captured, on a GPU)
        start = time.perf_counter()
        precompile(self._warm_ups)
        keys = [(seqs, prompt, variant) for seqs, prompt in self.shapes.all() for variant in self.variants]
        # a bar where the output is a terminal (tqdm's disable=None): a start captures ~50-150 graphs, ~0.3 s each
        for seqs, prompt, variant in tqdm(keys, desc="capturing CUDA graphs", unit="graph", disable=None):
            self._graphs[(seqs, prompt, variant)] = self._capture(seqs, prompt, variant)
        torch.cuda.synchronize()
        sh = self.shapes
        log.info("captured %d CUDA graphs (decode batches %s; mixed: sequences %s × prompt tokens %s, and %s "
                 "sequences beside prompt tokens %s; variants %s) in %.1f s", len(self._graphs), sh.buckets,
                 sh.mixed_seqs, sh.mixed_prompts, sh.mixed_seqs[-1:], sh.wide_prompts, ", ".join(self.variants),
                 time.perf_counter() - start)

    def _warm_ups(self) -> None:
        """Every graph's warm-up forward: under `precompile`, with its Triton kernels compiled, not launched, on
        every CPU at once (ops/launch.py), so that the warm-ups and captures after it find them compiled."""
        for seqs, prompt in self.shapes.all():
            for variant in self.variants:
                self._warm_up(*self._batch(seqs, prompt, variant), variant)

    def _batch(self, seqs: int, prompt: int, variant: str) -> tuple[ForwardBatch, torch.cuda.Stream]:
        """A graph's batch, with one real row (into KV block 0, which no sequence holds yet) so every kernel runs
        while capturing, and the stream it is captured on (its kernels keep the stream's priority at replay)."""
        c = self.model.config
        batch = ForwardBatch.for_graph(seqs, self.shapes.max_seq_len, block_size=self.kv.block_size,
                                       num_blocks=self.kv.num_blocks, vocab_size=c.vocab_size,
                                       num_adapter_slots=self.pool.num_slots if self.pool else 1,
                                       device=self.kv.device, max_prompt_tokens=prompt,
                                       max_members=self.max_members if variant == COMPOSED else 1)
        batch.update_([SequenceChunk([0], 0, [0])])
        return batch, self._stream(self.model.graph_stream_priority(batch.num_tokens, variant != BASE))

    def _warm_up(self, batch: ForwardBatch, stream: torch.cuda.Stream, variant: str) -> None:
        """The forward outside the graph: Triton compiles, the allocator settles."""
        device = self.kv.device
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.model(batch, self.kv, self.pool if variant != BASE else None)
        torch.cuda.current_stream(device).wait_stream(stream)

    def _capture(self, seqs: int, prompt: int, variant: str) -> _Graph:
        batch, stream = self._batch(seqs, prompt, variant)
        pool = self.pool if variant != BASE else None
        self._warm_up(batch, stream, variant)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory, stream=stream):
            self._logits[:seqs].copy_(self.model(batch, self.kv, pool))
        return _Graph(graph, batch)

    def _stream(self, priority: int) -> torch.cuda.Stream:
        if priority not in self._streams:
            self._streams[priority] = torch.cuda.Stream(self.kv.device, priority=priority)
        return self._streams[priority]

    def run(self, chunks: Sequence[SequenceChunk], inputs: tuple[torch.Tensor, torch.Tensor] | None, *,
            key: tuple[int, int]) -> torch.Tensor:
        """Logits `[chunks that need logits, vocab]` of the step, by replay (a view of the shared
        buffer: read it before the next replay). With `inputs` = (device ids, index), the first
        len(index) chunks are one-token decodes and chunk i's token is `ids[index[i]]` instead of its
        own (prompt chunks may follow them). `key`: the graph, as `shapes.key_for(chunks)` chose it
        (the batch's `update_` refuses chunks it cannot hold). The variant is the chunks' (`lora_variant`)."""
        if inputs is not None and any(len(c.token_ids) != 1 for c in chunks[:len(inputs[1])]):
            raise ValueError("device-side inputs feed one-token decode chunks, which come first")
        variant = lora_variant(chunks) if self.pool is not None else BASE
        if variant not in self.variants:
            raise ValueError(f"no CUDA graphs of compositions were captured (max_members={self.max_members}): "
                             f"run this step eagerly")
        g = self._graphs[(*key, variant)]
        g.batch.update_(chunks)
        if inputs is not None:   # rows 0 .. len(index) - 1: the decodes fed from the step in flight
            with torch.inference_mode():
                g.batch.input_ids[:len(inputs[1])].copy_(inputs[0].index_select(0, inputs[1]))
        g.graph.replay()
        return self._logits[:len(g.batch.logits_seqs)]
