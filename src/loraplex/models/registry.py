"""Which class serves which Hugging Face architecture."""
from __future__ import annotations

from .config import ModelConfig
from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class for `config.architecture` (or, when the config names none, for its model_type)."""
    name = config.architecture or _BY_MODEL_TYPE[config.model_type]
    if name not in ARCHITECTURES:
        where = f" ({config.name_or_path})" if config.name_or_path else ""
        raise ValueError(f"architecture {name!r}{where} is not served; supported: {sorted(ARCHITECTURES)}")
    if _BY_MODEL_TYPE[config.model_type] != name:
        raise ValueError(f"architecture {name!r} does not go with model_type {config.model_type!r}")
    return ARCHITECTURES[name]
