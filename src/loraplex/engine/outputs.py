"""What the engine hands back: one `RequestOutput` per request per step in which it made progress."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling import TokenLogprobs
from .sequence import Sequence


@dataclass
class RequestMetrics:
    arrival_time: float                  # time.monotonic() at submission
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    adapter: str | None               # what the request named: an adapter, a named composition, or a composition's
                                      # string form ("{sql: 0.7, formal: 0.3}"); None for the base model
    text: str                         # the output text so far (cut before a stop string)
    token_ids: list[int]              # the output token ids so far
    new_text: str                     # text not reported before (streaming); never part of a stop string
    new_token_ids: list[int]          # token ids not reported before
    finished: bool
    finish_reason: str | None         # stop | length | abort | error
    stop_reason: str | int | None     # the stop string or stop token id that ended it (None for eos)
    error: str | None
    logprobs: list[TokenLogprobs] | None
    metrics: RequestMetrics = field(repr=False)
    adapters: tuple[str, ...] = ()    # the adapters it ran with (a composition's members); empty for the base model

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


def make_output(seq: Sequence) -> RequestOutput:
    """The request's state now; marks what it reports as sent."""
    finished = seq.is_finished
    token_ids = seq.output_token_ids   # one copy of the output so far (each step's output holds its own)
    new_ids = token_ids[seq.sent_tokens:]
    seq.sent_tokens = len(token_ids)
    if seq.text is not None:
        new_text, text = seq.text.take_new(final=finished), seq.text.text
    else:
        new_text, text = "", ""
    t = seq.times
    return RequestOutput(
        request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids, adapter=seq.adapter_label,
        text=text, token_ids=token_ids, new_text=new_text, new_token_ids=new_ids, finished=finished,
        finish_reason=seq.finish_reason.value if seq.finish_reason else None, stop_reason=seq.stop_reason,
        error=seq.error, logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        metrics=RequestMetrics(t.arrival, t.first_scheduled, t.first_token, t.finished, seq.num_preemptions),
        adapters=seq.adapter_names)
