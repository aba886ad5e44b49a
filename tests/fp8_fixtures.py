"""FP8 checkpoints written by the tests, as the published ones store them, and their dequantized twins.

`quantize_folder` turns a float checkpoint (tests/model_fixtures.py's `make_hf_model`) into
- a compressed-tensors checkpoint (llm-compressor's FP8: `weight` e4m3, `weight_scale` per tensor `[1]` or
  per channel `[out, 1]`, `input_scale` `[1]` for static activations; `quantization_config` with
  config_groups / ignore), or
- a transformers `fp8` checkpoint (DeepSeek-V3, Qwen3-FP8: `weight` e4m3, `weight_scale_inv`
  `[ceil(out/bn), ceil(in/bk)]`; `quantization_config` with weight_block_size / modules_to_not_convert),
and writes beside it the oracle's folder: the same model with every FP8 weight replaced by its float64
dequantization (`q[n, k] * scale[n // bn, k // bk]`, written here independently of loraplex) in float32.
"""
from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
PROJECTION = re.compile(r"^(model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj)\.weight$")


def make_blocky_model(folder: Path, seed: int = 0) -> Path:
    """A one-layer Llama whose every projection width is a multiple of 128 (q 256, k/v 128, MLP 384): 128×128
    blocks tile each fused part exactly, as in published checkpoints."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():   # unit-gain weights, as tests/model_fixtures.py draws them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    model.save_pretrained(folder)
    return Path(folder)


def block_scales(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """float64 amax / 448 of each [bn, bk] block of w (partial blocks at the edges), by plain loops."""
    rows, cols = -(-w.shape[0] // bn), -(-w.shape[1] // bk)
    s = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(rows):
        for j in range(cols):
            s[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / E4M3_MAX
    return s


def expand(scale: torch.Tensor, shape: tuple[int, int], bn: int, bk: int) -> torch.Tensor:
    """S[n, k] = scale[n // bn, k // bk], float64."""
    n = torch.arange(shape[0]) // bn
    k = torch.arange(shape[1]) // bk
    return scale.double()[n[:, None], k[None, :]]


def quantize(w: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 q, float64 q * S): w / S rounded to e4m3 by torch's cast, and its dequantization."""
    S = expand(scale, tuple(w.shape), bn, bk)
    q = (w.double() / S).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float32).to(E4M3)
    return q, q.double() * S


def ct_config(strategy: str, static_input: bool, ignore: list[str], fmt: str = "float-quantized") -> dict:
    """compressed-tensors' quantization_config as llm-compressor writes an FP8 recipe."""
    common = dict(num_bits=8, type="float", symmetric=True, group_size=None, block_structure=None,
                  actorder=None, observer="minmax", observer_kwargs={})
    inputs = dict(common, strategy="tensor", dynamic=False) if static_input else \
        dict(common, strategy="token", dynamic=True, observer=None)
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(common, strategy=strategy,
                                                                                   dynamic=False),
                                          "input_activations": inputs, "output_activations": None}},
            "format": fmt, "global_compression_ratio": 1.5, "ignore": ignore, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def fp8_config(block: tuple[int, int], not_convert: list[str] | None) -> dict:
    """transformers' FineGrainedFP8 quantization_config, as Qwen3-FP8 and DeepSeek-V3 publish it."""
    config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    if not_convert is not None:
        config["modules_to_not_convert"] = not_convert
    return config


def quantize_folder(src: Path, dst: Path, oracle: Path, qconfig: dict, *, skip=lambda module: False,
                    scale_dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write `dst` (src's projections in FP8 per `qconfig`, except the modules `skip` names) and `oracle`
    (dequantized, float32, no quantization_config). Returns the dequantized float64 weights by key."""
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out, dense, deq = {}, {}, {}
    for key, w in tensors.items():
        m = PROJECTION.match(key)
        if m is None or skip(m.group(1)):
            out[key] = dense[key] = w
            continue
        module = m.group(1)
        if qconfig["quant_method"] == "fp8":
            bn, bk = qconfig["weight_block_size"]
            scale = block_scales(w, bn, bk).to(scale_dtype)
            q, deq[key] = quantize(w, scale, bn, bk)
            out[f"{module}.weight_scale_inv"] = scale
        else:
            group = qconfig["config_groups"]["group_0"]
            if group["weights"]["strategy"] == "tensor":
                scale = (w.abs().max() / E4M3_MAX).double().reshape(1).to(scale_dtype)
                q, deq[key] = quantize(w, scale.reshape(1, 1), *w.shape)
            else:
                scale = block_scales(w, 1, w.shape[1]).to(scale_dtype)   # [out, 1]
                q, deq[key] = quantize(w, scale, 1, w.shape[1])
            out[f"{module}.weight_scale"] = scale
            if not group["input_activations"]["dynamic"]:
                out[f"{module}.input_scale"] = (0.01 + torch.rand(1, generator=gen)).to(scale_dtype)
        out[key] = q
        dense[key] = deq[key].float()
    for folder, weights, quantized in ((dst, out, True), (oracle, dense, False)):
        folder.mkdir(parents=True, exist_ok=True)
        cfg = json.loads((src / "config.json").read_text())
        if quantized:
            cfg["quantization_config"] = qconfig
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
        if (src / "generation_config.json").exists():
            shutil.copy(src / "generation_config.json", folder)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return deq
