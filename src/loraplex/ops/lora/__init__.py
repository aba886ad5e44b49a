"""Batched multi-LoRA (SGMV): the LoraBatch, the public ops, the Triton kernels and the PyTorch reference."""
