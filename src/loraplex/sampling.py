"""Sampling: what each request asks for (`SamplingParams`) and the batched `Sampler`.

The sampler turns one logits row per request into that request's next token, for a whole
batch at once. Each row follows its own parameters; a request with a seed draws its noise
from its own generator, so its tokens never depend on what else is in the batch.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64   # per request
MAX_LOGIT_BIAS = 300       # entries per request (OpenAI's limit)
LOGIT_BIAS_LIMIT = 100.0   # |bias| at most this (OpenAI's range)
SEED_LIMIT = 2**63  # seeds are int64-sized so every backend's generator takes them as they are

# A positive temperature below this would become 0 (or a denormal that overflows) in float32.
_MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


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


@dataclass
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the model's (raw) distribution
    top: list[tuple[int, float]]  # the min(n, V) most likely tokens and their logprobs, most likely first


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per logits row
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None
    finite: list[bool] = field(default_factory=list)  # per row: its logits were all finite


@dataclass
class PendingSample:
    """A sample whose work is queued: `tokens` (long [N], on the device) is usable by later work on
    the same stream; `result()` waits for the host copy."""

    tokens: torch.Tensor
    _values: torch.Tensor | None
    _event: object | None
    _plan: "_Plan"
    _sampler: "Sampler"

    def result(self) -> SamplerOutput:
        if self._values is None:
            return SamplerOutput([], [])
        if self._event is not None:
            self._event.synchronize()
        return self._sampler._unpack(self._values.tolist(), self._plan)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


@dataclass
class _Plan:
    """Host-side view of one batch: which rows take which path, in index lists.

    Positions in `filtered`, `unseeded` and `seeded` count within `sampled`, the rows that
    draw noise; the per-sampled-row lists (`temperatures`, `top_ks`, `top_ps`) follow it too.
    """

    num_rows: int
    greedy: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    filtered: list[int] = field(default_factory=list)
    unseeded: list[int] = field(default_factory=list)
    seeded: list[int] = field(default_factory=list)
    seeded_generators: list[torch.Generator] = field(default_factory=list)
    with_logprobs: list[int] = field(default_factory=list)
    logprob_counts: list[int] = field(default_factory=list)  # min(n, V) per row of with_logprobs
    max_logprobs: int = 0
    bias_rows: list[int] = field(default_factory=list)    # logit_bias entries, flattened over rows
    bias_tokens: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
              vocab: int) -> _Plan:
        plan = cls(num_rows=len(params))
        for row, (p, gen) in enumerate(zip(params, generators)):
            if p.logit_bias:
                plan.bias_rows += [row] * len(p.logit_bias)
                plan.bias_tokens += list(p.logit_bias)
                plan.bias_values += list(p.logit_bias.values())
            if p.logprobs is not None:
                plan.with_logprobs.append(row)
                plan.logprob_counts.append(min(p.logprobs, vocab))
                plan.max_logprobs = max(plan.max_logprobs, plan.logprob_counts[-1])
            if p.greedy:
                plan.greedy.append(row)  # draws no noise: its generator does not advance
                continue
            pos = len(plan.sampled)
            plan.sampled.append(row)
            plan.temperatures.append(max(p.temperature, _MIN_TEMPERATURE))
            top_k = vocab if p.top_k == -1 else min(p.top_k, vocab)
            plan.top_ks.append(top_k)
            # inf rather than 1.0: a float32 cumsum may reach 1 before the last token and
            # must not cut anything when top-p is off.
            plan.top_ps.append(math.inf if p.top_p >= 1 else p.top_p)
            if top_k < vocab or p.top_p < 1:
                plan.filtered.append(pos)
            if gen is None:
                plan.unseeded.append(pos)
            else:
                plan.seeded.append(pos)
                plan.seeded_generators.append(gen)
        return plan

    def to_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every list the device needs, in one host-to-device copy (float64 holds ints exactly)."""
        sections = {
            "greedy": self.greedy, "sampled": self.sampled, "temperatures": self.temperatures,
            "top_ks": self.top_ks, "top_ps": self.top_ps, "filtered": self.filtered,
            "unseeded": self.unseeded, "seeded": self.seeded, "with_logprobs": self.with_logprobs,
            "bias_rows": self.bias_rows, "bias_tokens": self.bias_tokens, "bias_values": self.bias_values,
        }
        flat = [float(v) for values in sections.values() for v in values]
        host = torch.tensor(flat, dtype=torch.float64)
        if device.type == "cuda":
            # Pinned + non_blocking: the copy queues behind the forward instead of waiting for it.
            packed = host.pin_memory().to(device, non_blocking=True)
        else:
            packed = host.to(device)
        out, start = {}, 0
        for name, values in sections.items():
            out[name] = packed[start:start + len(values)]
            start += len(values)
        return out


def _subset(x: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """Rows `index` of `x`; `x` itself when the index covers all rows (index lists are ascending)."""
    return x if count == x.shape[0] else x.index_select(0, index)


def _biased(x: torch.Tensor, plan: _Plan, meta: dict[str, torch.Tensor]) -> torch.Tensor:
    """`x` with each row's logit_bias added (a copy; `x` itself when no row has one)."""
    if not plan.bias_rows:
        return x
    biased = x.clone()
    biased.index_put_((meta["bias_rows"].long(), meta["bias_tokens"].long()), meta["bias_values"].float(),
                      accumulate=True)
    return biased


def _cutoffs(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest scaled logit that survives top-k then top-p.

    `top_k` (long) is in [1, V]; `top_p` is in (0, 1) or inf (off). Callers keep every token
    whose value is >= the cutoff, so ties with the last kept value all stay.
    """
    vocab = z.shape[1]
    ordered = torch.sort(z, dim=1, descending=True).values
    kth = ordered.gather(1, (top_k - 1).unsqueeze(1))
    in_top_k = ordered >= kth
    num_top_k = in_top_k.sum(dim=1)
    probs = torch.softmax(ordered.masked_fill(~in_top_k, -math.inf), dim=1)
    # Tokens strictly before the one whose cumulative probability reaches top_p, plus that one.
    num_top_p = (probs.cumsum(dim=1) < top_p.unsqueeze(1)).sum(dim=1) + 1
    # clamp: a NaN row counts 0 top-k tokens; at least the most likely token always stays.
    keep = torch.minimum(num_top_k, num_top_p).clamp(1, vocab)
    return ordered.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)


class Sampler:
    """Turns one logits row per request into its next token (see `__call__` for the exact rule)."""

    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # Noise for rows without their own seed; which row gets which draw depends on the batch.
        self.generator = self.new_generator(seed)

    def new_generator(self, seed: int) -> torch.Generator:
        """A generator on the sampler's device seeded with `seed`: one per seeded request."""
        if not _is_int(seed) or not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        return gen

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> SamplerOutput:
        """Sample one token per row of `logits` [N, V]. Exactly this loop, vectorized over rows::

            for i in range(N):
                row, p = logits[i], params[i]
                if p.logprobs is not None:
                    lp = log_softmax(row)             # the raw row: before bias, temperature, top-k, top-p
                for token, bias in (p.logit_bias or {}).items():
                    row[token] += bias                # on a copy: `logits` is not modified
                if p.temperature == 0:
                    token = argmax(row)               # lowest id on ties; draws no noise
                else:
                    z = row / p.temperature
                    keep = [True] * V
                    if p.top_k >= 1:                  # ties with the k-th largest z all stay
                        keep = z >= kth_largest(z, p.top_k)
                    if p.top_p < 1:
                        q = sorted(softmax(z[keep]), descending)
                        c = smallest count with sum(q[:c]) >= p.top_p (c >= 1)
                        keep &= z >= z_of(q[c - 1])   # ties with the last kept token stay too
                    e = Exp(1) noise, V values: generators[i] when set, else the engine's generator
                    token = argmax(softmax(z[keep]) / e)   # exponential race: P(j) = softmax(z[keep])_j
                out.token_ids[i] = token
                out.logprobs[i] = None if p.logprobs is None else
                    TokenLogprobs(token, lp[token], top min(p.logprobs, V) of lp, most likely first)

        A row with a generator draws its noise alone, `torch.empty(V).exponential_(generator=gen)`,
        once per call, so its token depends only on its seed, how many times it was drawn from,
        and its own logits. Rows without one share one batched draw from the engine's generator.
        A non-greedy row whose params carry a seed must come with its generator (ValueError).

        Math is float32 (other float dtypes are upcast); `logits` is not modified. A positive
        temperature below float32's smallest normal number acts as that number. A row holding
        NaN (or +inf, or only -inf) gets some token id in [0, V) and NaN logprobs; the engine
        handles such rows itself. One device-to-host transfer at the end; the per-row metadata
        goes to the device in one (asynchronous on CUDA) copy.
        """
        return self.launch(logits, params, generators).result()

    def launch(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> "PendingSample":
        """`__call__` without waiting: the work and the copy back are queued on the current stream;
        `.tokens` holds the sampled ids on the device (for the next step's input), `.result()`
        waits for this sample only, not for work queued after it."""
        self._check(logits, params, generators)
        num_rows, vocab = logits.shape
        plan = _Plan.build(params, generators, vocab)
        if num_rows == 0:
            return PendingSample(torch.zeros(0, dtype=torch.long, device=self.device), None, None, plan, self)
        with torch.no_grad():
            x = logits.float()  # a no-op for float32: nothing below writes into x
            meta = plan.to_device(self.device)
            tokens = self._tokens(_biased(x, plan, meta), plan, meta)
            parts = [tokens.double()]
            if plan.with_logprobs:
                parts += self._logprobs(x, tokens, plan, meta)
            parts.append(torch.isfinite(x).all(dim=1).double())  # last: which rows can be trusted
            values = torch.cat(parts)
            event = None
            if values.device.type == "cuda":  # the one device-to-host copy, queued, into pinned memory
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                values = host
        return PendingSample(tokens, values, event, plan, self)

    def _check(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> None:
        if not isinstance(logits, torch.Tensor):
            raise ValueError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
        if logits.dim() != 2 or logits.shape[1] == 0:
            raise ValueError(f"logits must be [N, V] with V >= 1, got shape {list(logits.shape)}")
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
        if not _same_device(logits.device, self.device):
            raise ValueError(f"logits are on {logits.device} but the sampler is on {self.device}")
        num_rows = logits.shape[0]
        if len(params) != num_rows:
            raise ValueError(f"got {len(params)} SamplingParams for {num_rows} logits rows")
        if len(generators) != num_rows:
            raise ValueError(f"got {len(generators)} generators for {num_rows} logits rows")
        for row, (p, gen) in enumerate(zip(params, generators)):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{row}] must be SamplingParams, got {type(p).__name__}")
            if gen is None:
                # Falling back to the shared generator would silently lose the seed's promise.
                if p.seed is not None and not p.greedy:
                    raise ValueError(f"params[{row}] has seed {p.seed} but generators[{row}] is None; "
                                     f"make one with Sampler.new_generator(seed)")
            elif not isinstance(gen, torch.Generator):
                raise ValueError(f"generators[{row}] must be a torch.Generator or None, got {type(gen).__name__}")
            elif not _same_device(gen.device, self.device):
                raise ValueError(f"generators[{row}] is on {gen.device} but the sampler is on {self.device}")

    def _tokens(self, x: torch.Tensor, plan: _Plan, meta: dict[str, torch.Tensor]) -> torch.Tensor:
        num_rows = x.shape[0]
        if not plan.sampled:
            return x.argmax(dim=1)
        sampled_index = meta["sampled"].long()
        sampled = self._sample(_subset(x, sampled_index, len(plan.sampled)), plan, meta)
        if not plan.greedy:
            return sampled
        tokens = torch.empty(num_rows, dtype=torch.long, device=x.device)
        greedy_index = meta["greedy"].long()
        tokens.index_copy_(0, greedy_index, x.index_select(0, greedy_index).argmax(dim=1))
        tokens.index_copy_(0, sampled_index, sampled)
        return tokens

    def _sample(self, x: torch.Tensor, plan: _Plan, meta: dict[str, torch.Tensor]) -> torch.Tensor:
        """The non-greedy rows: temperature, top-k/top-p cutoff, then the exponential race."""
        rows, vocab = x.shape
        # Subtracting the row max first leaves the top token at 0 and sends the rest towards
        # -inf under tiny temperatures, instead of overflowing to +inf (and NaN in softmax).
        z = (x - x.amax(dim=1, keepdim=True)) / meta["temperatures"].float().unsqueeze(1)
        if plan.filtered:  # no sort at all when no row uses top-k or top-p
            filtered = meta["filtered"].long()
            cut = _cutoffs(_subset(z, filtered, len(plan.filtered)),
                           _subset(meta["top_ks"].long(), filtered, len(plan.filtered)),
                           _subset(meta["top_ps"].float(), filtered, len(plan.filtered)))
            if len(plan.filtered) < rows:
                cut = torch.full((rows,), -math.inf, device=x.device).index_copy_(0, filtered, cut)
            z = torch.where(z >= cut.unsqueeze(1), z, -math.inf)
        probs = torch.softmax(z, dim=1)
        noise = self._noise(rows, vocab, plan, meta)
        return (probs / noise).argmax(dim=1)

    def _noise(self, rows: int, vocab: int, plan: _Plan, meta: dict[str, torch.Tensor]) -> torch.Tensor:
        """Exp(1) noise [rows, V]: each seeded row from its own generator, the rest in one draw."""
        if not plan.seeded:
            noise = torch.empty(rows, vocab, device=self.device).exponential_(generator=self.generator)
        else:
            own = torch.stack([torch.empty(vocab, device=self.device).exponential_(generator=gen)
                               for gen in plan.seeded_generators])
            if not plan.unseeded:
                noise = own
            else:
                shared = torch.empty(len(plan.unseeded), vocab, device=self.device)
                shared.exponential_(generator=self.generator)
                noise = torch.empty(rows, vocab, device=self.device)
                noise.index_copy_(0, meta["seeded"].long(), own)
                noise.index_copy_(0, meta["unseeded"].long(), shared)
        # A zero draw would turn a cut token's 0/0 into NaN, which argmax picks; p <= 1 and
        # tiny > 1/float32.max, so the quotient stays finite.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _logprobs(self, x: torch.Tensor, tokens: torch.Tensor, plan: _Plan,
                  meta: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Flat float64 tensors: the sampled tokens' logprobs, then top values, then top ids."""
        index = meta["with_logprobs"].long()
        count = len(plan.with_logprobs)
        lp = torch.log_softmax(_subset(x, index, count), dim=1)
        chosen = lp.gather(1, _subset(tokens, index, count).unsqueeze(1)).squeeze(1)
        parts = [chosen.double()]
        if plan.max_logprobs > 0:
            top_values, top_ids = lp.topk(plan.max_logprobs, dim=1)  # sorted, most likely first
            parts += [top_values.flatten().double(), top_ids.flatten().double()]
        return parts

    def _unpack(self, values: list[float], plan: _Plan) -> SamplerOutput:
        num_rows, count, width = plan.num_rows, len(plan.with_logprobs), plan.max_logprobs
        token_ids = [int(v) for v in values[:num_rows]]
        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        chosen = values[num_rows:num_rows + count]
        top_values = values[num_rows + count:num_rows + count + count * width]
        top_ids = values[num_rows + count + count * width:len(values) - num_rows]
        finite = [v != 0 for v in values[len(values) - num_rows:]]
        for j, (row, n) in enumerate(zip(plan.with_logprobs, plan.logprob_counts)):
            base = j * width  # every row got `width` top entries; keep the n it asked for
            top = [(int(top_ids[base + k]), top_values[base + k]) for k in range(n)]
            logprobs[row] = TokenLogprobs(token_ids[row], chosen[j], top)
        return SamplerOutput(token_ids, logprobs, finite)
