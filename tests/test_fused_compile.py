"""The fused-op Triton kernels compile for Hopper (sm_90) and Ampere (sm_80) on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which takes the `COMPILED=False` branches
(numpy stand-ins for libdevice) and accepts code the compiler rejects; so every kernel variant is
also compiled here with `COMPILED=True`, in a subprocess without TRITON_INTERPRET (this session's
kernels may be the interpreter's). The PTX is checked for the numerics the kernels promise: no
approximate sine/cosine or division, and products that feed an addition kept out of FMAs.

    TRITON_INTERPRET=0 python tests/test_fused_compile.py rope
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ARCHS = (90, 80)
DTYPES = ("fp16", "bf16", "fp32")


def _compile(kernel, pointer_types: dict, constexprs: dict, arch: int, num_warps: int) -> str:
    """Compile `kernel` for sm_`arch` (float scalars fp32, other scalars i32); returns its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
        else:
            signature[name] = "fp32" if name in ("inv_h", "eps") else "i32"
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=1))
    return compiled.asm["ptx"]


def _no_approx(ptx: str, what: str) -> None:
    for op in ("sin.approx", "cos.approx", "div.approx", "div.full"):
        if op in ptx:
            raise AssertionError(f"{what}: PTX uses {op}")


def rms_norm(dtype: str, arch: int) -> None:
    from loraplex.ops import fused_kernels as fk
    # (residual, LoRA delta, weight dtype, BLOCK, ONE_PASS): one pass at Llama widths and a small tile,
    # the tiled loop; with and without a delta (ops/overlap.py).
    variants = ((True, False, dtype, 8192, True), (False, False, dtype, 128, True), (True, True, dtype, 8192, True),
                (False, True, dtype, 128, True), (True, False, "fp32", 4096, False), (True, True, "fp32", 4096, False))
    for has_res, has_delta, w_dtype, block, one_pass in variants:
        types = dict(x_ptr="*" + dtype, d_ptr="*fp32" if has_delta else "*" + dtype, r_ptr="*" + dtype,
                     w_ptr="*" + w_dtype, out_ptr="*" + dtype, s_ptr="*" + dtype)
        ptx = _compile(fk._rms_norm_kernel, types, dict(HAS_DELTA=has_delta, HAS_RESIDUAL=has_res,
                                                        WRITE_S=has_res or has_delta, BLOCK=block,
                                                        ONE_PASS=one_pass, COMPILED=True),
                       arch, max(1, min(16, block // 512)))
        what = f"rms_norm {dtype} weight {w_dtype} residual={has_res} delta={has_delta} BLOCK={block}"
        _no_approx(ptx, what)
        assert re.search(r"mul\.rn(\.ftz)?\.f32", ptx), f"{what}: sum·(1/H) must be a separate product before + eps"


def silu(dtype: str, arch: int) -> None:
    from loraplex.ops import fused_kernels as fk
    for block, has_delta in ((128, False), (1024, False), (1024, True)):
        ptx = _compile(fk._silu_and_mul_kernel, dict(gu_ptr="*" + dtype, d_ptr="*fp32" if has_delta else "*" + dtype,
                                                     out_ptr="*" + dtype),
                       dict(HAS_DELTA=has_delta, BLOCK=block, COMPILED=True), arch, max(1, min(4, block // 256)))
        _no_approx(ptx, f"silu {dtype}")
        assert "div.rn.f32" in ptx, f"silu {dtype}: the division must be IEEE"


def rope(dtype: str, arch: int) -> None:
    from loraplex.ops import fused_kernels as fk
    for pos, block_h, block_d, has_delta in (("i64", 16, 64, False), ("i32", 1, 32, False), ("i64", 16, 64, True)):
        ptx = _compile(fk._rope_kernel, dict(q_ptr="*" + dtype, k_ptr="*" + dtype, v_ptr="*" + dtype,
                                             d_ptr="*fp32" if has_delta else "*" + dtype, pos_ptr="*" + pos,
                                             inv_freq_ptr="*fp32"),
                       dict(HAS_DELTA=has_delta, BLOCK_H=block_h, BLOCK_D=block_d, COMPILED=True), arch,
                       max(1, min(4, block_h * block_d // 256)))
        what = f"rope {dtype} positions {pos} BLOCK_H={block_h} BLOCK_D={block_d} delta={has_delta}"
        _no_approx(ptx, what)
        # Every product that feeds the rotation's sums is rounded on its own (4 per element pair).
        assert len(re.findall(r"mul\.rn(?:\.ftz)?\.f32", ptx)) >= 4, f"{what}: products must be mul.rn"


KERNELS = {"rms_norm": rms_norm, "silu_and_mul": silu, "rope": rope}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_fused_kernel_compiles(kernel):
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, str(Path(__file__)), kernel], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == len(ARCHS) * len(DTYPES), proc.stdout


if __name__ == "__main__":
    name = sys.argv[1]
    for arch in ARCHS:
        for dt in DTYPES:
            KERNELS[name](dt, arch)
            print("compiled", name, dt, f"sm_{arch}")
