"""Llama-family models: their configuration (and, later, the forward pass)."""
from .config import PROJECTIONS, SUPPORTED_MODEL_TYPES, ModelConfig, module_path

__all__ = ["ModelConfig", "PROJECTIONS", "SUPPORTED_MODEL_TYPES", "module_path"]
