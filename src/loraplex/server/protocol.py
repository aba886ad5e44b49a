"""The OpenAI wire format, inbound: request schemas for /v1/completions and /v1/chat/completions
(their mapping onto the engine's inputs is translate.py; the response builders are responses.py).

Requests (pydantic v2; unknown fields are ignored, field names are OpenAI's):
- `CompletionRequest`, `ChatCompletionRequest` (with `ChatMessage`, `StreamOptions`). Parsing
  (`Model.model_validate(...)`, or FastAPI's body parsing) raises pydantic's ValidationError for a
  wrong shape or type, and `APIError(400, param=<field>)` for a well-typed request we refuse:
  more than MAX_PROMPTS prompts or MAX_CHOICES choices (prompts × n) in one request, `n` outside
  [1, MAX_N], `best_of` != n, `echo`, `suffix`, non-zero presence/frequency penalties, completions
  `logprobs` outside [0, MAX_COMPLETION_LOGPROBS], chat `top_logprobs` outside [0, MAX_TOP_LOGPROBS]
  or without `logprobs=true`, non-text content parts, null content outside assistant messages, an
  empty `messages`, and tools / tool_choice / response_format / functions (their "off" values: null,
  [], "none", {"type": "text"} are accepted).
  Token ids are JSON integers only (`true`, `"1"` or `1.0` are refused, in `prompt` and
  `stop_token_ids` alike), and integer fields refuse booleans. Lists are capped: `stop` at
  MAX_STOP_STRINGS strings, `stop_token_ids` at MAX_STOP_TOKEN_IDS, `logit_bias` at MAX_LOGIT_BIAS
  entries, `messages` at MAX_MESSAGES, a batch `prompt` at MAX_PROMPTS.
  A null `n`, `stream`, `echo`, `logprobs` (chat), `ignore_eos` or `add_generation_prompt` means
  its default. A one-element prompt list is unwrapped, so `CompletionRequest.prompt` is a str or a
  list of token ids, or (a batch) a list of several of those; `req.prompts` is always the list.
  `stream_options` is ignored unless `stream` is true.
  Extensions beyond OpenAI's schema (vLLM's names): `top_k`, `stop_token_ids`, `ignore_eos`, and
  chat's `add_generation_prompt`; and loraplex's `adapters` ({adapter: weight}, up to MAX_MEMBERS,
  composed on the base model: composition_fields.py parses it; `req.composition` is the parsed value).
  Helpers: `req.include_usage` (stream and include_usage), `ChatCompletionRequest.requested_max_tokens`,
  `ChatMessage.text()`.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from loraplex.adapters.composition import Composition
from loraplex.sampling import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from loraplex.server.composition_fields import parse_composition
from loraplex.server.errors import APIError

MAX_N = 8
MAX_PROMPTS = 64      # prompts in one /v1/completions request
MAX_CHOICES = 128     # prompts × n in one request
MAX_MESSAGES = 1024   # messages in one chat request
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


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):   # pydantic would read true as 1
        raise PydanticCustomError("int_type", "Input should be an integer, not a boolean")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
TokenId = Annotated[int, Strict()]   # a JSON integer: not true, "1" or 1.0
TokenIds = list[TokenId]
PromptField = Annotated[
    str | TokenIds | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
    | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)],
    _one_error(f"a string, a list of token ids (integers), or a list of up to {MAX_PROMPTS} of those")]
StopField = Annotated[str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None,
                      _one_error(f"a string or a list of up to {MAX_STOP_STRINGS} strings")]
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
    top_k: Int | None = None  # extension
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    stop_token_ids: Annotated[TokenIds, Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None  # extension
    seed: Int | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension
    adapters: dict[str, Any] | None = None   # extension: {adapter: weight}, composed on the base model
    _composition: Composition | None = PrivateAttr(default=None)

    @field_validator("n", "stream", "ignore_eos", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        return _default_if_null(cls, value, info)

    def _check_common(self) -> None:
        if self.adapters is not None:
            self._composition = parse_composition(self.adapters, "adapters")
        if not 1 <= self.n <= MAX_N:
            raise _refuse("n", f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and value != 0:
                raise _refuse(name, f"{name} is not supported (only 0 or null), got {value}")

    @property
    def composition(self) -> Composition | None:
        """The parsed `adapters` (None without it, or when it names no adapter with a non-zero weight)."""
        return self._composition

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """POST /v1/completions. After parsing, `prompt` is one str or one list of token ids, or a
    batch: a list of several of those (`prompts` is the list either way)."""

    prompt: PromptField
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None

    @field_validator("echo", mode="before")
    @classmethod
    def _null_echo(cls, value: Any, info: ValidationInfo) -> Any:
        return _default_if_null(cls, value, info)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        self._check_common()
        if self.is_batch and len(self.prompt) == 1:
            self.prompt = self.prompt[0]
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise _refuse("n", f"{len(self.prompts)} prompts × n={self.n} is more than {MAX_CHOICES} choices "
                               f"in one request; split the batch")
        if self.echo:
            raise _refuse("echo", "echo is not supported")
        if self.suffix:
            raise _refuse("suffix", "suffix is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise _refuse("logprobs", f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {self.logprobs}")
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of", f"best_of is not supported unless it equals n ({self.n}), got {self.best_of}")
        return self

    @property
    def is_batch(self) -> bool:
        """`prompt` is a list of prompts (strings or token-id lists)."""
        return isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)

    @property
    def prompts(self) -> list[str | list[int]]:
        return list(self.prompt) if self.is_batch else [self.prompt]


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

    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
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
