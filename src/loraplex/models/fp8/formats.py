"""Which FP8 weight scheme a model loads with: `quantization="fp8"` or the checkpoint's `quantization_config`.

Accepted (anything else is refused, naming the config field and its value):
- `quantization="fp8"` on an unquantized checkpoint: every decoder projection quantized at load, one scale
  per output row;
- compressed-tensors (`quant_method: "compressed-tensors"`, `format: "float-quantized"` or
  "naive-quantized", as llm-compressor writes FP8): e4m3 weights with `weight_scale` per tensor or per
  channel, symmetric; `input_scale` for static activation scales (kept) or none (dynamic); `ignore`;
- transformers `fp8` (`quant_method: "fp8"`): e4m3 weights with `weight_scale_inv` per
  `weight_block_size` block (DeepSeek-V3, Qwen3-FP8), dynamic activations; `modules_to_not_convert`.

A compressed-tensors config may also carry a `kv_cache_scheme` (FP8 e4m3, static, strategy "tensor"): the
checkpoint then stores `self_attn.k_scale` / `v_scale` per layer, which an FP8 KV cache takes
(`kv_cache_scales`, models/fp8/kv_scales.py); with it, `config_groups` may be empty (weights left dense).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

CT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's FP8 weights come: `source` "quantize" (a dense checkpoint, quantized at load),
    "compressed-tensors" or "fp8"; `block` the checkpoint's scale block ("fp8" only); `static_input` whether
    the checkpoint stores input scales; `ignore` the patterns of modules left unquantized."""

    source: str
    block: tuple[int, int] | None = None
    static_input: bool = False
    ignore: tuple[str, ...] = ()

    @property
    def scale_key(self) -> str:
        """The suffix of a weight's scale in the checkpoint (after the module's name)."""
        return "weight_scale_inv" if self.source == "fp8" else "weight_scale"

    def quantized(self, module: str) -> bool:
        """Is checkpoint module `module` (e.g. "model.layers.0.self_attn.q_proj") stored in FP8?"""
        if self.source == "quantize":
            return module != "lm_head"
        if self.source == "compressed-tensors":
            return not any(_ct_match(p, module) for p in self.ignore)
        return not any(_hf_match(p, module) for p in self.ignore)


def _ct_match(pattern: str, module: str) -> bool:
    # compressed-tensors: a module name, a "re:" regex from the name's start, or the layer class
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern in (module, "Linear")


def _hf_match(pattern: str, module: str) -> bool:
    # transformers: a prefix (or regex) ending on a module boundary, or a suffix
    return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) is not None or module.endswith(pattern)


def fp8_scheme(cfg: dict[str, Any], quantization: str | None, where: str = "") -> Fp8Scheme | None:
    """The scheme for config.json's contents `cfg` and the requested `quantization` (None or "fp8"); None: dense."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    qc = cfg.get("quantization_config", cfg.get("compression_config"))
    if qc is None:
        return Fp8Scheme("quantize") if quantization == "fp8" else None
    if not isinstance(qc, dict):
        raise ValueError(f"config{where}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        scheme = _compressed_tensors(qc, where)
        # (a KV-cache-only config leaves the weights dense: quantization="fp8" still quantizes them)
        return Fp8Scheme("quantize") if scheme is None and quantization == "fp8" else scheme
    if method == "fp8":
        return _transformers_fp8(qc, where)
    raise ValueError(f"config{where}: quantization_config.quant_method={method!r} is not served (FP8 checkpoints: "
                     f"'compressed-tensors' or 'fp8')")


def _refuse(where: str, field: str, value: Any, want: str) -> ValueError:
    return ValueError(f"config{where}: quantization_config.{field}={value!r} is not served ({want})")


def kv_cache_scales(cfg: dict[str, Any], where: str = "") -> bool:
    """Does config.json's contents `cfg` say that the checkpoint stores per-layer KV-cache scales (a
    compressed-tensors `kv_cache_scheme`, checked here: anything but static per-tensor e4m3 is refused)?"""
    qc = cfg.get("quantization_config", cfg.get("compression_config"))
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return False
    kv = qc.get("kv_cache_scheme")
    if kv is None:
        return False
    if not isinstance(kv, dict):
        raise _refuse(where, "kv_cache_scheme", kv, "an object or null")
    expect = {"num_bits": (8,), "type": ("float",), "strategy": ("tensor",), "dynamic": (False, None),
              "symmetric": (True, None), "group_size": (None,), "block_structure": (None,)}
    for key, allowed in expect.items():
        if kv.get(key) not in allowed:
            raise _refuse(where, f"kv_cache_scheme.{key}", kv.get(key), f"static per-tensor FP8 e4m3 KV-cache "
                                                                         f"scales: {allowed}")
    return True


def _compressed_tensors(qc: dict, where: str) -> Fp8Scheme | None:
    fmt = qc.get("format")
    if kv_cache_scales({"quantization_config": qc}, where) and not qc.get("config_groups"):
        return None   # KV-cache scales only: the weights are dense
    if fmt not in CT_FORMATS:
        raise _refuse(where, "format", fmt, f"FP8 weights: {' or '.join(CT_FORMATS)}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(where, "config_groups", groups, "one or more groups of FP8 weights")
    static = set()
    for name, group in groups.items():
        static.add(_ct_group(group, f"config_groups.{name}", where))
    if len(static) > 1:
        raise _refuse(where, "config_groups", sorted(groups), "one activation scheme for every group")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise _refuse(where, "ignore", ignore, "a list of module names")
    return Fp8Scheme("compressed-tensors", static_input=static.pop(), ignore=tuple(ignore))


def _ct_group(group: Any, at: str, where: str) -> bool:
    """Check one compressed-tensors config group; True if its input scales are static."""
    if not isinstance(group, dict):
        raise _refuse(where, at, group, "an object")
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise _refuse(where, f"{at}.targets", targets, "['Linear']")
    if group.get("output_activations") is not None:
        raise _refuse(where, f"{at}.output_activations", group["output_activations"], "null")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise _refuse(where, f"{at}.weights", w, "FP8 weights")
    expect = {"num_bits": (8,), "type": ("float",), "symmetric": (True, None), "dynamic": (False, None),
              "strategy": ("tensor", "channel"), "group_size": (None,), "block_structure": (None,),
              "actorder": (None, False)}
    for key, allowed in expect.items():
        if w.get(key) not in allowed:
            raise _refuse(where, f"{at}.weights.{key}", w.get(key), f"FP8 e4m3 weights: {allowed}")
    a = group.get("input_activations")
    if a is None:
        return False
    if not isinstance(a, dict) or a.get("num_bits") != 8 or a.get("type") != "float":
        raise _refuse(where, f"{at}.input_activations", a, "8-bit float activations or null")
    if a.get("dynamic") is True:
        return False
    if a.get("dynamic") is False and a.get("strategy") == "tensor":
        return True
    raise _refuse(where, f"{at}.input_activations.strategy", a.get("strategy"),
                  "dynamic activations, or static ones with strategy 'tensor'")


def _transformers_fp8(qc: dict, where: str) -> Fp8Scheme:
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(where, "activation_scheme", scheme, "'dynamic'")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(where, "fmt", fmt, "'e4m3' weights")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool)
                                                                and b > 0 for b in block)):
        raise _refuse(where, "weight_block_size", block, "two positive integers, e.g. [128, 128]")
    ignore = qc.get("modules_to_not_convert") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise _refuse(where, "modules_to_not_convert", ignore, "a list of module names")
    return Fp8Scheme("fp8", block=(block[0], block[1]), ignore=tuple(ignore))
