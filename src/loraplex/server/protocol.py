"""The OpenAI wire format, inbound: request schemas for /v1/completions and /v1/chat/completions,
and their mapping onto `SamplingParams` (the response builders are in responses.py).

Requests (pydantic v2; unknown fields are ignored, field names are OpenAI's):
- `CompletionRequest`, `ChatCompletionRequest` (with `ChatMessage`, `StreamOptions`). Parsing
  (`Model.model_validate(...)`, or FastAPI's body parsing) raises pydantic's ValidationError for a
  wrong shape or type, and `APIError(400, param=<field>)` for a well-typed request we refuse:
  several prompts in one request, `n` outside [1, MAX_N], `best_of` != n, `echo`, `suffix`,
  non-zero presence/frequency penalties, completions `logprobs` outside [0, MAX_COMPLETION_LOGPROBS],
  chat `top_logprobs` outside [0, MAX_TOP_LOGPROBS] or without `logprobs=true`, non-text content
  parts, null content outside assistant messages, an empty `messages`, and tools / tool_choice /
  response_format / functions (their "off" values: null, [], "none", {"type": "text"} are accepted).
  A null `n`, `stream`, `echo`, `logprobs` (chat), `ignore_eos` or `add_generation_prompt` means
  its default. A one-element prompt list is unwrapped, so `CompletionRequest.prompt` is always
  a str or a list of token ids. `stream_options` is ignored unless `stream` is true.
  Extensions beyond OpenAI's schema (vLLM's names): `top_k`, `stop_token_ids`, `ignore_eos`, and
  chat's `add_generation_prompt`. Helpers: `req.include_usage` (stream and include_usage),
  `ChatCompletionRequest.requested_max_tokens`, `ChatMessage.text()`.
- `sampling_params(req, *, prompt_len, max_model_len, vocab_size) -> SamplingParams`: checks the
  request against the model's context and vocabulary, then builds loraplex's parameters. Null
  temperature / top_p / top_k mean 1.0 / 1.0 / off. A null max_tokens (chat's default; allowed
  in completions too) means the rest of the context. Chat takes `max_completion_tokens` or
  `max_tokens` (both set and different: 400). Every problem, SamplingParams' own ValueErrors
  included, is an `APIError(400, param=<the request field>)`.
- `completion_prompt(req, *, vocab_size) -> str | list[int]`: the prompt, token ids checked.
- `chat_prompt(req, tokenizer) -> list[int]`: the messages through the tokenizer's chat template
  (text parts of a message are joined with "\\n"; role "developer" is given to the template as
  "system", which open models' templates know).
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from loraplex.sampling import SamplingParams
from loraplex.server.errors import APIError

MAX_N = 8
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
_BAD_CHAT_TEMPLATE_CHARS = 300
_INT_KEY = re.compile(r"-?[0-9]+")
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


# ---- requests -----------------------------------------------------------------------------------

def _one_error(expected: str) -> WrapValidator:
    """Report a union field's type error once ("Input should be <expected>") instead of one error
    per union member, each tagged with pydantic's member names."""
    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", f"Input should be {expected}") from None
    return WrapValidator(validate)


PromptField = Annotated[
    str | list[int] | list[str] | list[list[int]],
    _one_error("a string, a list of token ids, or a list holding one of those")]
StopField = Annotated[str | list[str] | None, _one_error("a string or a list of strings")]
ContentField = Annotated[str | list[dict[str, Any]] | None,
                         _one_error("a string, a list of content parts, or null")]


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _default_if_null(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    # Some clients send every field, the unset ones as null: null means "the default" here.
    return cls.model_fields[info.field_name].default if value is None else value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False


class _Request(BaseModel):
    """Fields and checks both endpoints share."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = None  # extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension

    @field_validator("n", "stream", "ignore_eos", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        return _default_if_null(cls, value, info)

    def _check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise _refuse("n", f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and value != 0:
                raise _refuse(name, f"{name} is not supported (only 0 or null), got {value}")

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """POST /v1/completions. After parsing, `prompt` is one str or one list of token ids."""

    prompt: PromptField
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("echo", mode="before")
    @classmethod
    def _null_echo(cls, value: Any, info: ValidationInfo) -> Any:
        return _default_if_null(cls, value, info)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        self._check_common()
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            # A list of strings or of token-id lists is a batch; one request is one prompt here.
            if len(self.prompt) != 1:
                raise _refuse("prompt", f"send one prompt per request (got a list of {len(self.prompt)})")
            self.prompt = self.prompt[0]
        if self.echo:
            raise _refuse("echo", "echo is not supported")
        if self.suffix:
            raise _refuse("suffix", "suffix is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise _refuse("logprobs", f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {self.logprobs}")
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of", f"best_of is not supported unless it equals n ({self.n}), got {self.best_of}")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: ContentField = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string: text parts joined with "\\n", null as ""."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content)


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # extension
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("logprobs", "add_generation_prompt", mode="before")
    @classmethod
    def _null_flag(cls, value: Any, info: ValidationInfo) -> Any:
        return _default_if_null(cls, value, info)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        self._check_common()
        if not self.messages:
            raise _refuse("messages", "messages must hold at least one message")
        for i, message in enumerate(self.messages):
            self._check_content(i, message)
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise _refuse("max_completion_tokens",
                          f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                          f"({self.max_completion_tokens}) disagree; send one of them")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise _refuse("top_logprobs",
                              f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
            if not self.logprobs:
                raise _refuse("top_logprobs", "top_logprobs needs logprobs to be true")
        unsupported = (
            ("tools", self.tools not in (None, [])),
            ("functions", self.functions not in (None, [])),
            ("tool_choice", self.tool_choice not in (None, "none")),
            ("function_call", self.function_call not in (None, "none")),
            ("response_format", self.response_format is not None and self.response_format != {"type": "text"}),
        )
        for name, is_set in unsupported:
            if is_set:
                raise _refuse(name, f"{name} is not supported")
        return self

    @staticmethod
    def _check_content(i: int, message: ChatMessage) -> None:
        param = f"messages[{i}].content"
        if message.content is None:
            if message.role != "assistant":
                raise _refuse(param, f"{param} may be null only in an assistant message")
            return
        if isinstance(message.content, str):
            return
        for j, part in enumerate(message.content):
            if part.get("type") != "text":
                raise _refuse(f"{param}[{j}]", "only text content is supported")
            if not isinstance(part.get("text"), str):
                raise _refuse(f"{param}[{j}].text", f"{param}[{j}].text must be a string")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- request → engine ---------------------------------------------------------------------------

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


def completion_prompt(req: CompletionRequest, *, vocab_size: int) -> str | list[int]:
    """The request's one prompt: text, or token ids each in [0, vocab_size)."""
    _check_server_int("vocab_size", vocab_size, 1)
    prompt = req.prompt
    if isinstance(prompt, str):
        if not prompt:
            raise _refuse("prompt", "prompt is empty")
        return prompt
    if not prompt:
        raise _refuse("prompt", "prompt is empty")
    for i, token_id in enumerate(prompt):
        _check_token_id("prompt", token_id, vocab_size, f"prompt[{i}]")
    return list(prompt)


def chat_prompt(req: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    """The token ids of `req.messages` rendered by the tokenizer's chat template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
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
        detail = str(e) or type(e).__name__
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
