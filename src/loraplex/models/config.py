"""The base model's shape, read from a Hugging Face `config.json`: what adapters are checked against.

Only Llama-family decoders (Llama, Mistral, Qwen2) are served: the same seven projections per
layer, with k/v narrower than q under grouped-query attention.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        kv_heads = cfg.get("num_key_value_heads")
        try:
            return cls(model_type=cfg["model_type"], hidden_size=cfg["hidden_size"],
                       intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
                       num_attention_heads=heads, num_key_value_heads=heads if kv_heads is None else kv_heads,
                       head_dim=head_dim, vocab_size=cfg.get("vocab_size", 32000),
                       name_or_path=name_or_path or cfg.get("_name_or_path", ""))
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
        return cls.from_dict(cfg, name_or_path=str(model_dir))

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
