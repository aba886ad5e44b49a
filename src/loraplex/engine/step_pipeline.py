"""The engine's steps on the GPU, one queued ahead of the host where the scheduler's next step is known.

`StepPipeline` launches every step (`launch`) and owns the overlap: right after a step is launched,
`queue_next` queues the step after it, so the host postprocesses one step while the GPU runs the next
and a decode step costs its GPU time, not GPU + host. The next step is the scheduler's for sure when:

1. every chunk of the step just launched samples a token (decodes, or prompts' last chunks), and every
   running sequence is in it: then `schedule` would run exactly their next decodes;
2. the KV blocks for one more token of each are free (no preemption is decided here);
3. no waiting request would go first: with `overlap_admissions` the scheduler admits those that
   arrived meanwhile into the queued step, after its decodes (`Scheduler.admit_beside`); without it a
   step that could admit one (`Scheduler.would_admit`) is left to `schedule`.

The queued step's decodes take their input tokens from the launched step's sample on the device (their
values are not on the host yet). Sequences that end by length with the token in flight are left out of
it. The engine `take`s the queued step at its next `step()`, unless every sequence in it has ended
since (stopped, or aborted): then it is dropped and the scheduler runs instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import EngineConfig
from ..sampling import PendingSample
from .block_manager import BlockManager
from .model_runner import GpuSpan, ModelRunner
from .scheduler import ScheduledChunk, Scheduler
from .sequence import Sequence, SequenceStatus


@dataclass
class Launched:
    """A step queued on the GPU whose sample the host has not read yet."""
    chunks: list[ScheduledChunk]
    pending: PendingSample
    graph: tuple[int, int] | None   # the CUDA graph's (sequences, prompt tokens); None: eager
    span: GpuSpan | None            # its GPU time (CUDA only)
    ahead: bool = False             # queued by `queue_next` (not by the scheduler)
    admitted: bool = False          # queued ahead with prompts admitted beside its decodes
    failed: list[Sequence] = field(default_factory=list)   # requests that admission failed (adapter errors)


class StepPipeline:
    def __init__(self, config: EngineConfig, runner: ModelRunner, scheduler: Scheduler,
                 blocks: BlockManager) -> None:
        self.config, self.runner, self.scheduler, self.blocks = config, runner, scheduler, blocks
        self.queued: Launched | None = None   # queued on the GPU for the engine's next step

    def launch(self, chunks: list[ScheduledChunk],
               inputs: tuple[torch.Tensor, torch.Tensor] | None = None) -> Launched:
        """Queue `chunks` on the GPU (`ModelRunner.launch`; `inputs` feeds leading decodes from the device)."""
        pending, graph, span = self.runner.launch(chunks, inputs)
        return Launched(chunks, pending, graph, span)

    def take(self) -> Launched | None:
        """The step queued ahead during the last engine step, if any of its sequences still runs."""
        queued, self.queued = self.queued, None
        if queued is None or not any(c.seq.status is SequenceStatus.RUNNING for c in queued.chunks):
            return None
        return queued

    def queue_next(self, current: Launched) -> list[Sequence]:
        """Queue the step after `current` now, where the rules above allow (`queued`). Returns the requests
        it could not admit because their adapter failed to load, for the engine to end. Keeps the scheduler's
        per-step bookkeeping for the steps it does not schedule: adapter loads follow the queue after
        admissions, and a step taken from the queue counts for the admission lookahead."""
        queued = self.queued = self._queue_after(current)
        if current.ahead or (queued is not None and queued.admitted):
            self.scheduler.plan_adapter_loads()
        if current.ahead:
            self.scheduler.note_step(0)
        return queued.failed if queued is not None else []

    def clear(self) -> None:
        self.queued = None

    # ---- the rules ----------------------------------------------------------------------------
    def _queue_after(self, current: Launched) -> Launched | None:
        decodes = self._next_decodes(current)
        if decodes is None:
            return None
        rows, chunks, leaving = decodes
        need = sum(self.blocks.missing(c.seq, c.start + 1) for c in chunks)
        if need > self.blocks.num_free:
            return None   # someone must give way: schedule() decides who
        beside = self.config.overlap_admissions
        if not beside and self.scheduler.would_admit(need):
            return None   # a waiting request goes first
        for c in chunks:
            self.blocks.grow(c.seq, c.start + 1)
        admitted = self.scheduler.admit_beside(len(chunks), leaving) if beside else None
        if admitted is not None:
            chunks += admitted.chunks   # after the decodes: the sample feeds the first len(rows) rows
        index = torch.tensor(rows, dtype=torch.long).to(self.runner.device, non_blocking=True)
        queued = self.launch(chunks, (current.pending.tokens, index))
        queued.ahead = True
        if admitted is not None:
            queued.admitted, queued.failed = bool(admitted.chunks), admitted.failed
        return queued

    def _next_decodes(self, current: Launched) -> tuple[list[int], list[ScheduledChunk], int] | None:
        """The one-token decodes `schedule` would run after `current` (rule 1): (the rows of current's sample
        that feed them, their chunks, how many running sequences end by length with current's token); None
        when the scheduler may run something else."""
        if not all(c.needs_logits for c in current.chunks):
            return None   # a prompt goes on with its next chunk
        in_step = {id(c.seq) for c in current.chunks}
        if any(id(s) not in in_step for s in self.scheduler.running):
            return None   # a running prompt got no budget this step: the scheduler must see it next
        max_len = self.runner.max_model_len
        rows, chunks, leaving = [], [], 0
        for row, c in enumerate(current.chunks):
            seq = c.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= max_len:
                leaving += 1   # ends with the token in flight: its row would be wasted
                continue
            rows.append(row)
            chunks.append(ScheduledChunk(seq, 1, start=seq.num_tokens, needs_logits=True))
        return (rows, chunks, leaving) if chunks else None
