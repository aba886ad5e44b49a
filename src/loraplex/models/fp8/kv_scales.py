"""A checkpoint's KV-cache scales: compressed-tensors' `model.layers.{i}.self_attn.k_scale` / `v_scale` (older
llm-compressor checkpoints name them `self_attn.k_proj.output_scale` / `v_proj.output_scale`, as vLLM reads too).

Each is one fp32 (or bf16/fp16) value a layer, stored as `[]` or `[1]`: the layer's keys (values) were
calibrated so that `k / k_scale` fits e4m3. `KvScaleSink` takes them while the loader walks the
checkpoint and hands back `KvScales`; the engine gives them to an FP8 KV cache (engine/model_runner.py)
and, as vLLM does, ignores them for a cache in the model's dtype.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

_KEY = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KvScales:
    """fp32 `[layers]` dequantization scales of the keys (`k`) and values (`v`), on the CPU."""
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class KvScaleSink:
    """Takes a checkpoint's `self_attn.k_scale` / `v_scale` tensors; `finish` checks that every layer has both."""

    num_layers: int
    _got: dict[str, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def takes(key: str) -> bool:
        return _KEY.match(key) is not None

    def put(self, path: Path, key: str, tensor: torch.Tensor) -> None:
        match = _KEY.match(key)
        layer = int(match.group(1))
        if layer >= self.num_layers:
            raise ValueError(f"{path}: tensor {key!r} names layer {layer}; the config has {self.num_layers}")
        canonical = f"model.layers.{layer}.self_attn.{match.group(2) or match.group(3)}_scale"
        if canonical in self._got:
            raise ValueError(f"{path}: tensor {key!r} appears twice in the checkpoint (or under both of its names, "
                             f"{canonical!r} and the older output_scale one)")
        if tensor.dtype not in SCALE_DTYPES or tensor.numel() != 1 or tensor.dim() > 1:
            raise ValueError(f"{path}: tensor {key!r} is {tensor.dtype} of shape {list(tensor.shape)}; a KV-cache "
                             f"scale is one float32, bfloat16 or float16 value, [] or [1] (strategy 'tensor')")
        value = float(tensor.float())
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{path}: tensor {key!r} is {value}; KV-cache scales are finite and positive")
        self._got[canonical] = torch.tensor(value, dtype=torch.float32)

    def finish(self, folder: Path) -> KvScales:
        scales = {}
        for kind in "kv":
            keys = [f"model.layers.{i}.self_attn.{kind}_scale" for i in range(self.num_layers)]
            missing = [key for key in keys if key not in self._got]
            if missing:
                raise ValueError(f"{folder}: the checkpoint has no tensor {missing[0]!r}, which its "
                                 f"quantization_config.kv_cache_scheme promises")
            scales[kind] = torch.stack([self._got[key] for key in keys])
        return KvScales(scales["k"], scales["v"])
