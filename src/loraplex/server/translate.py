"""A parsed request (protocol.py) → the engine's inputs: prompts as token ids, and SamplingParams.

- `sampling_params(req, *, prompt_len, max_model_len, vocab_size) -> SamplingParams`: checks the
  request against the model's context and vocabulary, then builds loraplex's parameters. Null
  temperature / top_p / top_k mean 1.0 / 1.0 / off. A null max_tokens (chat's default; allowed
  in completions too) means the rest of the context. Chat takes `max_completion_tokens` or
  `max_tokens` (both set and different: 400). Every problem, SamplingParams' own ValueErrors
  included, is an `APIError(400, param=<the request field>)`.
- `completion_prompts(req, *, vocab_size) -> list[str | list[int]]`: the prompts (one, or a batch),
  token ids checked; `completion_prompt` is the one prompt of a request that is not a batch.
- `chat_prompt(req, tokenizer) -> list[int]`: the messages through the tokenizer's chat template
  (text parts of a message are joined with "\\n"; role "developer" is given to the template as
  "system", which open models' templates know).
"""
from __future__ import annotations

from typing import Any

from loraplex.sampling import SamplingParams
from loraplex.server.errors import APIError, public_text
from loraplex.server.protocol import (
    _BAD_CHAT_TEMPLATE_CHARS,
    _INT_KEY,
    _SAMPLING_FIELD,
    ChatCompletionRequest,
    CompletionRequest,
    _refuse,
)


def _check_server_int(name: str, value: Any, minimum: int) -> None:
    # These come from the server, not the client: a bad one is a bug, not a 400.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_token_id(param: str, token_id: int, vocab_size: int, where: str) -> None:
    if not 0 <= token_id < vocab_size:
        raise _refuse(param, f"{where} is token id {token_id}, which is not in the vocabulary [0, {vocab_size})")


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if bias is None:
        return None
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        # Strict: "1e3", " 7" or "0x10" are not token ids, even if int() would take some of them.
        if not _INT_KEY.fullmatch(key):
            raise _refuse("logit_bias", f"logit_bias keys must be token ids (integers), got {key[:40]!r}")
        token_id = int(key)
        _check_token_id("logit_bias", token_id, vocab_size, f"logit_bias key {token_id}")
        parsed[token_id] = value
    return parsed


def _sampling_error(error: ValueError, renames: dict[str, str]) -> APIError:
    """A SamplingParams ValueError ("SamplingParams.<name> ...") as a 400 naming the request field."""
    message = str(error)
    match = _SAMPLING_FIELD.search(message)
    if match is None:
        return APIError(400, message)
    param = renames.get(match.group(1), match.group(1))
    # "SamplingParams.max_tokens must be ..." -> "max_completion_tokens must be ..."
    return APIError(400, message[:match.start()] + param + message[match.end():], param=param)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, prompt_len: int, max_model_len: int,
                    vocab_size: int) -> SamplingParams:
    """loraplex's SamplingParams for `req`, whose prompt is `prompt_len` tokens; APIError(400) if refused."""
    _check_server_int("prompt_len", prompt_len, 0)
    _check_server_int("max_model_len", max_model_len, 1)
    _check_server_int("vocab_size", vocab_size, 1)
    chat = isinstance(req, ChatCompletionRequest)
    if not chat and not isinstance(req, CompletionRequest):
        raise ValueError(f"req must be a CompletionRequest or ChatCompletionRequest, got {type(req).__name__}")

    prompt_param = "messages" if chat else "prompt"
    if prompt_len >= max_model_len:
        raise _refuse(prompt_param, f"This model's maximum context length is {max_model_len} tokens; "
                                    f"the prompt has {prompt_len}, which leaves no room for the completion")

    if chat:
        max_tokens = req.requested_max_tokens
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len  # the rest of the context
    elif max_tokens < 1:
        raise _refuse(max_param, f"{max_param} must be at least 1, got {max_tokens}")
    elif prompt_len + max_tokens > max_model_len:
        raise _refuse(max_param, f"This model's maximum context length is {max_model_len} tokens; the prompt "
                                 f"has {prompt_len} and {max_param} asks for {max_tokens} more "
                                 f"({prompt_len + max_tokens} in all)")

    if chat:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        logprobs_param = "top_logprobs" if req.top_logprobs else "logprobs"
    else:
        logprobs, logprobs_param = req.logprobs, "logprobs"

    stop_token_ids = list(req.stop_token_ids or ())
    for i, token_id in enumerate(stop_token_ids):
        _check_token_id("stop_token_ids", token_id, vocab_size, f"stop_token_ids[{i}]")
    bias = _logit_bias(req.logit_bias, vocab_size)

    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": -1 if req.top_k is None else req.top_k,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
        "logit_bias": bias,
    }
    try:
        params = SamplingParams(**kwargs)
        params.check_vocab(vocab_size)
    except ValueError as e:
        raise _sampling_error(e, {"max_tokens": max_param, "logprobs": logprobs_param}) from None
    return params


def completion_prompts(req: CompletionRequest, *, vocab_size: int) -> list[str | list[int]]:
    """The request's prompts (one, or a batch): text, or token ids each in [0, vocab_size)."""
    _check_server_int("vocab_size", vocab_size, 1)
    batch = req.is_batch
    out = []
    for k, prompt in enumerate(req.prompts):
        where = f"prompt[{k}]" if batch else "prompt"
        if not prompt:
            raise _refuse("prompt", f"{where} is empty")
        if not isinstance(prompt, str):
            for i, token_id in enumerate(prompt):
                _check_token_id("prompt", token_id, vocab_size, f"{where}[{i}]")
            prompt = list(prompt)
        out.append(prompt)
    return out


def completion_prompt(req: CompletionRequest, *, vocab_size: int) -> str | list[int]:
    """The one prompt of a request that is not a batch (see `completion_prompts`)."""
    if req.is_batch:
        raise ValueError("completion_prompt: the request holds a batch of prompts; use completion_prompts")
    return completion_prompts(req, vocab_size=vocab_size)[0]


def chat_prompt(req: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    """The token ids of `req.messages` rendered by the tokenizer's chat template."""
    if tokenizer is None:
        raise _refuse("messages", "this server has no tokenizer for its model (its log says why), so it cannot "
                                  "render chats; send token ids to /v1/completions")
    if not getattr(tokenizer, "chat_template", None):
        raise _refuse("messages", "this model has no chat template (its tokenizer_config.json has no "
                                  "chat_template); use /v1/completions")
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
    try:
        rendered = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=req.add_generation_prompt, tokenize=True)
    except Exception as e:  # noqa: BLE001 -- jinja errors, raise_exception(...), a TypeError on odd content
        # Templates check the conversation (roles alternating, a system message first, ...):
        # their complaints are about the request, not the server.
        detail = public_text(str(e) or type(e).__name__)
        raise _refuse("messages", f"the chat template refused the messages: "
                                  f"{detail[:_BAD_CHAT_TEMPLATE_CHARS]}") from None
    # transformers returns a list of ids, or (v5) a BatchEncoding holding them.
    ids = rendered["input_ids"] if not isinstance(rendered, list) else rendered
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    ids = [int(t) for t in ids]
    if not ids:
        raise _refuse("messages", "the chat template rendered an empty prompt")
    return ids
