"""What each request asks for: `SamplingParams`, its validation helpers and the per-request limits."""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64   # per request
MAX_LOGIT_BIAS = 300       # entries per request (OpenAI's limit)
LOGIT_BIAS_LIMIT = 100.0   # |bias| at most this (OpenAI's range)
SEED_LIMIT = 2**63  # seeds are int64-sized so every backend's generator takes them as they are


def _is_int(value) -> bool:
    # bool is an int subclass, but `max_tokens=True` is a caller's bug, not a count.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bad(name: str, rule: str, value) -> ValueError:
    return ValueError(f"SamplingParams.{name} {rule}, got {value!r}")


@dataclass
class SamplingParams:
    """How one request turns logits into tokens, and when it stops. Validated on construction.

    `top_k` of 0 or -1 both mean "off" and are stored as -1; `stop` becomes a tuple of strings
    and `stop_token_ids` a tuple of ints; an int temperature is stored as a float.
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 or 0 = off; else >= 1
    seed: int | None = None  # per request: its samples depend only on the seed and its own logits
    stop: str | Sequence[str] | None = None  # normalized to tuple[str, ...]
    stop_token_ids: Sequence[int] = ()  # normalized to tuple[int, ...]
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: the sampled token's logprob + the n most likely
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before choosing (not to logprobs)

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", "must be an int >= 1", self.max_tokens)
        self.max_tokens = int(self.max_tokens)

        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise _bad("temperature", "must be a finite number >= 0 (0 = greedy)", self.temperature)
        self.temperature = float(self.temperature)

        if not _is_real(self.top_p) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", "must be in (0, 1]", self.top_p)
        self.top_p = float(self.top_p)

        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", "must be -1 or 0 (off) or an int >= 1", self.top_k)
        self.top_k = -1 if self.top_k == 0 else int(self.top_k)

        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise _bad("seed", "must be None or an int in [0, 2**63)", self.seed)
        if self.seed is not None:
            self.seed = int(self.seed)

        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)

        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, "must be a bool", getattr(self, name))

        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _bad("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]", self.logprobs)
        if self.logprobs is not None:
            self.logprobs = int(self.logprobs)
        self.logit_bias = self._normalize_logit_bias(self.logit_bias)

    @staticmethod
    def _normalize_logit_bias(bias) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise _bad("logit_bias", "must be None or a dict of token id -> bias", bias)
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"SamplingParams.logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        out = {}
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"SamplingParams.logit_bias keys must be token ids (ints >= 0), got {token!r:.40}")
            if not _is_real(value) or not math.isfinite(value) or abs(value) > LOGIT_BIAS_LIMIT:
                raise ValueError(f"SamplingParams.logit_bias[{token}] must be a number in "
                                 f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {value!r:.40}")
            out[int(token)] = float(value)
        return out or None

    @staticmethod
    def _normalize_stop(stop) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = (stop,)
        elif not isinstance(stop, (list, tuple)):
            raise _bad("stop", "must be None, a string or a list of strings", stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings", stop)
        for s in stop:
            # An empty stop string would match before the first token.
            if not isinstance(s, str) or not s:
                raise _bad("stop", "must hold only non-empty strings", stop)
        return tuple(stop)

    @staticmethod
    def _normalize_stop_token_ids(ids) -> tuple[int, ...]:
        if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
            raise _bad("stop_token_ids", "must be a list of ints >= 0", ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"SamplingParams.stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        for t in ids:
            if not _is_int(t) or t < 0:
                raise _bad("stop_token_ids", "must hold only ints >= 0", ids)
        return tuple(int(t) for t in ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse stop token ids the model cannot produce (the engine calls this on admission)."""
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"SamplingParams.stop_token_ids holds {t}, which is not below "
                                 f"the vocabulary size {vocab_size}")
        for t in self.logit_bias or ():
            if t >= vocab_size:
                raise ValueError(f"SamplingParams.logit_bias has token id {t}, which is not below "
                                 f"the vocabulary size {vocab_size}")
