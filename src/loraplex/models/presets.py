"""Named model shapes (their published `config.json` fields), for benchmarks with dummy weights."""
from __future__ import annotations

from .config import ModelConfig

_LLAMA2 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16"}
_LLAMA3 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
           "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    "llama-2-7b": {**_LLAMA2, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32},
    "llama-2-13b": {**_LLAMA2, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                    "num_attention_heads": 40, "num_key_value_heads": 40},
    "llama-2-70b": {**_LLAMA2, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
    "llama-3-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8},
    "llama-3.1-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                     "rope_scaling": _LLAMA31_ROPE},
    "mistral-7b": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 32000,
                   "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                   "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": None,
                   "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"},
    "qwen2-7b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064,
                 "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                 "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "max_position_embeddings": 32768, "use_sliding_window": False,
                 "sliding_window": 131072, "eos_token_id": 151643, "torch_dtype": "bfloat16"},
}


def preset_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """The config of preset `name`, optionally cut to `num_layers` layers (test and benchmark shapes)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {sorted(PRESETS)}")
    config = ModelConfig.from_dict(PRESETS[name], name_or_path=name)
    return config.with_layers(num_layers) if num_layers is not None else config
