"""Compile loraplex's Triton kernels for Hopper (sm_90) without a GPU; run by test_kernels_compile.py.

    TRITON_INTERPRET=0 python tests/compile_kernels.py shrink bf16 16
"""
from __future__ import annotations

import dataclasses

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loraplex.ops.lora import lora_in_gemm
from loraplex.ops.lora import sgmv

TARGET = GPUTarget("cuda", 90, 32)


def _compile(kernel, pointer_types: dict, constexprs: dict, num_warps: int, num_stages: int) -> None:
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = next((t for prefix, t in pointer_types.items() if name.startswith(prefix)), "i32")
    triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET,
                   options=dict(num_warps=num_warps, num_stages=num_stages))


def shrink(dtype: str, block_m: int) -> None:
    cfg = sgmv.config_for(block_m)
    types = {"x_": "*" + dtype, "part_": "*fp32", "sorted_": "*i32", "work_": "*i32", "a": "*" + dtype, "rk": "*i32"}
    # ROWWISE: sgmv_kernels._shrink_tile_rows for tiles of a few rows (1) or every tile (2); ROWS_PREFETCH: its loads a
    # step ahead
    # AFTER_GEMM: launched after the GEMM over the same x (ops/overlap.py's "after" shrink order)
    for num_slices, block_r, rowwise, prefetch, after in ((1, 16, 0, False, False), (1, 16, 1, False, False),
                                                          (3, 32, 2, False, False), (3, 16, 1, True, False),
                                                          (3, 16, 1, True, True), (1, 16, 0, False, True)):
        consts = dict(NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=cfg.shrink_block_k,
                      PRECISION="tf32x3" if dtype == "fp32" else "tf32", ROWWISE=rowwise, ROWS_PREFETCH=prefetch,
                      AFTER_GEMM=after)
        _compile(sgmv._sgmv_shrink_kernel, types, consts, cfg.shrink_warps, cfg.shrink_stages)


def expand(dtype: str, block_m: int) -> None:
    cfg = sgmv.config_for(block_m)
    # ACCUMULATE=False: y is the fp32 buffer of LoRA products that ops/overlap.py leaves for the next op;
    # ROWWISE: sgmv_kernels._expand_tile_rows for tiles of a few rows (1) or every tile (2); one rank tile only.
    # ROWS_PREFETCH: its B loads a step ahead (and 512 columns a step, as a sweep may try); without it, the
    # row-wise steps' default columns (sgmv.rows_block_n_for: 512 for the rank tile of 16).
    # TILE_PREFETCH: the tile expand's y a step ahead, or 2+ pipelined stages (sgmv_kernels._expand_tile's PREFETCH;
    # LORAPLEX_LORA_PREFILL)
    variants = ((True, True, 0, False, False), (True, True, 1, False, False), (False, True, 1, False, False),
                (True, False, 2, False, False), (True, True, 1, True, False), (True, False, 2, True, False),
                (True, True, 0, False, True), (False, True, 0, False, True), (True, False, 0, False, True),
                (True, True, 1, False, True),   # prompt tiles with LORAPLEX_LORA_PREFILL's "rows"
                (True, True, 0, False, 3), (False, True, 1, False, 4))   # its "ts<stages>" (Triton's pipeliner)
    for one_r, accumulate, rowwise, prefetch, tile_prefetch in variants:
        types = {"y_": "*" + (dtype if accumulate else "fp32"), "part_": "*fp32", "sorted_": "*i32", "work_": "*i32",
                 "b": "*" + dtype, "rk": "*i32", "sc": "*fp32"}
        consts = dict(NUM_SLICES=2, SPLIT_K=2, BLOCK_M=block_m, BLOCK_N=cfg.expand_block_n,
                      BLOCK_R=16 if one_r else 64, ONE_R_TILE=one_r, PRECISION="split" if dtype == "bf16" else "tf32x3",
                      ACCUMULATE=accumulate, ROWWISE=rowwise,
                      ROWS_BLOCK_N=512 if prefetch else sgmv.rows_block_n_for(
                          dataclasses.replace(cfg, expand_rowwise=rowwise), 16 if one_r else 64),
                      ROWS_PREFETCH=prefetch, TILE_PREFETCH=tile_prefetch)
        _compile(sgmv._sgmv_expand_kernel, types, consts, cfg.expand_warps, cfg.expand_stages)


def in_gemm(dtype: str, block_m: int) -> None:
    """ops/lora_in_gemm.py's expand: v read from the GEMM's own (16-bit) output."""
    cfg = sgmv.config_for(block_m)
    types = {"y_": "*" + dtype, "sorted_": "*i32", "work_": "*i32", "slot_": "*i32", "b": "*" + dtype,
             "rk": "*i32", "sc": "*fp32"}
    for num_slices, one_r in ((3, True), (1, False)):
        consts = dict(NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_N=cfg.expand_block_n,
                      BLOCK_R=16 if one_r else 64, ONE_R_TILE=one_r, PRECISION="tf32")
        _compile(lora_in_gemm._expand_in_gemm_kernel, types, consts, cfg.expand_warps, cfg.expand_stages)


if __name__ == "__main__":
    kind, dtype, block_m = sys.argv[1], sys.argv[2], int(sys.argv[3])
    {"shrink": shrink, "expand": expand, "in_gemm": in_gemm}[kind](dtype, block_m)
    print("compiled", kind, dtype, block_m)
