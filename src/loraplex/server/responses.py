"""The OpenAI wire format, outbound: /v1/completions and /v1/chat/completions responses.

Responses are plain dicts (no pydantic on the hot path) in OpenAI's schemas, `system_fingerprint`
None:
- `Choice` (one finished choice) → `completion_response(...)` ("text_completion") and
  `chat_response(...)` ("chat.completion"), each with `usage`.
- Streaming: `completion_chunk(...)` ("text_completion"), `chat_chunk(...)`
  ("chat.completion.chunk"; pass `role="assistant"` in each choice's first chunk), and
  `usage_chunk(...)` (choices = [], for `stream_options.include_usage`).
- Logprobs (`completion_logprobs(...)`, `chat_logprobs(...)`): completions `{"tokens", "token_logprobs",
  "top_logprobs": [{token: logprob}], "text_offset"}`; chat `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [...]}]}`.
  A token's text is `tokenizer.decode([id])` ("token_id:<id>" without a tokenizer); non-finite
  logprobs become -9999.0, since JSON has no -inf.
- finish_reason: the engine's "stop" and "length" are OpenAI's; "abort" and "error" pass through
  as loraplex extensions (the server turns an errored request into an error response anyway).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from loraplex.sampling import TokenLogprobs

JSON_SAFE_MIN_LOGPROB = -9999.0  # what OpenAI's API reports for a -inf logprob
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Choice:
    """One finished choice, as the server collected it from the engine."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # the engine's: stop | length | abort | error
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when asked for

    def __post_init__(self) -> None:
        _check_finish_reason(self.finish_reason)


def _check_finish_reason(reason: str | None) -> str | None:
    if reason is not None and reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be None or one of {FINISH_REASONS}, got {reason!r}")
    return reason


def json_safe_logprob(value: float) -> float:
    """A logprob JSON can carry: non-finite (-inf, NaN) becomes -9999.0."""
    value = float(value)
    return value if math.isfinite(value) else JSON_SAFE_MIN_LOGPROB


class _TokenTexts:
    """Each token id's text, decoded once per response (top lists repeat ids)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id])
            self.cache[token_id] = text
        return text


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(logprobs: list[TokenLogprobs], tokenizer: Any, text_offset: int = 0) -> dict:
    """The completions API's logprobs object; offsets count characters from `text_offset`."""
    texts = _TokenTexts(tokenizer)
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for step in logprobs:
        text = texts(step.token_id)
        tokens.append(text)
        token_logprobs.append(json_safe_logprob(step.logprob))
        top: dict[str, float] = {}
        for token_id, value in step.top:
            # Two ids may decode alike; keep the likelier (listed first).
            top.setdefault(texts(token_id), json_safe_logprob(value))
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _chat_token(text: str, value: float) -> dict:
    return {"token": text, "logprob": json_safe_logprob(value),
            "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(logprobs: list[TokenLogprobs], tokenizer: Any) -> dict:
    """The chat API's logprobs object."""
    texts = _TokenTexts(tokenizer)
    content = []
    for step in logprobs:
        entry = _chat_token(texts(step.token_id), step.logprob)
        entry["top_logprobs"] = [_chat_token(texts(token_id), value) for token_id, value in step.top]
        content.append(entry)
    return {"content": content}


def _envelope(id: str, object_name: str, created: int, model: str, choices: list[dict]) -> dict:
    return {"id": id, "object": object_name, "created": int(created), "model": model,
            "system_fingerprint": None, "choices": choices}


def completion_response(id: str, model: str, created: int, choices: list[Choice], prompt_tokens: int,
                        tokenizer: Any) -> dict:
    """A whole /v1/completions response."""
    out = _envelope(id, "text_completion", created, model, [
        {"index": c.index, "text": c.text,
         "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs, tokenizer),
         "finish_reason": c.finish_reason}
        for c in choices])
    out["usage"] = usage(prompt_tokens, sum(len(c.token_ids) for c in choices))
    return out


def chat_response(id: str, model: str, created: int, choices: list[Choice], prompt_tokens: int,
                  tokenizer: Any) -> dict:
    """A whole /v1/chat/completions response."""
    out = _envelope(id, "chat.completion", created, model, [
        {"index": c.index, "message": {"role": "assistant", "content": c.text},
         "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs, tokenizer),
         "finish_reason": c.finish_reason}
        for c in choices])
    out["usage"] = usage(prompt_tokens, sum(len(c.token_ids) for c in choices))
    return out


def completion_chunk(id: str, model: str, created: int, index: int, text: str, finish_reason: str | None,
                     logprobs: list[TokenLogprobs] | None = None, tokenizer: Any = None,
                     text_offset: int = 0) -> dict:
    """One streamed /v1/completions event for choice `index`; `text_offset` is how many characters
    that choice has streamed before this chunk (its logprobs' offsets continue from there)."""
    return _envelope(id, "text_completion", created, model, [{
        "index": index, "text": text,
        "logprobs": None if logprobs is None else completion_logprobs(logprobs, tokenizer, text_offset),
        "finish_reason": _check_finish_reason(finish_reason)}])


def chat_chunk(id: str, model: str, created: int, index: int, *, role: str | None = None,
               content: str | None = None, finish_reason: str | None = None,
               logprobs: list[TokenLogprobs] | None = None, tokenizer: Any = None) -> dict:
    """One streamed /v1/chat/completions event for choice `index`; give `role="assistant"` in each
    choice's first chunk. Unset role/content are left out of `delta`."""
    delta: dict[str, str] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return _envelope(id, "chat.completion.chunk", created, model, [{
        "index": index, "delta": delta,
        "logprobs": None if logprobs is None else chat_logprobs(logprobs, tokenizer),
        "finish_reason": _check_finish_reason(finish_reason)}])


def usage_chunk(id: str, model: str, created: int, object_name: str, prompt_tokens: int,
                completion_tokens: int) -> dict:
    """The last streamed event when `stream_options.include_usage`: no choices, the whole usage.
    `object_name` is the stream's: "text_completion" or "chat.completion.chunk"."""
    if object_name not in ("text_completion", "chat.completion.chunk"):
        raise ValueError(f"object_name must be 'text_completion' or 'chat.completion.chunk', got {object_name!r}")
    out = _envelope(id, object_name, created, model, [])
    out["usage"] = usage(prompt_tokens, completion_tokens)
    return out
