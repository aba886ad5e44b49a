"""CUDA graphs of the decode forward, one per batch-size bucket (and with/without LoRA).

A decode step launches hundreds of small kernels; replaying a captured graph removes their
host cost. Each graph reads a `ForwardBatch.for_graph` batch (fixed buffers, rewritten in place
by `update_`, the `LoraBatch` included), so one capture serves every decode batch of up to its
bucket's size: rows past the real sequences write no KV and use no adapter. Batches where no
sequence has an adapter replay a graph captured without the LoRA launches.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..adapters.pool import AdapterPool
from ..models.forward_batch import ForwardBatch, SequenceChunk
from ..models.kv_cache import KVCache
from ..models.llama import LlamaForCausalLM

log = logging.getLogger("loraplex.engine")


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to `max_batch` (which is always one)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch
    logits: torch.Tensor   # [bucket, vocab], rewritten by each replay


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, pool: AdapterPool | None, *, max_batch: int,
                 max_seq_len: int) -> None:
        self.model, self.kv, self.pool = model, kv, pool
        self.buckets = graph_buckets(max_batch)
        self.max_seq_len = max_seq_len
        self._graphs: dict[tuple[int, bool], _Graph] = {}
        self._memory = torch.cuda.graph_pool_handle()

    def capture(self) -> None:
        """Capture every bucket, largest first (so smaller ones reuse its memory)."""
        start = time.perf_counter()
        for bucket in reversed(self.buckets):
            for lora in ((False, True) if self.pool is not None else (False,)):
                self._graphs[(bucket, lora)] = self._capture(bucket, lora)
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batches %s) in %.1f s", len(self._graphs),
                 self.buckets, time.perf_counter() - start)

    def _capture(self, bucket: int, lora: bool) -> _Graph:
        c = self.model.config
        batch = ForwardBatch.for_graph(bucket, self.max_seq_len, block_size=self.kv.block_size,
                                       num_blocks=self.kv.num_blocks, vocab_size=c.vocab_size,
                                       num_adapter_slots=self.pool.num_slots if self.pool else 1,
                                       device=self.kv.device)
        # One real row (into KV block 0, which no sequence holds yet) so every kernel runs while capturing.
        batch.update_([SequenceChunk([0], 0, [0])])
        pool = self.pool if lora else None
        device = self.kv.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up outside the graph: Triton compiles, allocator settles
            self.model(batch, self.kv, pool)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory):
            logits = self.model(batch, self.kv, pool)
        return _Graph(graph, batch, logits)

    def bucket_for(self, num_seqs: int) -> int | None:
        for bucket in self.buckets:
            if bucket >= num_seqs:
                return bucket
        return None

    def can_run(self, chunks: Sequence[SequenceChunk]) -> bool:
        return self.bucket_for(len(chunks)) is not None and \
            max(c.num_cached for c in chunks) + 1 <= self.max_seq_len

    def run(self, chunks: Sequence[SequenceChunk],
            inputs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits `[len(chunks), vocab]` of a decode batch (one token per chunk), by replay.
        With `inputs` = (device ids, index), chunk i's token is `ids[index[i]]` instead of its own."""
        bucket = self.bucket_for(len(chunks))
        lora = self.pool is not None and any(c.adapter_slot >= 0 for c in chunks)
        g = self._graphs[(bucket, lora)]
        g.batch.update_(chunks)
        if inputs is not None:
            with torch.inference_mode():
                g.batch.input_ids[:len(chunks)].copy_(inputs[0].index_select(0, inputs[1]))
        g.graph.replay()
        return g.logits[:len(chunks)]
