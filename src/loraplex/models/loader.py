"""Build a model from a Hugging Face folder, or with random weights of a named shape.

The model is built on the meta device, given uninitialised memory on the target device,
and filled one checkpoint tensor at a time from memory-mapped safetensors files (or
`pytorch_model*.bin` with `mmap`), so the host never holds a second copy of the weights.
Every checkpoint key must land somewhere and every weight must be filled: a missing, extra
or misshapen tensor is an error that names the key and the file. FP8 weights (a checkpoint whose
config.json has a `quantization_config`, or `quantization="fp8"`) go through models/fp8/checkpoint.py;
KV-cache scales (a compressed-tensors `kv_cache_scheme`) through models/fp8/kv_scales.py, into
`model.kv_scales`.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..ops.attention.paged import TRITON_HEAD_DIMS
from .config import ModelConfig
from .fp8.checkpoint import Fp8Sink, fp8_parts, prepare, quantize_model
from .fp8.formats import Fp8Scheme, fp8_scheme, kv_cache_scales
from .fp8.kv_scales import KvScaleSink
from .llama import LlamaForCausalLM
from .presets import preset_config
from .registry import model_class

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Checkpoint entries that hold no weight of ours: old RoPE buffers.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """'auto' is the checkpoint's dtype (float32 when the config names none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        return dtype
    if dtype == "auto":
        return DTYPES.get(config.dtype, torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def build_empty(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                fp8: Fp8Scheme | None = None) -> LlamaForCausalLM:
    """The model with uninitialised weights on `device` (built on meta: no throwaway init); with `fp8`, the
    projections it quantizes hold FP8 weights (never a dense copy)."""
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config)
    device = torch.device(device)
    if device.type == "cuda" and config.head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"head_dim={config.head_dim}{_where(config)} is not served on the GPU: the attention "
                         f"kernels take {TRITON_HEAD_DIMS}")
    model = model.to(dtype=dtype)
    if fp8 is not None:
        prepare(model, fp8)
    return model.to_empty(device=device).eval()  # the model keeps inv_freq in fp32


def _where(config: ModelConfig) -> str:
    return f" ({config.name_or_path})" if config.name_or_path else ""


def weight_targets(model: LlamaForCausalLM) -> dict[str, tuple[torch.Tensor, int]]:
    """Checkpoint key → (our tensor, first row): fused weights take their parts as row blocks."""
    c = model.config
    targets: dict[str, tuple[torch.Tensor, int]] = {"model.embed_tokens.weight": (model.embed_tokens, 0),
                                                    "model.norm.weight": (model.norm, 0)}
    if not c.tie_word_embeddings:
        targets["lm_head.weight"] = (model.lm_head_weight, 0)
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        targets[p + "input_layernorm.weight"] = (layer.input_layernorm, 0)
        targets[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm, 0)
        parts = [("self_attn.q_proj", layer.qkv_proj, 0), ("self_attn.k_proj", layer.qkv_proj, q),
                 ("self_attn.v_proj", layer.qkv_proj, q + kv), ("self_attn.o_proj", layer.o_proj, 0),
                 ("mlp.gate_proj", layer.gate_up_proj, 0), ("mlp.up_proj", layer.gate_up_proj, inter),
                 ("mlp.down_proj", layer.down_proj, 0)]
        for name, proj, row in parts:
            if isinstance(proj.weight, torch.Tensor):   # FP8 weights are filled by models/fp8/checkpoint.py
                targets[f"{p}{name}.weight"] = (proj.weight, row)
            if proj.bias is not None:
                targets[f"{p}{name}.bias"] = (proj.bias, row)
    return targets


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files, from the index when there is one."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = folder / index_name
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{index}: not a valid weight index ({e})") from None
            missing = [n for n in names if not (folder / n).exists()]
            if missing:
                raise ValueError(f"{index} lists {missing[0]}, which is not in {folder}")
            return [folder / n for n in names]
        if (folder / single).exists():
            return [folder / single]
    raise ValueError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _tensors(path: Path):
    """(key, shape, load) for each tensor of one file; `load()` reads just that tensor."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        with handle as f:
            for key in f.keys():
                yield key, tuple(f.get_slice(key).get_shape()), (lambda k=key: f.get_tensor(k))
        return
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({e})") from None
    for key, tensor in state.items():
        yield key, tuple(tensor.shape), (lambda t=tensor: t)


def load_weights(model: LlamaForCausalLM, folder: Path, progress: bool | None = None,
                 fp8: Fp8Scheme | None = None, kv_scales: bool = False) -> None:
    """Fill `model` from the checkpoint in `folder`; `fp8`: the scheme its FP8 weights were prepared with;
    `kv_scales`: the checkpoint stores KV-cache scales (every layer's), read into `model.kv_scales`."""
    targets = weight_targets(model)
    sink = None if fp8 is None else Fp8Sink(fp8, fp8_parts(model))
    kv_sink = KvScaleSink(model.config.num_hidden_layers) if kv_scales else None
    files = checkpoint_files(folder)
    total = sum(f.stat().st_size for f in files)
    show = progress if progress is not None else total > 2**30
    filled: set[str] = set()
    tied_head: tuple[Path, torch.Tensor] | None = None  # a stored lm_head.weight of a tied model
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {folder.name}", disable=not show) as bar:
        for path in files:
            for key, shape, load in _tensors(path):
                if _IGNORED.search(key):
                    continue
                if kv_sink is not None and kv_sink.takes(key):
                    kv_sink.put(path, key, load())
                    continue
                if sink is not None and sink.takes(key):
                    tensor = load()
                    sink.put(path, key, tensor)
                    bar.update(tensor.numel() * tensor.element_size())
                    continue
                if key == "lm_head.weight" and model.config.tie_word_embeddings:
                    tied_head = (path, load())  # settled once the embedding is in (memory-mapped until then)
                    continue
                if key not in targets:
                    raise ValueError(f"{path}: tensor {key!r} is not a weight of {type(model).__name__} "
                                     f"with this config")
                tensor = load()
                if tensor.dtype in FP8_DTYPES:
                    if sink is None:
                        raise ValueError(f"{path}: tensor {key!r} is {tensor.dtype}, but config.json has no "
                                         f"quantization_config")
                    sink.put(path, key, tensor)   # stored in FP8, served dense: dequantized below
                else:
                    _fill(model, targets, filled, path, key, tensor)
                bar.update(tensor.numel() * tensor.element_size())
        if sink is not None:
            for path, key, tensor in sink.finish(folder):
                _fill(model, targets, filled, path, key, tensor)
    if tied_head is not None:
        _settle_tied_head(model, *tied_head, embedding_loaded="model.embed_tokens.weight" in filled)
        filled.add("model.embed_tokens.weight")
    missing = sorted(set(targets) - filled)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{folder}: the checkpoint has no tensor {missing[0]!r}{more}")
    if kv_sink is not None:
        model.kv_scales = kv_sink.finish(folder)


def _fill(model: LlamaForCausalLM, targets: dict[str, tuple[torch.Tensor, int]], filled: set[str], path: Path,
          key: str, tensor: torch.Tensor) -> None:
    """Copy checkpoint tensor `key` into its rows of a dense weight (in the model's dtype)."""
    if key in filled:
        raise ValueError(f"{path}: tensor {key!r} appears twice in the checkpoint")
    dest, row = targets[key]
    expected = (_part_rows(model, key, dest),) + tuple(dest.shape[1:])
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{path}: tensor {key!r} has shape {list(tensor.shape)}; the config gives "
                         f"{list(expected)}")
    part = dest.narrow(0, row, expected[0])
    part.copy_(tensor)
    if not torch.isfinite(part).all():
        raise ValueError(f"{path}: tensor {key!r} has NaN or inf values in {model.dtype}")
    filled.add(key)


def _settle_tied_head(model: LlamaForCausalLM, path: Path, head: torch.Tensor, embedding_loaded: bool) -> None:
    """A tied model whose checkpoint also stores lm_head.weight, as transformers resolves it: the
    head alone fills the embedding; a head equal to the embedding stays tied; a different one
    unties them (transformers warns and keeps both)."""
    c = model.config
    if tuple(head.shape) != (c.vocab_size, c.hidden_size):
        raise ValueError(f"{path}: tensor 'lm_head.weight' has shape {list(head.shape)}; the config gives "
                         f"{[c.vocab_size, c.hidden_size]}")
    if not embedding_loaded:
        model.embed_tokens.copy_(head)
        return
    if torch.equal(head.to(model.dtype).to(model.device), model.embed_tokens):
        return
    warnings.warn(f"{path}: tie_word_embeddings is set but lm_head.weight differs from the embedding; "
                  f"using both, untied (as transformers does)")
    model.lm_head_weight = torch.nn.Parameter(head.to(model.device, model.dtype), requires_grad=False)
    if not torch.isfinite(model.lm_head_weight).all():
        raise ValueError(f"{path}: tensor 'lm_head.weight' has NaN or inf values in {model.dtype}")


def _part_rows(model: LlamaForCausalLM, key: str, dest: torch.Tensor) -> int:
    c = model.config
    widths = {"q_proj": c.num_attention_heads * c.head_dim, "k_proj": c.num_key_value_heads * c.head_dim,
              "v_proj": c.num_key_value_heads * c.head_dim, "gate_proj": c.intermediate_size,
              "up_proj": c.intermediate_size}
    name = key.rsplit(".", 2)[-2]
    return widths.get(name, dest.shape[0])


def load_model(folder: str | Path, *, dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu",
               progress: bool | None = None, quantization: str | None = None) -> LlamaForCausalLM:
    """A served model from a Hugging Face folder (`config.json` + weights), on `device`. FP8 checkpoints load
    as FP8 (their config's `quantization_config`); `quantization="fp8"` quantizes a dense one at load. A
    compressed-tensors `kv_cache_scheme`'s per-layer scales land in `model.kv_scales`."""
    folder = Path(folder)
    config = ModelConfig.from_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())   # from_pretrained has checked that it reads
    scheme = fp8_scheme(raw, quantization, _where(config))
    model = build_empty(config, resolve_dtype(dtype, config), device, fp8=scheme)
    load_weights(model, folder, progress, fp8=scheme, kv_scales=kv_cache_scales(raw, _where(config)))
    return model


def dummy_model(config: ModelConfig | str, *, dtype: str | torch.dtype = "bfloat16",
                device: torch.device | str = "cpu", seed: int = 0, num_layers: int | None = None,
                std: float = 0.02, quantization: str | None = None) -> LlamaForCausalLM:
    """Random weights of the right shapes, from a config or a preset name: no files at all; with
    `quantization="fp8"`, the projections quantized per row as `load_model` quantizes a dense checkpoint."""
    if isinstance(config, str):
        config = preset_config(config, num_layers)
    elif num_layers is not None:
        config = config.with_layers(num_layers)
    model = build_empty(config, resolve_dtype(dtype, config), device)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:  # RMSNorm gains near 1, as trained models have
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen, device=param.device))
        else:
            param.normal_(0.0, std, generator=gen)
    if fp8_scheme({}, quantization) is not None:
        quantize_model(model)
    return model
