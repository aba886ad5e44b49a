"""PEFT's `adapter_config.json`, resolved against the served model: which modules, what rank, what scale.

We follow PEFT's own matching rules (peft.tuners.tuners_utils.check_target_module_exists and
peft.utils.other.get_pattern_key) so that a folder means here exactly what it means to PEFT:

- `target_modules` as a string is a regex that must match a module's whole name;
  `"all-linear"` is every linear layer but the output head; as a list, an entry matches a module
  whose name is the entry or ends in `.entry`, restricted by `layers_to_transform` (and
  `layers_pattern`, the name of the block list) when given.
- `exclude_modules` takes the same forms and wins over `target_modules`.
- `rank_pattern` / `alpha_pattern` keys are regexes matched against the end of a module's name;
  the first that matches gives that module's rank / alpha.
- The scale is `alpha / r`, or `alpha / sqrt(r)` with `use_rslora`.
"""
from __future__ import annotations

import math
import re
import struct
from typing import Any

from ..models.config import OUTER_MODULES, PROJECTIONS, ModelConfig, module_path
from .spec import AdapterError, ModuleKey, ModuleSpec

# PEFT's defaults when a config names no target modules (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
DEFAULT_TARGETS = {"llama": ["q_proj", "v_proj"], "mistral": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"]}

# Fields whose non-default value changes the math in ways we do not serve: field → (is it set?, why).
_REFUSED_FIELDS = {
    "use_dora": (lambda v: bool(v), "DoRA adapters (use_dora) are not served"),
    "lora_bias": (lambda v: bool(v), "LoRA with a bias on B (lora_bias) is not served"),
    "modules_to_save": (lambda v: bool(v), "modules_to_save (fully fine-tuned extra modules) is not served"),
    "layer_replication": (lambda v: bool(v), "layer_replication is not served"),
    "target_parameters": (lambda v: bool(v), "LoRA on parameters (target_parameters) is not served"),
    "trainable_token_indices": (lambda v: bool(v), "trainable token embeddings (trainable_token_indices) "
                                                   "are not served"),
    "use_qalora": (lambda v: bool(v), "QALoRA (use_qalora) is not served"),
    "alora_invocation_tokens": (lambda v: bool(v), "activated LoRA (alora_invocation_tokens) is not served"),
    # PEFT turns these on whenever they are not None, even as an empty object of defaults
    "kasa_config": (lambda v: v is not None, "KaSA (kasa_config) changes the base weights and is not served"),
    "monteclora_config": (lambda v: v is not None, "MonteCLoRA (monteclora_config) is not served"),
    "use_bdlora": (lambda v: v is not None, "block-diagonal LoRA (use_bdlora) is not served"),
    "arrow_config": (lambda v: v is not None, "Arrow routing (arrow_config) is not served"),
}
# velora_config only changes training's backward pass, and lora_dropout does nothing at inference.

# These initialisations subtract the initial B @ A from the base weights, so the saved A and B only
# make sense on that modified base, unless PEFT converted them back to a plain LoRA when saving
# (`path_initial_model_for_weight_conversion`), which also resets init_lora_weights.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "lora-ga")


def _module_names(model: ModelConfig) -> list[str]:
    """The names PEFT sees in a transformers *ForCausalLM that LoRA could target."""
    return ["model.embed_tokens"] + model.linear_module_paths()


def _matches_names(spec: str | list[str], key: str) -> bool:
    if isinstance(spec, str):
        return re.fullmatch(spec, key) is not None
    return key in spec or any(key.endswith(f".{t}") for t in spec)


def _layer_index(key: str, layers_pattern) -> int | None:
    if not layers_pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        m = None
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if m:
                break
    return int(m.group("idx")) if m else None


def _is_target(cfg: dict[str, Any], targets, key: str) -> bool:
    exclude = cfg.get("exclude_modules")
    if exclude and _matches_names(exclude, key):
        return False
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    index = _layer_index(key, cfg.get("layers_pattern"))
    if index is None:
        return False
    return index == layers if isinstance(layers, int) else index in layers


def _pattern_value(patterns: dict[str, Any], key: str, default):
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _check_regex(value: str, field: str, where: str) -> None:
    try:
        re.compile(value)
    except re.error as e:
        raise AdapterError(f"{where}: field {field!r} is not a valid regular expression ({value!r}: {e})") from None


def _positive_int(value, field: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"{where}: field {field!r} must be a positive integer, got {value!r}")
    return value


def _number(value, field: str, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise AdapterError(f"{where}: field {field!r} must be a finite number, got {value!r}")
    return float(value)


def resolve_modules(cfg: dict[str, Any], model: ModelConfig, where: str) -> dict[ModuleKey, ModuleSpec]:
    """Every (layer, projection) the config targets, with its rank and scale; refuses what we don't serve."""
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"{where}: field 'peft_type' is {peft_type!r}; only LORA adapters are served")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"{where}: field 'bias' is {bias!r}; only bias='none' is served "
                           f"(trained biases of the base model would change it for every request)")
    for field, (is_set, why) in _REFUSED_FIELDS.items():
        if is_set(cfg.get(field)):
            raise AdapterError(f"{where}: field {field!r} is {cfg[field]!r}: {why}")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise AdapterError(f"{where}: field 'init_lora_weights' is {init!r}: this initialisation changes the base "
                           f"weights, so the adapter is only right on that changed model. Save it with PEFT's "
                           f"path_initial_model_for_weight_conversion to turn it into a plain LoRA")
    r = _positive_int(cfg.get("r", 8), "r", where)
    alpha = _number(cfg.get("lora_alpha", 8), "lora_alpha", where)
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"{where}: field 'use_rslora' must be true or false, got {rslora!r}")
    patterns = {}
    for field in ("rank_pattern", "alpha_pattern"):
        value = cfg.get(field) or {}
        if not isinstance(value, dict):
            raise AdapterError(f"{where}: field {field!r} must be an object of regex → value, got {value!r}")
        for pattern, v in value.items():
            _check_regex(pattern, f"{field}[{pattern!r}]", where)
            (_positive_int if field == "rank_pattern" else _number)(v, f"{field}[{pattern!r}]", where)
        patterns[field] = value

    targets = cfg.get("target_modules")
    if targets is None:
        targets = DEFAULT_TARGETS[model.model_type]
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = [name for name in model.linear_module_paths() if name != "lm_head"]
    elif isinstance(targets, str):
        _check_regex(targets, "target_modules", where)
    elif not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise AdapterError(f"{where}: field 'target_modules' must be a list of names or a regex string, "
                           f"got {targets!r}")
    exclude = cfg.get("exclude_modules")
    if isinstance(exclude, str):
        _check_regex(exclude, "exclude_modules", where)
    elif exclude is not None and not (isinstance(exclude, list) and all(isinstance(t, str) for t in exclude)):
        raise AdapterError(f"{where}: field 'exclude_modules' must be a list of names or a regex string, "
                           f"got {exclude!r}")
    layers = cfg.get("layers_to_transform")
    if layers is not None and not isinstance(layers, int) and not (
            isinstance(layers, list) and all(isinstance(i, int) for i in layers)):
        raise AdapterError(f"{where}: field 'layers_to_transform' must be an integer or a list of them, got {layers!r}")
    pattern = cfg.get("layers_pattern")
    if pattern is not None:
        if not (isinstance(pattern, str) or (isinstance(pattern, list) and all(isinstance(p, str) for p in pattern))):
            raise AdapterError(f"{where}: field 'layers_pattern' must be a string or a list of them, got {pattern!r}")
        for p in [pattern] if isinstance(pattern, str) else pattern:
            _check_regex(p, "layers_pattern", where)
    # PEFT's LoraConfig refuses these combinations when it loads the config; so do we.
    if isinstance(cfg.get("target_modules"), str) and (layers is not None or pattern):
        raise AdapterError(f"{where}: fields 'layers_to_transform' / 'layers_pattern' cannot be used with a regex "
                           f"'target_modules' (PEFT refuses this config too)")
    if pattern and layers is None:
        raise AdapterError(f"{where}: field 'layers_pattern' is set without 'layers_to_transform' (PEFT refuses "
                           f"this config too)")

    chosen = [key for key in _module_names(model) if _is_target(cfg, targets, key)]
    for outer in OUTER_MODULES:
        if outer in chosen:
            raise AdapterError(f"{where}: target_modules {targets!r} puts LoRA on {outer!r}; LoRA on the "
                               f"embeddings or lm_head is not served")
    if not chosen:
        raise AdapterError(f"{where}: target_modules {targets!r} matches no module of this "
                           f"{model.model_type} model (its projections: {', '.join(PROJECTIONS)})")
    by_path = {module_path(layer, proj): (layer, proj)
               for layer in range(model.num_hidden_layers) for proj in PROJECTIONS}
    modules = {}
    for key in chosen:
        rank = _pattern_value(patterns["rank_pattern"], key, r)
        alpha_k = float(_pattern_value(patterns["alpha_pattern"], key, alpha))
        scaling = alpha_k / math.sqrt(rank) if rslora else alpha_k / rank
        # rounded to float32 here, as the pool and packed files store it, so every source agrees
        modules[by_path[key]] = ModuleSpec(rank=rank, scaling=struct.unpack("f", struct.pack("f", scaling))[0])
    return modules
