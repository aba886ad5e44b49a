"""Benchmark workloads like the Punica paper's: request lengths and adapter popularity, from a seed.

Lengths ("punica"): prompt length ~ lognormal(σ=0.8, loc=-1, scale=18) capped at max_len - 2; total
length ~ uniform over [0, max_len), raised to prompt + 2; output = total - prompt. ("fixed": every
request has `prompt_len` and `output_len`.)

Popularity (which adapter each request asks for), over N requests:
- distinct: every request its own adapter (N adapters);
- uniform: ⌈√N⌉ adapters, equally used, shuffled;
- skewed: Zipf α=1.5 over N adapters (a few hot, a long tail);
- identical: one adapter for every request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..workloads import popularity_slots
from .flags import LENGTHS, POPULARITIES  # noqa: F401  (defined where the CLI can read them without numpy)


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_len: int
    output_len: int
    adapter: int          # 0-based adapter index; the system maps it to a name

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class Workload:
    requests: list[BenchRequest]
    popularity: str
    lengths: str
    max_len: int
    seed: int

    @property
    def num_adapters(self) -> int:
        return 1 + max(r.adapter for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def head(self, n: int) -> Workload:
        """The first n requests (baselines too slow for all of them run these, and say so)."""
        return Workload(self.requests[:n], self.popularity, self.lengths, self.max_len, self.seed)

    def prompt_ids(self, vocab_size: int) -> list[list[int]]:
        """Random prompt token ids (ids 3.. avoid the usual special tokens), the same for every system."""
        rng = np.random.default_rng(self.seed + 1)
        low = 3 if vocab_size > 3 else 0
        return [rng.integers(low, vocab_size, r.prompt_len).tolist() for r in self.requests]


def request_lengths(n: int, lengths: str, max_len: int, rng: np.random.Generator, *,
                    prompt_len: int = 128, output_len: int = 128) -> list[tuple[int, int]]:
    """(prompt_len, output_len) for n requests; every prompt ≥ 1 token and every output ≥ 1 token."""
    if lengths == "fixed":
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"fixed lengths need prompt_len ≥ 1 and output_len ≥ 1, got {prompt_len}, {output_len}")
        return [(prompt_len, output_len)] * n
    if lengths != "punica":
        raise ValueError(f"lengths must be one of {LENGTHS}, got {lengths!r}")
    if max_len < 4:
        raise ValueError(f"max_len must be at least 4, got {max_len}")
    sigma, loc, scale = 0.8, -1.0, 18.0
    prompts = np.minimum(loc + scale * rng.lognormal(0.0, sigma, n), max_len - 2).astype(np.int64)
    prompts = np.maximum(prompts, 1)
    totals = np.maximum(prompts + 2, rng.integers(0, max_len, n))
    return [(int(p), int(t - p)) for p, t in zip(prompts, totals)]


def make_workload(n: int = 1000, popularity: str = "distinct", *, lengths: str = "punica", max_len: int = 2048,
                  seed: int = 0, prompt_len: int = 128, output_len: int = 128) -> Workload:
    """N requests of `lengths`, with adapters by `popularity`; the same arguments give the same workload."""
    if n < 1:
        raise ValueError(f"need at least one request, got n={n}")
    if popularity not in POPULARITIES:
        raise ValueError(f"popularity must be one of {POPULARITIES}, got {popularity!r}")
    rng = np.random.default_rng(seed)
    lens = request_lengths(n, lengths, max_len, rng, prompt_len=prompt_len, output_len=output_len)
    slots = popularity_slots("zipf" if popularity == "skewed" else popularity, n, rng, zipf_alpha=1.5)
    # number adapters by first appearance, so adapter 0 is the first request's and indices are dense
    order: dict[int, int] = {}
    dense = [order.setdefault(s, len(order)) for s in slots]
    reqs = [BenchRequest(i, p, o, a) for i, ((p, o), a) in enumerate(zip(lens, dense))]
    return Workload(reqs, popularity, lengths, max_len if lengths == "punica" else prompt_len + output_len, seed)


def expected_adapters(popularity: str, n: int) -> int:
    """How many adapters a popularity spreads n requests over at most (skewed: at most n)."""
    return {"distinct": n, "uniform": math.ceil(math.sqrt(n)), "skewed": n, "identical": 1}[popularity]
