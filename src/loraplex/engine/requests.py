"""A request's prompt in, and when its output stops: the per-request rules of the engine."""
from __future__ import annotations

from typing import Any

from ..sampling import SamplingParams
from .sequence import FinishReason, Sequence


def check_request(prompt, params: SamplingParams | None, tokenizer: Any | None, vocab_size: int,
                  max_model_len: int) -> tuple[SamplingParams, str | None, list[int]]:
    """(params, the prompt's text or None, its token ids) after the checks every engine applies to a new request
    (the single engine, and the cluster's engine at its ingress); a ValueError naming what is wrong otherwise."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params.check_vocab(vocab_size)
    text, ids = prompt_token_ids(prompt, tokenizer, vocab_size)
    if len(ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(ids)} tokens; this engine serves at most {max_model_len} "
                         f"tokens per sequence (max_model_len), output included")
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
    return params, text, ids


def prompt_token_ids(prompt, tokenizer: Any | None, vocab_size: int) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids) for a string (encoded by `tokenizer`) or a list of token ids,
    each checked against the vocabulary; a ValueError that names what is wrong otherwise."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: give the prompt as token ids")
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt, list(tokenizer.encode(prompt))
    try:
        ids = [int(t) for t in prompt]
        ok = all(isinstance(t, int) or type(t).__name__.startswith("int") for t in prompt)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"the prompt must be a string or a list of token ids, got {prompt!r:.80}")
    if not ids:
        raise ValueError("the prompt is empty")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token {i} = {t} is outside the vocabulary [0, {vocab_size})")
    return None, ids


def stop_reason(seq: Sequence, token: int, eos_token_ids, max_model_len: int) -> FinishReason | None:
    """Why `seq` ends with `token`, just appended to its output (None: it goes on). A stop token or eos ends the
    request (its id stays in token_ids, its text is not added); so does a stop string (the detokenizer, which
    this feeds, finds it) and the length limits."""
    params = seq.params
    if token in params.stop_token_ids:
        seq.stop_reason = token
        return FinishReason.STOP
    if not params.ignore_eos and token in eos_token_ids:
        return FinishReason.STOP
    stop_str = seq.text.append(token) if seq.text is not None else None
    if stop_str is not None:
        seq.stop_reason = stop_str
        return FinishReason.STOP
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
