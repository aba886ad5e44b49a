"""Answering a `Run` (generation.py): whole (`respond_whole`) or as server-sent events
(`respond_stream`), both watching for the client leaving, which aborts what is unfinished.

A stream's 200 is sent only once its first output has come (`start_stream`), so a request that
fails before then (its adapter's files are missing, the engine stopped) gets an error status like
a whole response would; a failure after that ends the stream with an error event.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request

from ..engine.async_engine import EngineDeadError
from ..engine.outputs import RequestOutput
from . import responses
from .errors import APIError, error_body
from .generation import Run, output_error

DISCONNECT_POLL_S = 0.25


async def _unless_client_leaves(request: Request, work: Awaitable):
    """`work`'s result, or APIError 499 if the client disconnects first (then `work` is cancelled)."""
    async def client_left() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(client_left())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():   # the client left: closing the streams aborts the engine requests
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "the client closed the request")
    e = task.exception()
    if e is not None:
        raise APIError(503, "the engine stopped", code="engine_dead") if isinstance(e, EngineDeadError) else e
    return task.result()


# ---- whole responses ----------------------------------------------------------------------------
async def respond_whole(run: Run, request: Request) -> dict:
    prep = run.prep
    finals: dict[int, RequestOutput] = {}

    async def collect() -> None:
        async with contextlib.aclosing(run.outputs()) as outputs:
            async for index, out in outputs:
                if out.finished:
                    finals[index] = out

    await _unless_client_leaves(request, collect())
    for out in finals.values():
        if out.finish_reason == "error":
            raise output_error(run.state, prep, out)
    choices = [responses.Choice(i, finals[i].text, finals[i].token_ids, finals[i].finish_reason, finals[i].logprobs)
               for i in sorted(finals)]
    build = responses.chat_response if prep.chat else responses.completion_response
    return build(prep.request_id, prep.model, prep.created, choices, prep.prompt_tokens, run.state.tokenizer)


# ---- server-sent events ---------------------------------------------------------------------------
async def start_stream(run: Run, request: Request) -> None:
    """Wait for the stream's first output (an error before it becomes the response); closes the
    run if it raises."""
    try:
        await _unless_client_leaves(request, run.first())
    except BaseException:
        await run.close()
        raise


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
                    yield _event(output_error(run.state, prep, out).body())
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
                                                      prep.prompt_tokens, completion_tokens))
    except EngineDeadError:
        yield _event(error_body(503, "the engine stopped", code="engine_dead"))
    yield "data: [DONE]\n\n"
