"""One request through the replicas (`ClusterRequest`), as one uninterrupted stream of outputs for the server.

Each attempt is a `Job` on one replica. Every output token comes back to the ingress, so when an attempt ends
without finishing the request, the next attempt resumes it elsewhere by re-prefilling prompt + the tokens generated
so far (replica_engine.py):
- **migration**: the replica ran short of KV memory and, since another replica had room, ended the request as
  `migrated` instead of preempting it;
- **failover**: the replica died (its actor is gone; or its engine stopped), so the stream broke; the request is
  retried on another replica, at most `max_retries` times.
The client sees neither: tokens, text and logprobs continue where they stopped, none repeated or lost, and greedy
output is the same as without the move. Seeded sampling goes on from a generator seeded afresh on the new replica.

`RequestOutput`s handed to the server are built here: the whole output so far, the ingress's own arrival and
first-token times (so TTFT includes the router queue), and `num_preemptions` counting the moves.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..adapters.composition import Composition
from ..engine.outputs import RequestMetrics, RequestOutput
from ..sampling import SamplingParams, TokenLogprobs
from .messages import Job, route_of
from .routing import RouteRequest


@dataclass
class ClusterRequest:
    request_id: str
    prompt: list[int]
    prompt_text: str | None
    params: SamplingParams
    adapter: str | Composition | None     # what replicas are given
    composition: Composition | None
    label: str | None                     # what the request called its adapters
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    text: str = ""
    moves: int = 0                        # migrations and retries so far
    attempts: int = 0
    replica: str | None = None            # where its current attempt runs
    finished: bool = False
    task: asyncio.Task | None = None
    closing: bool = False                 # its reader left

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    def route(self) -> RouteRequest:
        return route_of(len(self.prompt), self.params, self.composition, len(self.generated))

    def job(self, origin: str, target: str | None, exclude: frozenset[str], sources: dict[str, str]) -> Job:
        self.attempts += 1
        return Job(key=f"{self.request_id}#{self.attempts}", origin=origin, prompt=tuple(self.prompt),
                   params=self.params, adapter=self.adapter, route=self.route(), exclude=exclude,
                   resume=tuple(self.generated), target=target, sources=sources)

    def take(self, out: RequestOutput) -> RequestOutput:
        """A replica's output as part of this request's one stream (module docstring)."""
        now = time.monotonic()
        if self.first_scheduled is None:
            self.first_scheduled = now
        if out.new_token_ids and self.first_token is None:
            self.first_token = now
        self.generated.extend(out.new_token_ids)
        if self.logprobs is not None and out.logprobs is not None and out.new_token_ids:
            self.logprobs.extend(out.logprobs[len(out.logprobs) - len(out.new_token_ids):])
        self.text = out.text   # the replica decodes the whole output, resumed tokens included
        self.finished = out.finished
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt_text, prompt_token_ids=self.prompt, adapter=self.label,
            text=self.text, token_ids=list(self.generated), new_text=out.new_text,
            new_token_ids=list(out.new_token_ids), finished=out.finished, finish_reason=out.finish_reason,
            stop_reason=out.stop_reason, error=out.error,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            metrics=self.metrics(now if out.finished else None),
            adapters=self.composition.names if self.composition is not None else ())

    def ended(self, reason: str, error: str | None = None) -> RequestOutput:
        """A last output made here: aborted, or failed before a replica could finish it."""
        self.finished = True
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt_text, prompt_token_ids=self.prompt, adapter=self.label,
            text=self.text, token_ids=list(self.generated), new_text="", new_token_ids=[], finished=True,
            finish_reason=reason, stop_reason=None, error=error,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            metrics=self.metrics(time.monotonic()),
            adapters=self.composition.names if self.composition is not None else ())

    def metrics(self, finished: float | None) -> RequestMetrics:
        return RequestMetrics(self.arrival, self.first_scheduled, self.first_token, finished, self.moves)
