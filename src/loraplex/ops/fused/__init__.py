"""RMSNorm, RoPE and SiLU-and-mul, each able to add (or expand) the LoRA product of the projection before it."""
