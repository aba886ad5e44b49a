"""float8 e4m3 inside Triton kernels. `e4m3_to_bf16`: e4m3 → bf16 by integer operations, for the FP8 weights' decode
GEMM when weight-only (ops/gemm/fp8_kernels.py) and prompt attention over an e4m3 KV cache (ops/attention/kernels.py).
`to_e4m3`: fp32 to e4m3 as torch rounds (clamped to ±448), for the KV cache's store (ops/attention/store_kernel.py)
and the activations' per-row quantization (ops/gemm/quantize_kernel.py, the RMSNorms' e4m3 output): the hardware's
conversion where compiled, `round_to_e4m3` (fp32 rounded to e4m3's values by integer operations) in the interpreter.
`f16_range_scales`: the powers of two that bring a row into fp16's range, for decode attention's fp16 dots
(ops/attention/kernels.py's F16_DOTS), and `e4m3_to_f16_in_place`: e4m3 → fp16 where a tile is, for its V tiles.

Triton's own conversion to bf16 goes through fp16 and converts each value again (sm_90 PTX: `cvt.rn.f16x2.e4m3x2`
then `cvt.bf16.f16` per value, at a fraction of the integer rate); at the FP8 GEMM's tuned tiles it bound a
Llama-2-7B layer's four projections at 32 rows to 162 µs against 110 µs with this one (H100).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import envs
from .gemm.fp8 import E4M3_MAX


# e4m3 → bf16, exact for every finite byte (e4m3fn's NaN bytes, which quantizing never writes, give ±480): each
# byte b placed in the high byte of a 16-bit half (prmt), its magnitude shifted under bf16's exponent field and its
# sign kept, which is a bf16 of b's value times 2^-120 (the exponent biases are 7 and 127; subnormal bytes land on
# bf16 subnormals of the same scale), then one bf16x2 multiply by 2^120 (0x7B80; -0 added keeps the sign of zeros).
_E4M3_TO_BF16 = tl.constexpr("""{
.reg .b32 h, m, c, z;
mov.b32 c, 0x7B807B80;
mov.b32 z, 0x80008000;
prmt.b32 h, $2, 0, 0x1404;
shr.b32 m, h, 4;
and.b32 m, m, 0x07F007F0;
and.b32 h, h, 0x80008000;
or.b32 h, h, m;
fma.rn.bf16x2 $0, h, c, z;
prmt.b32 h, $2, 0, 0x3424;
shr.b32 m, h, 4;
and.b32 m, m, 0x07F007F0;
and.b32 h, h, 0x80008000;
or.b32 h, h, m;
fma.rn.bf16x2 $1, h, c, z;
}""")


@triton.jit
def e4m3_to_bf16(q, IN_PLACE: tl.constexpr = False):
    """q (float8 e4m3, finite) as bf16, exactly (see _E4M3_TO_BF16); compiled PTX only (not Triton's interpreter).
    IN_PLACE: converted in q's own layout, as `e4m3_to_f16_in_place` (for a tile read by a dot along its rows)."""
    return tl.inline_asm_elementwise(_E4M3_TO_BF16, "=r,=r,r", [q.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                                     is_pure=not IN_PLACE, pack=4)


_INTERPRETED: tl.constexpr = tl.constexpr(envs.triton_interpret())
# Four e4m3 bytes to fp16 by the paired conversion (exact), declared impure: Triton then converts the tile in the
# layout it was loaded in, rather than moving the conversion into the layout of the dot that reads the result.
_E4M3X4_TO_F16 = tl.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")


@triton.jit
def e4m3_to_f16_in_place(q):
    """q (float8 e4m3) as fp16, exactly, converted in q's own layout. For a tile read by a dot along its rows (decode
    attention's V: the keys are the dot's reduction): Triton would otherwise convert it in the dot's operand layout,
    and an 8-bit operand whose reduction runs across rows loads from shared memory a byte at a time (128 single-byte
    loads a thread a key step at the decode tiles, plus their packing); converted first, the fp16 tile goes through
    shared memory with 16-byte stores and `ldmatrix` (sm_90 PTX, Triton 3.6, decode at head size 128, 64 keys and
    2 warps: 813 against 1,311 instructions a thread a key step). The interpreter casts."""
    if _INTERPRETED:
        return q.to(tl.float16)
    return tl.inline_asm_elementwise(_E4M3X4_TO_F16, "=r,=r,r", [q.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                                     is_pure=False, pack=4)


_E4M3_MAX: tl.constexpr = tl.constexpr(E4M3_MAX)   # (a jitted function reads only constexpr globals)


@triton.jit
def f16_range_scales(amax):
    """(2^-e, 2^e), fp32, e = clamp(floor(log2(amax)) - 14, -100, 113) (0 for amax 0): values scaled by 2^-e have
    their largest in [2^14, 2^15), so bf16 values convert to fp16 exactly down to 2^-31 of it. For the fp16 routes
    (decode attention's F16_DOTS), where e4m3 converts to fp16 by one paired instruction."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) - 127 - 14   # (a subnormal amax reads as -141: clamped)
    e = tl.where(amax > 0, tl.minimum(tl.maximum(e, -100), 113), 0)
    return ((127 - e) << 23).to(tl.float32, bitcast=True), ((127 + e) << 23).to(tl.float32, bitcast=True)


# Two fp32 values to e4m3, rounded to nearest (ties to even) and saturated (beyond ±448, infinities included, to
# ±448; NaN stays NaN): the first value in the low byte. Triton's own cast takes this instruction on sm_90 but goes
# through fp16 rounded toward zero on sm_89.
_F32_TO_E4M3X2 = tl.constexpr("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;")


@triton.jit
def to_e4m3(x):
    """fp32 x rounded to the nearest e4m3 value (ties to even), as float8 e4m3, values beyond ±448 to ±448 (NaN stays
    NaN): torch's rounding of x clamped. Compiled, by the hardware's paired conversion (sm_89 on); in Triton's
    interpreter by `round_to_e4m3` first, whose values the cast then keeps (the interpreter's own cast rounds wrongly
    where the mantissa carries into the exponent)."""
    if _INTERPRETED:
        return round_to_e4m3(x).to(tl.float8e4nv)
    q = tl.inline_asm_elementwise(_F32_TO_E4M3X2, "=h,r,r", [x.to(tl.float32)], dtype=tl.uint8, is_pure=True, pack=2)
    return q.to(tl.float8e4nv, bitcast=True)


@triton.jit
def round_to_e4m3(x):
    """fp32 x clamped to ±448 and rounded to the nearest e4m3 value (ties to even), still in fp32.

    The cast to e4m3 that follows is then exact. Rounding here rather than in the cast keeps the
    hardware's rounding out of the result, and Triton's interpreter (the CPU tests) rounds that cast
    wrongly where the mantissa carries into the exponent (7.9 → 4)."""
    a = tl.where(tl.abs(x) > _E4M3_MAX, _E4M3_MAX, tl.abs(x))   # (a NaN stays NaN)
    # Normal e4m3 values (≥ 2^-6) keep 3 of fp32's 23 mantissa bits: round the bit pattern to nearest even
    # (a carry moves into the exponent, as it should).
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # Subnormal ones are multiples of 2^-9: next to 2^14, whose fp32 ulp is 2^-9, the addition rounds to one.
    tiny = (a + 16384.0) - 16384.0
    r = tl.where(a < 0.015625, tiny, normal)
    # x's sign bit onto |r| (a comparison would lose -0.0's, which the cast keeps)
    sign = x.to(tl.int32, bitcast=True) & -0x80000000
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
