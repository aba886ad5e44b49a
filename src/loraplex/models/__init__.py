"""Llama-family models: configuration, loading, the paged KV cache and the flat-batch forward."""
from .config import PROJECTIONS, SUPPORTED_MODEL_TYPES, ModelConfig, module_path
from .forward_batch import ForwardBatch, SequenceChunk
from .kv_cache import KVCache
from .presets import PRESETS, preset_config
from .rope import RopeConfig

__all__ = ["ForwardBatch", "KVCache", "ModelConfig", "PRESETS", "PROJECTIONS", "RopeConfig", "SUPPORTED_MODEL_TYPES",
           "SequenceChunk", "module_path", "preset_config", "load_model", "dummy_model", "LlamaForCausalLM",
           "MistralForCausalLM", "Qwen2ForCausalLM", "ARCHITECTURES", "model_class"]


def __getattr__(name: str):
    # The model classes import the ops (Triton); adapters only need the config, so load them lazily.
    if name in ("load_model", "dummy_model"):
        from . import loader
        return getattr(loader, name)
    if name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "ARCHITECTURES", "model_class"):
        from . import registry
        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
