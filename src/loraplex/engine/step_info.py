"""What a step ran: the engine's record of its last step (for metrics and benchmarks)."""
from __future__ import annotations

from dataclasses import dataclass

from .model_runner import GpuSpan
from .scheduler import ScheduledChunk, is_decode


@dataclass
class StepInfo:
    """What the last step ran (for metrics and benchmarks)."""
    num_seqs: int
    num_tokens: int
    adapters: tuple[str | None, ...]   # the step's distinct adapters, compositions' members each (None: sequences
                                       # on the base model, first)
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

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], graphed: bool, seconds: float, span: GpuSpan | None) -> StepInfo:
        """The record of a step that ran `chunks`."""
        names = {name for c in chunks for name in (c.seq.adapter_names or (None,))}
        return cls(len(chunks), sum(c.num_tokens for c in chunks),
                   tuple(sorted(names, key=lambda a: (a is not None, a or ""))), is_decode(chunks), graphed,
                   seconds, span, sum(c.start + c.num_tokens for c in chunks))
