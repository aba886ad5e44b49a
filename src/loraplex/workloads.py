"""Adapter popularity patterns from the Punica paper, used by tests and benchmarks.

Each function maps `n` requests (segments) to adapter slots:
- distinct: every request its own adapter (n adapters);
- uniform: ⌈√n⌉ adapters, each used by about n/⌈√n⌉ requests, in shuffled order;
- zipf: adapter k drawn with probability ∝ k^-1.5 over n adapters (a few hot, a long tail);
- identical: one adapter for all;
- skewed: one request on adapter 0, the other n-1 on adapter 1.
"""
from __future__ import annotations

import math

import numpy as np

POPULARITIES = ("distinct", "uniform", "zipf", "identical", "skewed")


def popularity_slots(popularity: str, n: int, rng: np.random.Generator, zipf_alpha: float = 1.5) -> list[int]:
    """Slots (0-based, fewer than n, or 1 for n == 1) for n segments under `popularity`."""
    if n < 1:
        raise ValueError(f"need at least one request, got n={n}")
    if popularity == "distinct":
        slots = rng.permutation(n)
    elif popularity == "uniform":
        m = math.ceil(math.sqrt(n))
        slots = rng.permutation(np.arange(n) % m)
    elif popularity == "zipf":
        p = 1.0 / np.arange(1, n + 1) ** zipf_alpha
        slots = rng.choice(n, size=n, p=p / p.sum())
    elif popularity == "identical":
        slots = np.zeros(n, dtype=np.int64)
    elif popularity == "skewed":
        slots = np.ones(n, dtype=np.int64)
        slots[rng.integers(n)] = 0
        if n == 1:
            slots[0] = 0
    else:
        raise ValueError(f"popularity must be one of {POPULARITIES}, got {popularity!r}")
    return [int(s) for s in slots]
