"""The host-side plan of one sampled batch (`_Plan`) and the tensor helpers the sampler runs on it."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .params import SamplingParams

# A positive temperature below this would become 0 (or a denormal that overflows) in float32.
_MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


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
