"""The base model's shape, read from a Hugging Face `config.json`: what adapters are checked against.

Only Llama-family decoders (Llama, Mistral, Qwen2) are served: the same seven projections per
layer, with k/v narrower than q under grouped-query attention.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .rope import RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Every linear layer of a decoder layer, in a fixed order: the pool and packed files index by it.
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
# Linear or embedding modules outside the decoder layers (LoRA on them is not served yet).
OUTER_MODULES = ("model.embed_tokens", "lm_head")


def module_path(layer: int, proj: str) -> str:
    """The module's name inside a transformers `*ForCausalLM`, as PEFT matches and saves it."""
    block = "self_attn" if proj in ATTENTION_PROJECTIONS else "mlp"
    return f"model.layers.{layer}.{block}.{proj}"


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Llama-family config that fix the shape of every projection."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    name_or_path: str = ""
    # The rest only matters to the forward pass; defaults are Llama 2's.
    architecture: str = ""
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False     # Qwen2, or Llama's attention_bias
    o_bias: bool = False       # Llama's attention_bias
    mlp_bias: bool = False     # Llama's mlp_bias
    sliding_windows: tuple[int, ...] = ()  # per layer, 0 = full attention; () = every layer full
    dtype: str = ""            # the checkpoint's dtype as saved ("bfloat16", …), "" if not given
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not served; supported: {SUPPORTED_MODEL_TYPES}")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if isinstance(self.rms_norm_eps, bool) or not isinstance(self.rms_norm_eps, (int, float)) \
                or not self.rms_norm_eps > 0:
            raise ValueError(f"config field rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {self.num_hidden_layers} layers")
        if any(not isinstance(w, int) or w < 0 for w in self.sliding_windows):
            raise ValueError(f"sliding windows must be integers >= 0, got {self.sliding_windows}")

    def sliding_window(self, layer: int) -> int:
        """Keys a query of `layer` sees (itself included), or 0 for the whole context."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name_or_path: str = "") -> "ModelConfig":
        where = f" in {name_or_path}" if name_or_path else ""
        for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ValueError(f"config{where} has no field {key!r}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim")
        if head_dim is None:  # older configs leave it implied
            hidden = cfg["hidden_size"]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, hidden)) \
                    or hidden % heads:
                raise ValueError(f"config{where}: hidden_size={cfg['hidden_size']!r} does not split into "
                                 f"num_attention_heads={heads} heads and no head_dim is given")
            head_dim = cfg["hidden_size"] // heads
        family = cfg["model_type"]
        kv_heads = cfg.get("num_key_value_heads", _KV_HEADS_DEFAULT.get(family))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config{where}: hidden_act={cfg['hidden_act']!r} is not served (only 'silu')")
        if cfg.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"config{where}: pretraining_tp={cfg['pretraining_tp']} is not served")
        architectures = cfg.get("architectures") or []
        # These two add `where` to their own errors.
        rope = RopeConfig.from_config_dict(cfg, where)
        windows = _sliding_windows(cfg, where)
        try:
            return cls(model_type=family, hidden_size=cfg["hidden_size"],
                       intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
                       num_attention_heads=heads, num_key_value_heads=heads if kv_heads is None else kv_heads,
                       head_dim=head_dim, vocab_size=cfg.get("vocab_size", 32000),
                       name_or_path=name_or_path or cfg.get("_name_or_path", ""),
                       architecture=architectures[0] if isinstance(architectures, list) and architectures else "",
                       rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope=rope,
                       max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       qkv_bias=family == "qwen2" or (family == "llama" and bool(cfg.get("attention_bias"))),
                       o_bias=family == "llama" and bool(cfg.get("attention_bias")),
                       mlp_bias=family == "llama" and bool(cfg.get("mlp_bias")),
                       sliding_windows=windows,
                       dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or ""),
                       bos_token_id=cfg.get("bos_token_id"),
                       eos_token_ids=_token_ids(cfg.get("eos_token_id"), "eos_token_id"))
        except ValueError as e:
            raise ValueError(f"config{where}: {e}") from None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        """Read `model_dir/config.json` (a folder as transformers' `save_pretrained` writes it)."""
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file (is {model_dir} a Hugging Face model folder?)") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read it as JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
        config = cls.from_dict(cfg, name_or_path=str(model_dir))
        # Chat models list their end-of-turn tokens in generation_config.json (Llama 3: 128001, 128009).
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.exists():
            try:
                gen = json.loads(gen_path.read_text())
                extra = _token_ids(gen.get("eos_token_id") if isinstance(gen, dict) else None, "eos_token_id")
            except (OSError, json.JSONDecodeError, ValueError) as e:
                raise ValueError(f"{gen_path}: {e}") from None
            config = replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))
        return config

    def with_layers(self, num_hidden_layers: int) -> "ModelConfig":
        """The same model cut (or grown) to `num_hidden_layers` layers: benchmark and test shapes."""
        windows = self.sliding_windows
        if windows:
            windows = tuple(windows[i] if i < len(windows) else windows[-1] for i in range(num_hidden_layers))
        return replace(self, num_hidden_layers=num_hidden_layers, sliding_windows=windows)

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection."""
        q_width = self.num_attention_heads * self.head_dim
        kv_width = self.num_key_value_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden_size, q_width), "k_proj": (self.hidden_size, kv_width),
            "v_proj": (self.hidden_size, kv_width), "o_proj": (q_width, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        if proj not in shapes:
            raise ValueError(f"unknown projection {proj!r}; projections: {PROJECTIONS}")
        return shapes[proj]

    def linear_module_paths(self) -> list[str]:
        """Every nn.Linear of the model, as PEFT names them (lm_head last)."""
        return [module_path(layer, p) for layer in range(self.num_hidden_layers) for p in PROJECTIONS] + ["lm_head"]

    def lora_parameter_count(self, rank: int, projections=PROJECTIONS) -> int:
        """Weights (A and B) of a rank-`rank` adapter on `projections` of every layer."""
        per_layer = sum(rank * sum(self.projection_shape(p)) for p in projections)
        return per_layer * self.num_hidden_layers


# transformers' defaults when config.json leaves num_key_value_heads out (Llama: as many as query heads).
_KV_HEADS_DEFAULT = {"mistral": 8, "qwen2": 32}


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise ValueError(f"{name} must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def _sliding_windows(cfg: dict[str, Any], where: str) -> tuple[int, ...]:
    """Per-layer windows as transformers applies them: Mistral on every layer when `sliding_window`
    is set; Qwen2 only with `use_sliding_window`, on the layers `layer_types` (or, in older
    configs, `max_window_layers`) marks; Llama never."""
    family, layers = cfg["model_type"], cfg["num_hidden_layers"]
    # A missing key takes transformers' default (Mistral: 4096); an explicit null means no window.
    window = cfg.get("sliding_window", 4096 if family == "mistral" else None)
    if family == "llama" or window is None:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"config{where}: sliding_window must be a positive integer or null, got {window!r}")
    if family == "mistral":
        return (window,) * layers
    if not cfg.get("use_sliding_window", False):
        return ()
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", 28)  # transformers' Qwen2Config default
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"config{where}: layer_types must list 'full_attention' or 'sliding_attention' "
                         f"for each of the {layers} layers, got {types!r}")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()
