"""`Composition`: the adapters one request combines, each with a weight.

A request names one adapter ("sql"), or several with weights ({"sql": 0.7, "formal": 0.3}). For every projection
the model then adds, per row of the request,

    y += Σ_i weight_i · scaling_i · (x @ A_iᵀ) @ B_iᵀ

with each adapter's own rank, scaling and target modules (a projection an adapter does not touch contributes
nothing): PEFT's `add_weighted_adapter(..., combination_type="cat")`, computed in the batched LoRA kernels with no
merged copy (ops/lora/batch.py). A single name is the composition {name: 1.0}.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Union

MAX_MEMBERS = 4   # adapters one request may combine (the kernels' lanes: ops/lora/batch.py)

AdapterRef = Union[str, Mapping[str, float], "Composition", None]


@dataclass(frozen=True)
class Composition:
    """Members `(name, weight)` in the order given; weights finite and non-zero (0 means absent: dropped)."""

    members: tuple[tuple[str, float], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.members)

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(w for _, w in self.members)

    @property
    def single(self) -> str | None:
        """The adapter's name when this is one adapter at weight 1 (a plain single-adapter request), else None."""
        if len(self.members) == 1 and self.members[0][1] == 1.0:
            return self.members[0][0]
        return None

    def __str__(self) -> str:
        return self.single or "{" + ", ".join(f"{n}: {w:g}" for n, w in self.members) + "}"

    @classmethod
    def parse(cls, value: AdapterRef, field: str = "adapter") -> "Composition | None":
        """A composition from a name, a {name: weight} mapping, or a Composition; None (or an empty mapping, or
        weights all 0) for the base model. Raises ValueError naming `field` for more than MAX_MEMBERS adapters,
        non-finite or non-numeric weights, empty or non-string names."""
        if value is None or isinstance(value, Composition):
            return value if value is None or value.members else None
        if isinstance(value, str):
            if not value:
                raise ValueError(f"{field}: an adapter name must not be empty")
            return cls(((value, 1.0),))
        if not isinstance(value, Mapping):
            raise ValueError(f"{field} must be an adapter name or a mapping of adapter names to weights, "
                             f"got {type(value).__name__}")
        members = []
        for name, weight in value.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"{field}: adapter names must be non-empty strings, got {name!r}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise ValueError(f"{field}[{name!r}]: the weight must be a number, got {weight!r}")
            try:
                value_f = float(weight)
            except OverflowError:   # an int past float's range
                value_f = math.inf
            if not math.isfinite(value_f):
                raise ValueError(f"{field}[{name!r}]: the weight must be finite, got {weight!r:.40}")
            if value_f != 0.0:
                members.append((name, value_f))
        if len(value) > MAX_MEMBERS:
            raise ValueError(f"{field} combines {len(value)} adapters; at most {MAX_MEMBERS}")
        return cls(tuple(members)) if members else None

    @classmethod
    def from_pairs(cls, pairs: list[tuple[str, float]], field: str = "adapter") -> "Composition | None":
        """From (name, weight) pairs (the CLI's repeated `--adapter NAME=WEIGHT`), refusing a name given twice."""
        seen = set()
        for name, _ in pairs:
            if name in seen:
                raise ValueError(f"{field}: adapter {name!r} is given twice")
            seen.add(name)
        return cls.parse(dict(pairs), field)
