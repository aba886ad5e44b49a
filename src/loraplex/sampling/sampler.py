"""The batched `Sampler` and what it returns.

The sampler turns one logits row per request into that request's next token, for a whole
batch at once. Each row follows its own parameters; a request with a seed draws its noise
from its own generator, so its tokens never depend on what else is in the batch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .params import SEED_LIMIT, SamplingParams, _is_int
from .plan import _biased, _cutoffs, _Plan, _subset


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
