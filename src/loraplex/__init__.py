"""loraplex: serve many LoRA fine-tunes of one base model from one GPU.

    from loraplex import LLM, SamplingParams
"""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineConfig"]


def __getattr__(name: str):
    # Lazy: `import loraplex` stays cheap (no torch import) for the CLI and tools.
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "SamplingParams":
        from .sampling import SamplingParams
        return SamplingParams
    if name == "EngineConfig":
        from .config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'loraplex' has no attribute {name!r}")
