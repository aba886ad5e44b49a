"""`Sequence`: one request's host state, from arrival to its last token (nano-vllm's split: no tensors
of its own except its sampling generator)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..adapters.composition import AdapterRef, Composition
from ..sampling import SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # no KV blocks (new, or preempted and to be recomputed)
    RUNNING = "running"    # holds KV blocks and a pinned slot for each of its adapters
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"          # eos, a stop token or a stop string
    LENGTH = "length"      # max_tokens or the model's length limit
    ABORT = "abort"        # aborted by the caller
    ERROR = "error"        # one of its adapters failed to load, or the model produced NaN
    MIGRATED = "migrated"  # taken off a cluster replica short of KV memory, to go on elsewhere (cluster/)


@dataclass
class SequenceTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # its adapters with their weights (a name or a {name: weight} mapping given here is parsed); None: the base model
    adapter: AdapterRef = None
    prompt: str | None = None
    generator: torch.Generator | None = None   # the request's own, when it brings a seed
    text: object | None = None                 # its OutputText (detokenizer), when the engine has a tokenizer
    token_ids: list[int] = field(default_factory=list)   # prompt + output
    num_cached: int = 0                        # tokens whose keys and values are in the KV cache
    block_table: list[int] = field(default_factory=list)
    adapter_slots: tuple[int, ...] = ()        # each member's pool slot, in the composition's order; pinned
                                               # while RUNNING, () otherwise
    # what the request named: an adapter, a named composition, or (default) the composition's string form
    adapter_label: str | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None       # the stop string or token id that ended it
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    times: SequenceTimes = field(default_factory=SequenceTimes)
    num_preemptions: int = 0
    sent_tokens: int = 0                       # output tokens already reported to the caller

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.adapter = Composition.parse(self.adapter)
        if self.adapter_label is None and self.adapter is not None:
            self.adapter_label = str(self.adapter)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """Its adapters' names (empty for the base model)."""
        return () if self.adapter is None else self.adapter.names

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncached(self) -> int:
        """Tokens still to be fed through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, adapter={self.adapter_label!r}, "
                f"tokens={self.num_tokens}, cached={self.num_cached}, blocks={len(self.block_table)})")
