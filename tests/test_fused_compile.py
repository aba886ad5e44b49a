"""The fused-op Triton kernels compile for Hopper (sm_90) and Ampere (sm_80) on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which takes the `COMPILED=False` branches
(numpy stand-ins for libdevice) and accepts code the compiler rejects; so every kernel variant is
also compiled here with `COMPILED=True`, in a subprocess without TRITON_INTERPRET (this session's
kernels may be the interpreter's). The PTX is checked for the numerics the kernels promise: no
approximate sine/cosine or division, and products that feed an addition kept out of FMAs. The
LoraProduct consumers (ops/fused/lora_kernels.py and rms_split.py, "*_lora") are compiled and checked the same way.

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

pytestmark = pytest.mark.compile

ARCHS = (90, 80)
DTYPES = ("fp16", "bf16", "fp32")


def rounds_by_conversion(ptx: str) -> bool:
    """e4m3 rounded by ops/e4m3.py's to_e4m3, the hardware's paired conversion (which Triton's own cast takes on
    sm_90 only), and not by round_to_e4m3's integer operations (their 16384.0: the interpreter's rounding). Also
    test_attention_compile.py's check of the KV store."""
    return "cvt.rn.satfinite.e4m3x2.f32" in ptx and "0f46800000" not in ptx


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
    # Pointers as a real launch specializes them (torch's allocations are 16-byte aligned): Triton 3.6 has failed
    # to compile a kernel only with these.
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
    # (residual, LoRA delta, weight dtype, BLOCK, ONE_PASS, QUANTIZE): one pass at Llama widths and a small tile,
    # the tiled loop; with and without a delta (ops/lora/overlap.py: a LoraDelta, taken only by rows with a slot);
    # one-pass rows also quantized to e4m3 (for a W8A8 GEMM after the norm).
    variants = ((True, False, dtype, 8192, True, True), (False, False, dtype, 128, True, False),
                (True, True, dtype, 8192, True, True), (False, True, dtype, 128, True, False),
                (True, False, "fp32", 4096, False, False), (True, True, "fp32", 4096, False, False))
    for has_res, has_delta, w_dtype, block, one_pass, quantize in variants:
        quantize = quantize and arch >= 89   # (e4m3 needs sm_89: FP8 weights' GPUs)
        types = dict(x_ptr="*" + dtype, d_ptr="*fp32" if has_delta else "*" + dtype, r_ptr="*" + dtype,
                     w_ptr="*" + w_dtype, out_ptr="*" + dtype, s_ptr="*" + dtype,
                     rows_ptr="*i32" if has_delta else "*" + dtype, q_ptr="*fp8e4nv" if quantize else "*" + dtype,
                     qs_ptr="*fp32" if quantize else "*" + dtype)
        ptx = _compile(fk._rms_norm_kernel, types, dict(HAS_DELTA=has_delta, HAS_ROWS=has_delta, HAS_RESIDUAL=has_res,
                                                        WRITE_S=has_res or has_delta, BLOCK=block,
                                                        ONE_PASS=one_pass, QUANTIZE=quantize, COMPILED=True),
                       arch, max(1, min(16, block // 512)))
        what = f"rms_norm {dtype} weight {w_dtype} residual={has_res} delta={has_delta} BLOCK={block}"
        _no_approx(ptx, what)
        assert not quantize or "div.rn.f32" in ptx, f"{what}: the e4m3 quantization's divisions must be IEEE"
        assert not quantize or rounds_by_conversion(ptx), f"{what}: e4m3 not rounded by the paired conversion"
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
    for pos, block_h, block_d, has_delta, split in (("i64", 16, 64, False, False), ("i32", 1, 32, False, False),
                                                   ("i64", 16, 64, True, False), ("i64", 16, 64, False, True),
                                                   ("i64", 16, 64, True, True)):
        ptx = _compile(fk._rope_kernel, dict(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype,
                                             d_ptr="*fp32" if has_delta else "*" + dtype, pos_ptr="*" + pos,
                                             inv_freq_ptr="*fp32", rows_ptr="*i32" if has_delta else "*" + pos),
                       dict(HAS_DELTA=has_delta, HAS_ROWS=has_delta, SPLIT_HEADS=split, BLOCK_H=block_h,
                            BLOCK_D=block_d, COMPILED=True),
                       arch,
                       max(1, min(4, block_h * block_d // 256)))
        what = f"rope {dtype} positions {pos} BLOCK_H={block_h} BLOCK_D={block_d} delta={has_delta} split={split}"
        _no_approx(ptx, what)
        # Every product that feeds the rotation's sums is rounded on its own (4 per element pair).
        assert len(re.findall(r"mul\.rn(?:\.ftz)?\.f32", ptx)) >= 4, f"{what}: products must be mul.rn"


# The consumers of a LoraProduct (ops/fused/lora_kernels.py, rms_split.py, rope_lora.py), with the constexprs their
# launchers pick: SPLIT_K the shrink's K splits (1 up to sgmv.MAX_SPLIT_K = 8), BLOCK_R = min(pow2(R), 32) (ranks 8,
# 16, and 64: two rank tiles, ONE_R_TILE off), the widths' blocks (lora_kernels.RMS_SPLIT and SILU_BLOCK,
# rope_lora.ROPE_HEADS at Llama widths; small ones for narrow models), EARLY (ops/pdl.py's early reads, one rank
# tile) and the launchers' warp counts, EXTRAS (a composed batch's product: members after a row's first). Few
# variants: each compile costs
# seconds, and CI compiles them from an empty cache.


LORA_POINTERS = dict(part_ptr="*fp32", row_slot_ptr="*i32", extra_ptr="*i32")   # partials, row slots, members


def rms_norm_lora_split(dtype: str, arch: int) -> None:
    from loraplex.ops.fused import rms_split as k
    types = dict(x_ptr="*" + dtype, r_ptr="*" + dtype, s_ptr="*" + dtype, sumsq_ptr="*fp32", b_ptr="*" + dtype,
                 rank_ptr="*i32", scale_ptr="*fp32", **LORA_POINTERS)
    # (residual, SPLIT_K, BLOCK_R, ONE_R_TILE, BLOCK, EARLY, EXTRAS)
    for has_res, split_k, block_r, one_r, block, early, extras in ((True, 8, 16, True, 512, False, False),
                                                                   (True, 8, 16, True, 512, True, True),
                                                                   (False, 2, 32, False, 64, False, True)):
        ptx = _compile(k._rms_lora_sums_kernel, types, dict(HAS_RESIDUAL=has_res, ONE_R_TILE=one_r, SPLIT_K=split_k,
                                                            BLOCK_R=block_r, BLOCK=block, COMPILED=True, EARLY=early,
                                                            EXTRAS=extras, MEMBER_R=16),
                       arch, max(1, min(4, block // 128)))
        _no_approx(ptx, f"rms_norm_lora_split sums {dtype} SPLIT_K={split_k} BLOCK_R={block_r} EARLY={early} "
                        f"EXTRAS={extras}")
    for block, quantize in ((512, False), (4096, arch >= 89)):   # a chunk; a whole row, quantized to e4m3 too
        ptx = _compile(k._rms_scale_kernel, dict(s_ptr="*" + dtype, w_ptr="*" + dtype, out_ptr="*" + dtype,
                                                 sumsq_ptr="*fp32", q_ptr="*fp8e4nv" if quantize else "*" + dtype,
                                                 qs_ptr="*fp32" if quantize else "*" + dtype),
                       dict(BLOCK_C=8, BLOCK=block, QUANTIZE=quantize, COMPILED=True), arch,
                       max(1, min(16, block // 512)) if quantize else 4)
        _no_approx(ptx, f"rms_norm_lora_split scale {dtype} BLOCK={block}")
        assert re.search(r"mul\.rn(\.ftz)?\.f32", ptx), "sum·(1/H) must be a separate product before + eps"
        assert not quantize or "div.rn.f32" in ptx, "the e4m3 quantization's divisions must be IEEE"
        assert not quantize or rounds_by_conversion(ptx), "e4m3 not rounded by the paired conversion"


def silu_lora(dtype: str, arch: int) -> None:
    from loraplex.ops.fused import lora_kernels as k
    # (SPLIT_K, BLOCK_R, ONE_R_TILE, BLOCK, EARLY, EXTRAS)
    for split_k, block_r, one_r, block, early, extras in ((8, 16, True, k.SILU_BLOCK, False, False),
                                                          (2, 32, False, 64, False, True),
                                                          (8, 16, True, k.SILU_BLOCK, True, True)):
        types = dict(gu_ptr="*" + dtype, out_ptr="*" + dtype, b0="*" + dtype, b1="*" + dtype, rk0="*i32", rk1="*i32",
                     sc0="*fp32", sc1="*fp32", **LORA_POINTERS)
        ptx = _compile(k._silu_and_mul_lora_kernel, types,
                       dict(ONE_R_TILE=one_r, SPLIT_K=split_k, BLOCK_R=block_r, BLOCK=block, COMPILED=True,
                            EARLY=early, EXTRAS=extras, MEMBER_R=16), arch, max(1, min(4, block // 128)))
        what = (f"silu_and_mul_lora {dtype} SPLIT_K={split_k} BLOCK_R={block_r} BLOCK={block} EARLY={early} "
                f"EXTRAS={extras}")
        _no_approx(ptx, what)
        assert "div.rn.f32" in ptx, f"{what}: the division must be IEEE"


def rope_lora(dtype: str, arch: int) -> None:
    from loraplex.ops.fused import rope_lora as k
    # (positions, SPLIT_K, BLOCK_R, ONE_R_TILE, BLOCK_H, BLOCK_D, EARLY): D=128 heads ROPE_HEADS at a time; D=64
    # one head per program, two rank tiles; one head per program with the early reads.
    for pos, split_k, block_r, one_r, block_h, block_d, early, extras in (
            ("i64", 8, 16, True, k.ROPE_HEADS, 64, False, False), ("i32", 2, 32, False, 1, 32, False, True),
            ("i64", 8, 16, True, k.ROPE_HEADS, 64, True, True), ("i64", 1, 16, True, 1, 64, True, False)):
        types = dict(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype, pos_ptr="*" + pos,
                     inv_freq_ptr="*fp32", b0="*" + dtype, b1="*" + dtype, b2="*" + dtype, rk0="*i32", rk1="*i32",
                     rk2="*i32", sc0="*fp32", sc1="*fp32", sc2="*fp32", **LORA_POINTERS)
        ptx = _compile(k._rope_lora_kernel, types,
                       dict(ONE_R_TILE=one_r, SPLIT_K=split_k, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_D=block_d,
                            COMPILED=True, EARLY=early, EXTRAS=extras, MEMBER_R=16), arch,
                       max(1, min(4, block_h * block_d // 128)) * (2 if extras else 1))   # rope_lora.apply_rope's
        what = (f"rope_lora {dtype} positions {pos} SPLIT_K={split_k} BLOCK_R={block_r} BLOCK_H={block_h} "
                f"BLOCK_D={block_d} EARLY={early} EXTRAS={extras}")
        _no_approx(ptx, what)
        # As rope: every product that feeds the rotation's sums is rounded on its own.
        assert len(re.findall(r"mul\.rn(?:\.ftz)?\.f32", ptx)) >= 4, f"{what}: products must be mul.rn"


def _vector_b_loads(ptx: str, dtype: str, what: str, rope: bool = False) -> None:
    """A 16-bit B block read 16 bytes at a time (expand_kernels._load_rank_block): no 2-byte global loads are left.
    `rope`: RoPE's kernel, whose B tiles keep the exact mask (expand_kernels._load_rank_block_exact: 2-byte loads)."""
    if dtype == "fp32":
        return
    scalar = len(re.findall(r"ld\.global(?:\.nc)?\.b16", ptx))
    if rope:
        assert scalar > 0, f"{what}: no 2-byte loads, but RoPE's B should keep the exact mask"
        return
    assert scalar == 0 and "ld.global.v4.b32" in ptx, f"{what}: {scalar} 2-byte loads, B should load 16 bytes a time"


def lora_loads(dtype: str, arch: int) -> None:
    """The decode step's LoRA readers at Llama-2-7B's shapes, ints specialized as a launch does (R = 16, widths
    and row strides multiples of 16, unit column strides 1), with and without the early reads: their B blocks
    compile to 16-byte loads (RoPE's keep the exact mask)."""
    from loraplex.ops.fused import lora_kernels as k
    from loraplex.ops.fused import rms_split as ks
    from loraplex.ops.fused import rope_lora as rope
    from loraplex.ops.lora import expand_kernels, sgmv
    div = ("R", "I", "H", "HALF", "n0", "n1", "n2", "n3", "c0", "c1", "c2", "c3", "n_per_prog", "stride_pm",
           "stride_p_split", "stride_p_slice", "stride_gu", "stride_out", "stride_x", "stride_r", "stride_s",
           "stride_ym", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh")
    # (EARLY, EXTRAS, BLOCK_R, ONE_R_TILE): a plain product of a rank-16 pool, and a composed one of a rank-32 pool
    # (two members of rank ≤ 16 a step: ops/lora/b_blocks.py)
    for early, extras, block_r in ((True, False, 16), (False, False, 16), (True, True, 32)):
        tiles = dict(ONE_R_TILE=True, SPLIT_K=1, BLOCK_R=block_r, COMPILED=True, EARLY=early, EXTRAS=extras,
                     MEMBER_R=16)
        what = f"{dtype} sm_{arch} EARLY={early} EXTRAS={extras}"
        ptx = _compile(k._silu_and_mul_lora_kernel, dict(gu_ptr="*" + dtype, out_ptr="*" + dtype, b0="*" + dtype,
                                                         b1="*" + dtype, rk0="*i32", rk1="*i32", sc0="*fp32",
                                                         sc1="*fp32", **LORA_POINTERS),
                       dict(tiles, BLOCK=k.SILU_BLOCK), arch, 4, divisible=div)
        _vector_b_loads(ptx, dtype, f"silu_and_mul_lora {what}")
        ptx = _compile(rope._rope_lora_kernel, dict(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype,
                                                 pos_ptr="*i64", inv_freq_ptr="*fp32", b0="*" + dtype, b1="*" + dtype,
                                                 b2="*" + dtype, rk0="*i32", rk1="*i32", rk2="*i32", sc0="*fp32",
                                                 sc1="*fp32", sc2="*fp32", **LORA_POINTERS),
                       dict(tiles, BLOCK_H=rope.ROPE_HEADS, BLOCK_D=64), arch, 4 if extras else 2, divisible=div)
        _vector_b_loads(ptx, dtype, f"rope_lora {what}", rope=True)
        ptx = _compile(ks._rms_lora_sums_kernel, dict(x_ptr="*" + dtype, r_ptr="*" + dtype, s_ptr="*" + dtype,
                                                      sumsq_ptr="*fp32", b_ptr="*" + dtype, rank_ptr="*i32",
                                                      scale_ptr="*fp32", **LORA_POINTERS),
                       dict(tiles, HAS_RESIDUAL=True, BLOCK=k.RMS_SPLIT), arch, 4, divisible=div)
        _vector_b_loads(ptx, dtype, f"rms_norm_lora_split sums {what}")
    # The row-wise expand (expand_kernels._expand_tile_rows, compiled alone: the tile path beside it in the kernel
    # feeds the tensor cores, still at the exact rank mask) into an fp32 buffer: its only 16-bit loads are B's, a
    # composed batch's pairs of members (ops/lora/b_blocks.py) too.
    for composed in (False, True):
        ptx = _compile(expand_kernels._expand_tile_rows,
                       dict(y_ptr="*fp32", part_ptr="*fp32", b_ptr="*" + dtype, rank_ptr="*i32", scale_ptr="*fp32",
                            sorted_rows_ptr="*i32", extra_slot_ptr="*i32"),
                       dict(SPLIT_K=1, BLOCK_N=sgmv.rows_block_n_for(sgmv.config_for(16), 32 if composed else 16),
                            BLOCK_R=16, ACCUMULATE=False, COMPOSED=composed, MEMBER_R=16, stride_yn=1),
                       arch, 4, 2, divisible=div + ("N", "col0"))
        _vector_b_loads(ptx, dtype, f"row-wise expand {dtype} sm_{arch} COMPOSED={composed}")


def skinny_gemm(dtype: str, arch: int) -> None:
    """ops/gemm/kernels.py at Llama-2-7B's widths (ints specialized as a launch does), unsplit and split
    (the split's partials and counter): 16-bit w through tensor-core MMAs, pipelined with asynchronous copies;
    and the shared memory each config takes within skinny.shared_bytes, the bound fit_config keeps under
    the GPU's."""
    from loraplex.ops.gemm.skinny import SkinnyConfig, shared_bytes
    from loraplex.ops.gemm.kernels import _skinny_gemm_kernel as k
    for split, block_m, block_n, block_k, stages in ((1, 32, 64, 128, 4), (4, 64, 128, 128, 3), (1, 16, 64, 256, 4),
                                                     (1, 32, 128, 64, 2)):
        ptx = _compile(k, dict(x_ptr="*" + dtype, w_ptr="*" + dtype, bias_ptr="*" + dtype, y_ptr="*" + dtype,
                               part_ptr="*fp32", count_ptr="*i32"),
                       dict(HAS_BIAS=split == 1, SPLIT_K=split, EVEN_N=True, EVEN_K=True, IEEE=dtype == "fp32",
                            PREFETCH=_prefetch(dtype, block_n), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k),
                       arch, 4, stages, divisible=("N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_ym"))
        what = f"skinny_gemm {dtype} sm_{arch} split {split} m{block_m} n{block_n} k{block_k} st{stages}"
        _prefetches(ptx, _prefetch(dtype, block_n), what)
        if dtype != "fp32":
            assert ("wgmma" if arch == 90 else "mma.sync") in ptx, f"{what}: no tensor-core MMA"
        assert "cp.async" in ptx, f"{what}: w's loads are not pipelined"
        if split > 1:
            assert "atom.global" in ptx and "ld.global.cg" in ptx, f"{what}: no counter atomic or L2 loads"
        bound = shared_bytes(SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split, stages=stages), block_m,
                             4 if dtype == "fp32" else 2)
        assert 0 < COMPILED_SHARED[0] <= bound, f"{what}: {COMPILED_SHARED[0]} bytes of shared memory, bound {bound}"


def _prefetch(dtype: str, block_n: int) -> int:
    """The GEMMs' PREFETCH in these builds: the launchers' (skinny.PREFETCH_BYTES of a row) for 64-column tiles,
    none for the others, so that both variants compile."""
    from loraplex.ops.gemm.skinny import PREFETCH_BYTES
    return PREFETCH_BYTES // {"fp32": 4, "fp8": 1}.get(dtype, 2) if block_n == 64 else 0


def _prefetches(ptx: str, prefetch: int, what: str) -> None:
    """With PREFETCH, one L2 prefetch a 128-byte line of the program's rows (kernels.py's prefetch_rows): its
    instructions are in the PTX; without, none is."""
    found = ptx.count("prefetch.global.L2")
    assert (found > 0) == (prefetch > 0), f"{what}: {found} L2 prefetches with PREFETCH = {prefetch}"


def fp8_gemm(dtype: str, arch: int) -> None:
    """ops/gemm/fp8_kernels.py at Llama-2-7B's widths, a scale per column and 128×128 blocks, for sm_90 and (in
    sm_80's turn) sm_89, the first GPUs with FP8: e4m3 loads pipelined with asynchronous copies, 16-bit products
    on tensor-core MMAs, within the shared memory skinny.shared_bytes bounds (for 1-byte weights beside 16-bit x; fp32
    x's dot stages them as fp32). The default tiles of
    o's and down's shapes (64 × 512 in 4 stages, which fit_config cuts to 3 at 32 rows) among them. For bf16, W8A8
    (X_E4M3): e4m3 x, q unconverted into e4m3 MMAs (wgmma on sm_90), a scale per column and 128×128 blocks."""
    from loraplex.ops.gemm.fp8_kernels import _fp8_skinny_kernel as k
    from loraplex.ops.gemm.skinny import SkinnyConfig, shared_bytes
    arch = 89 if arch == 80 else arch
    for per_step, block_m, block_n, block_k, stages, split in ((False, 32, 64, 256, 4, 1), (True, 32, 128, 128, 4, 1),
                                                               (True, 16, 64, 128, 3, 1), (False, 32, 64, 512, 3, 1),
                                                               (False, 32, 128, 256, 4, 4), (True, 32, 128, 128, 3, 2)):
        ptx = _compile(k, dict(x_ptr="*" + dtype, q_ptr="*fp8e4nv", s_ptr="*fp32", bias_ptr="*" + dtype,
                               y_ptr="*" + dtype, part_ptr="*fp32", count_ptr="*i32", r_ptr="*fp32"),
                       dict(HAS_BIAS=not per_step, PER_STEP_SCALE=per_step, EVEN_N=True, EVEN_K=True,
                            IEEE=dtype == "fp32", FAST_BF16=dtype == "bf16", X_E4M3=False,
                            PREFETCH=_prefetch("fp8", block_n), SPLIT_K=split, SWAP_AB=False,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k), arch, 4, stages,
                       divisible=("N", "K", "k_per_split", "stride_xm", "stride_qn", "stride_ym", "scale_bk"))
        what = (f"fp8_gemm {dtype} sm_{arch} per_step {per_step} m{block_m} n{block_n} k{block_k} st{stages} "
                f"split {split}")
        _prefetches(ptx, _prefetch("fp8", block_n), what)
        if split > 1:
            assert "atom.global" in ptx and "ld.global.cg" in ptx, f"{what}: no counter atomic or L2 loads"
        if dtype != "fp32":
            assert ("wgmma" if arch == 90 else "mma.sync") in ptx, f"{what}: no tensor-core MMA"
        assert "cp.async" in ptx, f"{what}: q's loads are not pipelined"
        if dtype == "bf16":   # q's bytes to bf16 by integer operations, none converted twice through fp16
            assert "fma.rn.bf16x2" in ptx and "cvt.bf16.f16" not in ptx, f"{what}: not fp8_kernels.py's conversion"
        bound = shared_bytes(SkinnyConfig(block_n=block_n, block_k=block_k, stages=stages), block_m,
                             4 if dtype == "fp32" else 2, w_bytes=None if dtype == "fp32" else 1)
        assert 0 < COMPILED_SHARED[0] <= bound, f"{what}: {COMPILED_SHARED[0]} bytes of shared memory, bound {bound}"
    if dtype == "bf16":   # W8A8 (X_E4M3): x quantized to e4m3 a row, q straight into the FP8 tensor cores; swap_ab:
        # x's rows (a 64-row tile) on the MMA's long side, w's 32 or 16 on the short one, still e4m3 wgmma on sm_90
        for per_step, block_k, split, swap, block_n in ((False, 256, 1, False, 64), (False, 256, 4, False, 64),
                                                        (True, 128, 1, False, 64), (False, 256, 1, True, 32),
                                                        (True, 128, 2, True, 16)):
            block_m = 64 if swap else 32
            ptx = _compile(k, dict(x_ptr="*fp8e4nv", q_ptr="*fp8e4nv", s_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16",
                                   part_ptr="*fp32", count_ptr="*i32", r_ptr="*fp32"),
                           dict(HAS_BIAS=True, PER_STEP_SCALE=per_step, EVEN_N=True, EVEN_K=True, IEEE=False,
                                FAST_BF16=False, X_E4M3=True, PREFETCH=_prefetch("fp8", block_n), SPLIT_K=split,
                                SWAP_AB=swap, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k), arch, 4, 4,
                           divisible=("N", "K", "k_per_split", "stride_xm", "stride_qn", "stride_ym", "scale_bk"))
            what = f"fp8_gemm W8A8 sm_{arch} per_step {per_step} split {split} swap_ab {swap} n{block_n}"
            _prefetches(ptx, _prefetch("fp8", block_n), what)
            assert "fma.rn.bf16x2" not in ptx and "cvt.rn.f16x2.e4m3x2" not in ptx, f"{what}: q converted"
            assert ".e4m3.e4m3" in ptx and "cp.async" in ptx, f"{what}: no e4m3 MMAs or unpipelined loads"
            mma = f"wgmma.mma_async.sync.aligned.m64n{block_m if not swap else block_n}k32.f32.e4m3.e4m3"
            assert arch != 90 or mma in ptx, f"{what}: no {mma}"
            bound = shared_bytes(SkinnyConfig(block_n=block_n, block_k=block_k, stages=4), block_m, 1)
            assert 0 < COMPILED_SHARED[0] <= bound, f"{what}: {COMPILED_SHARED[0]} bytes of shared memory, bound {bound}"
    # the prompt GEMM's activations quantized a row a program (quantize_kernel.py): IEEE divisions, as torch's
    from loraplex.ops.gemm.quantize_kernel import _quantize_rows_kernel
    for block in (4096, 16384):
        ptx = _compile(_quantize_rows_kernel, dict(x_ptr="*" + dtype, q_ptr="*fp8e4nv", s_ptr="*fp32"),
                       dict(BLOCK=block), arch, min(32, max(4, block // 512)), divisible=("K", "stride_x", "stride_q"))
        _no_approx(ptx, f"quantize_rows {dtype} sm_{arch} BLOCK={block}")
        assert "div.rn.f32" in ptx, f"quantize_rows {dtype} sm_{arch}: the divisions must be IEEE"
        # rounded by the hardware's conversion (ops/e4m3.py's to_e4m3), not round_to_e4m3's integer operations
        assert rounds_by_conversion(ptx), f"quantize_rows {dtype} sm_{arch}: not the paired conversion"


KERNELS = {"rms_norm": rms_norm, "silu_and_mul": silu, "rope": rope, "rms_norm_lora_split": rms_norm_lora_split,
           "silu_and_mul_lora": silu_lora, "rope_lora": rope_lora, "lora_loads": lora_loads,
           "skinny_gemm": skinny_gemm, "fp8_gemm": fp8_gemm}
# (arch, dtype) per kernel: every pair, but for the LoRA consumers (the slowest compiles: about ten seconds a
# variant), whose arch and dtype only change their loads and stores: each arch and dtype once, bf16 on Hopper
LORA_TARGETS = ((90, "bf16"), (90, "fp32"), (80, "fp16"))
TARGETS = {name: LORA_TARGETS if name in ("rms_norm_lora_split", "silu_and_mul_lora", "rope_lora")
           else ((90, "bf16"), (80, "fp16")) if name == "lora_loads"
           else tuple((arch, dtype) for arch in ARCHS for dtype in DTYPES) for name in KERNELS}


def _compile_in_subprocess(kernel: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="0")
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


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_fused_kernel_compiles(compile_jobs, kernel):
    """Each kernel's variants compile, and their PTX keeps the numerics (and loads) they promise."""
    proc = compile_jobs[kernel].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == len(TARGETS[kernel]), proc.stdout


if __name__ == "__main__":
    name = sys.argv[1]
    for arch, dt in TARGETS[name]:
        KERNELS[name](dt, arch)
        print("compiled", name, dt, f"sm_{arch}")
