"""Rotary position embedding parameters: what a config says, and the inverse frequencies it gives.

Configs write RoPE two ways: transformers ≥ 5 saves `rope_parameters` (`rope_type`,
`rope_theta`, scaling fields); older configs have `rope_theta` beside `rope_scaling`
(`type` or `rope_type`). Both are read into one `RopeConfig`. Only the kinds whose effect is
a fixed change of the inverse frequencies are served (`default`, `linear`, `llama3`); the
others (dynamic NTK, YaRN, LongRoPE) change the cos/sin amplitude or depend on the sequence
length, and are refused by name rather than run wrong.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_config_dict(cls, cfg: dict[str, Any], where: str = "") -> "RopeConfig":
        params = cfg.get("rope_parameters")
        if params is None:
            params = cfg.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ValueError(f"config{where}: rope_parameters must be an object, got {params!r}")
        params = dict(params)
        # As transformers does: a top-level rope_theta fills in, and llama3's original context
        # defaults to max_position_embeddings.
        if "rope_theta" in cfg:
            params.setdefault("rope_theta", cfg["rope_theta"])
        if "max_position_embeddings" in cfg:
            params.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
        if "sliding_attention" in params or "full_attention" in params:
            raise ValueError(f"config{where}: per-layer-type rope_parameters are not served")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"config{where}: rope type {rope_type!r} is not served; supported: "
                             f"{SUPPORTED_ROPE_TYPES}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"config{where}: partial_rotary_factor={params['partial_rotary_factor']} is not served")
        fields: dict[str, Any] = {"theta": params.get("rope_theta", 10000.0), "rope_type": rope_type}
        if rope_type in ("linear", "llama3"):
            if "factor" not in params:
                raise ValueError(f"config{where}: rope type {rope_type!r} needs a 'factor'")
            fields["factor"] = params["factor"]
        if rope_type == "llama3":
            for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if key not in params:
                    raise ValueError(f"config{where}: rope type 'llama3' needs {key!r}")
                fields[key] = params[key]
        try:
            return cls(**fields)
        except ValueError as e:
            raise ValueError(f"config{where}: {e}") from None

    def __post_init__(self) -> None:
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"rope field {name} must be a positive number, got {value!r}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope high_freq_factor={self.high_freq_factor} must exceed "
                             f"low_freq_factor={self.low_freq_factor}")

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """float32 `[head_dim / 2]`: the angle per position of each rotated pair, scaling folded in."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv = 1.0 / (self.theta ** exponents)
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended.
            old = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            blended = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, blended, scaled)
        return inv
