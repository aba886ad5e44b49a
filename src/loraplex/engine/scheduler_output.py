"""What the scheduler hands the engine for one step: the chunks of tokens to run, and the sequences the
step's scheduling preempted, migrated or failed.

The model runner, the step pipeline and `StepInfo` read these; `Scheduler` builds them (engine/scheduler.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int                  # tokens fed this step
    start: int = -1                  # the first one's position (default: seq.num_cached now)
    needs_logits: bool | None = None  # the chunk reaches the sequence's end (default: from its state now)

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.seq.num_cached
        if self.needs_logits is None:
            self.needs_logits = self.start + self.num_tokens == self.seq.num_tokens


def is_decode(chunks: list[ScheduledChunk]) -> bool:
    """Every chunk is one token that gets sampled (what CUDA graphs replay)."""
    return bool(chunks) and all(c.num_tokens == 1 and c.needs_logits for c in chunks)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    migrated: list[Sequence] = field(default_factory=list)   # taken by the `migrate` hook instead of preempted
    failed: list[Sequence] = field(default_factory=list)   # their adapter failed to load; still waiting:
                                                           # the engine finishes them

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)
