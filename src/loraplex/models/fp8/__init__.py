"""FP8 base weights (float8 e4m3 with fp32 scales) under bf16 LoRA: formats, loading, the weight the GEMMs read."""
from .formats import Fp8Scheme, fp8_scheme
from .gemm import BaseWeight, base_linear, gemm_operand
from .weight import E4M3_MAX, FP8, Fp8Weight, dequantize, quantize_rows

__all__ = ["BaseWeight", "E4M3_MAX", "FP8", "Fp8Scheme", "Fp8Weight", "base_linear", "dequantize", "fp8_scheme",
           "gemm_operand", "quantize_rows"]
