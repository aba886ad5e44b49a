"""The batch the engine's scheduler alone allows a workload: `engine.Scheduler` with every adapter resident from
the start (no loads), the run's KV memory and settings, host only, no model.

Beside a run's measured mean batch it says how far adapter loads (or anything else outside the scheduler)
held the batch back (`schedule_mean_batch` in `loraplex bench`'s rows).
"""
from __future__ import annotations

import time

from ..config import EngineConfig
from ..engine.block_manager import BlockManager
from ..engine.scheduler import Scheduler
from ..engine.sequence import Sequence
from ..sampling import SamplingParams
from .workload import Workload


class AllResident:
    """The scheduler's view of an adapter cache where every adapter is on the GPU (one slot each)."""

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}

    def acquire_if_resident(self, name: str) -> int:
        return self.slots.setdefault(name, len(self.slots))

    def release(self, name: str) -> None:
        pass

    def want(self, names: list[str], num_gpu: int) -> None:
        pass


def simulate_schedule(workload: Workload, config: EngineConfig, num_blocks: int) -> dict:
    """Every request queued at once, stepped to the end: each step schedules, then does to the host state
    what the engine's postprocess does (one token per sequence that gets logits). The steps, mean batch
    and preemptions of that schedule."""
    sched = Scheduler(config, BlockManager(num_blocks, config.block_size), AllResident())
    for r in workload.requests:
        seq = Sequence(f"r{r.index}", [(7 * i + 3) % 100 for i in range(r.prompt_len)],
                       SamplingParams(max_tokens=r.output_len, ignore_eos=True), adapter=f"a{r.adapter}")
        seq.times.arrival = 0.0
        sched.add(seq)
    steps = seqs = 0
    while sched.has_work():
        out = sched.schedule(now=time.monotonic())
        steps += 1
        seqs += len(out.chunks)
        for chunk in out.chunks:
            seq, needs_logits = chunk.seq, chunk.needs_logits   # read before num_cached moves
            seq.num_cached += chunk.num_tokens
            if needs_logits:
                seq.token_ids.append(5)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq)
    return dict(schedule_steps=steps, schedule_mean_batch=seqs / max(steps, 1),
                schedule_preemptions=sched.num_preemptions,
                schedule_recomputed_tokens=sched.num_recomputed_tokens)
