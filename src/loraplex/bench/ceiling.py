"""The memory-bandwidth ceiling of a text-generation workload.

A decode step must at least read the weights once, the KV cache of every sequence in the batch, and
each adapter the batch uses once. `simulate_ceiling` schedules the workload as continuous batching
would (first come first served, at most `max_batch` sequences, a request admitted once its whole
length fits in the KV memory beside the running requests' whole lengths: a length-aware scheduler that
never preempts), and sums those bytes over every step, over the copy bandwidth:

    ceiling tokens/s = output tokens / Σ_steps (weights + KV of the batch's contexts + its adapters) / BW

A request's prefill counts as its first step (its prompt's KV), so prompts add no separate time.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..models.config import ModelConfig
from .workload import Workload

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class StepBytes:
    weights: int               # every weight a forward reads once (the embedding excepted)
    kv_per_token: int          # K and V of one token over every layer
    adapter: int               # one adapter's A and B over every layer and projection

    @classmethod
    def of(cls, c: ModelConfig, rank: int, dtype_bytes: int = 2, *, projection_bytes: int | None = None,
           kv_bytes: int | None = None) -> StepBytes:
        """Bytes in the model's dtype, except the projections' weights (`projection_bytes`: 1 for FP8 weights) and
        the KV cache (`kv_bytes`: 1 for an FP8 cache) where given; adapters stay in the model's dtype."""
        projections = sum(i * o for i, o in (c.projection_shape(p) for p in PROJECTIONS)) * \
            (projection_bytes or dtype_bytes)
        weights = c.num_hidden_layers * (projections + 2 * c.hidden_size * dtype_bytes) + \
            (c.vocab_size * c.hidden_size + c.hidden_size) * dtype_bytes
        kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * (kv_bytes or dtype_bytes)
        adapter = rank * sum(sum(c.projection_shape(p)) for p in PROJECTIONS) * c.num_hidden_layers * dtype_bytes
        return cls(weights, kv, adapter)


def simulate_ceiling(workload: Workload, step_bytes: StepBytes, bandwidth_gbs: float, *,
                     max_batch: int | None, kv_tokens: int, with_adapters: bool = True) -> dict:
    """The ceiling of `workload` at `max_batch` (None: unlimited) with `kv_tokens` of KV memory."""
    if bandwidth_gbs <= 0:
        raise ValueError(f"bandwidth_gbs must be positive, got {bandwidth_gbs}")
    too_long = [r.index for r in workload.requests if r.total_len > kv_tokens]
    if too_long:
        raise ValueError(f"request {too_long[0]} needs more KV memory ({workload.requests[too_long[0]].total_len} "
                         f"tokens) than the ceiling's {kv_tokens}")
    queue = deque(workload.requests)
    running: list[list[int]] = []     # [context, remaining, adapter, total length]
    reserved, total_bytes, steps, batch_sum = 0, 0, 0, 0
    limit = max_batch if max_batch is not None else len(workload.requests)
    while queue or running:
        while queue and len(running) < limit and reserved + queue[0].total_len <= kv_tokens:
            r = queue.popleft()
            running.append([r.prompt_len, r.output_len, r.adapter, r.total_len])
            reserved += r.total_len
        contexts = sum(s[0] for s in running)
        adapters = len({s[2] for s in running}) if with_adapters else 0
        total_bytes += step_bytes.weights + contexts * step_bytes.kv_per_token + adapters * step_bytes.adapter
        steps += 1
        batch_sum += len(running)
        for s in running:
            s[0] += 1
            s[1] -= 1
        reserved -= sum(s[3] for s in running if s[1] == 0)
        running = [s for s in running if s[1] > 0]
    seconds = total_bytes / (bandwidth_gbs * 1e9)
    return dict(ceiling_tokens_per_s=workload.output_tokens / seconds, ceiling_seconds=seconds, ceiling_steps=steps,
                ceiling_mean_batch=batch_sum / steps, bandwidth_gbs=bandwidth_gbs)


def run_ceiling_tokens_per_s(step_bytes: StepBytes, bandwidth_gbs: float, output_tokens: int, *, steps: int,
                             context_tokens: int, adapter_reads: int) -> float:
    """The same bound over a run's own steps instead of the reference schedule: `steps` weight reads,
    `context_tokens` KV tokens (summed over steps) and `adapter_reads` adapters (each step's distinct ones,
    summed). A run whose batches are fuller than the reference schedule's reads the weights fewer times, so
    its own ceiling is higher (where the engine admits more than `simulate_ceiling`'s never-preempting
    schedule: unlimited batches); one whose batches are emptier (held back by adapter loads) gets a lower
    one. It bounds the run's schedule, not the workload."""
    if bandwidth_gbs <= 0:
        raise ValueError(f"bandwidth_gbs must be positive, got {bandwidth_gbs}")
    total = (steps * step_bytes.weights + context_tokens * step_bytes.kv_per_token
             + adapter_reads * step_bytes.adapter)
    return output_tokens / (total / (bandwidth_gbs * 1e9)) if total else 0.0


def copy_bandwidth_gbs(device: torch.device | str = "cuda", size: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), median of `reps` CUDA-event timings."""
    a = torch.empty(size, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_()
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del a, b
    return 2 * size / times[len(times) // 2] / 1e9
