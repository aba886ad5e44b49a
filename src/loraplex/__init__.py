"""loraplex: serve many LoRA fine-tunes of one base model from one GPU."""
__version__ = "0.1.0"
