"""LoRA adapters: read PEFT folders and packed files, validate them, keep the hot ones in a GPU slot pool."""
from .cache import AdapterCache, AdapterState
from .packed import PackedFile, convert
from .peft_format import inspect_peft_adapter, read_peft_adapter
from .pool import AdapterPool, LoraStack
from .spec import AdapterError, AdapterSpec, LoraAdapter, LoraModule, ModuleSpec

__all__ = ["AdapterCache", "AdapterError", "AdapterPool", "AdapterSpec", "AdapterState", "LoraAdapter",
           "LoraModule", "LoraStack", "ModuleSpec", "PackedFile", "convert", "inspect_peft_adapter",
           "read_peft_adapter"]
