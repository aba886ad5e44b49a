"""Tiny base models and adapters written by real transformers and PEFT, as users bring them."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

FAMILIES = ("llama", "mistral", "qwen2")


def tiny_config(family: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 96, vocab: int = 128):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[family]
    return cls(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
               max_position_embeddings=256)


def make_base(folder: Path, family: str = "llama", seed: int = 0, **shape) -> Path:
    """Save a random tiny *ForCausalLM (config.json + model.safetensors) into `folder`."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **shape))
    model.save_pretrained(folder)
    return Path(folder)


def make_adapter(base_dir: Path, out_dir: Path, seed: int = 1, *, merged: bool = False, **lora_kwargs):
    """Write a PEFT adapter with random (non-zero) A and B; with `merged`, also return PEFT's deltas.

    The deltas are `merge_and_unload()` weights minus the base weights, float64, keyed by the
    module name (`model.layers.0.self_attn.q_proj`) — the oracle for what the pool must hold.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    lora_kwargs.setdefault("r", 8)
    lora_kwargs.setdefault("lora_alpha", 16)
    lora_kwargs.setdefault("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"])
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    base_weights = {k: v.clone() for k, v in base.state_dict().items()}
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
        model.save_pretrained(out_dir)
    if not merged:
        return Path(out_dir)
    merged_model = model.merge_and_unload()
    deltas = {}
    for key, weight in merged_model.state_dict().items():
        if key.endswith(".weight"):
            delta = weight.double() - base_weights[key].double()
            if delta.abs().max() > 0:
                deltas[key[: -len(".weight")]] = delta
    return Path(out_dir), deltas


def write_adapter(folder: Path, model, *, rank: int = 4, projections=("q_proj", "v_proj"), layers=None,
                  seed: int = 0, alpha: float = 8.0, dtype=torch.float32) -> Path:
    """Write a PEFT-format folder directly (no PEFT): fast, for tests of the tiers rather than the format.

    `model` is a loraplex ModelConfig; A and B are random and non-zero; every listed projection of
    every listed layer (all by default) gets `rank`.
    """
    import json

    from safetensors.torch import save_file

    from loraplex.models.config import module_path
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layers = list(range(model.num_hidden_layers)) if layers is None else list(layers)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        for proj in projections:
            in_f, out_f = model.projection_shape(proj)
            key = f"base_model.model.{module_path(layer, proj)}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen) / in_f ** 0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen).to(dtype)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(projections),
              "layers_to_transform": layers if len(layers) < model.num_hidden_layers else None,
              "bias": "none", "base_model_name_or_path": model.name_or_path}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder
