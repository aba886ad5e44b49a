"""The fused-op Triton kernels compile for Hopper (sm_90) and Ampere (sm_80) on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which takes the `COMPILED=False` branches
(numpy stand-ins for libdevice) and accepts code the compiler rejects; so every kernel variant is
also compiled here with `COMPILED=True`, in a subprocess without TRITON_INTERPRET (this session's
kernels may be the interpreter's). The PTX is checked for the numerics the kernels promise: no
approximate sine/cosine or division, and products that feed an addition kept out of FMAs. The
LoraProduct consumers (ops/fused_lora_kernels.py, "*_lora") are compiled and checked the same way.

    TRITON_INTERPRET=0 python tests/test_fused_compile.py rope
    TRITON_INTERPRET=0 python tests/test_fused_compile.py rope_lora
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ARCHS = (90, 80)
DTYPES = ("fp16", "bf16", "fp32")


def _compile(kernel, pointer_types: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int = 1,
             divisible: tuple[str, ...] = ()) -> str:
    """Compile `kernel` for sm_`arch` (float scalars fp32, other scalars i32); returns its PTX. `divisible`: int
    arguments specialized as multiples of 16, as a launch does for such values. The compiled kernel's shared
    memory bytes are left in COMPILED_SHARED."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    unknown = set(pointer_types) - set(kernel.arg_names)
    assert not unknown, f"{kernel.fn.__name__} has no arguments {sorted(unknown)}"   # else they would compile as i32
    missing = {kernel.arg_names[i] for i in kernel.constexprs} - set(constexprs)
    assert not missing, f"{kernel.fn.__name__}: constexprs {sorted(missing)} not given (they would compile as i32)"
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
        else:
            signature[name] = "fp32" if name in ("inv_h", "eps") else "i32"
    # Pointers as a real launch specializes them (torch's allocations are 16-byte aligned): Triton 3.6 failed
    # on a kernel only with these (rms_shrink_kernels._slice_partial, before its broadcast left the loop).
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name in pointer_types or name in divisible}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    COMPILED_SHARED[0] = compiled.metadata.shared
    return compiled.asm["ptx"]


COMPILED_SHARED = [0]


def _no_approx(ptx: str, what: str) -> None:
    for op in ("sin.approx", "cos.approx", "div.approx", "div.full"):
        if op in ptx:
            raise AssertionError(f"{what}: PTX uses {op}")


def rms_norm(dtype: str, arch: int) -> None:
    from loraplex.ops.fused import kernels as fk
    # (residual, LoRA delta, weight dtype, BLOCK, ONE_PASS): one pass at Llama widths and a small tile,
    # the tiled loop; with and without a delta (ops/overlap.py: a LoraDelta, taken only by rows with a slot).
    variants = ((True, False, dtype, 8192, True), (False, False, dtype, 128, True), (True, True, dtype, 8192, True),
                (False, True, dtype, 128, True), (True, False, "fp32", 4096, False), (True, True, "fp32", 4096, False))
    for has_res, has_delta, w_dtype, block, one_pass in variants:
        types = dict(x_ptr="*" + dtype, d_ptr="*fp32" if has_delta else "*" + dtype, r_ptr="*" + dtype,
                     w_ptr="*" + w_dtype, out_ptr="*" + dtype, s_ptr="*" + dtype,
                     rows_ptr="*i32" if has_delta else "*" + dtype)
        ptx = _compile(fk._rms_norm_kernel, types, dict(HAS_DELTA=has_delta, HAS_ROWS=has_delta, HAS_RESIDUAL=has_res,
                                                        WRITE_S=has_res or has_delta, BLOCK=block,
                                                        ONE_PASS=one_pass, COMPILED=True),
                       arch, max(1, min(16, block // 512)))
        what = f"rms_norm {dtype} weight {w_dtype} residual={has_res} delta={has_delta} BLOCK={block}"
        _no_approx(ptx, what)
        assert re.search(r"mul\.rn(\.ftz)?\.f32", ptx), f"{what}: sum·(1/H) must be a separate product before + eps"


def silu(dtype: str, arch: int) -> None:
    from loraplex.ops.fused import kernels as fk
    for block, has_delta in ((128, False), (1024, False), (1024, True)):
        types = dict(gu_ptr="*" + dtype, d_ptr="*fp32" if has_delta else "*" + dtype, out_ptr="*" + dtype,
                     rows_ptr="*i32" if has_delta else "*" + dtype)
        ptx = _compile(fk._silu_and_mul_kernel, types,
                       dict(HAS_DELTA=has_delta, HAS_ROWS=has_delta, BLOCK=block, COMPILED=True), arch,
                       max(1, min(4, block // 256)))
        _no_approx(ptx, f"silu {dtype}")
        assert "div.rn.f32" in ptx, f"silu {dtype}: the division must be IEEE"


def rope(dtype: str, arch: int) -> None:
    from loraplex.ops.fused import kernels as fk
    for pos, block_h, block_d, has_delta in (("i64", 16, 64, False), ("i32", 1, 32, False), ("i64", 16, 64, True)):
        ptx = _compile(fk._rope_kernel, dict(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype,
                                             d_ptr="*fp32" if has_delta else "*" + dtype, pos_ptr="*" + pos,
                                             inv_freq_ptr="*fp32", rows_ptr="*i32" if has_delta else "*" + pos),
                       dict(HAS_DELTA=has_delta, HAS_ROWS=has_delta, BLOCK_H=block_h, BLOCK_D=block_d, COMPILED=True),
                       arch,
                       max(1, min(4, block_h * block_d // 256)))
        what = f"rope {dtype} positions {pos} BLOCK_H={block_h} BLOCK_D={block_d} delta={has_delta}"
        _no_approx(ptx, what)
        # Every product that feeds the rotation's sums is rounded on its own (4 per element pair).
        assert len(re.findall(r"mul\.rn(?:\.ftz)?\.f32", ptx)) >= 4, f"{what}: products must be mul.rn"


# The consumers of a LoraProduct (ops/fused_lora_kernels.py), with the constexprs their launchers pick:
# SPLIT_K the shrink's K splits (1 up to sgmv.MAX_SPLIT_K = 8), BLOCK_R = min(pow2(R), 32) (ranks 8, 16,
# and 64: two rank tiles, ONE_R_TILE off), the widths' blocks (fused_lora_kernels.RMS_BLOCK, SILU_BLOCK,
# ROPE_HEADS at Llama widths; small ones for narrow models) and the launchers' warp counts and stages.
# Few variants: each compile costs seconds, and CI compiles them from an empty cache.


LORA_POINTERS = dict(part_ptr="*fp32", row_slot_ptr="*i32")   # the shrink's partials, each row's slot


def rms_norm_lora(dtype: str, arch: int) -> None:
    from loraplex.ops.fused import lora_kernels as k
    # (residual, SPLIT_K, BLOCK_R, ONE_R_TILE, BLOCK, weight dtype)
    variants = ((True, 8, 16, True, k.RMS_BLOCK, dtype), (False, 1, 32, False, 64, dtype),
                (True, 2, 8, True, 128, "fp32"))
    for has_res, split_k, block_r, one_r, block, w_dtype in variants:
        types = dict(x_ptr="*" + dtype, r_ptr="*" + dtype, w_ptr="*" + w_dtype, out_ptr="*" + dtype,
                     s_ptr="*" + dtype, b_ptr="*" + dtype, rank_ptr="*i32", scale_ptr="*fp32", **LORA_POINTERS)
        ptx = _compile(k._rms_norm_lora_kernel, types,
                       dict(HAS_RESIDUAL=has_res, ONE_R_TILE=one_r, SPLIT_K=split_k, BLOCK_R=block_r, BLOCK=block,
                            COMPILED=True), arch, max(1, min(8, block // 128)), k.RMS_STAGES)
        what = (f"rms_norm_lora {dtype} weight {w_dtype} residual={has_res} SPLIT_K={split_k} BLOCK_R={block_r} "
                f"one rank tile={one_r} BLOCK={block}")
        _no_approx(ptx, what)
        assert re.search(r"mul\.rn(\.ftz)?\.f32", ptx), f"{what}: sum·(1/H) must be a separate product before + eps"


def rms_norm_lora_split(dtype: str, arch: int) -> None:
    from loraplex.ops.fused import rms_split as k
    types = dict(x_ptr="*" + dtype, r_ptr="*" + dtype, s_ptr="*" + dtype, sumsq_ptr="*fp32", b_ptr="*" + dtype,
                 rank_ptr="*i32", scale_ptr="*fp32", **LORA_POINTERS)
    for early in (False, True):   # EARLY: fused_lora_kernels.EARLY_READS (ops/pdl.py's early reads)
        ptx = _compile(k._rms_lora_sums_kernel, types, dict(HAS_RESIDUAL=True, ONE_R_TILE=True, SPLIT_K=8, BLOCK_R=16,
                                                            BLOCK=512, COMPILED=True, EARLY=early), arch, 4)
        _no_approx(ptx, f"rms_norm_lora_split sums {dtype} EARLY={early}")
        # ONE_LAUNCH: both launches in one, the row's last program (by its counter) normalizing it
        ptx = _compile(k._rms_lora_one_launch_kernel, dict(types, w_ptr="*" + dtype, out_ptr="*" + dtype,
                                                           count_ptr="*i32"),
                       dict(HAS_RESIDUAL=True, ONE_R_TILE=True, SPLIT_K=8, BLOCK_R=16, BLOCK=512, BLOCK_C=8,
                            ROW_BLOCK=4096, COMPILED=True, EARLY=early), arch, 4)
        what = f"rms_norm_lora_split one launch {dtype} EARLY={early}"
        _no_approx(ptx, what)
        assert "atom.global" in ptx and "ld.global.cg" in ptx, f"{what}: no counter atomic or L2 loads"
        assert re.search(r"mul\.rn(\.ftz)?\.f32", ptx), f"{what}: sum·(1/H) must be a separate product before + eps"
    ptx = _compile(k._rms_scale_kernel, dict(s_ptr="*" + dtype, w_ptr="*" + dtype, out_ptr="*" + dtype,
                                             sumsq_ptr="*fp32"), dict(BLOCK_C=8, BLOCK=512, COMPILED=True), arch, 4)
    _no_approx(ptx, f"rms_norm_lora_split scale {dtype}")
    assert re.search(r"mul\.rn(\.ftz)?\.f32", ptx), "sum·(1/H) must be a separate product before + eps"


def silu_lora(dtype: str, arch: int) -> None:
    from loraplex.ops.fused import lora_kernels as k
    # (SPLIT_K, BLOCK_R, ONE_R_TILE, BLOCK, LOADS_FIRST, EARLY); EARLY: EARLY_READS (ops/pdl.py's early reads)
    for split_k, block_r, one_r, block, first, early in ((8, 16, True, k.SILU_BLOCK, False, False),
                                                         (2, 32, False, 64, False, False),
                                                         (8, 16, True, k.SILU_BLOCK, True, False),
                                                         (8, 16, True, k.SILU_BLOCK, False, True)):
        types = dict(gu_ptr="*" + dtype, out_ptr="*" + dtype, b0="*" + dtype, b1="*" + dtype, rk0="*i32", rk1="*i32",
                     sc0="*fp32", sc1="*fp32", **LORA_POINTERS)
        ptx = _compile(k._silu_and_mul_lora_kernel, types,
                       dict(ONE_R_TILE=one_r, SPLIT_K=split_k, BLOCK_R=block_r, BLOCK=block, COMPILED=True,
                            LOADS_FIRST=first, EARLY=early), arch, max(1, min(4, block // 128)))
        what = (f"silu_and_mul_lora {dtype} SPLIT_K={split_k} BLOCK_R={block_r} BLOCK={block} LOADS_FIRST={first} "
                f"EARLY={early}")
        _no_approx(ptx, what)
        assert "div.rn.f32" in ptx, f"{what}: the division must be IEEE"


def silu_lora_tiles(dtype: str, arch: int) -> None:
    """SiLU-and-mul expanding gate/up's product over the work tiles (ops/silu_lora_tiles_kernels.py), both tile
    heights, one and two rank tiles, at the precision the launcher picks for the dtype."""
    from loraplex.ops.fused import silu_lora_tiles_kernels as k
    precision = "split" if dtype == "bf16" else "tf32x3"
    for block_m, block_r, one_r, split_k, prefetch in ((64, 16, True, 1, True), (16, 16, True, 4, True),
                                                       (64, 32, False, 2, True), (64, 16, True, 2, False)):
        types = dict(gu_ptr="*" + dtype, out_ptr="*" + dtype, b0="*" + dtype, b1="*" + dtype, rk0="*i32", rk1="*i32",
                     sc0="*fp32", sc1="*fp32", sorted_rows_ptr="*i32", work_slot_ptr="*i32", work_start_ptr="*i32",
                     work_end_ptr="*i32", **LORA_POINTERS)
        ptx = _compile(k._silu_and_mul_lora_tiles_kernel, types,
                       dict(SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=k.BLOCK_N, BLOCK_R=block_r, ONE_R_TILE=one_r,
                            PRECISION=precision, PREFETCH=prefetch, COMPILED=True), arch, k.NUM_WARPS,
                       divisible=("I", "stride_gu", "stride_out", "stride_pm", "stride_p_split", "stride_p_slice"))
        what = f"silu_and_mul_lora_tiles {dtype} sm_{arch} BLOCK_M={block_m} BLOCK_R={block_r} SPLIT_K={split_k}"
        _no_approx(ptx, what)
        assert "div.rn.f32" in ptx, f"{what}: the division must be IEEE"
        if dtype != "fp32":
            assert "mma" in ptx, f"{what}: no tensor-core product"


def rope_lora(dtype: str, arch: int) -> None:
    from loraplex.ops.fused import lora_kernels as k
    # (positions, SPLIT_K, BLOCK_R, ONE_R_TILE, BLOCK_H, BLOCK_D): D=128 heads ROPE_HEADS at a time; D=64
    # one head per program, two rank tiles.
    # IN_GEMM: part is a GEMM's 16-bit shrink columns, offset by the row's active index (lora_product.py)
    # EARLY: EARLY_READS (ops/pdl.py's early reads)
    for pos, split_k, block_r, one_r, block_h, block_d, in_gemm, early in (
            ("i64", 8, 16, True, k.ROPE_HEADS, 64, False, False), ("i32", 2, 32, False, 1, 32, False, False),
            ("i64", 1, 16, True, k.ROPE_HEADS, 64, True, False), ("i64", 8, 16, True, k.ROPE_HEADS, 64, False, True),
            ("i64", 1, 16, True, 1, 64, True, True)):
        types = dict(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype, pos_ptr="*" + pos,
                     inv_freq_ptr="*fp32", b0="*" + dtype, b1="*" + dtype, b2="*" + dtype, rk0="*i32", rk1="*i32",
                     rk2="*i32", sc0="*fp32", sc1="*fp32", sc2="*fp32", slot_active_ptr="*i32", **LORA_POINTERS)
        if in_gemm:
            types["part_ptr"] = "*" + dtype
        ptx = _compile(k._rope_lora_kernel, types,
                       dict(ONE_R_TILE=one_r, SPLIT_K=split_k, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_D=block_d,
                            COMPILED=True, IN_GEMM=in_gemm, EARLY=early), arch,
                       max(1, min(4, block_h * block_d // 128)))
        what = (f"rope_lora {dtype} positions {pos} SPLIT_K={split_k} BLOCK_R={block_r} BLOCK_H={block_h} "
                f"BLOCK_D={block_d} IN_GEMM={in_gemm} EARLY={early}")
        _no_approx(ptx, what)
        # As rope: every product that feeds the rotation's sums is rounded on its own.
        assert len(re.findall(r"mul\.rn(?:\.ftz)?\.f32", ptx)) >= 4, f"{what}: products must be mul.rn"


def silu_shrink(dtype: str, arch: int) -> None:
    """SiLU-and-mul computing down's shrink (ops/silu_shrink_kernels.py), as models/llama.py launches it."""
    from loraplex.ops.fused import silu_shrink_kernels as k
    types = dict(gu_ptr="*" + dtype, d_ptr="*fp32", rows_ptr="*i32", out_ptr="*" + dtype, slot_ptr="*i32",
                 a_ptr="*" + dtype, rank_ptr="*i32", part_ptr="*fp32")
    ptx = _compile(k._silu_and_mul_shrink_kernel, types,
                   dict(HAS_DELTA=True, HAS_ROWS=True, BLOCK=k.BLOCK, BLOCK_R=k.BLOCK_R, COMPILED=True), arch, k.WARPS)
    _no_approx(ptx, f"silu_shrink {dtype}")
    assert "div.rn.f32" in ptx, f"silu_shrink {dtype}: the division must be IEEE"


def rms_shrink(dtype: str, arch: int) -> None:
    """The split RMSNorm's scaling step computing the next projection's shrink (ops/rms_shrink_kernels.py)."""
    from loraplex.ops.fused import rms_shrink_kernels as k
    types = dict(s_ptr="*" + dtype, w_ptr="*" + dtype, out_ptr="*" + dtype, sumsq_ptr="*fp32", slot_ptr="*i32",
                 a0="*" + dtype, a1="*" + dtype, a2="*" + dtype, rk0="*i32", rk1="*i32", rk2="*i32",
                 part_ptr="*fp32")
    for slices, block in ((3, 1024), (2, 512)):
        ptx = _compile(k._rms_scale_shrink_kernel, types,
                       dict(NUM_SLICES=slices, BLOCK_C=8, BLOCK=block, BLOCK_R=k.BLOCK_R, COMPILED=True), arch,
                       k.warps(block))
        what = f"rms_shrink {dtype} slices={slices} BLOCK={block}"
        _no_approx(ptx, what)
        assert re.search(r"mul\.rn(\.ftz)?\.f32", ptx), f"{what}: sum·(1/H) must be a separate product before + eps"


def _vector_b_loads(ptx: str, dtype: str, what: str, rope: bool = False) -> None:
    """A 16-bit B block read 16 bytes at a time (sgmv_kernels._load_rank_block): no 2-byte global loads are left.
    `rope`: RoPE's kernel, whose B tiles keep the exact mask unless LORAPLEX_LORA_VECTOR_LOADS=on."""
    from loraplex.ops.lora import sgmv_kernels
    if dtype == "fp32" or not sgmv_kernels.VECTOR_LOADS:
        return
    scalar = len(re.findall(r"ld\.global(?:\.nc)?\.b16", ptx))
    if rope and sgmv_kernels.VECTOR_LOADS_SETTING == "no-rope":   # the switch took effect: the exact mask's loads
        assert scalar > 0, f"{what}: no 2-byte loads, but RoPE's B should keep the exact mask under no-rope"
        return
    assert scalar == 0 and "ld.global.v4.b32" in ptx, f"{what}: {scalar} 2-byte loads, B should load 16 bytes a time"


def lora_loads(dtype: str, arch: int) -> None:
    """The decode step's LoRA readers at Llama-2-7B's shapes, ints specialized as a launch does (R = 16, widths
    and row strides multiples of 16, unit column strides 1): their B blocks compile to 16-byte loads."""
    from loraplex.ops.fused import lora_kernels as k
    from loraplex.ops.fused import rms_split as ks
    from loraplex.ops.lora import sgmv_kernels
    div = ("R", "I", "H", "HALF", "n0", "n1", "n2", "n3", "c0", "c1", "c2", "c3", "n_per_prog", "stride_pm",
           "stride_p_split", "stride_p_slice", "stride_gu", "stride_out", "stride_x", "stride_r", "stride_s",
           "stride_ym", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh")
    ptx = _compile(k._silu_and_mul_lora_kernel, dict(gu_ptr="*" + dtype, out_ptr="*" + dtype, b0="*" + dtype,
                                                     b1="*" + dtype, rk0="*i32", rk1="*i32", sc0="*fp32",
                                                     sc1="*fp32", **LORA_POINTERS),
                   dict(ONE_R_TILE=True, SPLIT_K=1, BLOCK_R=16, BLOCK=k.SILU_BLOCK, COMPILED=True,
                        LOADS_FIRST=k.SILU_LOADS_FIRST, EARLY=k.EARLY_READS), arch, 4, divisible=div)
    _vector_b_loads(ptx, dtype, f"silu_and_mul_lora {dtype} sm_{arch}")
    ptx = _compile(k._rope_lora_kernel, dict(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype, pos_ptr="*i64",
                                             inv_freq_ptr="*fp32", b0="*" + dtype, b1="*" + dtype, b2="*" + dtype,
                                             rk0="*i32", rk1="*i32", rk2="*i32", sc0="*fp32", sc1="*fp32",
                                             sc2="*fp32", slot_active_ptr="*i32", **LORA_POINTERS),
                   dict(ONE_R_TILE=True, SPLIT_K=1, BLOCK_R=16, BLOCK_H=k.ROPE_HEADS, BLOCK_D=64, COMPILED=True,
                        IN_GEMM=False, EARLY=k.EARLY_READS), arch, 2, divisible=div)
    _vector_b_loads(ptx, dtype, f"rope_lora {dtype} sm_{arch}", rope=True)
    ptx = _compile(ks._rms_lora_sums_kernel, dict(x_ptr="*" + dtype, r_ptr="*" + dtype, s_ptr="*" + dtype,
                                                  sumsq_ptr="*fp32", b_ptr="*" + dtype, rank_ptr="*i32",
                                                  scale_ptr="*fp32", **LORA_POINTERS),
                   dict(HAS_RESIDUAL=True, ONE_R_TILE=True, SPLIT_K=1, BLOCK_R=16, BLOCK=k.RMS_SPLIT, COMPILED=True,
                        EARLY=k.EARLY_READS), arch, 4, divisible=div)
    _vector_b_loads(ptx, dtype, f"rms_norm_lora_split sums {dtype} sm_{arch}")
    # The row-wise expand into an fp32 buffer (a "delta" projection): its only 16-bit loads are B's. ROWWISE=2
    # leaves the tile path (whose B feeds the tensor cores, still at the exact rank mask) out of the binary.
    ptx = _compile(sgmv_kernels._sgmv_expand_kernel, dict(y_ptr="*fp32", part_ptr="*fp32", sorted_rows_ptr="*i32",
                                                  work_slot_ptr="*i32", work_start_ptr="*i32", work_end_ptr="*i32",
                                                  b0="*" + dtype, b1="*" + dtype, b2="*" + dtype, b3="*" + dtype,
                                                  rk0="*i32", rk1="*i32", rk2="*i32", rk3="*i32", sc0="*fp32",
                                                  sc1="*fp32", sc2="*fp32", sc3="*fp32"),
                   dict(NUM_SLICES=2, SPLIT_K=1, BLOCK_M=16, BLOCK_N=256, BLOCK_R=16, ONE_R_TILE=True,
                        PRECISION="split" if dtype == "bf16" else "tf32x3", ACCUMULATE=False, ROWWISE=2,
                        ROWS_BLOCK_N=512, ROWS_PREFETCH=False, TILE_PREFETCH=False, stride_yn=1),
                   arch, 4, 2, divisible=div)
    _vector_b_loads(ptx, dtype, f"row-wise expand {dtype} sm_{arch}")


def skinny_gemm(dtype: str, arch: int) -> None:
    """ops/skinny_gemm_kernels.py at Llama-2-7B's widths (ints specialized as a launch does), unsplit and split
    (the split's partials and counter): 16-bit w through tensor-core MMAs, pipelined with asynchronous copies;
    and the shared memory each config takes within skinny_gemm.shared_bytes, the bound fit_config keeps under
    the GPU's."""
    from loraplex.ops.gemm.skinny import SkinnyConfig, shared_bytes
    from loraplex.ops.gemm.kernels import _skinny_gemm_kernel as k
    for split, block_m, block_n, block_k, stages in ((1, 32, 64, 128, 4), (4, 64, 128, 128, 3), (1, 16, 64, 256, 4),
                                                     (1, 32, 128, 64, 2)):
        ptx = _compile(k, dict(x_ptr="*" + dtype, w_ptr="*" + dtype, bias_ptr="*" + dtype, y_ptr="*" + dtype,
                               part_ptr="*fp32", count_ptr="*i32"),
                       dict(HAS_BIAS=split == 1, SPLIT_K=split, EVEN_N=True, EVEN_K=True, IEEE=dtype == "fp32",
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k), arch, 4, stages,
                       divisible=("N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_ym"))
        what = f"skinny_gemm {dtype} sm_{arch} split {split} m{block_m} n{block_n} k{block_k} st{stages}"
        if dtype != "fp32":
            assert ("wgmma" if arch == 90 else "mma.sync") in ptx, f"{what}: no tensor-core MMA"
        assert "cp.async" in ptx, f"{what}: w's loads are not pipelined"
        if split > 1:
            assert "atom.global" in ptx and "ld.global.cg" in ptx, f"{what}: no counter atomic or L2 loads"
        bound = shared_bytes(SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split, stages=stages), block_m,
                             4 if dtype == "fp32" else 2)
        assert 0 < COMPILED_SHARED[0] <= bound, f"{what}: {COMPILED_SHARED[0]} bytes of shared memory, bound {bound}"


KERNELS = {"rms_norm": rms_norm, "silu_and_mul": silu, "rope": rope, "rms_norm_lora": rms_norm_lora,
           "rms_norm_lora_split": rms_norm_lora_split, "silu_and_mul_lora": silu_lora, "rope_lora": rope_lora,
           "silu_lora_tiles": silu_lora_tiles,
           "silu_shrink": silu_shrink, "rms_shrink": rms_shrink, "lora_loads": lora_loads,
           "skinny_gemm": skinny_gemm}


JOBS = [*KERNELS, "lora_loads:on", "lora_loads:early-off"]


def _compile_in_subprocess(job: str) -> subprocess.CompletedProcess:
    kernel, _, setting = job.partition(":")
    env = dict(os.environ, TRITON_INTERPRET="0")
    if setting == "early-off":
        env["LORAPLEX_LORA_EARLY_READS"] = "off"
    elif setting:
        env["LORAPLEX_LORA_VECTOR_LOADS"] = setting
    return subprocess.run([sys.executable, str(Path(__file__)), kernel], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def compile_jobs(request):
    """Start the selected jobs at once, one subprocess per CPU (compiling is most of this file's time: ~3 minutes
    one after another on 2 CPUs with a cold Triton cache)."""
    wanted = [item.callspec.params["kernel"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec") and "kernel" in item.callspec.params]
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    yield {job: pool.submit(_compile_in_subprocess, job) for job in dict.fromkeys(wanted)}
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("kernel", JOBS)
def test_fused_kernel_compiles(compile_jobs, kernel):
    """Each kernel's variants compile; "lora_loads:on" checks the decode readers' 16-byte B loads with
    LORAPLEX_LORA_VECTOR_LOADS=on, where RoPE's tiles take them too; "lora_loads:early-off" with
    LORAPLEX_LORA_EARLY_READS=off (the readers' code before it)."""
    proc = compile_jobs[kernel].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == len(ARCHS) * len(DTYPES), proc.stdout


if __name__ == "__main__":
    name = sys.argv[1]
    for arch in ARCHS:
        for dt in DTYPES:
            KERNELS[name](dt, arch)
            print("compiled", name, dt, f"sm_{arch}")
