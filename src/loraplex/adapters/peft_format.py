"""Read and validate a PEFT LoRA adapter folder (`adapter_config.json` + weights).

`inspect_peft_adapter` checks everything that can be checked without reading the weights: the
config, every key, every tensor's shape and dtype (safetensors headers only), so that registering
thousands of folders stays fast. `read_peft_adapter` then reads, checks values and casts once.

Keys are PEFT's: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, with or
without an adapter-name infix (`...lora_A.default.weight`). `lora_A` is `[r, in]`, `lora_B` is
`[out, r]` for every Llama-family projection; `fan_in_fan_out` does not change that (PEFT itself
turns it off for `nn.Linear`), and `lora_dropout` does nothing at inference.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from ..models.config import ATTENTION_PROJECTIONS, PROJECTIONS, ModelConfig
from .peft_config import resolve_modules
from .priority import HOST_PRIORITY
from .spec import AdapterError, AdapterSpec, LoraAdapter, ModuleKey, check_finite, pack_host_adapter

log = logging.getLogger("loraplex.adapters")

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_LAYER_MODULE = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<proj>\w+)$")
_FLOAT_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64}


def read_adapter_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterError(f"{folder}: not a folder (expected a PEFT adapter folder with {CONFIG_FILE})")
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: missing (a PEFT adapter folder has {CONFIG_FILE})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: unreadable: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def weights_file(folder: Path) -> Path:
    for name in (SAFETENSORS_FILE, BIN_FILE):
        if (folder / name).is_file():
            return folder / name
    raise AdapterError(f"{folder}: no weights file ({SAFETENSORS_FILE} or {BIN_FILE})")


def _tensor_infos(path: Path) -> dict[str, tuple[list[int], torch.dtype]]:
    """Shape and dtype of every tensor; reads only the header of a safetensors file."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        try:
            with safe_open(str(path), framework="pt") as f:
                infos = {}
                for key in f.keys():
                    s = f.get_slice(key)
                    infos[key] = (list(s.get_shape()), _safetensors_dtype(s.get_dtype(), path, key))
                return infos
        except AdapterError:
            raise
        except Exception as e:  # safetensors raises its own error type for truncated or corrupt files
            raise AdapterError(f"{path}: unreadable safetensors file: {e}") from None
    state = _load_bin(path)
    return {k: (list(v.shape), v.dtype) for k, v in state.items()}


def _safetensors_dtype(name: str, path: Path, key: str) -> torch.dtype:
    table = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    if name not in table:
        raise AdapterError(f"{path}: tensor {key!r} has dtype {name}; LoRA weights must be floating point")
    return table[name]


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # pickle errors, truncation, or objects weights_only refuses
        raise AdapterError(f"{path}: unreadable PyTorch weights file: {e}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise AdapterError(f"{path}: expected a dict of tensors")
    return state


def _module_key(module: str, key: str, path: Path, model: ModelConfig) -> ModuleKey:
    m = _LAYER_MODULE.match(module)
    if m is None:
        last = module.rsplit(".", 1)[-1]
        if last in ("lm_head", "embed_tokens"):
            raise AdapterError(f"{path}: key {key!r} puts LoRA on {last!r}; LoRA on the embeddings or lm_head "
                               f"is not served")
        raise AdapterError(f"{path}: key {key!r} matches no module of the model (expected "
                           f"model.layers.<i>.self_attn|mlp.<projection>)")
    proj, block = m.group("proj"), m.group("block")
    if proj not in PROJECTIONS or (block == "self_attn") != (proj in ATTENTION_PROJECTIONS):
        raise AdapterError(f"{path}: key {key!r} matches no module of the model ({block}.{proj} is not one "
                           f"of its projections: {', '.join(PROJECTIONS)})")
    layer = int(m.group("layer"))
    if layer >= model.num_hidden_layers:
        raise AdapterError(f"{path}: key {key!r} matches no module of the model: layer {layer} does not exist "
                           f"(the model has {model.num_hidden_layers} layers)")
    return layer, proj


def _classify_keys(infos: dict[str, tuple[list[int], torch.dtype]], path: Path,
                   model: ModelConfig) -> dict[ModuleKey, dict[str, str]]:
    """Map every tensor key to its (layer, projection) and A/B; refuse anything else."""
    found: dict[ModuleKey, dict[str, str]] = {}
    adapter_names = set()
    for key in sorted(infos):
        if "lora_magnitude_vector" in key:
            raise AdapterError(f"{path}: key {key!r} is a DoRA magnitude; DoRA adapters are not served")
        if "lora_embedding_" in key:
            raise AdapterError(f"{path}: key {key!r} is LoRA on embeddings, which is not served")
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{path}: unexpected key {key!r}: only LoRA weights (...lora_A.weight and "
                               f"...lora_B.weight) are served")
        adapter_names.add(m.group("adapter"))
        module = _module_key(m.group("module"), key, path, model)
        found.setdefault(module, {})[m.group("ab")] = key
    if len(adapter_names) > 1:
        names = sorted("(no adapter name)" if n is None else repr(n) for n in adapter_names)
        raise AdapterError(f"{path}: holds weights of several adapters ({', '.join(names)}); save one per folder")
    return found


def inspect_peft_adapter(folder: str | Path, model: ModelConfig, *, name: str | None = None,
                         max_rank: int | None = None) -> AdapterSpec:
    """Validate a PEFT folder against the served model without reading its weights (headers only)."""
    folder = Path(folder)
    cfg = read_adapter_config(folder)
    where = str(folder / CONFIG_FILE)
    modules = resolve_modules(cfg, model, where)
    path = weights_file(folder)
    infos = _tensor_infos(path)
    found = _classify_keys(infos, path, model)
    for key in sorted(found):
        if key not in modules:
            example = next(iter(found[key].values()))
            raise AdapterError(f"{path}: has weights for layer {key[0]} {key[1]} ({example!r}) but {where} "
                               f"does not target that module")
    dtypes = set()
    for (layer, proj), spec in sorted(modules.items()):
        keys = found.get((layer, proj), {})
        in_f, out_f = model.projection_shape(proj)
        for ab, want in (("A", [spec.rank, in_f]), ("B", [out_f, spec.rank])):
            if ab not in keys:
                raise AdapterError(f"{path}: no lora_{ab} weight for layer {layer} {proj}, which {where} targets")
            shape, dtype = infos[keys[ab]]
            dtypes.add(dtype)
            if dtype not in _FLOAT_DTYPES:
                raise AdapterError(f"{path}: tensor {keys[ab]!r} is {dtype}; LoRA weights must be floating point")
            if shape != want:
                raise AdapterError(f"{path}: tensor {keys[ab]!r} has shape {shape} but the model's {proj} "
                                   f"({in_f} → {out_f}) with rank {spec.rank} needs {want}")
        if max_rank is not None and spec.rank > max_rank:
            raise AdapterError(f"{where}: layer {layer} {proj} has rank {spec.rank}, above the pool's "
                               f"max_lora_rank={max_rank}")
    spec = AdapterSpec(name=name or folder.name, source=str(folder), modules=modules,
                       base_model_name_or_path=cfg.get("base_model_name_or_path"),
                       locator={k: {ab: (found[k][ab], tuple(infos[found[k][ab]][0])) for ab in "AB"}
                                for k in modules},
                       weights_dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32)
    _check_base_model(spec, model)
    return spec


def _check_base_model(spec: AdapterSpec, model: ModelConfig) -> None:
    """A different base model name is only a warning: local copies and mirrors rename freely."""
    theirs, ours = spec.base_model_name_or_path, model.name_or_path
    if not theirs or not ours:
        return
    if Path(theirs.rstrip("/")).name.lower() != Path(ours.rstrip("/")).name.lower():
        msg = (f"adapter {spec.name!r} was trained on {theirs!r} but the served model is {ours!r}; "
               f"its shapes fit, so it is served")
        spec.warnings.append(msg)
        log.warning(msg)


def read_peft_adapter(spec: AdapterSpec, dtype: torch.dtype, pin: bool = False) -> LoraAdapter:
    """Read the weights of an inspected folder, check their values, cast them to `dtype` once."""
    folder = Path(spec.source)
    path = weights_file(folder)
    keys = {module: {ab: key for ab, (key, _) in abs_.items()} for module, abs_ in spec.locator.items()}
    tensors = {}
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        try:
            with safe_open(str(path), framework="pt") as f:
                for module, ab in keys.items():
                    HOST_PRIORITY.checkpoint()
                    tensors[module] = (f.get_tensor(ab["A"]), f.get_tensor(ab["B"]))
        except Exception as e:
            raise AdapterError(f"{path}: unreadable safetensors file: {e}") from None
    else:
        state = _load_bin(path)
        for module, ab in keys.items():
            if ab["A"] not in state or ab["B"] not in state:
                raise AdapterError(f"{path}: changed since it was registered (key {ab['A']!r} is gone)")
            tensors[module] = (state[ab["A"]], state[ab["B"]])
    for module, (a, b) in tensors.items():
        for ab, t in (("A", a), ("B", b)):
            key, shape = spec.locator[module][ab]
            if tuple(t.shape) != shape:
                raise AdapterError(f"{path}: changed since it was registered (tensor {key!r} is now "
                                   f"{list(t.shape)}, was {list(shape)})")
    adapter = pack_host_adapter(spec, tensors, dtype, pin)
    try:
        check_finite(adapter, str(path))  # one pass over the cast copy; on failure, name the tensor at fault
    except AdapterError:
        for module, (a, b) in tensors.items():
            for ab, t in (("A", a), ("B", b)):
                if not torch.isfinite(t).all():
                    raise AdapterError(f"{path}: tensor {keys[module][ab]!r} holds NaN or infinite values") from None
        raise AdapterError(f"{path}: values overflow {str(dtype).replace('torch.', '')}, the serving dtype") from None
    return adapter
