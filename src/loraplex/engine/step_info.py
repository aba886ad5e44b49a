"""What a step launched and what it ran: the engine's records of its steps (for overlap, metrics, benchmarks)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling import PendingSample
from .model_runner import GpuSpan
from .scheduler import ScheduledChunk
from .sequence import Sequence


@dataclass
class Launched:
    chunks: list[ScheduledChunk]
    pending: PendingSample
    graph: tuple[int, int] | None   # the CUDA graph's (sequences, prompt tokens); None: eager
    span: GpuSpan | None            # its GPU time (CUDA only)
    admitted: bool = False          # queued ahead with prompts admitted beside its decodes
    failed: list[Sequence] = field(default_factory=list)   # requests that admission failed (adapter errors)


@dataclass
class StepInfo:
    """What the last step ran (for metrics and benchmarks)."""
    num_seqs: int
    num_tokens: int
    adapters: tuple[str | None, ...]   # the step's distinct adapters (None: sequences on the base model first)
    decode: bool           # every sequence fed one token
    graphed: bool          # replayed a CUDA graph
    seconds: float         # wall time of the whole step: schedule, run, sample, postprocess
    span: GpuSpan | None = None   # its inputs, forward and sample on the GPU (CUDA only)
    context_tokens: int = 0       # KV tokens its attention covers: each sequence's context through its chunk

    @property
    def gpu_seconds(self) -> float | None:
        """The step's GPU span in seconds (None on the CPU); waits for the step's end on the GPU if it has
        not come yet (read it later, e.g. after a run, not to stall the host)."""
        return None if self.span is None else self.span.seconds()

    @property
    def num_adapters(self) -> int:
        """Distinct adapters in the step (the base model not counted)."""
        return sum(a is not None for a in self.adapters)
