"""One completion or chat request through the engine: prepare (model and adapters → what it runs
on, targets.py; prompts → token ids; fields → SamplingParams), then `Run` submits its choices and
gathers their outputs (respond.py answers with them, whole or as server-sent events).

A completions request may hold a batch of prompts: each has `n` choices, choice `k * n + j` is
prompt k's j-th (OpenAI's numbering). Choice i with a seed draws from seed + i.

A client that goes away aborts its engine requests: streaming responses are cancelled by
Starlette when the client disconnects, and whole responses watch for the disconnect themselves.
Either way the per-choice streams are closed, which aborts them in the engine (KV freed at once).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from dataclasses import dataclass, replace
from collections.abc import AsyncIterator

import anyio

from ..adapters import AdapterError
from ..engine.async_engine import EngineDeadError
from ..engine.outputs import RequestOutput
from ..sampling import SEED_LIMIT, SamplingParams
from . import translate
from .errors import APIError, public_text
from .state import ServerState
from .targets import Target, resolve
from .tenants import Access

log = logging.getLogger("loraplex.server")


@dataclass
class Prepared:
    chat: bool
    request_id: str
    created: int
    model: str                    # the name the client asked for (echoed back)
    target: Target
    prompts: list[list[int]]      # token ids of each prompt
    params: list[SamplingParams]  # one per choice
    prompt_of: list[int]          # per choice, the index of its prompt
    include_usage: bool
    stream: bool
    tenant: str | None = None     # the caller's tenant (keys file), for the metrics

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text))
    except Exception as e:   # e.g. a lone surrogate the tokenizer cannot take
        raise APIError(400, f"the prompt could not be tokenized: {type(e).__name__}: {public_text(str(e))}",
                       param="prompt") from None


async def prepare(state: ServerState, req, chat: bool, access: Access) -> Prepared:
    """Check and translate the request; its engine requests are reserved in `state` (no await comes
    between the checks and the reservation); on any error here they are released."""
    if not state.accepting:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    target = resolve(state, req, access)
    count = req.n * (1 if chat else len(req.prompts))
    if state.in_flight + count > state.max_in_flight:
        raise APIError(429, f"the server is at capacity ({state.in_flight} requests in flight); retry shortly",
                       code="queue_full", headers={"Retry-After": "1"})
    state.reserve(target.members, count)
    try:
        return await _prepare(state, req, chat, target, access.tenant)
    except BaseException:
        for _ in range(count):
            state.release(target.members)
        raise


async def _prepare(state: ServerState, req, chat: bool, target: Target, tenant: str | None) -> Prepared:
    tokenizer = state.tokenizer
    if chat:
        # templates and tokenizers run off the event loop: a long prompt must not stall other clients
        prompts = [await anyio.to_thread.run_sync(translate.chat_prompt, req, tokenizer)]
    else:
        prompts = []
        for prompt in translate.completion_prompts(req, vocab_size=state.vocab_size):
            if isinstance(prompt, str):
                if tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids",
                                   param="prompt")
                prompt = await anyio.to_thread.run_sync(_encode, tokenizer, prompt)
            if not prompt:
                raise APIError(400, "the prompt is empty", param="prompt")
            prompts.append(prompt)
    params, prompt_of = [], []
    for k, ids in enumerate(prompts):
        first = translate.sampling_params(req, prompt_len=len(ids), max_model_len=state.max_model_len,
                                          vocab_size=state.vocab_size)
        for _ in range(req.n):   # with a seed, choice i draws from seed + i: different and reproducible
            i = len(params)
            seed = None if first.seed is None else (first.seed + i) % SEED_LIMIT
            params.append(replace(first, seed=seed) if i else first)
            prompt_of.append(k)
    prefix = "chatcmpl" if chat else "cmpl"
    return Prepared(chat, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), req.model, target, prompts, params,
                    prompt_of, req.include_usage, bool(req.stream), tenant)


# ---- what went wrong, as the client should see it ----------------------------------------------
def adapter_unavailable(state: ServerState, name: str, detail: str, param: str = "model") -> APIError:
    """Its files are missing or broken: the adapter's fault, not the server's (424, naming it)."""
    retry = state.cache.retry_in(name) if name in state.cache else 0.0
    reason = public_text(detail.split("failed to load: ", 1)[-1])
    return APIError(424, f"the adapter {name!r} could not be loaded from its files ({reason[:300]}); the other "
                         f"models serve as usual, and this one is tried again on a request after "
                         f"{math.ceil(retry)} s", param=param, code="adapter_unavailable",
                    headers={"Retry-After": str(max(math.ceil(retry), 1))})


def _failed_member(target: Target, error: str) -> str | None:
    """The member an engine error says failed to load."""
    return next((m for m in target.members if f"adapter {m!r} failed to load" in error), None)


def output_error(state: ServerState, prep: Prepared, out: RequestOutput) -> APIError:
    """The error of an output that finished with "error"."""
    error = out.error or "unknown error"
    failed = _failed_member(prep.target, error)
    if failed is not None:
        return adapter_unavailable(state, failed, error, prep.target.param)
    return APIError(500, f"generation failed: {public_text(error)}", code="generation_failed")


def submit_error(state: ServerState, prep: Prepared, e: BaseException) -> BaseException:
    if isinstance(e, APIError) or not isinstance(e, Exception):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(503, "the engine is not running", code="engine_dead")
    target = prep.target
    if isinstance(e, AdapterError) and target.members:
        gone = next((m for m in target.members if m not in state.cache), None)
        if gone is not None:   # removed between the checks and the engine
            return APIError(404, f"the model {gone!r} does not exist", param=target.param, code="model_not_found")
        failed = _failed_member(target, str(e)) or next(
            (m for m in target.members if state.cache.error(m) is not None), None)
        if failed is not None:
            return adapter_unavailable(state, failed, str(e), target.param)
        return APIError(400, public_text(str(e)), param=target.param)
    if isinstance(e, ValueError):
        return APIError(400, public_text(str(e)))
    return e


# ---- running the choices ----------------------------------------------------------------------
class Run:
    """The engine requests of one API request; iterate `outputs()` for (choice index, output)."""

    def __init__(self, state: ServerState, prep: Prepared) -> None:
        self.state, self.prep = state, prep
        self.ids: list[str] = []
        self._tasks: list[asyncio.Task] = []
        self._first: list = []   # an item `first()` took from the queue, handed out first

    async def submit(self) -> None:
        """Queue every choice in the engine (all or none); takes over `prepare`'s reservations."""
        state, prep = self.state, self.prep
        try:
            for i, params in enumerate(prep.params):
                rid = await state.engine.submit(prep.prompts[prep.prompt_of[i]], params, prep.target.adapter,
                                                request_id=f"{prep.request_id}-{i}")
                self.ids.append(rid)
        except BaseException as e:
            for rid in self.ids:   # accepted choices: aborted, and their streams dropped
                with contextlib.suppress(Exception):
                    state.engine.cancel(rid)
            self.ids.clear()
            for _ in prep.params:
                state.release(prep.target.members)
            raise submit_error(state, prep, e) from e
        self._start_pumps()

    def _start_pumps(self) -> None:
        # started at once, not when the response is first read: a client that leaves before then
        # still has its requests aborted by `close()` (the response's background task)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._remaining = len(self.ids)
        self._tasks = [asyncio.create_task(self._pump(i, rid, self._queue)) for i, rid in enumerate(self.ids)]

    async def _next(self):
        """The next (index, output), or None when every choice has ended; raises a choice's error."""
        while self._remaining:
            item = self._first.pop() if self._first else await self._queue.get()
            if item is None:
                self._remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return item
        return None

    async def first(self) -> None:
        """Wait for the first output (kept for `outputs()`); the APIError instead if it is a failure,
        so that a stream that cannot start is answered with an error status, not a 200."""
        item = await self._next()
        if item is None:
            return
        _, out = item
        if out.finished and out.finish_reason == "error":
            raise output_error(self.state, self.prep, out)
        self._first.append(item)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's outputs, interleaved as they come; closing this aborts what is unfinished."""
        try:
            while (item := await self._next()) is not None:
                yield item
        finally:
            await self.close()

    async def close(self) -> None:
        """Abort whatever is unfinished (idempotent)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pump(self, index: int, rid: str, queue: asyncio.Queue) -> None:
        last: RequestOutput | None = None
        try:
            async with contextlib.aclosing(self.state.engine.stream(rid)) as stream:
                async for out in stream:
                    last = out
                    queue.put_nowait((index, out))
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):   # the engine's own failure: its requests get 503
                dead = self.state.engine.error is not None and not isinstance(e, (APIError, EngineDeadError))
                queue.put_nowait(EngineDeadError(f"the engine stopped: {e!r}") if dead else e)
            raise
        finally:
            try:
                self._record(index, last)
            except Exception:   # metrics must never leak a request
                log.exception("recording a request's metrics")
            self.state.release(self.prep.target.members,
                               served=last is not None and last.finish_reason in ("stop", "length"))
            queue.put_nowait(None)

    def _record(self, index: int, out: RequestOutput | None) -> None:
        outcome = out.finish_reason if out is not None and out.finished else "abort"   # the reader left
        m = out.metrics if out is not None else None
        tokens = out.num_output_tokens if out is not None else 0
        tpot = None
        if m is not None and m.finished_time is not None and m.first_token_time is not None and tokens > 1:
            tpot = (m.finished_time - m.first_token_time) / (tokens - 1)
        self.state.metrics.request_finished(
            self.prep.target.label, outcome,
            prompt_tokens=len(self.prep.prompts[self.prep.prompt_of[index]]), output_tokens=tokens,
            ttft_s=m.time_to_first_token if m is not None else None,
            e2e_s=m.latency if m is not None and out.finished else None, tpot_s=tpot, tenant=self.prep.tenant,
            members=self.prep.target.members)
