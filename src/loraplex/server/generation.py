"""One completion or chat request through the engine: prepare (model → adapter, prompt → token ids,
fields → SamplingParams), submit its `n` choices, then answer whole or as server-sent events.

A client that goes away aborts its engine requests: streaming responses are cancelled by
Starlette when the client disconnects, and whole responses watch for the disconnect themselves.
Either way the per-choice streams are closed, which aborts them in the engine (KV freed at once).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator

import anyio
from fastapi import Request

from ..adapters import AdapterError
from ..engine.async_engine import EngineDeadError
from ..engine.outputs import RequestOutput
from ..sampling import SEED_LIMIT, SamplingParams
from . import protocol, responses
from .errors import APIError, error_body
from .state import ServerState

log = logging.getLogger("loraplex.server")

DISCONNECT_POLL_S = 0.25


@dataclass
class Prepared:
    chat: bool
    request_id: str
    created: int
    model: str                    # the name the client asked for (echoed back)
    adapter: str | None
    prompt_ids: list[int]
    params: list[SamplingParams]  # one per choice
    include_usage: bool
    stream: bool


def resolve_model(state: ServerState, model: str) -> str | None:
    """The adapter a request's `model` names (None: the base model); 404 if it names nothing served."""
    if model == state.model_name:
        return None
    if model in state.adapters and model not in state.draining:
        return model
    raise APIError(404, f"the model {model!r} does not exist: GET /v1/models lists the base model and its adapters",
                   param="model", code="model_not_found")


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text))
    except Exception as e:   # e.g. a lone surrogate the tokenizer cannot take
        raise APIError(400, f"the prompt could not be tokenized: {type(e).__name__}: {e}", param="prompt") from None


async def prepare(state: ServerState, req, chat: bool) -> Prepared:
    """Check and translate the request; its `n` engine requests are reserved in `state` (no await
    comes between the checks and the reservation); on any error here they are released."""
    if not state.accepting:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    adapter = resolve_model(state, req.model)
    n = req.n
    if state.in_flight + n > state.max_in_flight:
        raise APIError(429, f"the server is at capacity ({state.in_flight} requests in flight); retry shortly",
                       code="queue_full", headers={"Retry-After": "1"})
    state.reserve(adapter, n)
    try:
        return await _prepare(state, req, chat, adapter, n)
    except BaseException:
        for _ in range(n):
            state.release(adapter)
        raise


async def _prepare(state: ServerState, req, chat: bool, adapter: str | None, n: int) -> Prepared:
    tokenizer = state.tokenizer
    if chat:
        # templates and tokenizers run off the event loop: a long prompt must not stall other clients
        prompt_ids = await anyio.to_thread.run_sync(protocol.chat_prompt, req, tokenizer)
    else:
        prompt = protocol.completion_prompt(req, vocab_size=state.vocab_size)
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids",
                               param="prompt")
            prompt_ids = await anyio.to_thread.run_sync(_encode, tokenizer, prompt)
        else:
            prompt_ids = prompt
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
    params = protocol.sampling_params(req, prompt_len=len(prompt_ids), max_model_len=state.max_model_len,
                                      vocab_size=state.vocab_size)
    choices = [params]
    for i in range(1, n):   # with a seed, choice i draws from seed + i: different and reproducible
        seed = None if params.seed is None else (params.seed + i) % SEED_LIMIT
        choices.append(replace(params, seed=seed))
    prefix = "chatcmpl" if chat else "cmpl"
    return Prepared(chat, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), req.model, adapter, prompt_ids,
                    choices, req.include_usage, bool(req.stream))


# ---- running the choices ----------------------------------------------------------------------
class Run:
    """The engine requests of one API request; iterate `outputs()` for (choice index, output)."""

    def __init__(self, state: ServerState, prep: Prepared) -> None:
        self.state, self.prep = state, prep
        self.ids: list[str] = []
        self._tasks: list[asyncio.Task] = []

    async def submit(self) -> None:
        """Queue every choice in the engine (all or none); takes over `prepare`'s reservations."""
        state, prep = self.state, self.prep
        try:
            for i, params in enumerate(prep.params):
                rid = await state.engine.submit(prep.prompt_ids, params, prep.adapter,
                                                request_id=f"{prep.request_id}-{i}")
                self.ids.append(rid)
        except BaseException as e:
            for rid in self.ids:   # accepted choices: aborted, and their streams dropped
                with contextlib.suppress(Exception):
                    state.engine.cancel(rid)
            self.ids.clear()
            for _ in prep.params:
                state.release(prep.adapter)
            raise _submit_error(state, prep, e) from e
        self._start_pumps()

    def _start_pumps(self) -> None:
        # started at once, not when the response is first read: a client that leaves before then
        # still has its requests aborted by `close()` (the response's background task)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, rid, self._queue)) for i, rid in enumerate(self.ids)]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's outputs, interleaved as they come; closing this aborts what is unfinished."""
        try:
            remaining = len(self._tasks)
            while remaining:
                item = await self._queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
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
            if not isinstance(e, asyncio.CancelledError):
                queue.put_nowait(e)
            raise
        finally:
            try:
                self._record(last)
            except Exception:   # metrics must never leak a request
                log.exception("recording a request's metrics")
            self.state.release(self.prep.adapter, served=last is not None and last.finish_reason in ("stop", "length"))
            queue.put_nowait(None)

    def _record(self, out: RequestOutput | None) -> None:
        outcome = out.finish_reason if out is not None and out.finished else "abort"   # the reader left
        m = out.metrics if out is not None else None
        tokens = out.num_output_tokens if out is not None else 0
        tpot = None
        if m is not None and m.finished_time is not None and m.first_token_time is not None and tokens > 1:
            tpot = (m.finished_time - m.first_token_time) / (tokens - 1)
        self.state.metrics.request_finished(
            self.prep.adapter, outcome,
            prompt_tokens=len(self.prep.prompt_ids), output_tokens=tokens,
            ttft_s=m.time_to_first_token if m is not None else None,
            e2e_s=m.latency if m is not None and out.finished else None, tpot_s=tpot)


def _submit_error(state: ServerState, prep: Prepared, e: BaseException) -> BaseException:
    if isinstance(e, APIError) or not isinstance(e, Exception):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(503, "the engine is not running", code="engine_dead")
    if isinstance(e, AdapterError) and prep.adapter is not None:
        if prep.adapter not in state.cache:
            return APIError(404, f"the model {prep.adapter!r} does not exist", param="model", code="model_not_found")
        error = state.cache.error(prep.adapter)
        if error is not None:
            return APIError(500, f"adapter {prep.adapter!r} failed to load: {error}", code="adapter_load_failed")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return e


def _failure(out: RequestOutput) -> APIError:
    return APIError(500, f"generation failed: {out.error or 'unknown error'}", code="generation_failed")


# ---- whole responses ----------------------------------------------------------------------------
async def respond_whole(run: Run, request: Request) -> dict:
    prep = run.prep
    finals: dict[int, RequestOutput] = {}

    async def collect() -> None:
        async with contextlib.aclosing(run.outputs()) as outputs:
            async for index, out in outputs:
                if out.finished:
                    finals[index] = out

    async def client_left() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    work = asyncio.create_task(collect())
    watch = asyncio.create_task(client_left())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():   # the client left: closing the streams aborts the engine requests
            work.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        raise APIError(499, "the client closed the request")
    if work.exception() is not None:
        e = work.exception()
        raise APIError(503, "the engine stopped") if isinstance(e, EngineDeadError) else e
    for out in finals.values():
        if out.finish_reason == "error":
            raise _failure(out)
    choices = [responses.Choice(i, finals[i].text, finals[i].token_ids, finals[i].finish_reason, finals[i].logprobs)
               for i in sorted(finals)]
    build = responses.chat_response if prep.chat else responses.completion_response
    return build(prep.request_id, prep.model, prep.created, choices, len(prep.prompt_ids), run.state.tokenizer)


# ---- server-sent events ---------------------------------------------------------------------------
def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def respond_stream(run: Run) -> AsyncIterator[str]:
    prep, tokenizer = run.prep, run.state.tokenizer
    sent_chars = [0] * len(run.ids)
    completion_tokens = 0
    try:
        if prep.chat:
            for i in range(len(run.ids)):
                yield _event(responses.chat_chunk(prep.request_id, prep.model, prep.created, i, role="assistant",
                                                 content=""))
        async with contextlib.aclosing(run.outputs()) as outputs:
            async for index, out in outputs:
                if out.finished and out.finish_reason == "error":
                    yield _event(_failure(out).body())
                    break
                new_lp = None
                if out.logprobs is not None and out.new_token_ids:
                    new_lp = out.logprobs[len(out.logprobs) - len(out.new_token_ids):]
                if out.finished:
                    completion_tokens += out.num_output_tokens
                if not out.new_text and not out.finished and not new_lp:
                    continue
                reason = out.finish_reason if out.finished else None
                if prep.chat:
                    chunk = responses.chat_chunk(prep.request_id, prep.model, prep.created, index,
                                                content=out.new_text or None,
                                                finish_reason=reason, logprobs=new_lp, tokenizer=tokenizer)
                else:
                    chunk = responses.completion_chunk(prep.request_id, prep.model, prep.created, index, out.new_text,
                                                      reason, logprobs=new_lp, tokenizer=tokenizer,
                                                      text_offset=sent_chars[index])
                sent_chars[index] += len(out.new_text)
                yield _event(chunk)
            else:
                if prep.include_usage:
                    name = "chat.completion.chunk" if prep.chat else "text_completion"
                    yield _event(responses.usage_chunk(prep.request_id, prep.model, prep.created, name,
                                                      len(prep.prompt_ids), completion_tokens))
    except EngineDeadError:
        yield _event(error_body(503, "the engine stopped", code="engine_dead"))
    yield "data: [DONE]\n\n"
